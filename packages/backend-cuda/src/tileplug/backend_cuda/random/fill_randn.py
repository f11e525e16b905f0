"""CUDA ``fill_randn``: Box–Muller on each Philox block's pairs ``(r0, r1)``, ``(r2, r3)``
(SPEC §9), in fp32, rounded once to a 16-bit dtype.

With ``a = ((r_even >> 8) + 1) · 2^-24`` and ``t = (r_odd >> 8) · 2^-24``: ``z_even =
sqrt(−2 ln a) · cos(2πt)``, ``z_odd = sqrt(−2 ln a) · sin(2πt)``, evaluated in fp64 and rounded
once to fp32, as the reference does, from inputs that are exact: ``ln a = log1p(a − 1)`` with
``a − 1 = ((r >> 8) + 1 − 2^24) · 2^-24`` (an integer times a power of two: no cancellation near
``a = 1``), and the angle through ``sinpi`` / ``cospi`` of ``2t = (r >> 8) · 2^-23`` (no rounding
of ``2π``; exact zeros and ones at the quadrant boundaries). The values are those of the
reference's fp64 formula but for the last bits of two different fp64 libraries: equal in fp32
but for a near-tie. (fp32 ``log1pf`` / ``sinpif`` / ``cospif`` — each within 1 ulp — put 2 in
10^6 values 3 ulp away, past SPEC's 2, on the H200.)

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.random.philox import build_draw
from tileplug.backend_cuda.random.spec import RandomKernelSpec

MANTISSA_SHIFT = 8
STEPS = 1 << 24
"""``r >> 8`` takes this many values: ``a``'s and ``t``'s steps are ``2^-24``."""


@T.macro
def box_muller(words, run, k):
    """``run[4k … 4k + 3]``: Box–Muller of the pairs ``(words[0], words[1])``, ``(words[2], words[3])``."""
    radius = T.alloc_local((1,), "float64")
    turns = T.alloc_local((1,), "float64")
    for pair in T.unroll(2):
        # a − 1 and 2t, both exact
        below_one = T.cast(T.cast(T.shift_right(words[2 * pair], MANTISSA_SHIFT), "int32") + (1 - STEPS),
                           "float64") * T.float64(1.0 / STEPS)
        radius[0] = T.sqrt(T.float64(-2.0) * T.log1p(below_one))
        turns[0] = T.cast(T.shift_right(words[2 * pair + 1], MANTISSA_SHIFT), "float64") * T.float64(2.0 / STEPS)
        run[4 * k + 2 * pair] = T.cast(radius[0] * T.call_extern("float64", "cospi", turns[0]), "float32")
        run[4 * k + 2 * pair + 1] = T.cast(radius[0] * T.call_extern("float64", "sinpi", turns[0]), "float32")


def build(spec: RandomKernelSpec):
    """The ``T.prim_func``: buffers ``(values [N], seed [1], offset [1])``."""
    return build_draw(spec, box_muller)
