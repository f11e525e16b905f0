"""Reference ``rms_norm_rope`` and ``rms_norm_rope_per_token_cast``: the unfused chain, on the
reference's own math, so that "fused ≡ chain" holds by construction here and is the bytes
every other backend's fused kernel must reproduce.

1. RMSNorm of every head over its ``D`` channels (the norm family's row formula,
   :func:`tileplug.core.norm.rms_norm_rows`), rounded to ``x.dtype``;
2. the rotation of :mod:`tileplug.reference.rope.apply_rotary` on that rounded ``y``;
3. for the quantized op, the per-token cast of ``y.view(T, N·D)``
   (:func:`tileplug.reference.quant.grouped_cast.grouped_cast`, the ``per_token_cast`` kernel).
"""

from __future__ import annotations

from tileplug.core.contracts.quant import QuantInputs, QuantOutputs
from tileplug.core.contracts.rope import NormRopeCall, NormRopeInputs, NormRopeOutputs
from tileplug.core.norm import rms_norm_rows
from tileplug.reference.quant.grouped_cast import grouped_cast
from tileplug.reference.rope.apply_rotary import cos_sin_rows, rotate, token_positions


def rms_norm_rope(call: NormRopeCall, inputs: NormRopeInputs, outputs: NormRopeOutputs) -> None:
    """Write ``y`` (when the call returns it) and, for the quantized op, ``q`` and ``sf``."""
    x = inputs.x
    tokens, heads, width = x.shape
    y, _ = rms_norm_rows(x.reshape(tokens * heads, width), inputs.weight, call.eps, call.weight_offset)
    y = y.view(tokens, heads, width)
    positions = token_positions(inputs.positions, (tokens,), inputs.seqlen_offset, x.device)
    cos, sin = cos_sin_rows(inputs.cos_sin_cache, positions, False)
    rotate(y, cos, sin, call.interleaved)
    if outputs.y is not None:
        outputs.y.copy_(y)
    if call.quant is not None:
        grouped_cast(call.quant, QuantInputs(y.view(tokens, heads * width)), QuantOutputs(outputs.q, outputs.sf))
