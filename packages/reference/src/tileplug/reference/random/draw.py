"""Reference ``fill_rand`` / ``fill_randn``: the words of one draw, their transform (SPEC §9),
written into ``values`` in row-major order; then the generator's offset advances by one
with a tensor op (no host synchronisation: a captured graph draws fresh numbers on replay).

- uniform: ``u = (r >> 8) · 2^-24``, exact in fp32, rounded once to a 16-bit dtype;
- normal: Box–Muller on the pairs ``(r0, r1)``, ``(r2, r3)`` of each block, with
  ``a = ((r_even >> 8) + 1) · 2^-24`` and ``t = (r_odd >> 8) · 2^-24``:
  ``z_even = sqrt(−2 ln a) · cos(2πt)``, ``z_odd = sqrt(−2 ln a) · sin(2πt)``. The reference
  evaluates it in fp64 and rounds once to fp32 (the fp32 value closest to the formula: SPEC
  allows a backend 2 fp32 ulp from it for its fp32 transcendentals), then once to bf16 /
  fp16. ``a`` and ``t`` are exact in fp64; the angle is reduced on the integer ``t·2^24``
  (its top two bits are the quadrant), so ``cos`` and ``sin`` are exactly 0 or ±1 where they
  should be and accurate to fp64 elsewhere.
"""

from __future__ import annotations

import math

import torch

from tileplug.core.call import NoOutputs
from tileplug.core.contracts.random import RandomCall, RandomInputs
from tileplug.reference.random.philox import block_count, block_words, words

MANTISSA_SHIFT = 8
"""``r >> 8`` keeps the top 24 bits of a word: fp32's significand."""
UNIT = 2.0 ** -24
QUADRANT_BITS = 22
"""``t·2^24 >> 22`` is the quadrant of the angle ``2πt``; the low 22 bits its position inside."""


def uniform_from_words(draws: torch.Tensor) -> torch.Tensor:
    """``(r >> 8) · 2^-24`` of int64 words → fp32 in ``[0, 1)`` (exact: 24-bit integers)."""
    return (draws >> MANTISSA_SHIFT).to(torch.float32) * UNIT


def cos_sin_of_turns(steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos(2πt)`` and ``sin(2πt)`` in fp64 for ``t = steps · 2^-24`` (``steps`` int64 in
    ``[0, 2^24)``): the quadrant from the top two bits, the rest an angle in ``[0, π/2)``."""
    quadrant = steps >> QUADRANT_BITS
    inside = (steps & ((1 << QUADRANT_BITS) - 1)).to(torch.float64) * (math.pi / 2 * 2.0 ** -QUADRANT_BITS)
    cos, sin = torch.cos(inside), torch.sin(inside)
    # rotate by quadrant·π/2; 0 − v (not −v) keeps an exact zero positive
    cos_turn = torch.where(quadrant == 0, cos, torch.where(quadrant == 1, 0.0 - sin,
                           torch.where(quadrant == 2, 0.0 - cos, sin)))
    sin_turn = torch.where(quadrant == 0, sin, torch.where(quadrant == 1, cos,
                           torch.where(quadrant == 2, 0.0 - sin, 0.0 - cos)))
    return cos_turn, sin_turn


def normal_from_block_words(block: torch.Tensor) -> torch.Tensor:
    """Box–Muller of int64 ``[B, 4]`` block words → fp32 ``[4B]`` in element order."""
    even = block[:, 0::2] >> MANTISSA_SHIFT  # r0, r2
    odd = block[:, 1::2] >> MANTISSA_SHIFT  # r1, r3
    radius = torch.sqrt(-2.0 * torch.log((even + 1).to(torch.float64) * UNIT))
    cos, sin = cos_sin_of_turns(odd)
    return torch.stack((radius * cos, radius * sin), dim=2).reshape(-1).to(torch.float32)


def fill_rand(call: RandomCall, inputs: RandomInputs, outputs: NoOutputs) -> None:
    """Uniform draws into ``inputs.values``, then ``offset += 1``."""
    values = inputs.values
    draws = words(inputs.seed, inputs.offset, values.numel())
    values.view(-1).copy_(uniform_from_words(draws))
    inputs.offset.add_(1)


def fill_randn(call: RandomCall, inputs: RandomInputs, outputs: NoOutputs) -> None:
    """Normal draws into ``inputs.values``, then ``offset += 1``."""
    values = inputs.values
    count = values.numel()
    block = block_words(inputs.seed, inputs.offset, block_count(count))
    values.view(-1).copy_(normal_from_block_words(block)[:count])
    inputs.offset.add_(1)
