"""Benchmark machinery behind ``tileplug bench`` and ``tileplug demo``, generic over the op
table: the cases are every op's ``OpDef.bench()``, the bytes its ``OpDef.ledger``.

Effective bandwidth is the op's ledger bytes (what must move) over the median time. The
device copy (``dst.copy_(src)``) measured in the same process is the reference line,
``torch.compile`` of the reference is one peer, where it compiles, and other kernel
libraries (``PEERS``: TileKernels, Liger, plain PyTorch under torch.compile, through the
adapters of ``tileplug.core.peers``) are timed in the same process and the same way when they
are importable.

Two times per runner on CUDA: *eager* (median over calls between CUDA events, L2 flushed
clean before each: what a user's call costs on the device, launch included) and *graph*
(the calls captured in one CUDA graph over distinct copies of the inputs whose working set
exceeds L2, replayed: the kernels alone, no host).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tileplug.core import opdefs
from tileplug.core.errors import TileplugError
from tileplug.core.opdefs import BenchCase, describe_call
from tileplug.core.registry import registry, use_backend

COMPILE_PEER = "torch.compile(reference)"
"""Runner name of the compile peer (``torch.compile`` of the reference kernel)."""


@dataclass(frozen=True)
class Peer:
    """Another kernel library timed beside tileplug: ``module`` holds functions named like
    tileplug's ops, taking the same arguments (an adapter module of ``tileplug.core.peers``;
    ``distribution`` is the library's PyPI name)."""

    name: str
    module: str
    distribution: str

    def module_object(self) -> Any:
        """The peer's module (imported on first use; raises what its import raises)."""
        import importlib

        return importlib.import_module(self.module)


PEERS = {
    "tile_kernels": Peer("tile_kernels", "tileplug.core.peers.tile_kernels", "tile-kernels"),
    "liger": Peer("liger", "tileplug.core.peers.liger", "liger-kernel"),
    "torch_compile": Peer("torch_compile", "tileplug.core.peers.torch_compile", "torch"),
}
"""Peers ``tileplug bench --peer`` knows, by runner name (their adapters: ``tileplug.core.peers``)."""

GRAPH_WORKING_SET = 512 << 20
"""Bytes of distinct inputs and outputs one graph replay walks through (several times an
H200's 60 MB L2), up to ``GRAPH_MAX_CALLS`` calls per graph."""
GRAPH_MAX_CALLS = 512


def bench_cases() -> dict[str, BenchCase]:
    """Every op's bench cases (``OpDef.bench()``), by name, in declaration order."""
    cases: dict[str, BenchCase] = {}
    for opdef in opdefs.all_ops():
        for case in opdef.bench():
            if case.name in cases:
                raise ValueError(f"bench case name '{case.name}' is declared twice ({cases[case.name].op}, {case.op})")
            cases[case.name] = case
    return cases


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":  # pragma: no cover - needs torch_npu
        torch.npu.synchronize()


FLUSH_BYTES = 256 << 20
"""L2 flush before each timed CUDA call: a reduction reading this many bytes."""

_flush_buffers: dict[torch.device, torch.Tensor] = {}


def flush_l2(device: torch.device) -> None:
    """Evict the device's L2 by *reading* a 256 MB buffer, which leaves clean lines behind.

    (``triton.testing.do_bench`` flushes by zeroing a buffer instead: L2 is then full of
    dirty lines that the timed call pays to write back — about 5 µs on an H200, which is 5%
    of a 100 µs call and nothing to do with the op.)"""
    buffer = _flush_buffers.get(device)
    if buffer is None:
        buffer = _flush_buffers[device] = torch.ones(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    buffer.amax()


def median_seconds(fn: Callable[[], Any], device: torch.device, min_time: float = 0.2, max_repeat: int = 200) -> float:
    """Median time of ``fn``. CUDA: device time between CUDA events around each call, L2
    flushed (clean) before each one (``flush_l2``); other devices: synchronised wall time."""
    if device.type == "cuda":
        with torch.cuda.device(device):  # events and the flush on the timed device's stream, whatever is current
            return _cuda_event_median(fn, device, min_time, max_repeat)
    fn()
    synchronize(device)
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < max_repeat and (len(samples) < 5 or time.perf_counter() - started < min_time):
        begin = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def _cuda_event_median(fn: Callable[[], Any], device: torch.device, min_time: float, max_repeat: int) -> float:
    for _ in range(3):  # warm up (first calls compile and cache)
        flush_l2(device)
        fn()
    synchronize(device)
    begin = time.perf_counter()
    for _ in range(5):
        flush_l2(device)
        fn()
    synchronize(device)
    per_call = (time.perf_counter() - begin) / 5
    repeats = max(10, min(max_repeat, int(min_time / max(per_call, 1e-6))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for start, end in zip(starts, ends):
        flush_l2(device)
        start.record()
        fn()
        end.record()
    synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends)) * 1e-3


def host_seconds_per_call(fn: Callable[[], Any], device: torch.device, calls: int = 2000, rounds: int = 3) -> float:
    """Host time per call: ``calls`` calls issued back to back, no sync in between; the best of
    ``rounds`` rounds (a shared host's scheduling noise only ever adds time)."""
    for _ in range(20):
        fn()
    synchronize(device)
    best = float("inf")
    for _ in range(rounds):
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - begin
        synchronize(device)
        best = min(best, elapsed / calls)
    return best


def graph_seconds_per_call(fn: Callable[..., Any], args: tuple, kwargs: dict, device: torch.device,
                           ledger_bytes: int, replays: int = 20) -> tuple[float, int]:
    """(seconds per call, calls per graph) of ``fn(*args, **kwargs)`` captured in one CUDA
    graph over distinct copies of the arguments, ``GRAPH_WORKING_SET`` bytes in all (at most
    ``GRAPH_MAX_CALLS`` calls), replayed back to back: the kernel alone, no host time.
    Captured and timed with ``device`` current (a capture stream is the current device's)."""
    with torch.cuda.device(device):
        return _graph_seconds_per_call(fn, args, kwargs, device, ledger_bytes, replays)


def _graph_seconds_per_call(fn: Callable[..., Any], args: tuple, kwargs: dict, device: torch.device,
                            ledger_bytes: int, replays: int) -> tuple[float, int]:
    from tileplug.core.testing import moved

    calls = max(2, min(GRAPH_MAX_CALLS, -(-GRAPH_WORKING_SET // max(ledger_bytes, 1))))
    copies = [moved((args, kwargs), device, fresh=True) for _ in range(calls)]
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm up outside the capture (compiles, caches)
        for copy_args, copy_kwargs in copies[:2]:
            fn(*copy_args, **copy_kwargs)
    torch.cuda.current_stream(device).wait_stream(side)
    synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for copy_args, copy_kwargs in copies:
            fn(*copy_args, **copy_kwargs)
    graph.replay()
    synchronize(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    synchronize(device)
    seconds = statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends)) * 1e-3 / calls
    del graph
    return seconds, calls


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Device copy bandwidth in GB/s (read + write bytes / median time), the ceiling."""
    if nbytes is None:
        nbytes = 2 << 30 if device.type in ("cuda", "npu") else 256 << 20
    source = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    seconds = median_seconds(lambda: target.copy_(source), device, min_time=0.5, max_repeat=50)
    return 2 * nbytes / seconds / 1e9


def compiled_reference(call: Any, opdef: opdefs.OpDef | None = None) -> Callable[[Any], Any]:
    """``torch.compile`` of the reference kernel for ``call``'s signature (dynamic T): the
    outputs allocated by the op's plan for the reference's layout, then the kernel run."""
    backend = registry.get("reference")
    if backend is None:
        raise RuntimeError("tileplug-reference is not installed")
    opdef = opdef or opdefs.get(call.name)
    kernel = backend.kernels[opdef.kernel]
    plan = opdef.outputs(call, backend.traits_for(call.device_type))
    tokens, device = call.tokens, call.device

    def run(inputs: Any) -> Any:
        outputs = plan.allocate(tokens, device)
        kernel(call, inputs, outputs)
        return outputs

    return torch.compile(run, dynamic=True)


@dataclass
class BenchRow:
    """One measurement of one op configuration at one size on one backend (or peer)."""

    case: str
    tokens: int
    hidden: int
    dtype: str
    device: str
    runner: str
    median_us: float | None = None
    gbps: float | None = None
    ledger_bytes: int = 0
    pct_of_copy: float | None = None
    host_us: float | None = None
    graph_us: float | None = None
    graph_gbps: float | None = None
    graph_calls: int | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BenchReport:
    """Everything one ``tileplug bench`` run measured."""

    device: str
    device_name: str
    copy_gbps: float
    torch_version: str
    rows: list[BenchRow] = field(default_factory=list)
    dispatch: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["rows"] = [row.as_dict() for row in self.rows]
        return data


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        import platform

        return platform.processor() or platform.machine()
    return device.type


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _described(case: BenchCase, tokens: int, hidden: int, dtype: torch.dtype, device: torch.device
               ) -> tuple[tuple, dict, Any, Any]:
    """(args, kwargs, call, inputs) of ``case`` at [tokens, hidden] on ``device``. On a real
    device the inputs hold values (made by the backend in force where an input is itself an
    op's output); for the dry run they are made on meta under the layout of ``device``."""
    args, kwargs = case.arguments(tokens, hidden, dtype, device)
    call, inputs = describe_call(case.op, *args, **kwargs)
    return args, kwargs, call, inputs


def _runners(case: BenchCase, tokens: int, hidden: int, dtype: torch.dtype, device: torch.device,
             backends: list[str], call: Any) -> list[tuple[BenchRow, Any]]:
    """One row per backend with its ledger bytes (or why it cannot run ``call``), and the backend."""
    opdef = opdefs.get(case.op)
    rows = []
    for name in backends:
        entry = BenchRow(case.name, tokens, hidden, _dtype_name(dtype), device.type, name)
        backend = registry.get(name)
        why = registry.reason_against(backend, call.op, call) if backend else "not installed"
        if why is not None:
            entry.note = why
            rows.append((entry, None))
            continue
        entry.ledger_bytes = opdef.ledger(call, backend.traits_for(call.device_type)).bytes_total
        rows.append((entry, backend))
    return rows


def plan_case(case: BenchCase, tokens: int, hidden: int, dtype: torch.dtype, device: torch.device,
              backends: list[str], with_compile: bool) -> list[BenchRow]:
    """What :func:`measure_case` would time, with the ledger bytes of each runner, timing
    nothing (``tileplug bench --dry-run``): calls are described on meta under each backend's
    layout for ``device``, then re-homed to ``device``'s type."""
    from tileplug.core import config

    opdef = opdefs.get(case.op)
    rows = []
    runners = list(backends) + ([COMPILE_PEER] if with_compile else [])
    for name in runners:
        entry = BenchRow(case.name, tokens, hidden, _dtype_name(dtype), device.type, name)
        backend = registry.get("reference" if name == COMPILE_PEER else name)
        if backend is None:
            entry.note = ("skipped: tileplug-reference is not installed" if name == COMPILE_PEER
                          else "not installed")
            rows.append(entry)
            continue
        traits = backend.traits_for(device.type)
        try:
            with config.host_layout(traits):
                _, _, call, _ = _described(case, tokens, hidden, dtype, torch.device("meta"))
            call = dataclasses.replace(call, device_type=device.type)
        except TileplugError as error:
            entry.note = f"no call: {error}"
            rows.append(entry)
            continue
        why = registry.reason_against(backend, call.op, call)
        if why is not None:
            entry.note = why
        else:
            entry.ledger_bytes = opdef.ledger(call, traits).bytes_total
        rows.append(entry)
    return rows


def measure_case(
    case: BenchCase,
    tokens: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    backends: list[str],
    copy_gbps: float,
    with_compile: bool,
    with_host_time: bool,
    log: Callable[[str], None] = lambda _: None,
    peers: Sequence[str] = (),
    with_graph: bool = False,
) -> list[BenchRow]:
    """Time bench case ``case`` at [tokens, hidden] on each backend in ``backends`` (+ the
    compile peer, where the reference is installed, and each peer library of ``peers``,
    called with the same arguments, with the ledger bytes of the default backend's call).

    The backend the dispatcher picks by itself is called exactly as a user calls the op;
    the others are forced with ``use_backend`` (whose context manager adds host time).
    ``with_graph`` (CUDA) adds the graph-replay time of each runner."""
    opdef = opdefs.get(case.op)

    def row(runner: str) -> BenchRow:
        return BenchRow(case.name, tokens, hidden, _dtype_name(dtype), device.type, runner)

    try:
        args, kwargs, call, inputs = _described(case, tokens, hidden, dtype, device)
    except TileplugError as error:  # e.g. no backend makes this case's quantized input
        rows = [row(name) for name in backends]
        for entry in rows:
            entry.note = f"inputs not made: {error}"
        return rows
    try:
        default_backend = registry.select(call.op, call)[0].name
    except TileplugError:  # no default choice: every runner is forced
        default_backend = None
    rows = []
    for entry, backend in _runners(case, tokens, hidden, dtype, device, backends, call):
        rows.append(entry)
        if backend is None:
            continue
        name = backend.name
        if name == default_backend:  # what a user's call runs: time it as a user calls it
            invoke = opdef.function
        else:

            def invoke(*call_args: Any, name: str = name, **call_kwargs: Any) -> Any:
                with use_backend(name):
                    return opdef.function(*call_args, **call_kwargs)

        _time_runner(entry, invoke, args, kwargs, device, copy_gbps, with_host_time, with_graph)
        log(f"  {case.name} T={tokens} H={hidden} {name}: {entry.median_us or 0:.1f} us")
    # A peer moves the bytes of the call the dispatcher would run (else of the first runner that has them).
    default_bytes = next((r.ledger_bytes for r in rows if r.runner == default_backend and r.ledger_bytes),
                         next((r.ledger_bytes for r in rows if r.ledger_bytes), 0))
    for peer_name in peers:
        entry = row(peer_name)
        rows.append(entry)
        peer = PEERS[peer_name]
        try:
            module = peer.module_object()
        except Exception as error:  # noqa: BLE001 - any import failure: the peer is not here
            entry.note = f"not importable (pip install {peer.distribution}): {type(error).__name__}: {error}"
            continue
        function = getattr(module, case.op, None)
        if function is None:
            entry.note = f"{peer.module} has no {case.op}"
            continue
        try:
            peer_args, peer_kwargs = peer_arguments(opdef.function, function, args, kwargs)
        except TypeError as error:
            entry.note = f"not comparable: {error}"
            continue
        entry.ledger_bytes = default_bytes
        _time_runner(entry, function, peer_args, peer_kwargs, device, copy_gbps, with_host_time, with_graph)
        log(f"  {case.name} T={tokens} H={hidden} {peer_name}: {entry.median_us or 0:.1f} us")
    if with_compile:
        entry = row(COMPILE_PEER)
        reference = registry.get("reference")
        if reference is None:
            entry.note = "skipped: tileplug-reference is not installed"
        else:
            try:
                compiled = compiled_reference(call, opdef)
                seconds = median_seconds(lambda: compiled(inputs), device)
                ledger = opdef.ledger(call, reference.traits_for(call.device_type))
                entry.ledger_bytes = ledger.bytes_total
                entry.median_us = seconds * 1e6
                entry.gbps = ledger.bytes_total / seconds / 1e9
                entry.pct_of_copy = 100.0 * entry.gbps / copy_gbps if copy_gbps else None
            except Exception as error:  # noqa: BLE001 - the peer may not compile here
                entry.note = f"did not compile: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
        rows.append(entry)
    return rows


def peer_arguments(ours: Callable[..., Any], theirs: Callable[..., Any], args: tuple, kwargs: dict
                   ) -> tuple[tuple, dict]:
    """The arguments of a call of ``ours`` spelt for ``theirs``: every argument bound with
    ``ours``' defaults (a peer may have other defaults, or none), the first positionally, the
    rest by keyword; an argument ``theirs`` does not take must hold ``ours``' default (else
    TypeError: the peer cannot make the same call)."""
    import inspect

    signature = inspect.signature(ours)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    accepted = inspect.signature(theirs).parameters
    values = list(bound.arguments.items())
    first = values[0][1]
    named = {}
    for name, value in values[1:]:
        if name in accepted:
            named[name] = value
        elif value is not signature.parameters[name].default and value != signature.parameters[name].default:
            raise TypeError(f"the peer has no argument '{name}' (this case sets it to {value!r})")
    return (first,), named


def _time_runner(entry: BenchRow, invoke: Callable[..., Any], args: tuple, kwargs: dict, device: torch.device,
                 copy_gbps: float, with_host_time: bool, with_graph: bool) -> None:
    """Fill ``entry``'s times (eager median, host time, graph replay) of ``invoke(*args,
    **kwargs)``; a runner that fails is reported in its note, never fatal."""

    def run_once() -> Any:
        return invoke(*args, **kwargs)

    try:
        seconds = median_seconds(run_once, device)
        entry.median_us = seconds * 1e6
        entry.gbps = entry.ledger_bytes / seconds / 1e9
        entry.pct_of_copy = 100.0 * entry.gbps / copy_gbps if copy_gbps else None
        if with_host_time:
            entry.host_us = host_seconds_per_call(run_once, device, calls=200 if device.type == "cpu" else 2000) * 1e6
    except Exception as error:  # noqa: BLE001 - a failing backend is reported, not fatal
        entry.note = f"{type(error).__name__}: {error}"
        return
    if with_graph and device.type == "cuda":
        try:
            graph_s, entry.graph_calls = graph_seconds_per_call(invoke, args, kwargs, device, entry.ledger_bytes)
        except Exception as error:  # noqa: BLE001
            entry.note = f"graph capture failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
            return
        entry.graph_us = graph_s * 1e6
        entry.graph_gbps = entry.ledger_bytes / graph_s / 1e9


def dispatch_cost(device: torch.device, hidden: int = 7168, cases: Sequence[str] | None = None
                  ) -> dict[str, dict[str, Any]]:
    """Host µs per call at T = 1 of each bench case in ``cases`` (default: every op's first
    bench case), by case name: the op called through ``core.ops`` vs the launcher its route
    uses (``kernel.prepare(call)`` where the kernel has one, else ``kernel(call, ...)``)
    called directly, into preallocated outputs and into fresh outputs allocated by the op's
    plan (what calling the kernel yourself costs). The dispatch overhead is core's call
    minus the latter: contract check, cached route, allocation. ``contract_check_us`` times
    ``describe_call`` (the declared contract, which binds the arguments by name first). A
    case no backend runs here gets ``{"note": why}``."""
    known = bench_cases()
    if cases is None:
        cases = [bench[0].name for bench in (list(d.bench()) for d in opdefs.all_ops()) if bench]
    costs: dict[str, dict[str, Any]] = {}
    for name in cases:
        case = known[name]
        opdef = opdefs.get(case.op)
        try:
            args, kwargs, call, inputs = _described(case, 1, hidden, torch.bfloat16, device)
            route = registry.route(call)
        except TileplugError as error:
            costs[name] = {"note": str(error)}
            continue
        launch = route.launcher or route.prepare()  # the launcher the route itself calls
        plan = route.plan
        outputs = plan.allocate(call.tokens, device)
        tokens = call.tokens

        def through_core() -> Any:
            return opdef.function(*args, **kwargs)

        def direct() -> None:
            launch(inputs, outputs)

        def direct_with_fresh_outputs() -> None:
            launch(inputs, plan.allocate(tokens, device))

        def contract_only() -> Any:
            return describe_call(case.op, *args, **kwargs)

        core_s = host_seconds_per_call(through_core, device, calls=3000)
        direct_s = host_seconds_per_call(direct, device, calls=3000)
        fresh_s = host_seconds_per_call(direct_with_fresh_outputs, device, calls=3000)
        contract_s = host_seconds_per_call(contract_only, device, calls=3000)
        costs[name] = {
            "op": case.op,
            "backend": route.backend.name,
            "core_call_us": core_s * 1e6,
            "direct_kernel_us": direct_s * 1e6,
            "direct_kernel_fresh_outputs_us": fresh_s * 1e6,
            "dispatch_overhead_us": (core_s - fresh_s) * 1e6,
            "contract_check_us": contract_s * 1e6,
        }
    return costs


def peer_ratios(rows: Sequence[BenchRow], peer: str, ours: str) -> list[dict[str, Any]]:
    """Per (case, T): the peer's time over ``ours`` (> 1: ours is faster), eager and graph."""
    by_key: dict[tuple[str, int], dict[str, BenchRow]] = {}
    for entry in rows:
        by_key.setdefault((entry.case, entry.tokens), {})[entry.runner] = entry

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if not a or not b else b / a

    ratios = []
    for (case, tokens), runners in by_key.items():
        mine, theirs = runners.get(ours), runners.get(peer)
        if mine is None or theirs is None:
            continue
        entry = {"case": case, "tokens": tokens, "eager": ratio(mine.median_us, theirs.median_us),
                 "graph": ratio(mine.graph_us, theirs.graph_us), "host": ratio(mine.host_us, theirs.host_us)}
        if any(entry[k] is not None for k in ("eager", "graph", "host")):
            ratios.append(entry)
    return ratios


def plot_report(report: dict[str, Any], path: str) -> None:
    """Draw a report (``BenchReport.as_dict()``): one panel per bench case, GB/s against T
    (log scale) per runner, eager solid and graph replay dashed, the copy line of the run.
    Needs matplotlib (``pip install tileplug-core[plot]``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in report["rows"] if row.get("gbps")]
    cases = list(dict.fromkeys(row["case"] for row in rows))
    if not cases:
        raise ValueError("the report has no timed row to plot")
    columns = min(3, len(cases))
    lines = -(-len(cases) // columns)
    figure, axes = plt.subplots(lines, columns, figsize=(5.2 * columns, 3.8 * lines), squeeze=False)
    runners = list(dict.fromkeys(row["runner"] for row in rows))
    colours = {runner: f"C{i}" for i, runner in enumerate(runners)}
    copy = report.get("copy_gbps")
    for index, case in enumerate(cases):
        axis = axes[index // columns][index % columns]
        for runner in runners:
            mine = sorted((row for row in rows if row["case"] == case and row["runner"] == runner),
                          key=lambda row: row["tokens"])
            if not mine:
                continue
            tokens = [row["tokens"] for row in mine]
            axis.plot(tokens, [row["gbps"] for row in mine], "o-", color=colours[runner], label=f"{runner} eager",
                      markersize=3)
            graph = [(row["tokens"], row["graph_gbps"]) for row in mine if row.get("graph_gbps")]
            if graph:
                axis.plot(*zip(*graph), "s--", color=colours[runner], label=f"{runner} graph", markersize=3,
                          alpha=0.8)
        if copy:
            axis.axhline(copy, color="grey", linestyle=":", label=f"copy {copy:.0f} GB/s")
        axis.set_xscale("log", base=2)
        hidden = next(row["hidden"] for row in rows if row["case"] == case)
        axis.set_title(f"{case} (H={hidden})", fontsize=10)
        axis.set_xlabel("tokens T")
        axis.set_ylabel("GB/s (ledger bytes / time)")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    for index in range(len(cases), lines * columns):
        axes[index // columns][index % columns].axis("off")
    figure.suptitle(f"tileplug bench on {report.get('device_name', report.get('device'))}", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
