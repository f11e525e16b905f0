"""Reference per_block_cast_lossless (SPEC §11): e2m1 (xq, sf) → e4m3 in new groups, the
output scale read off the input scales' exponents, every value kept exactly."""

from __future__ import annotations

from tileplug.core.contracts.quant import QuantCall, QuantInputs, QuantOutputs
from tileplug.core.quant import formats, layouts
from tileplug.core.quant.sf_math import expand_groups, given_scale_exponent, lossless_scales
from tileplug.reference.quant.grouped_cast import input_values


def per_block_cast_lossless(call: QuantCall, inputs: QuantInputs, outputs: QuantOutputs) -> None:
    """``sf_out = 2^max(e_max − 6, −127)`` per output group, ``q = e4m3(value · (sf_in · inv))``
    in fp32 (SPEC §2's re-quantization with that scale)."""
    cast = call.cast
    tokens, hidden = inputs.x.shape[0], call.hidden
    data, input_scale = input_values(call, inputs)
    scales = lossless_scales(given_scale_exponent(input_scale), cast.block)
    layouts.write(outputs.sf, scales, layouts.encoding_of_dtype(outputs.sf.dtype), cast.pack_axis)
    scaled = data * (input_scale * expand_groups(scales.inverse, cast.block, tokens, hidden))
    outputs.q.copy_(formats.encode(scaled, cast.fmt))
