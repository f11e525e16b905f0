"""CUDA ``fill_randn``: Box–Muller on each Philox block's pairs ``(r0, r1)``, ``(r2, r3)``
(SPEC §9), in fp32, rounded once to a 16-bit dtype.

With ``a = ((r_even >> 8) + 1) · 2^-24`` and ``t = (r_odd >> 8) · 2^-24``: ``z_even =
sqrt(−2 ln a) · cos(2πt)``, ``z_odd = sqrt(−2 ln a) · sin(2πt)``. Evaluated so that every
input of a transcendental is exact: ``ln a = log1p(a − 1)`` with ``a − 1 = ((r >> 8) + 1 −
2^24) · 2^-24`` (an integer times a power of two: no cancellation near ``a = 1``), and the angle
through ``sinpi`` / ``cospi`` of ``2t = (r >> 8) · 2^-23`` (exact: no rounding of ``2π``, exact
zeros and ones at the quadrant boundaries). CUDA's ``log1pf``, ``sinpif`` and ``cospif`` are
within 1 ulp and ``sqrtf`` is correctly rounded, so a value is within about 2 ulp of the
reference's (fp64, rounded once) — SPEC's bound; the GPU test measures the largest distance.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.random.philox import RunLayout, philox_block, state_buffers
from tileplug.backend_cuda.random.spec import RandomKernelSpec

MANTISSA_SHIFT = 8
STEPS = 1 << 24
"""``r >> 8`` takes this many values: ``a``'s and ``t``'s steps are ``2^-24``."""


def build(spec: RandomKernelSpec):
    """The ``T.prim_func``: buffers ``(values [N], seed [1], offset [1])``."""
    N = T.dynamic("N", "int64")
    layout = RunLayout(spec, N)
    BLOCKS, RUN, THREADS = layout.BLOCKS, layout.RUN, layout.THREADS
    seed_t, offset_t = state_buffers()

    @T.prim_func
    def kernel(values: T.Tensor((N,), spec.dtype), seed: seed_t, offset: offset_t):
        with T.Kernel(layout.grid(N), threads=THREADS) as bx:
            tx = T.get_thread_binding()
            words = T.alloc_local((4,), "uint32")
            run = T.alloc_local((RUN,), "float32")
            radius = T.alloc_local((1,), "float32")
            turns = T.alloc_local((1,), "float32")
            thread = T.cast(bx, "int64") * THREADS + tx
            for k in T.unroll(BLOCKS):
                philox_block(seed[0], offset[0], thread * BLOCKS + k, words)
                for pair in T.unroll(2):
                    # a − 1 and 2t, both exact in fp32
                    below_one = T.cast(T.cast(T.shift_right(words[2 * pair], MANTISSA_SHIFT), "int32") + (1 - STEPS),
                                       "float32") * T.float32(1.0 / STEPS)
                    radius[0] = T.sqrt(T.float32(-2.0) * T.log1p(below_one))
                    turns[0] = T.cast(T.shift_right(words[2 * pair + 1], MANTISSA_SHIFT), "float32") * T.float32(
                        2.0 / STEPS)
                    run[4 * k + 2 * pair] = radius[0] * T.call_extern("float32", "cospif", turns[0])
                    run[4 * k + 2 * pair + 1] = radius[0] * T.call_extern("float32", "sinpif", turns[0])
            layout.store_run(values, thread * RUN, run)

    return kernel.with_attr("global_symbol", spec.name)
