"""Reference transpose_weight_sf (SPEC §11): fp32 weight-block scales → the packed UE8M0,
MN-major sf0 / sf1 DeepGEMM's FP8 GEMMs read."""

from __future__ import annotations

import torch

from tileplug.core.contracts.quant_reblock import WeightScaleCall, WeightScaleOutputs
from tileplug.core.quant import layouts
from tileplug.core.quant.sf_math import given_scale_exponent


def _rows_packed(exponent_bytes: torch.Tensor, block_size: int, pack_factor: int) -> torch.Tensor:
    """uint8 ``[*g, R, C]`` → ``[*g, R·bs, ceil(C/f)]`` packed integers: each row repeated for
    the ``bs`` weight rows of its block, its bytes packed little-endian (pad bytes 0)."""
    expanded = exponent_bytes.repeat_interleave(block_size, dim=-2)
    flat = expanded.reshape(-1, expanded.shape[-1])
    packed = layouts.pack_ue8m0(flat, pack_factor, pack_axis=1)
    return packed.reshape(*expanded.shape[:-1], packed.shape[-1])


def transpose_weight_sf(call: WeightScaleCall, inputs: tuple[torch.Tensor, ...], outputs: WeightScaleOutputs) -> None:
    """Per weight: sf0 from the scales, sf1 from their transpose, each byte ``e + 127``."""
    pack_factor = layouts.encoding_of_dtype(outputs[0].dtype).pack_factor
    for index, scales in enumerate(inputs):
        sf0, sf1 = outputs[2 * index], outputs[2 * index + 1]
        if scales.numel() == 0:
            continue
        exponent_bytes = (given_scale_exponent(scales) + 127).to(torch.uint8)
        sf0.copy_(_rows_packed(exponent_bytes, call.block_size, pack_factor))
        transposed = _rows_packed(exponent_bytes.transpose(-1, -2), call.block_size, pack_factor)
        (sf1.transpose(-1, -2) if call.transpose_sf1 else sf1).copy_(transposed)
