"""Benchmark machinery behind ``tileplug bench`` and ``tileplug demo``.

Effective bandwidth is the op's ledger bytes (what must move) over the median time. The
device copy (``dst.copy_(src)``) measured in the same process is the ceiling, and
``torch.compile`` of the reference is the peer, where it compiles.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tileplug.core.contracts.quant import QuantCall, QuantOutputs
from tileplug.core.lowering import describe_call
from tileplug.core.registry import registry, use_backend


@dataclass(frozen=True)
class BenchCase:
    """One benchmarked op configuration: ``make_args(x)`` → (args, kwargs) for ``op``."""

    name: str
    op: Callable[..., Any]
    make_args: Callable[[torch.Tensor], tuple[tuple, dict]]


def _quantized_input(x: torch.Tensor) -> tuple[tuple, dict]:
    from tileplug.core import ops

    with use_backend("reference"):
        pair = ops.per_token_cast(x)
    return (pair,), {"fmt": "bf16", "x_block_size": (1, 128)}


def bench_cases() -> dict[str, BenchCase]:
    """The default op configurations (SPEC defaults, DeepGEMM-style UE8M0 variant included)."""
    from tileplug.core import ops

    cases = [
        BenchCase("per_token_cast", ops.per_token_cast, lambda x: ((x,), {})),
        BenchCase(
            "per_token_cast/ue8m0-col",
            ops.per_token_cast,
            lambda x: ((x,), {"round_sf": True, "use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True}),
        ),
        BenchCase("per_token_cast/e2m1-g16", ops.per_token_cast, lambda x: ((x,), {"fmt": "e2m1", "num_per_channels": 16})),
        BenchCase("per_block_cast", ops.per_block_cast, lambda x: ((x,), {"block_size": (128, 128)})),
        BenchCase("per_channel_cast", ops.per_channel_cast, lambda x: ((x,), {"num_per_tokens": 128})),
        BenchCase("cast_back", ops.cast_back, _quantized_input),
    ]
    return {case.name: case for case in cases}


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


def compiled_reference(call: QuantCall) -> Callable[[Any], Any]:
    """``torch.compile`` of the reference kernel for ``call``'s signature (dynamic T)."""
    backend = registry.get("reference")
    if backend is None:
        raise RuntimeError("tileplug-reference is not installed")
    kernel = backend.kernels[call.op]
    traits = backend.traits_for(call.device_type)

    def run(inputs: Any) -> Any:
        outputs = call.allocate(traits)
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
    """Time ``case`` at [tokens, hidden] on each backend in ``backends`` (+ the compile peer).

    The backend the dispatcher picks by itself is called exactly as a user calls the op;
    the others are forced with ``use_backend`` (whose context manager adds host time)."""
    from tileplug.reference.testing import activation

    x = activation(tokens, hidden, dtype=dtype, device=device, seed=tokens)
    args, kwargs = case.make_args(x)
    call, inputs = describe_call(case.op, *args, **kwargs)
    rows = []
    dtype_name = str(dtype).replace("torch.", "")

    def row(runner: str) -> BenchRow:
        return BenchRow(case.name, tokens, hidden, dtype_name, device.type, runner)

    try:
        default_backend = registry.select(call.op, call)[0].name
    except Exception:  # noqa: BLE001 - no default choice: every runner is forced
        default_backend = None
    for name in backends:
        entry = row(name)
        backend = registry.get(name)
        why = registry.reason_against(backend, call.op, call) if backend else "not installed"
        if why is not None:
            entry.note = why
            rows.append(entry)
            continue
        ledger = call.ledger(backend.traits_for(call.device_type))
        entry.ledger_bytes = ledger.bytes_total

        if name == default_backend:  # what a user's call runs: time it as a user calls it

            def run_once() -> Any:
                return case.op(*args, **kwargs)

        else:

            def run_once(name: str = name) -> Any:
                with use_backend(name):
                    return case.op(*args, **kwargs)

        try:
            seconds = median_seconds(run_once, device)
            entry.median_us = seconds * 1e6
            entry.gbps = ledger.bytes_total / seconds / 1e9
            entry.pct_of_copy = 100.0 * entry.gbps / copy_gbps if copy_gbps else None
            if with_host_time:
                entry.host_us = host_seconds_per_call(run_once, device, calls=200 if device.type == "cpu" else 2000) * 1e6
        except Exception as error:  # noqa: BLE001 - a failing backend is reported, not fatal
            entry.note = f"{type(error).__name__}: {error}"
        log(f"  {case.name} T={tokens} H={hidden} {name}: {entry.median_us or 0:.1f} us")
        rows.append(entry)
    if with_compile and registry.get("reference") is not None:
        entry = row("torch.compile(reference)")
        try:
            compiled = compiled_reference(call)
            seconds = median_seconds(lambda: compiled(inputs), device)
            ledger = call.ledger(registry.get("reference").traits_for(call.device_type))
            entry.ledger_bytes = ledger.bytes_total
            entry.median_us = seconds * 1e6
            entry.gbps = ledger.bytes_total / seconds / 1e9
            entry.pct_of_copy = 100.0 * entry.gbps / copy_gbps if copy_gbps else None
        except Exception as error:  # noqa: BLE001 - the peer may not compile here
            entry.note = f"did not compile: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
        rows.append(entry)
    return rows


def dispatch_cost(device: torch.device, hidden: int = 7168) -> dict[str, Any]:
    """Host µs per call of ``core.ops.per_token_cast`` on a 1 × hidden tensor vs calling the
    selected backend's kernel directly, into preallocated outputs and into fresh
    ``torch.empty`` outputs (what calling the kernel yourself costs). The dispatch overhead
    is core's call minus the latter: contract check, cached selection, allocation plan."""
    from tileplug.core import ops
    from tileplug.reference.testing import activation

    x = activation(1, hidden, device=device)
    call, inputs = describe_call(ops.per_token_cast, x)
    backend, kernel = registry.select(call.op, call)
    outputs = call.allocate(backend.traits_for(call.device_type))
    q_shape, sf_shape = tuple(outputs.q.shape), tuple(outputs.sf.shape)

    def direct_with_fresh_outputs() -> None:
        fresh = QuantOutputs(
            torch.empty(q_shape, dtype=outputs.q.dtype, device=device),
            torch.empty(sf_shape, dtype=outputs.sf.dtype, device=device),
        )
        kernel(call, inputs, fresh)

    through_core = host_seconds_per_call(lambda: ops.per_token_cast(x), device, calls=3000)
    direct = host_seconds_per_call(lambda: kernel(call, inputs, outputs), device, calls=3000)
    direct_fresh = host_seconds_per_call(direct_with_fresh_outputs, device, calls=3000)
    contract_only = host_seconds_per_call(lambda: describe_call(ops.per_token_cast, x), device, calls=3000)
    return {
        "backend": backend.name,
        "core_call_us": through_core * 1e6,
        "direct_kernel_us": direct * 1e6,
        "direct_kernel_fresh_outputs_us": direct_fresh * 1e6,
        "dispatch_overhead_us": (through_core - direct_fresh) * 1e6,
        "contract_check_us": contract_only * 1e6,
    }
