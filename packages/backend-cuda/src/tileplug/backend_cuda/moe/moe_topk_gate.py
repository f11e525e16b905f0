"""CUDA ``moe_topk_gate`` (SPEC §7): scored, biased, optionally group-limited top-k routing
with renormalisation, routed scaling, shared-expert slots, a row mask and the scores output.

One warp per row (``warp_topk.WarpRow``), ``WARPS`` rows per CTA, every value in registers:

1. ``x`` = the row's logits in fp32 (bf16 widened exactly); scores ``u`` in fp32
   (``score_row``) with the reference's operations and rounding points
   (``tileplug.core.moe.formulas.scores_of``): softmax ``exp(x − m) / D`` with ``m`` the row's
   maximum and ``D`` the sum of the exponentials in the reference's own order, the pairwise
   halving tree of ``tileplug.core.norm.formulas.row_sum`` (``WarpRow.row_sum``: the norm rows'
   plan, in registers then in the warp's part of a shared buffer, ``__syncwarp`` per level),
   bit for bit; ``1 / (1 + exp(−x))``; or ``sqrt(softplus(x))`` with the reference's stable
   ``softplus(x) = max(x, 0) + log1p(exp(−|x|))``. Every add / divide / square root is IEEE
   (``__fadd_rn``, ``__fdiv_rn``, ``__fsqrt_rn``); ``exp`` and ``log1p`` are the fp32 roundings
   of fp64 values, as the reference computes them (``formulas.correctly_rounded``; CUDA's
   ``expf`` is up to 2 ulp off): CUDA's fp64 ``exp`` / ``log1p`` rounded once, or, with
   ``spec.table_math`` (``spec.SCORE_MATH_VARIABLE``: the default for sqrtsoftplus),
   ``tileplug.backend_cuda.fp32_math``'s table-driven fp64 polynomials, which defer to CUDA's
   functions wherever their few ulps of error could change the fp32 rounding — the same bits, at
   about a third of the fp64 instructions (sqrtsoftplus: both functions in one helper,
   ``softplus_log``, one range test for the two). (A double rounding at a near-tie, about 2^-28
   of the inputs, can still put a score one ulp from the reference.)
2. Selection keys on ``u + bias`` (bias for selection only).
3. Groups (``G > 1``): group ``g``'s score is the sum of its two largest biased scores (two
   warp argmax rounds over its members); lane ``g`` holds it, and ``topk_groups`` argmax
   rounds over the lanes pick the groups (ties to the smaller group); other groups' experts
   become ``NONE``.
4. ``k`` argmax rounds (or, with ``spec.lane_heads``, rounds over the lanes' two heads, which
   choose the same experts: ``warp_topk.WarpRow.lane_heads``; with ``spec.unrolled`` unrolled while
   tracing); round ``r`` gives slot ``r`` (lane
   ``r`` keeps it) its expert and unbiased ``u``, and adds ``u`` to the running sum in slot order,
   left to right from 0 (the reference's ``slot_sum``; every lane the same sum).
5. Weights: ``u / (sum + 1e-20) · routed_scaling_factor`` with ``renormalize``, else
   ``u · routed_scaling_factor`` (each op rounded to fp32, as the reference's tensor ops);
   slots ``k .. k+S−1`` expert ``E + s``, weight 1.
6. A masked row (``mask[t]`` False), a row whose logits are not all finite, or every row when
   the bias holds a non-finite value (the reference's ``finite_rows``: the logits are checked,
   not the scores — ``sqrt(softplus(−inf)) = 0`` is finite) gets index −1 and weight 0 in
   every slot; its scores are still written.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.fp32_math import device_helpers, fast_f32, library_f32
from tileplug.backend_cuda.moe.spec import GateSpec, lane_groups_fit
from tileplug.backend_cuda.moe.warp_topk import NO_COLUMN, NONE, WARP, WarpRow, key_of, value_of

RENORMALIZE_EPSILON = 1e-20


def build(spec: GateSpec):
    """The ``T.prim_func`` of a ``moe_topk_gate`` specialisation: buffers ``(logits, bias, mask,
    topk_idx, topk_weights, scores)``, an absent one replaced by the logits (never read)."""
    row = WarpRow(spec.experts, spec.vec, spec.fixed_heads)
    E, K, S = spec.experts, spec.topk, spec.shared
    SLOTS = K + S
    WARPS = spec.warps
    VALUES = row.VALUES
    ENTRIES = row.entries
    GROUPS, TOPK_GROUPS = spec.groups, spec.topk_groups
    GROUP_SIZE = E // GROUPS
    GROUP_LIST = list(range(GROUPS))
    SCORING = spec.scoring
    SCALING = spec.scaling
    PIECES = list(range(row.CHUNKS))
    LANE_GROUPS = spec.lane_groups
    if LANE_GROUPS:
        assert lane_groups_fit(E, GROUPS, spec.vec), (E, GROUPS, spec.vec)
        LANES_PER_GROUP = GROUP_SIZE // spec.vec
        GROUPS_PER_CHUNK = WARP // LANES_PER_GROUP
        LANE_MASKS = [1 << b for b in range(LANES_PER_GROUP.bit_length() - 1)]
    assert SLOTS <= WARP and GROUPS <= WARP

    rows = T.dynamic("T")
    logits_t = T.StridedTensor((rows, E), (T.dynamic("S0"), 1), spec.dtype)
    bias_t = T.Tensor((E,), "float32") if spec.biased else \
        T.StridedTensor((T.dynamic("bA"), T.dynamic("bB")), (T.dynamic("bC"), 1), spec.dtype)
    mask_t = T.Tensor((rows,), "bool") if spec.masked else \
        T.StridedTensor((T.dynamic("mA"), T.dynamic("mB")), (T.dynamic("mC"), 1), spec.dtype)
    idx_t = T.Tensor((rows, SLOTS), "int64")
    weights_t = T.Tensor((rows, SLOTS), "float32")
    scores_t = T.Tensor((rows, E), "float32") if spec.with_scores else \
        T.StridedTensor((T.dynamic("sA"), T.dynamic("sB")), (T.dynamic("sC"), 1), spec.dtype)

    LIBRARY_MATH = not spec.table_math

    def fast(function, argument):
        """CUDA's fp64 function inline, rounded once; with ``spec.table_math``
        (:data:`spec.SCORE_MATH_VARIABLE`) the fast value (NaN: the library must decide, :func:`settle`)."""
        if LIBRARY_MATH:
            wide = T.cast(argument, "float64")
            return T.cast(T.exp(wide) if function == "exp" else T.log1p(wide), "float32")
        return fast_f32(function, argument)

    @T.macro
    def settle(function, values, arguments):
        """``values[i]`` = ``rn32(function(arguments[i]))`` for every entry: the fast values, computed by
        the caller for all entries first (branch-free, so they interleave), then the rare NaN
        (``fast_f32``: the library must decide) replaced by CUDA's fp64 function, behind a branch."""
        if not LIBRARY_MATH:
            for i in ENTRIES:
                if T.isnan(values[i]):
                    values[i] = library_f32(function, arguments[i])

    @T.macro
    def score_row(x, u, e, lane, acc, total, tree, base):
        """``u`` = the scores of the lane's values ``x`` (softmax: over the whole row, ``acc``
        holding the row's maximum key, ``total`` the denominator; ``x`` is consumed; ``e`` is
        scratch: the arguments of ``exp`` / ``log1p``). Each ``exp`` / ``log1p`` is the fp32
        rounding of the fp64 value, as the reference's (``fp32_math``); the other operations are
        IEEE fp32, in the reference's order: ``1 / (1 + exp(−v))``; ``sqrt(max(v, 0) +
        log1p(exp(−|v|)))``."""
        if SCORING == "softmax":
            acc[0] = NONE
            for i in ENTRIES:
                if row.present(i, lane) is True:
                    acc[0] = T.max(acc[0], key_of(x[i]))
                else:
                    if row.present(i, lane):
                        acc[0] = T.max(acc[0], key_of(x[i]))
            row_max = value_of(T.warp_reduce_max(acc[0]))
            for i in ENTRIES:  # (a column past E: exp(0), never the library's path)
                e[i] = T.ieee_sub(x[i], row_max) if row.present(i, lane) is True else \
                    T.if_then_else(row.present(i, lane), T.ieee_sub(x[i], row_max), T.float32(0.0))
                u[i] = fast("exp", e[i])
            settle("exp", u, e)
            for i in ENTRIES:
                if row.present(i, lane) is not True:
                    u[i] = T.if_then_else(row.present(i, lane), u[i], T.float32(0.0))
                x[i] = u[i]
            row.row_sum(x, tree, base, lane, total)  # the reference's pairwise tree, bit for bit
            for i in ENTRIES:
                u[i] = T.ieee_fdiv(u[i], total[0])
        elif SCORING == "sigmoid":
            for i in ENTRIES:
                e[i] = T.ieee_sub(T.float32(0.0), x[i])
                u[i] = fast("exp", e[i])
            settle("exp", u, e)
            for i in ENTRIES:
                u[i] = T.ieee_fdiv(T.float32(1.0), T.ieee_add(T.float32(1.0), u[i]))
        else:  # sqrtsoftplus, with the reference's stable softplus(v) = max(v, 0) + log1p(exp(−|v|))
            if LIBRARY_MATH:
                for i in ENTRIES:
                    e[i] = T.ieee_sub(T.float32(0.0), T.abs(x[i]))
                    u[i] = fast("exp", e[i])
                for i in ENTRIES:
                    e[i] = u[i]
                    u[i] = fast("log1p", e[i])
            else:  # both functions' fast values at once (one range test), the rare rest by the library
                for i in ENTRIES:
                    u[i] = fast_f32("softplus_log", x[i])
                settle("softplus_log", u, x)
            for i in ENTRIES:
                u[i] = T.ieee_fsqrt(T.ieee_add(T.max(x[i], T.float32(0.0)), u[i]))

    @T.macro
    def lane_group_scores(keys, lane, group_key):
        """``group_key`` of lane ``g`` = group ``g``'s score (:func:`pick_groups`) from each chunk's
        two largest keys: a lane's own (its ``VEC`` values of a chunk are one group's), then merged
        over the group's ``LANES_PER_GROUP`` lanes by xor shuffles (``pair``: the running largest and
        second largest, ``other``: a partner's), then moved to lane ``g`` from the group's first lane.
        The score is the sum of the two largest keys' values whichever columns hold them, so the
        argmax rounds' ties make no difference."""
        pair = T.alloc_local((2,), "int32")
        other = T.alloc_local((2,), "int32")
        group_key[0] = NONE
        for j in PIECES:
            pair[0] = NONE
            pair[1] = NONE
            for c in range(spec.vec):
                pair[1] = T.max(pair[1], T.min(pair[0], keys[j * spec.vec + c]))
                pair[0] = T.max(pair[0], keys[j * spec.vec + c])
            for mask in LANE_MASKS:
                other[0] = T.shfl_xor(pair[0], mask)
                other[1] = T.shfl_xor(pair[1], mask)
                pair[1] = T.max(T.min(pair[0], other[0]), T.max(pair[1], other[1]))
                pair[0] = T.max(pair[0], other[0])
            other[0] = key_of(T.ieee_add(value_of(pair[0]), value_of(pair[1])))
            other[1] = T.shfl_sync(other[0], ((lane - j * GROUPS_PER_CHUNK) * LANES_PER_GROUP) % WARP)
            if lane >= j * GROUPS_PER_CHUNK and lane < min((j + 1) * GROUPS_PER_CHUNK, GROUPS):
                group_key[0] = other[1]  # (a chunk's lanes past E hold no group)

    @T.macro
    def pick_groups(keys, scratch, lane, best, where, found, index, group_key, chosen):
        """Experts outside the ``topk_groups`` best groups become ``NONE`` in ``keys``. A group's score
        is the sum of its two largest biased scores: two argmax rounds over its masked members each
        (or, with ``spec.lane_groups``, :func:`lane_group_scores`)."""
        if LANE_GROUPS:
            lane_group_scores(keys, lane, group_key)
        else:
            group_key[0] = NONE
            for g in GROUP_LIST:
                for i in ENTRIES:
                    scratch[i] = T.if_then_else(row.column(i, lane) // GROUP_SIZE == g, keys[i], NONE)
                row.argmax(scratch, lane, best, where, found, index)
                first = value_of(found[0])
                row.take(scratch, lane, index[0])
                row.argmax(scratch, lane, best, where, found, index)
                if lane == g:
                    group_key[0] = key_of(T.ieee_add(first, value_of(found[0])))
        chosen[0] = 0
        for r in T.serial(TOPK_GROUPS):
            found[0] = T.warp_reduce_max(group_key[0])
            index[0] = T.warp_reduce_min(T.if_then_else(group_key[0] == found[0], lane, NO_COLUMN))
            chosen[0] = chosen[0] | (1 << index[0])
            if lane == index[0]:
                group_key[0] = NONE
        for i in ENTRIES:
            if ((chosen[0] >> (row.column(i, lane) // GROUP_SIZE)) & 1) == 0:
                keys[i] = NONE

    @T.macro
    def body(logits, bias, mask, topk_idx, topk_weights, scores_out):
        with T.Kernel(T.ceildiv(rows, WARPS), threads=WARPS * WARP,
                      prelude=None if LIBRARY_MATH else device_helpers()) as bx:
            if spec.ctas_per_sm:
                T.annotate_min_blocks_per_sm(spec.ctas_per_sm)
            if spec.vec > 1:
                T.assume(logits_t.strides[0] % spec.vec == 0)
            tree = T.alloc_shared((WARPS * row.TREE_WIDTH,), "float32") if SCORING == "softmax" else None
            tx = T.get_thread_binding()
            lane = tx % WARP
            t = bx * WARPS + tx // WARP
            if t < rows:
                x = T.alloc_local((VALUES,), "float32")
                u = T.alloc_local((VALUES,), "float32")
                e = T.alloc_local((VALUES,), "float32")
                keys = row.keys()
                scratch = row.keys()
                ok = T.alloc_local((1,), "int32")
                bias_ok = T.alloc_local((1,), "int32")
                acc = T.alloc_local((1,), "int32")
                best = T.alloc_local((1,), "int32")
                where = T.alloc_local((1,), "int32")
                found = T.alloc_local((1,), "int32")
                index = T.alloc_local((1,), "int32")
                group_key = T.alloc_local((1,), "int32")
                chosen = T.alloc_local((1,), "int32")
                picked = T.alloc_local((1,), "float32")
                total = T.alloc_local((1,), "float32")
                slot_index = T.alloc_local((1,), "int64")
                slot_weight = T.alloc_local((1,), "float32")
                heads = row.lane_heads() if spec.lane_heads else None
                row.load_row(logits, t, lane, x)
                row.all_finite(x, lane, ok)  # the logits decide (sqrt(softplus(-inf)) = 0 is finite)
                score_row(x, u, e, lane, acc, total, tree, (tx // WARP) * row.TREE_WIDTH)
                if spec.with_scores:
                    row.store_row(scores_out, t, lane, u)
                for i in ENTRIES:
                    if spec.biased:
                        x[i] = bias[T.min(row.column(i, lane), E - 1)]
                if spec.biased:
                    row.all_finite(x, lane, bias_ok)  # a non-finite bias spoils every row
                    ok[0] = ok[0] & bias_ok[0]
                for i in ENTRIES:
                    if spec.biased:
                        x[i] = T.ieee_add(u[i], x[i])  # x now holds the biased scores
                    else:
                        x[i] = u[i]
                if spec.masked:
                    if not mask[t]:
                        ok[0] = 0
                slot_index[0] = T.int64(-1)
                slot_weight[0] = T.float32(0.0)
                if ok[0]:
                    for i in ENTRIES:
                        keys[i] = T.if_then_else(row.present(i, lane), key_of(x[i]), NONE) \
                            if row.present(i, lane) is not True else key_of(x[i])
                    if GROUPS > 1:
                        pick_groups(keys, scratch, lane, best, where, found, index, group_key, chosen)
                    total[0] = T.float32(0.0)
                    if spec.lane_heads:
                        row.fill_heads(keys, u, lane, heads, False)
                    for r in row.rounds(K, spec.unrolled):
                        if spec.lane_heads:
                            row.heads_round(keys, u, lane, heads, r, found, index, picked)
                        else:
                            row.argmax(keys, lane, best, where, found, index)
                            picked[0] = T.float32(0.0)
                            for i in ENTRIES:
                                if row.column(i, lane) == index[0]:
                                    picked[0] = u[i]
                                    keys[i] = NONE
                            picked[0] = row.broadcast(picked[0], index[0])
                        total[0] = T.ieee_add(total[0], picked[0])
                        if lane == r:
                            slot_index[0] = T.cast(index[0], "int64")
                            slot_weight[0] = picked[0]
                    if lane < K:
                        if spec.renormalize:
                            slot_weight[0] = T.ieee_fdiv(slot_weight[0],
                                                         T.ieee_add(total[0], T.float32(RENORMALIZE_EPSILON)))
                        if SCALING != 1.0:
                            slot_weight[0] = T.ieee_mul(slot_weight[0], T.float32(SCALING))
                    elif lane < SLOTS:
                        slot_index[0] = T.cast(E - K + lane, "int64")
                        slot_weight[0] = T.float32(1.0)
                if lane < SLOTS:
                    topk_idx[t, lane] = slot_index[0]
                    topk_weights[t, lane] = slot_weight[0]

    # One prim_func per buffer set: absent buffers are passed as the logits (never read).
    @T.prim_func
    def kernel(logits: logits_t, bias: bias_t, mask: mask_t, topk_idx: idx_t, topk_weights: weights_t,
               scores_out: scores_t):
        body(logits, bias, mask, topk_idx, topk_weights, scores_out)

    return kernel.with_attr("global_symbol", spec.name)
