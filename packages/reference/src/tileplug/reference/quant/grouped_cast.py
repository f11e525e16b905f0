"""The exact PyTorch model of SPEC.md §2-3 shared by the three grouped cast ops.

Every step runs on the input's own device in fp32 with one rounding where the SPEC puts
one, so the bytes it writes are the bytes every other backend must write.
"""

from __future__ import annotations

import torch

from tileplug.core.contracts.cast import QUANT_RANDOM_FIELD_BITS
from tileplug.core.contracts.quant import MODE_PRECOMPUTED_SF, MODE_SF_ONLY, QuantCall, QuantInputs, QuantOutputs
from tileplug.core.quant import formats, layouts
from tileplug.core.quant.sf_math import (
    ceil_div,
    compute_scales,
    expand_groups,
    group_amax,
    inverse_of_given,
    scale_groups,
)
from tileplug.reference.quant.stochastic_cast import element_random_bits, round_on_grid


def input_values(call: QuantCall, inputs: QuantInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 data [T, H] of the input and, for a quantized ``(xq, sf)`` input, its per-element
    scale [T, H] (None for a bf16/fp32 input)."""
    qin = call.quantized_input
    if qin is None:
        return inputs.x.float(), None
    tokens, hidden = inputs.x.shape[0], call.hidden
    data = formats.decode(inputs.x, qin.fmt)
    rows, cols = ceil_div(tokens, qin.block[0]), ceil_div(hidden, qin.block[1])
    scales = layouts.read(inputs.input_sf, qin.sf_encoding, qin.pack_axis, rows, cols)
    return data, expand_groups(scales, qin.block, tokens, hidden)


def grouped_cast(call: QuantCall, inputs: QuantInputs, outputs: QuantOutputs) -> None:
    """Run a per-token / per-block / per-channel cast (any mode) into ``outputs``."""
    cast = call.cast
    tokens, hidden = inputs.x.shape[0], call.hidden
    data, input_scale = input_values(call, inputs)
    rows, cols = ceil_div(tokens, cast.block[0]), ceil_div(hidden, cast.block[1])
    if call.mode == MODE_PRECOMPUTED_SF:
        given = call.given_sf
        inverse = inverse_of_given(layouts.read(inputs.given_sf, given.encoding, cast.pack_axis, rows, cols))
    else:
        values = data if input_scale is None else data * input_scale
        scales = compute_scales(group_amax(values, cast.block), cast.fmt, cast.clamp_min, cast.round_sf, cast.use_e4m3_sf)
        encoding = layouts.encoding_of_dtype(outputs.sf.dtype)
        layouts.write(outputs.sf, scales, encoding, cast.pack_axis)
        if call.mode == MODE_SF_ONLY:
            return
        inverse = scales.inverse
    if input_scale is None:
        scaled = scale_groups(data, inverse, cast.block)
    else:
        scaled = data * (input_scale * expand_groups(inverse, cast.block, tokens, hidden))
    if cast.stochastic:  # element i = t·H + h rounds with field i mod 2 of word i // 2 of the generator's draw
        random_bits = element_random_bits(inputs.seed, inputs.offset, tuple(scaled.shape), QUANT_RANDOM_FIELD_BITS)
        scaled = round_on_grid(scaled, random_bits, cast.fmt)
        inputs.offset.add_(1)  # the draw is done: the next one takes fresh words (a tensor op: no host sync)
    outputs.q.copy_(formats.encode(scaled, cast.fmt))


def cast_back(call: QuantCall, inputs: QuantInputs, outputs: QuantOutputs) -> None:
    """``float(q) * sf`` expanded over the group, rounded once to the output dtype."""
    data, input_scale = input_values(call, inputs)
    outputs.q.copy_((data * input_scale).to(call.output_dtype))
