"""Benchmark machinery behind ``tileplug bench`` and ``tileplug demo``, generic over the op
table: the cases are every op's ``OpDef.bench()``, the bytes its ``OpDef.ledger``.

Effective bandwidth is the op's ledger bytes (what must move) over the median time. The
device copy (``dst.copy_(src)``) measured in the same process is the ceiling, and
``torch.compile`` of the reference is the peer, where it compiles.
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


def host_seconds_per_call(fn: Callable[[], Any], device: torch.device, calls: int = 2000) -> float:
    """Host time per call: issue ``calls`` calls back to back, no sync in between."""
    for _ in range(20):
        fn()
    synchronize(device)
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - begin
    synchronize(device)
    return elapsed / calls


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
) -> list[BenchRow]:
    """Time bench case ``case`` at [tokens, hidden] on each backend in ``backends`` (+ the
    compile peer, where the reference is installed).

    The backend the dispatcher picks by itself is called exactly as a user calls the op;
    the others are forced with ``use_backend`` (whose context manager adds host time)."""
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

            def run_once() -> Any:
                return opdef.function(*args, **kwargs)

        else:

            def run_once(name: str = name) -> Any:
                with use_backend(name):
                    return opdef.function(*args, **kwargs)

        try:
            seconds = median_seconds(run_once, device)
            entry.median_us = seconds * 1e6
            entry.gbps = entry.ledger_bytes / seconds / 1e9
            entry.pct_of_copy = 100.0 * entry.gbps / copy_gbps if copy_gbps else None
            if with_host_time:
                entry.host_us = host_seconds_per_call(run_once, device, calls=200 if device.type == "cpu" else 2000) * 1e6
        except Exception as error:  # noqa: BLE001 - a failing backend is reported, not fatal
            entry.note = f"{type(error).__name__}: {error}"
        log(f"  {case.name} T={tokens} H={hidden} {name}: {entry.median_us or 0:.1f} us")
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
