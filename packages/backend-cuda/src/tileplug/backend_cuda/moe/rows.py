"""The row-moving kernels of ``moe_permute`` / ``moe_unpermute`` (TileLang).

A row of ``width`` elements is ``PIECES`` pieces of ``vec`` elements (16 bytes on the vector
path); thread ``tx`` of a CTA of ``ROW_THREADS`` holds pieces ``p · ROW_THREADS + tx``
(consecutive threads, consecutive 16 bytes: coalesced).

- ``permute_rows``: one CTA per token reads its row (and scale row) once into registers and
  writes it to each row ``permutation[t, s] ≥ 0`` (every expanded row has one writer).
  Its slots' rows are loaded ``SLOT_GROUP`` at a time (with the row: nothing stored in between).
  The CTAs after the ``T`` copying ones zero the padding rows, in the same launch:
- padding: one warp per expanded row ``r``; ``r`` is padding when no expert's range
  ``[start[e], expert_ends[e])`` holds it (a binary search of ``expert_ends``, ascending;
  ``start[e] = align(expert_ends[e − 1], alignment)``): such a row (and its scale row) is
  written with zeros. Copies and zeros touch disjoint rows. Batched (``spec.batched``,
  ``spec.BATCHED_LAYOUT_VARIABLE``): the padding rows are found from the ends instead of searched
  for — CTA ``e < E − 1`` zeroes ``[expert_ends[e], align(expert_ends[e]))`` (that is
  ``start[e + 1]``), and ``TAIL_CTAS`` CTAs the rows ``[expert_ends[E − 1], R)`` past the last
  expert — so a launch no longer searches for each of the ``T·K`` rows that are not padding.
- ``unpermute``: one CTA per token: ``y[t] = Σ_s w[t, s] · y_expanded[permutation[t, s]]``,
  each product and sum rounded to fp32 in slot order (slots whose row is outside ``[0, R)`` skipped), rounded once to
  the output dtype.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.moe.spec import RowCopySpec

ROW_THREADS = 128
PADDING_WARPS = 4
SLOT_GROUP = 8
"""Slots whose expanded rows a row-copy thread loads together before storing to them (one load latency a group,
where a slot at a time waited for each)."""
TAIL_CTAS = 256
"""CTAs of the batched padding job striding over the rows past the last expert (none when every pair
is routed; a constant: which CTA zeroes a row changes no byte)."""


class RowPieces:
    """Trace-time piece geometry of a row of ``width`` elements, ``vec`` per piece."""

    def __init__(self, width: int, vec: int) -> None:
        self.W, self.VEC = width, vec
        self.PIECES = -(-width // vec)
        self.PER_THREAD = -(-self.PIECES // ROW_THREADS)
        self.SLOTS = list(range(self.PER_THREAD))  # unrolled while tracing
        self.LANE_VALUES = list(range(vec))
        # slot p of some thread lies (partly) past the row: only those test their piece
        self.partial = [(p + 1) * ROW_THREADS > self.PIECES for p in self.SLOTS]


def _padding_rows(spec: RowCopySpec, expanded):
    """The padding job of ``moe_permute``'s row kernel: ``(CTAs it takes, macro zeroing the rows of its CTA
    ``job``)``. A CTA is ``PADDING_WARPS`` warps, a warp a row. Batched (``spec.batched``): CTA ``e < E − 1``
    zeroes ``[expert_ends[e], align(expert_ends[e]))`` (none without alignment), the last ``TAIL_CTAS`` stride
    over ``[expert_ends[E − 1], R)``; otherwise CTA ``j`` holds rows ``4j … 4j + 3`` and zeroes those no
    expert's ``[start[e], expert_ends[e])`` holds (a binary search of the ascending ends)."""
    VEC, E, ALIGN, F = spec.vec, spec.experts, spec.alignment, spec.sf_width
    PIECES = -(-spec.width // VEC)
    SEARCH = list(range(max(1, E.bit_length())))  # lower-bound steps over E ends (unrolled)
    EXPERT_CTAS = E - 1 if ALIGN > 1 else 0  # the padding after expert e < E − 1 (batched)

    @T.macro
    def zero_row(r, lane, x_expanded, x_sf_expanded):
        for step in T.serial(T.ceildiv(PIECES, 32)):
            piece = step * 32 + lane
            if piece < PIECES:
                for c in T.vectorized(VEC):
                    x_expanded[r, piece * VEC + c] = T.cast(0, spec.dtype)
        if spec.sf_dtype is not None:
            for step in T.serial(T.ceildiv(F, 32)):
                j = step * 32 + lane
                if j < F:
                    x_sf_expanded[r, j] = T.cast(0, spec.sf_dtype)

    @T.macro
    def batched_job(job, tx, expert_ends, x_expanded, x_sf_expanded):
        lane = tx % 32
        warp = tx // 32
        if job < EXPERT_CTAS:  # rows [end, align(end)): fewer than ALIGN
            end = expert_ends[job]
            for step in T.serial(T.ceildiv(ALIGN - 1, PADDING_WARPS)):
                r = end + step * PADDING_WARPS + warp
                if r < (end + (ALIGN - 1)) // ALIGN * ALIGN:
                    zero_row(r, lane, x_expanded, x_sf_expanded)
        else:  # the tail [expert_ends[E − 1], R), a warp a row, striding over the tail CTAs
            first = expert_ends[E - 1] + (job - EXPERT_CTAS) * PADDING_WARPS + warp
            for step in T.serial(T.ceildiv(expanded - expert_ends[E - 1], TAIL_CTAS * PADDING_WARPS)):
                r = first + step * (TAIL_CTAS * PADDING_WARPS)
                if r < expanded:
                    zero_row(r, lane, x_expanded, x_sf_expanded)

    @T.macro
    def searched_job(job, tx, expert_ends, x_expanded, x_sf_expanded, low, high):
        lane = tx % 32
        r = job * PADDING_WARPS + tx // 32
        if r < expanded:
            low[0] = 0
            high[0] = E
            for _ in SEARCH:  # the first expert whose end is past r
                middle = (low[0] + high[0]) // 2
                if low[0] < high[0]:
                    if expert_ends[T.min(middle, E - 1)] > r:
                        high[0] = middle
                    else:
                        low[0] = middle + 1
            start = T.if_then_else(low[0] == 0, 0,
                                   (expert_ends[T.max(low[0] - 1, 0)] + (ALIGN - 1)) // ALIGN * ALIGN)
            if T.Or(low[0] >= E, r < start):
                zero_row(r, lane, x_expanded, x_sf_expanded)

    if spec.batched:
        return EXPERT_CTAS + TAIL_CTAS, batched_job
    return T.ceildiv(expanded, PADDING_WARPS), searched_job


def build_permute_rows(spec: RowCopySpec):
    """``(expert_ends [E], x [T, W], x_sf [T, F] | x, permutation [T, K], x_expanded [R, W],
    x_sf_expanded [R, F] | x_expanded)``: CTAs ``t < T`` copy token ``t``'s row, the CTAs after them zero the
    padding rows (``_padding_rows``; the two touch disjoint rows, so one launch holds both)."""
    geometry = RowPieces(spec.width, spec.vec)
    VEC, K, F = spec.vec, spec.slots, spec.sf_width
    GROUP = max(1, min(K, SLOT_GROUP))  # (K = 0: no slot, no group)
    rows, expanded = T.dynamic("T"), T.dynamic("R")
    x_t = T.StridedTensor((rows, spec.width), (T.dynamic("S0"), 1), spec.dtype)
    out_t = T.Tensor((expanded, spec.width), spec.dtype)
    if spec.sf_dtype is not None:
        sf_t = T.StridedTensor((rows, F), (T.dynamic("F0"), 1), spec.sf_dtype)
        sf_out_t = T.Tensor((expanded, F), spec.sf_dtype)
    else:
        sf_t = T.StridedTensor((T.dynamic("fA"), T.dynamic("fB")), (T.dynamic("fC"), 1), spec.dtype)
        sf_out_t = T.StridedTensor((T.dynamic("gA"), T.dynamic("gB")), (T.dynamic("gC"), 1), spec.dtype)
    padding_ctas, padding_job = _padding_rows(spec, expanded)

    @T.prim_func
    def kernel(expert_ends: T.Tensor((spec.experts,), "int32"), x: x_t, x_sf: sf_t,
               permutation: T.Tensor((rows, K), "int32"), x_expanded: out_t, x_sf_expanded: sf_out_t):
        with T.Kernel(rows + padding_ctas, threads=ROW_THREADS) as t:
            if VEC > 1:
                T.assume(x_t.strides[0] % VEC == 0)
            tx = T.get_thread_binding()
            values = T.alloc_local((geometry.PER_THREAD * VEC,), spec.dtype)
            targets = T.alloc_local((GROUP,), "int32")  # the expanded rows of GROUP slots, loaded together
            low = T.alloc_local((1,), "int32")
            high = T.alloc_local((1,), "int32")
            if t < rows:
                for p in geometry.SLOTS:
                    piece = p * ROW_THREADS + tx
                    if (not geometry.partial[p]) or piece < geometry.PIECES:
                        for c in T.vectorized(VEC):
                            values[p * VEC + c] = x[t, piece * VEC + c]
                for group in T.serial(T.ceildiv(K, GROUP)):
                    for j in T.unroll(GROUP):
                        if K % GROUP == 0:
                            targets[j] = permutation[t, group * GROUP + j]
                        else:
                            targets[j] = T.if_then_else(group * GROUP + j < K,
                                                        permutation[t, T.min(group * GROUP + j, K - 1)], -1)
                    for j in T.unroll(GROUP):
                        if targets[j] >= 0:
                            for p in geometry.SLOTS:
                                piece = p * ROW_THREADS + tx
                                if (not geometry.partial[p]) or piece < geometry.PIECES:
                                    for c in T.vectorized(VEC):
                                        x_expanded[targets[j], piece * VEC + c] = values[p * VEC + c]
                            if spec.sf_dtype is not None:
                                for step in T.serial(T.ceildiv(F, ROW_THREADS)):
                                    column = step * ROW_THREADS + tx
                                    if column < F:
                                        x_sf_expanded[targets[j], column] = x_sf[t, column]
            else:
                search = () if spec.batched else (low, high)  # the searched job's two bounds
                padding_job(t - rows, tx, expert_ends, x_expanded, x_sf_expanded, *search)

    return kernel.with_attr("global_symbol", spec.name)


def build_unpermute(spec: RowCopySpec):
    """``(y_expanded [R, H], permutation [T, K], topk_weights [T, K], y [T, H])``."""
    geometry = RowPieces(spec.width, spec.vec)
    VEC, K = spec.vec, spec.slots
    rows, expanded = T.dynamic("T"), T.dynamic("R")
    y_exp_t = T.StridedTensor((expanded, spec.width), (T.dynamic("Y0"), 1), spec.dtype)
    perm_t = T.StridedTensor((rows, K), (T.dynamic("P0"), 1), spec.index_dtype)
    weights_t = T.StridedTensor((rows, K), (T.dynamic("W0"), 1), "float32")

    @T.prim_func
    def kernel(y_expanded: y_exp_t, permutation: perm_t, topk_weights: weights_t,
               y: T.Tensor((rows, spec.width), spec.dtype)):
        with T.Kernel(rows, threads=ROW_THREADS) as t:
            if VEC > 1:
                T.assume(y_exp_t.strides[0] % VEC == 0)
            tx = T.get_thread_binding()
            acc = T.alloc_local((geometry.PER_THREAD * VEC,), "float32")
            values = T.alloc_local((geometry.PER_THREAD * VEC,), spec.dtype)
            source = T.alloc_local((1,), "int64")
            weight = T.alloc_local((1,), "float32")
            for i in T.unroll(geometry.PER_THREAD * VEC):
                acc[i] = T.float32(0.0)
            for s in T.serial(K):
                source[0] = T.cast(permutation[t, s], "int64")
                weight[0] = topk_weights[t, s]
                if T.And(source[0] >= 0, source[0] < T.cast(expanded, "int64")):
                    for p in geometry.SLOTS:
                        piece = p * ROW_THREADS + tx
                        if (not geometry.partial[p]) or piece < geometry.PIECES:
                            for c in T.vectorized(VEC):
                                values[p * VEC + c] = y_expanded[source[0], piece * VEC + c]
                            for c in geometry.LANE_VALUES:
                                acc[p * VEC + c] = T.ieee_add(
                                    acc[p * VEC + c], T.ieee_mul(weight[0], T.cast(values[p * VEC + c], "float32")))
            for p in geometry.SLOTS:
                piece = p * ROW_THREADS + tx
                if (not geometry.partial[p]) or piece < geometry.PIECES:
                    for c in T.vectorized(VEC):
                        y[t, piece * VEC + c] = T.cast(acc[p * VEC + c], spec.dtype)

    return kernel.with_attr("global_symbol", spec.name)
