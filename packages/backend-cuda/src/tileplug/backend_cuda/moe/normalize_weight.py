"""CUDA ``normalize_weight`` (SPEC §7): per row of fp32 ``topk_weights [T, K]``,
``denominator = Σ w`` added left to right in slot order and ``normalized = w / denominator``
(IEEE division). One thread per row: the sum's order is the contract's, nothing to reduce.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.moe.spec import RowSpec

THREADS = 128


def build(spec: RowSpec):
    """The ``T.prim_func`` of a ``normalize_weight`` specialisation: ``(topk_weights, denominator,
    normalized)``."""
    K = spec.width
    SLOTS = list(range(K))  # unrolled while tracing
    rows = T.dynamic("T")

    @T.prim_func
    def kernel(topk_weights: T.StridedTensor((rows, K), (T.dynamic("S0"), 1), "float32"),
               denominator: T.Tensor((rows,), "float32"), normalized: T.Tensor((rows, K), "float32")):
        with T.Kernel(T.ceildiv(rows, THREADS), threads=THREADS) as bx:
            t = bx * THREADS + T.get_thread_binding()
            if t < rows:
                w = T.alloc_local((K,), "float32")
                total = T.alloc_local((1,), "float32")
                for s in SLOTS:
                    w[s] = topk_weights[t, s]
                total[0] = w[0]
                for s in SLOTS[1:]:
                    total[0] = T.ieee_add(total[0], w[s])
                denominator[t] = total[0]
                for s in SLOTS:
                    normalized[t, s] = T.ieee_fdiv(w[s], total[0])

    return kernel.with_attr("global_symbol", spec.name)
