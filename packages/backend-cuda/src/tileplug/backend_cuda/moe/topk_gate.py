"""CUDA ``topk_gate`` (SPEC §7): per row of fp32 ``scores [T, E]`` the indices of the ``k``
largest scores in descending order, ties to the smaller index, int64 ``[T, k]``; a row holding
a non-finite score gets −1 in every slot (no device assert: nothing else changes).

One warp per row (``warp_topk.WarpRow``), ``WARPS`` rows per CTA; ``k`` rounds of the warp
argmax (or, with ``spec.lane_heads``, over the lanes' two heads; with ``spec.unrolled`` unrolled while
tracing), lane ``r`` keeping slot ``r`` and writing it (``k ≤ 32``: one coalesced store).

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.moe.spec import GateSpec
from tileplug.backend_cuda.moe.warp_topk import NONE, WARP, WarpRow, key_of


def build(spec: GateSpec):
    """The ``T.prim_func`` of a ``topk_gate`` specialisation: buffers ``(scores, topk_idx)``."""
    row = WarpRow(spec.experts, spec.vec, spec.fixed_heads)
    K = spec.topk
    WARPS = spec.warps
    VALUES = row.VALUES
    rows = T.dynamic("T")
    scores_t = T.StridedTensor((rows, spec.experts), (T.dynamic("S0"), 1), "float32")
    idx_t = T.Tensor((rows, K), "int64")

    @T.prim_func
    def kernel(scores: scores_t, topk_idx: idx_t):
        with T.Kernel(T.ceildiv(rows, WARPS), threads=WARPS * WARP) as bx:
            if spec.ctas_per_sm:
                T.annotate_min_blocks_per_sm(spec.ctas_per_sm)
            if spec.vec > 1:
                T.assume(scores_t.strides[0] % spec.vec == 0)
            tx = T.get_thread_binding()
            lane = tx % WARP
            t = bx * WARPS + tx // WARP
            if t < rows:
                values = T.alloc_local((VALUES,), "float32")
                keys = row.keys()
                finite = T.alloc_local((1,), "int32")
                best = T.alloc_local((1,), "int32")
                where = T.alloc_local((1,), "int32")
                found = T.alloc_local((1,), "int32")
                index = T.alloc_local((1,), "int32")
                mine = T.alloc_var("int32" if spec.unrolled else "int64")  # slot `lane`'s index
                heads = row.lane_heads() if spec.lane_heads else None
                row.load_row(scores, t, lane, values)
                row.all_finite(values, lane, finite)
                mine = -1
                if finite[0]:
                    for i in row.entries:
                        keys[i] = key_of(values[i]) if row.present(i, lane) is True else \
                            T.if_then_else(row.present(i, lane), key_of(values[i]), NONE)
                    if spec.lane_heads:
                        row.fill_heads(keys, None, lane, heads, False)
                    for r in row.rounds(K, spec.unrolled):
                        if spec.lane_heads:
                            row.heads_round(keys, None, lane, heads, r, found, index, None)
                        else:
                            row.argmax(keys, lane, best, where, found, index)
                            row.take(keys, lane, index[0])
                        if lane == r:
                            mine = index[0] if spec.unrolled else T.cast(index[0], "int64")
                if lane < K:
                    topk_idx[t, lane] = T.cast(mine, "int64") if spec.unrolled else mine

    return kernel.with_attr("global_symbol", spec.name)
