"""CUDA ``fill_rand``: uniform values ``u = (r >> 8) · 2^-24`` (exact in fp32, rounded once to a
16-bit dtype) from the Philox words of one draw (``philox``), in row-major order.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.random.philox import RunLayout, philox_block, state_buffers
from tileplug.backend_cuda.random.spec import RandomKernelSpec

MANTISSA_SHIFT = 8
UNIT = 2.0 ** -24


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
            thread = T.cast(bx, "int64") * THREADS + tx
            for k in T.unroll(BLOCKS):
                philox_block(seed[0], offset[0], thread * BLOCKS + k, words)
                for i in T.unroll(4):
                    run[4 * k + i] = T.cast(T.shift_right(words[i], MANTISSA_SHIFT), "float32") * T.float32(UNIT)
            layout.store_run(values, thread * RUN, run)

    return kernel.with_attr("global_symbol", spec.name)
