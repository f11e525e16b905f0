"""Public quantization ops (SPEC.md §3): contract → cached selection → allocate → kernel.

Shapes: ``x`` is ``[T, H]`` bf16/fp32 (any row stride, unit last stride) or a quantized
pair ``(xq, sf)``; ``q`` is ``[T, H]`` float8_e4m3fn or ``[T, H/2]`` int8 (e2m1, two per
byte); ``sf`` is ``[ceil(T/bm), ceil(H/bn)]`` groups in the layout the flags ask for
(packed UE8M0 shrinks the packed axis by the backend's pack factor).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from tileplug.core.contracts import quant as contracts
from tileplug.core.contracts.quant import (
    MODE_CAST,
    MODE_PRECOMPUTED_SF,
    MODE_SF_ONLY,
    QuantCall,
    QuantInputs,
)
from tileplug.core.registry import registry

QuantizedPair = tuple[torch.Tensor, torch.Tensor]


_capture: contextvars.ContextVar[list | None] = contextvars.ContextVar("tileplug_capture", default=None)


def _run(call: QuantCall, inputs: QuantInputs, out: Any = None) -> Any:
    captured = _capture.get()
    if captured is not None:  # core.lower: describe the call, run nothing
        captured.append((call, inputs))
        return None
    route = registry.route(call)
    plan = route.plan_for(call)
    outputs = plan.allocate(call.tokens, call.device) if out is None else call.check_out(out, plan)
    if call.tokens:
        route.launcher()(inputs, outputs)
    return call.result(outputs)


@contextlib.contextmanager
def capture_calls() -> Iterator[list[tuple[QuantCall, QuantInputs]]]:
    """Inside the block, ops check their contract and record ``(call, inputs)`` instead of running."""
    captured: list[tuple[QuantCall, QuantInputs]] = []
    token = _capture.set(captured)
    try:
        yield captured
    finally:
        _capture.reset(token)


# ---------------------------------------------------------------------- per token


def per_token_cast(
    x: torch.Tensor | QuantizedPair,
    fmt: str = "e4m3",
    num_per_channels: int = 128,
    x_block_size: tuple[int, int] | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    use_e4m3_sf: bool = False,
    out: QuantizedPair | None = None,
) -> QuantizedPair:
    """Quantize ``x`` [T, H] in groups of ``1 × num_per_channels`` → ``(q, sf)``.

    ``fmt``: "e4m3" or "e2m1". ``num_per_channels``: 16, 32, 64 or 128. ``x`` may be a
    quantized pair ``(xq, sf_in)`` whose grouping ``x_block_size`` gives (re-quantization).
    ``round_sf``: power-of-two scales; ``use_packed_ue8m0``: store them as packed UE8M0
    bytes; ``use_e4m3_sf``: store scales as e4m3; ``use_tma_aligned_col_major_sf``:
    column-major sf. ``out``: optional preallocated ``(q, sf)`` of exactly that layout.
    sf: [T, ceil(H/num_per_channels)] (packed: last dim / pack factor).
    """
    call, inputs = contracts.per_token_cast(
        x, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf, round_sf,
        use_packed_ue8m0, use_e4m3_sf,
    )
    return _run(call, inputs, out)


def per_token_cast_with_sf_only(
    x: torch.Tensor | QuantizedPair,
    fmt: str = "e4m3",
    num_per_channels: int = 128,
    x_block_size: tuple[int, int] | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    use_e4m3_sf: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Only the scales ``per_token_cast`` would return for the same arguments: sf."""
    call, inputs = contracts.per_token_cast(
        x, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf, round_sf,
        use_packed_ue8m0, use_e4m3_sf, MODE_SF_ONLY,
    )
    return _run(call, inputs, out)


def per_token_cast_with_precomputed_sf(
    x: torch.Tensor | QuantizedPair,
    fmt: str = "e4m3",
    num_per_channels: int = 128,
    sf: torch.Tensor | None = None,
    x_block_size: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize ``x`` with the caller's scales ``sf`` (any layout §2 defines, read off its
    dtype and strides): ``inv = 1 / sf``, nothing else computed → q [T, H] (or [T, H/2])."""
    call, inputs = contracts.per_token_cast(
        x, fmt, num_per_channels, x_block_size, False, False, False, False, MODE_PRECOMPUTED_SF, sf,
    )
    return _run(call, inputs, out)


# ---------------------------------------------------------------------- per block


def per_block_cast(
    x: torch.Tensor | QuantizedPair,
    fmt: str = "e4m3",
    block_size: tuple[int, int] = (128, 128),
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    x_block_size: tuple[int, int] | None = None,
) -> QuantizedPair:
    """Quantize ``x`` [T, H] in ``bm × bn`` blocks (each side 16, 32, 64 or 128) → ``(q, sf)``
    with sf [ceil(T/bm), ceil(H/bn)]. Flags as in :func:`per_token_cast`."""
    call, inputs = contracts.per_block_cast(
        x, fmt, block_size, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0,
    )
    return _run(call, inputs)


def per_block_cast_with_sf_only(
    x: torch.Tensor | QuantizedPair,
    fmt: str = "e4m3",
    block_size: tuple[int, int] = (128, 128),
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    x_block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Only the scales :func:`per_block_cast` would return: sf [ceil(T/bm), ceil(H/bn)]."""
    call, inputs = contracts.per_block_cast(
        x, fmt, block_size, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, MODE_SF_ONLY,
    )
    return _run(call, inputs)


def per_block_cast_with_precomputed_sf(
    x: torch.Tensor | QuantizedPair,
    fmt: str = "e4m3",
    block_size: tuple[int, int] = (128, 128),
    sf: torch.Tensor | None = None,
    x_block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Quantize ``x`` in ``bm × bn`` blocks with the caller's scales ``sf`` → q."""
    call, inputs = contracts.per_block_cast(
        x, fmt, block_size, x_block_size, False, False, False, MODE_PRECOMPUTED_SF, sf,
    )
    return _run(call, inputs)


# ---------------------------------------------------------------------- per channel, cast back


def per_channel_cast(
    x: torch.Tensor | QuantizedPair,
    fmt: str = "e4m3",
    num_per_tokens: int = 128,
    round_sf: bool = False,
    num_per_channels: int | None = None,
    use_packed_ue8m0: bool = False,
) -> QuantizedPair:
    """Quantize ``x`` [T, H] in groups of ``num_per_tokens × 1`` (32 or 128) → ``(q, sf)``
    with sf [ceil(T/num_per_tokens), H] (packed UE8M0: packed along tokens).
    ``num_per_channels`` is the per-token grouping of a quantized pair input."""
    call, inputs = contracts.per_channel_cast(x, fmt, num_per_tokens, round_sf, num_per_channels, use_packed_ue8m0)
    return _run(call, inputs)


def cast_back(
    x: QuantizedPair,
    fmt: str = "bf16",
    x_block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Dequantize ``(q, sf)`` of any layout §3 produces: ``float(q) * sf`` expanded over
    ``x_block_size`` groups, rounded once to ``fmt`` ("bf16" or "fp32") → [T, H]."""
    call, inputs = contracts.cast_back(x, fmt, x_block_size)
    return _run(call, inputs)
