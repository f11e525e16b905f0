"""Reference ``stochastic_cast`` (docs/spec.md §10.2), on integer tensors so that it is exact
on every device: element ``i`` of ``a = |x|`` between its neighbouring targets ``lo ≤ a < hi``
rounds up iff ``floor(p · 2^w) + f_i ≥ 2^w``, ``p = (a − lo) / (hi − lo)`` and ``f_i`` the
element's ``w``-bit field of the Philox draw under ``(seed, offset)`` (``w`` by the pair:
``core.contracts.cast.RANDOM_FIELD_BITS``); then ``offset += 1``. Every rounding here takes the
field shifted up to 24 bits, ``r_i = f_i · 2^(24 − w)``: ``floor(p · 2^24) + r_i ≥ 2^24`` is the
same test (``r_i``'s low bits are zero), so one rule serves every width.

- bf16 target: ``lo`` is the fp32 pattern with its low 16 bits cleared, ``hi`` the next bf16
  pattern (``+0x10000``: past the largest finite it is inf), ``floor(p · 2^24)`` the low 16
  bits shifted up by 8 (``p`` has 16 fractional bits).
- e4m3 target (and the quantized formats of the stochastic per-token / per-block casts,
  :func:`round_on_grid`): ``a = min(a, max)``; ``lo`` / ``hi`` from the table of the format's
  non-negative finite values (e4m3's 127, e2m1's 8), ``p`` in fp64, where ``a − lo`` and the
  division by a power-of-two step are exact, so ``floor(p · 2^24)`` is the truncation the
  spec defines.
"""

from __future__ import annotations

import torch

from tileplug.core.call import NoOutputs
from tileplug.core.contracts.cast import StochasticCastCall, StochasticCastInputs
from tileplug.core.quant.formats import E2M1_MAGNITUDES, E4M3, QuantFormat
from tileplug.reference.random.draw import MANTISSA_SHIFT
from tileplug.reference.random.philox import words

RANDOM_BITS = 32 - MANTISSA_SHIFT
"""The rounding's fixed point: an element's random field shifted up to 24 bits (at 24, ``word >> 8``: rand's bits)."""
WORD_BITS = 32
BF16_DROPPED_BITS = 16
"""fp32 → bf16 drops the low 16 bits of the pattern."""
E4M3_FINITE_CODES = 127
"""Codes 0x00 … 0x7E are e4m3's non-negative finite values (0x7F is NaN)."""


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


def grid_values(fmt: QuantFormat, device: torch.device) -> torch.Tensor:
    """The non-negative finite values of ``fmt`` ascending, fp64: e4m3's 127, e2m1's 8."""
    if fmt is E4M3:
        codes = torch.arange(E4M3_FINITE_CODES, dtype=torch.uint8, device=device)
        return codes.view(torch.float8_e4m3fn).to(torch.float64)
    return torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64, device=device)


def round_on_grid(x: torch.Tensor, random_bits: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """fp32 / bf16 ``x`` (any shape) → fp32 values of ``fmt``'s grid: ``|x|`` saturated at the
    format's largest value and rounded stochastically with ``random_bits`` (int64, 24 bits each,
    ``x``'s shape); the sign is kept, NaN stays NaN. ``fmt``'s deterministic encoder then maps
    these exact values to their codes."""
    table = grid_values(fmt, x.device)
    wide = x.to(torch.float64)
    magnitude = wide.abs().clamp(max=fmt.max_value).nan_to_num(0.0)
    low_index = torch.searchsorted(table, magnitude, right=True) - 1
    high_index = (low_index + 1).clamp(max=table.numel() - 1)
    low, high = table[low_index], table[high_index]
    step = torch.where(high > low, high - low, torch.ones_like(high))
    fraction_bits = torch.floor((magnitude - low) / step * float(1 << RANDOM_BITS)).to(torch.int64)
    rounded = torch.where(fraction_bits + random_bits >= (1 << RANDOM_BITS), high, low)
    rounded = torch.where(torch.signbit(wide), -rounded, rounded)
    return torch.where(torch.isnan(wide), wide, rounded).to(torch.float32)


def round_to_e4m3(x: torch.Tensor, random_bits: torch.Tensor) -> torch.Tensor:
    """fp32 / bf16 ``x`` (flat) → e4m3, saturating at ±448, stochastically with ``random_bits``."""
    return round_on_grid(x, random_bits, E4M3).to(torch.float8_e4m3fn)


def element_random_bits(seed: torch.Tensor, offset: torch.Tensor, shape: tuple[int, ...],
                        field_bits: int) -> torch.Tensor:
    """The random bits of each element of ``shape`` (row-major) under ``(seed, offset)``, int64 of
    that shape, as 24-bit integers: element ``i``'s ``field_bits``-wide field ``f_i`` of the draw
    (field ``i mod k`` of word ``i // k``, ``k = 32 // field_bits``, the first field at the word's
    top) shifted up to 24 bits, ``f_i · 2^(24 − field_bits)`` (``field_bits``: core's
    ``RANDOM_FIELD_BITS`` of the pair, or ``QUANT_RANDOM_FIELD_BITS``)."""
    count = 1
    for size in shape:
        count *= size
    fields = WORD_BITS // field_bits
    drawn = words(seed, offset, -(-count // fields))
    # field s of a word: its bits [32 − w·(s + 1), 32 − w·s), moved to the top of 24 bits
    shifts = torch.tensor([WORD_BITS - field_bits * (index + 1) for index in range(fields)], device=drawn.device)
    split = (drawn.unsqueeze(-1) >> shifts) & ((1 << field_bits) - 1)
    return (split.reshape(-1)[:count] << (RANDOM_BITS - field_bits)).view(shape)


def stochastic_cast(call: StochasticCastCall, inputs: StochasticCastInputs, outputs: NoOutputs) -> None:
    """``result`` = the stochastic narrowing of ``x``; then ``offset += 1`` (a tensor op: no host
    synchronisation)."""
    flat = inputs.x.reshape(-1)
    random_bits = element_random_bits(inputs.seed, inputs.offset, flat.shape, call.random_field_bits)
    if call.target == torch.bfloat16:
        rounded = round_to_bf16(flat, random_bits)
    else:
        rounded = round_to_e4m3(flat, random_bits)
    inputs.result.view(-1).copy_(rounded)
    inputs.offset.add_(1)
