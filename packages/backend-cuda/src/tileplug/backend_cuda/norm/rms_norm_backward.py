"""CUDA ``rms_norm_backward`` (SPEC §5): ``grad_x`` and a deterministic, batch-invariant
``grad_weight``, in two kernels.

Per row (the forward's row tile, ``rows.RowMacros``), in registers: ``x̂ = s · rstd``,
``g = grad_y · ((float(w) + offset) · out_scale)``, ``proj = sum(g · x̂) / D`` (the reference's
pairwise order: ``rows.row_sum``), ``grad_x = round_to(x.dtype, rstd · (g − x̂ · proj) +
grad_residual_out)``, each operation rounded where the reference rounds (IEEE intrinsics):
``grad_x`` is the reference's, bit for bit.

``grad_weight = Σ_rows (grad_y · out_scale) · x̂`` (fp32): per-CTA partial rows over a fixed
blocking of the rows, then an ordered column sum (``backward.py``): deterministic and
batch-invariant, no atomics.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.norm.backward import BlockLayout, ColumnAccumulators
from tileplug.backend_cuda.norm.rows import (RowMacros, RowPrefetch, aligned_strides, f32, over_width, row_buffer,
                                             statistic_buffer, vector_buffer)
from tileplug.backend_cuda.norm.spec import PREFETCH_SOURCES, NormKernelSpec, backward_ctas_per_sm


def build(spec: NormKernelSpec):
    """The ``T.prim_func`` of an ``rms_norm_backward`` specialisation: buffers ``(grad_y, x,
    weight, rstd, grad_residual_out, grad_x, partials)``, an absent one replaced by ``x``."""
    M = T.dynamic("M")
    R = M if spec.heads is None else M * spec.heads
    rows = RowMacros(spec, R, subtrees=spec.subtrees)  # the warp-subtree form where the spec takes it
    IN = spec.in_dtype
    WDT = spec.weight_dtype
    VEC = spec.vec
    VALUES = rows.VALUES
    D = spec.hidden
    OFFSET = f32(spec.weight_offset)
    SCALE = f32(spec.out_scale)
    GRAD_RESIDUAL = spec.grad_residual
    W_LOCAL = WDT or "float32"
    sums = ColumnAccumulators(rows, 1) if WDT is not None else None
    g_t = row_buffer(spec, "g", IN, M)
    x_t = row_buffer(spec, "x", IN, M)
    w_t = vector_buffer(spec, "w", WDT)
    rstd_t = statistic_buffer(spec, "rstd", M, True)
    gr_t = row_buffer(spec, "gr", IN, M, GRAD_RESIDUAL)
    dx_t = row_buffer(spec, "dx", IN, M)
    partials_t = T.Tensor((T.dynamic("P"), D), "float32") if WDT is not None else vector_buffer(spec, "p", None)
    STRIDES = aligned_strides(spec, g_t, x_t, dx_t, *((gr_t,) if GRAD_RESIDUAL else ()))
    ROWS = rows.ROWS
    # a CTA's row-tile iterations (spec.row_block: a constant, the weight gradient's fixed blocking; half of it on
    # the half path) and the partial rows it writes
    layout = BlockLayout(spec)
    SUB = layout.sub
    ahead = RowPrefetch(rows, PREFETCH_SOURCES, spec.prefetch)  # grad_y and x, copied one row iteration ahead or loaded

    def factor(wv, i):
        """``(float(w) + offset) · out_scale`` (no weight: ``out_scale``)."""
        if WDT is None:
            return T.float32(SCALE)
        shifted = T.ieee_add(T.cast(wv[i], "float32"), T.float32(OFFSET))
        return shifted if SCALE == 1.0 else T.ieee_mul(shifted, T.float32(SCALE))

    def normalized(sv, i, row_rstd):
        """``x̂ = s · rstd`` of value ``i``."""
        return T.ieee_mul(T.cast(sv[i], "float32"), row_rstd)

    def upstream(gv, i):
        """``grad_y · out_scale`` of value ``i`` (the weight gradient's factor): ``grad_y`` itself at
        ``out_scale = 1`` (``· 1`` changes no value but a NaN's payload, and ``· x̂`` then makes every
        NaN the canonical one). (Adding a zero ``offset`` once at the weight's load instead of per row
        let nvcc hoist the 32 converted weights out of the row loop: 152 bytes of spills at D = 7168.)"""
        value = T.cast(gv[i], "float32")
        return value if SCALE == 1.0 else T.ieee_mul(value, T.float32(SCALE))

    def weight_term(gv, sv, row_rstd):
        """The weight gradient's term of value ``i``: ``grad_y · out_scale · x̂``."""
        return lambda i: T.ieee_mul(upstream(gv, i), normalized(sv, i, row_rstd))

    def scaled(gv, wv, i):
        """``g = grad_y · ((float(w) + offset) · out_scale)`` of value ``i``."""
        return T.ieee_mul(T.cast(gv[i], "float32"), factor(wv, i))

    def statistic(rstd, t, n, valid):
        value = rstd[t] if spec.heads is None else rstd[t, n]
        return T.if_then_else(valid, value, T.float32(0.0))

    @T.prim_func
    def kernel(grad_y: g_t, x: x_t, weight: w_t, rstd: rstd_t, grad_residual_out: gr_t, grad_x: dx_t,
               partials: partials_t):
        with T.Kernel(T.ceildiv(R, ROWS * SUB), threads=rows.THREADS) as bx:
            T.annotate_min_blocks_per_sm(sums.ctas_per_sm if sums is not None else backward_ctas_per_sm())
            for stride in STRIDES:
                T.assume(stride % VEC == 0)
            tx = T.get_thread_binding()
            gv = T.alloc_local((VALUES,), IN)
            sv = T.alloc_local((VALUES,), IN)
            rv = T.alloc_local((VALUES,), IN)  # grad_residual_out, then grad_x (in place)
            wv = T.alloc_local((VALUES,), W_LOCAL)
            terms = T.alloc_local((VALUES,), "float32")
            quad = T.alloc_local((4,), "float32")
            acc = T.alloc_local((1,), "float32")
            tree = rows.tree_buffer()
            lane = tx % rows.LANES
            if WDT is not None:
                gw = sums.buffer(0)
                rows.load_vector(weight, wv, lane, WDT)
                sums.zero(gw, 0, tx)
            first = T.alloc_var("int32", init=bx * SUB)
            # the last CTA stops at the last row (its masked iterations would add nothing)
            count = T.alloc_var("int32", init=T.min(SUB, T.ceildiv(R, ROWS) - first))
            staged = ahead.buffer()
            ahead.start(staged, (grad_y, x), first, tx)
            for block_row in T.serial(count):
                t, n, _, valid = rows.coords(first + block_row, tx)
                if GRAD_RESIDUAL:
                    rows.load_row(grad_residual_out, rv, t, n, lane, valid, IN)
                row_rstd = statistic(rstd, t, n, valid)
                ahead.load(staged, (grad_y, x), (gv, sv), first, block_row, count, tx, (t, n, lane, valid))
                for i in T.unroll(VALUES):
                    terms[i] = T.ieee_mul(scaled(gv, wv, i), normalized(sv, i, row_rstd))
                rows.row_sum(terms, tree, acc, lane, rows.slot(tx))
                projection = over_width(acc[0], D)
                rows.reuse_barrier()  # the next row's sum writes the buffer again
                for i in T.unroll(VALUES):
                    difference = T.ieee_mul(row_rstd, T.ieee_sub(scaled(gv, wv, i),
                                                                 T.ieee_mul(normalized(sv, i, row_rstd), projection)))
                    if GRAD_RESIDUAL:
                        rv[i] = T.cast(T.ieee_add(difference, T.cast(rv[i], "float32")), IN)
                    else:
                        rv[i] = T.cast(difference, IN)
                rows.store_row(grad_x, rv, t, n, lane, valid)
                if WDT is not None:
                    if bx % layout.per == 0:  # a block's first CTA (its only one but on the half path) adds its terms
                        if valid:
                            sums.add(gw, 0, tx, weight_term(gv, sv, row_rstd), quad)
                    else:  # the half path: the block's later CTAs write each row's terms
                        sums.store_terms(partials, layout.term_row(bx, block_row) * ROWS + rows.slot(tx), lane,
                                         valid, weight_term(gv, sv, row_rstd), terms)
            ahead.finish()
            if WDT is not None:
                if bx % layout.per == 0:
                    sums.store(gw, 0, partials, layout.first_row(bx) * ROWS + rows.slot(tx), tx, lane)

    return kernel.with_attr("global_symbol", spec.name)
