"""Reference ``stochastic_cast`` (docs/spec.md §10.2), on integer tensors so that it is exact
on every device: element ``i`` of ``a = |x|`` between its neighbouring targets ``lo ≤ a < hi``
rounds up iff ``floor(p · 2^24) + r_i ≥ 2^24``, ``p = (a − lo) / (hi − lo)`` and
``r_i = word_i >> 8`` of the Philox draw under ``(seed, offset)``; then ``offset += 1``.

- bf16 target: ``lo`` is the fp32 pattern with its low 16 bits cleared, ``hi`` the next bf16
  pattern (``+0x10000``: past the largest finite it is inf), ``floor(p · 2^24)`` the low 16
  bits shifted up by 8 (``p`` has 16 fractional bits).
- e4m3 target: ``a = min(a, 448)``; ``lo`` / ``hi`` from the table of the 127 non-negative
  finite e4m3 values, ``p`` in fp64, where ``a − lo`` and the division by a power-of-two step
  are exact, so ``floor(p · 2^24)`` is the truncation the spec defines.
"""

from __future__ import annotations

import torch

from tileplug.core.call import NoOutputs
from tileplug.core.contracts.cast import StochasticCastCall, StochasticCastInputs
from tileplug.core.quant.formats import E4M3
from tileplug.reference.random.draw import MANTISSA_SHIFT
from tileplug.reference.random.philox import words

RANDOM_BITS = 32 - MANTISSA_SHIFT
"""``word >> 8``: the 24 random bits added below the target's last place (rand's bits)."""
BF16_DROPPED_BITS = 16
"""fp32 → bf16 drops the low 16 bits of the pattern."""
E4M3_FINITE_CODES = 127
"""Codes 0x00 … 0x7E are e4m3's non-negative finite values (0x7F is NaN)."""
E4M3_SIGN = 0x80
E4M3_NAN = 0x7F


def _random_bits(inputs: StochasticCastInputs) -> torch.Tensor:
    """``word_i >> 8`` of the draw, int64 in element order."""
    return words(inputs.seed, inputs.offset, inputs.x.numel()) >> MANTISSA_SHIFT


def round_to_bf16(x: torch.Tensor, random_bits: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` (flat) → bf16, stochastically with ``random_bits`` (int64, 24 bits each)."""
    pattern = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sign = pattern & 0x80000000
    magnitude = pattern & 0x7FFFFFFF
    below = magnitude & ((1 << BF16_DROPPED_BITS) - 1)
    up = ((below << (RANDOM_BITS - BF16_DROPPED_BITS)) + random_bits) >= (1 << RANDOM_BITS)
    rounded = (magnitude >> BF16_DROPPED_BITS) + up.to(torch.int64)
    result = (sign >> BF16_DROPPED_BITS) | rounded
    nan = torch.isnan(x)
    result = torch.where(nan, (pattern >> BF16_DROPPED_BITS) | 0x40, result)  # a quiet NaN, sign kept
    return result.to(torch.int16).view(torch.bfloat16)


def _e4m3_table(device: torch.device) -> torch.Tensor:
    return torch.arange(E4M3_FINITE_CODES, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).to(
        torch.float64)


def round_to_e4m3(x: torch.Tensor, random_bits: torch.Tensor) -> torch.Tensor:
    """fp32 / bf16 ``x`` (flat) → e4m3, saturating at ±448, stochastically with ``random_bits``."""
    table = _e4m3_table(x.device)
    wide = x.to(torch.float64)
    magnitude = wide.abs().clamp(max=E4M3.max_value).nan_to_num(0.0)
    low_code = torch.searchsorted(table, magnitude, right=True) - 1
    high_code = (low_code + 1).clamp(max=E4M3_FINITE_CODES - 1)
    low, high = table[low_code], table[high_code]
    step = torch.where(high > low, high - low, torch.ones_like(high))
    fraction_bits = torch.floor((magnitude - low) / step * float(1 << RANDOM_BITS)).to(torch.int64)
    up = (fraction_bits + random_bits) >= (1 << RANDOM_BITS)
    code = low_code + up.to(torch.int64)
    code = torch.where(torch.signbit(wide), code | E4M3_SIGN, code)
    code = torch.where(torch.isnan(wide), code.new_full((), E4M3_NAN) | (code & E4M3_SIGN), code)
    return code.to(torch.uint8).view(torch.float8_e4m3fn)


def stochastic_cast(call: StochasticCastCall, inputs: StochasticCastInputs, outputs: NoOutputs) -> None:
    """``result`` = the stochastic narrowing of ``x``; then ``offset += 1`` (a tensor op: no host
    synchronisation)."""
    flat = inputs.x.reshape(-1)
    random_bits = _random_bits(inputs)
    if call.target == torch.bfloat16:
        rounded = round_to_bf16(flat, random_bits)
    else:
        rounded = round_to_e4m3(flat, random_bits)
    inputs.result.view(-1).copy_(rounded)
    inputs.offset.add_(1)
