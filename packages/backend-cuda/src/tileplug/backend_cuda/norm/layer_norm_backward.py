"""CUDA ``layer_norm_backward`` (SPEC §5): ``grad_x``, and deterministic, batch-invariant
``grad_weight`` / ``grad_bias``.

Per row (the forward's row tile, ``rows.RowMacros``), in registers: ``x̂ = (s − mean) · rstd``,
``g = grad_y · float(w)`` (``grad_y`` without a weight), ``mean_g = sum(g) / D`` and
``proj = sum(g · x̂) / D`` (both in the reference's pairwise order, through one pass of the tree:
``rows.row_sums``, ``spec.PAIRED_SUMS_VARIABLE``),
``grad_x = round_to(x.dtype, rstd · ((g − mean_g) − x̂ · proj) + grad_residual_out)``, each
operation rounded where the reference rounds: ``grad_x`` is the reference's, bit for bit.

``grad_weight = Σ_rows grad_y · x̂`` and ``grad_bias = Σ_rows grad_y`` (fp32): per-CTA partial
rows over a fixed blocking of the rows, then an ordered column sum (``backward.py``).

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.norm.backward import BlockLayout, ColumnAccumulators
from tileplug.backend_cuda.norm.rows import (RowMacros, RowPrefetch, aligned_strides, over_width, row_buffer,
                                             statistic_buffer, vector_buffer)
from tileplug.backend_cuda.norm.spec import PREFETCH_SOURCES, NormKernelSpec


def build(spec: NormKernelSpec):
    """The ``T.prim_func`` of a ``layer_norm_backward`` specialisation: buffers ``(grad_y, x,
    weight, mean, rstd, grad_residual_out, grad_x, weight_partials, bias_partials)``, an
    absent one replaced by ``x``."""
    M = T.dynamic("M")
    R = M if spec.heads is None else M * spec.heads
    rows = RowMacros(spec, R, subtrees=spec.subtrees)  # the warp-subtree form where the spec takes it
    IN = spec.in_dtype
    WDT = spec.weight_dtype
    VEC = spec.vec
    VALUES = rows.VALUES
    D = spec.hidden
    GRAD_RESIDUAL = spec.grad_residual
    W_LOCAL = WDT or "float32"
    P = T.dynamic("P")
    g_t = row_buffer(spec, "g", IN, M)
    x_t = row_buffer(spec, "x", IN, M)
    w_t = vector_buffer(spec, "w", WDT)
    mean_t = statistic_buffer(spec, "mean", M, True)
    rstd_t = statistic_buffer(spec, "rstd", M, True)
    gr_t = row_buffer(spec, "gr", IN, M, GRAD_RESIDUAL)
    dx_t = row_buffer(spec, "dx", IN, M)
    wp_t = T.Tensor((P, D), "float32") if WDT is not None else vector_buffer(spec, "wp", None)
    bp_t = T.Tensor((P, D), "float32")
    STRIDES = aligned_strides(spec, g_t, x_t, dx_t, *((gr_t,) if GRAD_RESIDUAL else ()))
    ROWS = rows.ROWS
    PAIRED = spec.paired_sums
    # a CTA's row-tile iterations (spec.row_block: a constant, the weight gradient's fixed blocking; half of it on
    # the half path) and the partial rows it writes
    layout = BlockLayout(spec)
    SUB = layout.sub
    ahead = RowPrefetch(rows, PREFETCH_SOURCES, spec.prefetch)  # grad_y and x, copied one row iteration ahead or loaded

    def normalized(sv, i, row_mean, row_rstd):
        """``x̂ = (s − mean) · rstd`` of value ``i``."""
        return T.ieee_mul(T.ieee_sub(T.cast(sv[i], "float32"), row_mean), row_rstd)

    def scaled(gv, wv, i):
        """``g = grad_y · float(w)`` of value ``i`` (``grad_y`` without a weight)."""
        upstream = T.cast(gv[i], "float32")
        return upstream if WDT is None else T.ieee_mul(upstream, T.cast(wv[i], "float32"))

    def bias_term(gv):
        """The bias gradient's term of value ``i``: ``grad_y``."""
        return lambda i: T.cast(gv[i], "float32")

    def weight_term(gv, sv, row_mean, row_rstd):
        """The weight gradient's term of value ``i``: ``grad_y · x̂``."""
        return lambda i: T.ieee_mul(T.cast(gv[i], "float32"), normalized(sv, i, row_mean, row_rstd))

    def statistic(buffer, t, n, valid):
        value = buffer[t] if spec.heads is None else buffer[t, n]
        return T.if_then_else(valid, value, T.float32(0.0))

    TREE_SUMS = 2 if PAIRED else 1  # the row sums one tree holds
    # sum 0: the bias gradient's, sum 1: the weight gradient's
    sums = ColumnAccumulators(rows, 1 if WDT is None else 2, rows.tree_bytes(TREE_SUMS))

    @T.prim_func
    def kernel(grad_y: g_t, x: x_t, weight: w_t, mean: mean_t, rstd: rstd_t, grad_residual_out: gr_t, grad_x: dx_t,
               weight_partials: wp_t, bias_partials: bp_t):
        with T.Kernel(T.ceildiv(R, ROWS * SUB), threads=rows.THREADS) as bx:
            T.annotate_min_blocks_per_sm(sums.ctas_per_sm)
            for stride in STRIDES:
                T.assume(stride % VEC == 0)
            tx = T.get_thread_binding()
            gv = T.alloc_local((VALUES,), IN)
            sv = T.alloc_local((VALUES,), IN)
            rv = T.alloc_local((VALUES,), IN)  # grad_residual_out, then grad_x (in place)
            wv = T.alloc_local((VALUES,), W_LOCAL)
            terms = T.alloc_local((VALUES,), "float32")
            products = T.alloc_local((VALUES,), "float32") if PAIRED else None  # Σ g · x̂'s terms, beside Σ g's
            quad = T.alloc_local((4,), "float32")
            bias_sums = sums.buffer(0)
            weight_sums = sums.buffer(1) if WDT is not None else None
            acc = T.alloc_local((TREE_SUMS,), "float32")  # Σ g (then Σ g · x̂ unless paired)
            tree = rows.tree_buffer(TREE_SUMS)
            lane = tx % rows.LANES
            if WDT is not None:
                rows.load_vector(weight, wv, lane, WDT)
            sums.zero(bias_sums, 0, tx)
            if WDT is not None:
                sums.zero(weight_sums, 1, tx)
            first = T.alloc_var("int32", init=bx * SUB)
            # the last CTA stops at the last row (its masked iterations would add nothing)
            count = T.alloc_var("int32", init=T.min(SUB, T.ceildiv(R, ROWS) - first))
            staged = ahead.buffer()
            ahead.start(staged, (grad_y, x), first, tx)
            for block_row in T.serial(count):
                t, n, _, valid = rows.coords(first + block_row, tx)
                if GRAD_RESIDUAL:
                    rows.load_row(grad_residual_out, rv, t, n, lane, valid, IN)
                row_mean = statistic(mean, t, n, valid)
                row_rstd = statistic(rstd, t, n, valid)
                ahead.load(staged, (grad_y, x), (gv, sv), first, block_row, count, tx, (t, n, lane, valid))
                for i in T.unroll(VALUES):
                    terms[i] = scaled(gv, wv, i)
                if PAIRED:  # both sums through one pass of the tree
                    for i in T.unroll(VALUES):
                        products[i] = T.ieee_mul(scaled(gv, wv, i), normalized(sv, i, row_mean, row_rstd))
                    rows.row_sums((terms, products), tree, acc, lane, rows.slot(tx))
                    rows.reuse_barrier()
                    mean_g = over_width(acc[0], D)
                    projection = over_width(acc[1], D)
                else:
                    rows.row_sum(terms, tree, acc, lane, rows.slot(tx))
                    mean_g = over_width(acc[0], D)
                    rows.reuse_barrier()
                    for i in T.unroll(VALUES):
                        terms[i] = T.ieee_mul(scaled(gv, wv, i), normalized(sv, i, row_mean, row_rstd))
                    rows.row_sum(terms, tree, acc, lane, rows.slot(tx))
                    projection = over_width(acc[0], D)
                    rows.reuse_barrier()
                for i in T.unroll(VALUES):
                    difference = T.ieee_mul(row_rstd, T.ieee_sub(
                        T.ieee_sub(scaled(gv, wv, i), mean_g),
                        T.ieee_mul(normalized(sv, i, row_mean, row_rstd), projection)))
                    if GRAD_RESIDUAL:
                        rv[i] = T.cast(T.ieee_add(difference, T.cast(rv[i], "float32")), IN)
                    else:
                        rv[i] = T.cast(difference, IN)
                rows.store_row(grad_x, rv, t, n, lane, valid)
                if bx % layout.per == 0:  # a block's first CTA (its only one but on the half path) adds its terms
                    if valid:
                        sums.add(bias_sums, 0, tx, bias_term(gv), quad)
                        if WDT is not None:
                            sums.add(weight_sums, 1, tx, weight_term(gv, sv, row_mean, row_rstd), quad)
                else:  # the half path: the block's later CTAs write each row's terms
                    term_row = layout.term_row(bx, block_row) * ROWS + rows.slot(tx)
                    sums.store_terms(bias_partials, term_row, lane, valid, bias_term(gv), terms)
                    if WDT is not None:
                        sums.store_terms(weight_partials, term_row, lane, valid,
                                         weight_term(gv, sv, row_mean, row_rstd), terms)
            ahead.finish()
            if bx % layout.per == 0:
                partial_row = layout.first_row(bx) * ROWS + rows.slot(tx)
                sums.store(bias_sums, 0, bias_partials, partial_row, tx, lane)
                if WDT is not None:
                    sums.store(weight_sums, 1, weight_partials, partial_row, tx, lane)

    return kernel.with_attr("global_symbol", spec.name)
