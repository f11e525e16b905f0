"""CUDA ``fill_rand``: uniform values ``u = (r >> 8) · 2^-24`` (exact in fp32, rounded once to a
16-bit dtype) from the Philox words of one draw (``philox``), in row-major order.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.random.philox import build_draw
from tileplug.backend_cuda.random.spec import RandomKernelSpec

MANTISSA_SHIFT = 8
UNIT = 2.0 ** -24


@T.macro
def uniform(words, run, k):
    """``run[4k + i] = (words[i] >> 8) · 2^-24`` (exact)."""
    for i in T.unroll(4):
        run[4 * k + i] = T.cast(T.shift_right(words[i], MANTISSA_SHIFT), "float32") * T.float32(UNIT)


def build(spec: RandomKernelSpec):
    """The ``T.prim_func``: buffers ``(values [N], seed [1], offset [1])``."""
    return build_draw(spec, uniform)
