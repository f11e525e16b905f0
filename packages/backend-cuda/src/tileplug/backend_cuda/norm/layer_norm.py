"""CUDA ``layer_norm`` (SPEC §5): optional weight and bias, residual add (``residual_out``),
optional ``mean`` / ``rstd``; 2-D and per-head 3-D; bf16 / fp16 / fp32; any row strides;
in place through ``out=x`` / ``residual_out=residual``.

Per row, in registers (``rows.RowMacros``), two passes over the on-chip values:
``mean = sum(s) / D``; ``var = sum((s − mean)²) / D`` (both sums over the true ``D`` in the
reference's pairwise order, ``rows.row_sum``: the statistics are the reference's, bit for
bit); ``rstd = 1 / sqrt(var + eps)``;
``y = round_to(x.dtype, ((s − mean) · rstd) · float(w) + float(b))``, each operation rounded
separately (IEEE intrinsics: no FMA contraction), no multiplication without a weight and no
addition without a bias (as the reference).

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.norm.rows import (
    RowMacros,
    aligned_strides,
    as_float,
    f32,
    over_width,
    row_buffer,
    statistic_buffer,
    vector_buffer,
)
from tileplug.backend_cuda.norm.spec import NormKernelSpec, layer_norm_threads_per_sm, long_row_ctas


def build(spec: NormKernelSpec):
    """The ``T.prim_func`` of a ``layer_norm`` specialisation: buffers ``(x, weight, bias,
    residual, y, residual_out, mean, rstd)``, an absent one replaced by ``x`` (never read)."""
    M = T.dynamic("M")
    R = M if spec.heads is None else M * spec.heads
    rows = RowMacros(spec, R)
    IN = spec.in_dtype
    WDT = spec.weight_dtype
    BDT = spec.bias_dtype
    VEC = spec.vec
    VALUES = rows.VALUES
    D = spec.hidden
    EPS = f32(spec.eps)
    x_t = row_buffer(spec, "x", IN, M)
    w_t = vector_buffer(spec, "w", WDT)
    b_t = vector_buffer(spec, "b", BDT)
    r_t = row_buffer(spec, "r", IN, M, spec.residual)
    y_t = row_buffer(spec, "y", IN, M)
    ro_t = row_buffer(spec, "ro", IN, M, spec.residual)
    mean_t = statistic_buffer(spec, "mean", M, spec.stats)
    rstd_t = statistic_buffer(spec, "rstd", M, spec.stats)
    STRIDES = aligned_strides(spec, x_t, y_t, *((r_t, ro_t) if spec.residual else ()))
    W_LOCAL, B_LOCAL = WDT or "float32", BDT or "float32"  # (unused without a weight / bias)
    THREADS_PER_SM = layer_norm_threads_per_sm()  # (read for every spec: a bad value is refused wherever it is set)
    CTAS_PER_SM = long_row_ctas(rows.ROWS, rows.THREADS, 0 if spec.residual else THREADS_PER_SM)


    def output(c, wv, bv, i, rstd):
        value = T.ieee_mul(c[i], rstd)
        if WDT is not None:
            value = T.ieee_mul(value, as_float(wv, i))
        if BDT is not None:
            value = T.ieee_add(value, as_float(bv, i))
        return value

    @T.prim_func
    def kernel(x: x_t, weight: w_t, bias: b_t, residual: r_t, y: y_t, residual_out: ro_t, mean: mean_t,
               rstd: rstd_t):
        with T.Kernel(rows.grid(), threads=rows.THREADS) as bx:
            # a long row without a residual: cap the registers so that more rows share an SM (with a
            # residual the cap spilled 284 bytes at D = 7168: left to ptxas)
            if CTAS_PER_SM:
                T.annotate_min_blocks_per_sm(CTAS_PER_SM)
            for stride in STRIDES:
                T.assume(stride % VEC == 0)
            tx = T.get_thread_binding()
            t, n, lane, valid = rows.coords(bx, tx)
            s = T.alloc_local((VALUES,), IN)
            rv = T.alloc_local((VALUES,), IN)
            wv = T.alloc_local((VALUES,), W_LOCAL)
            bv = T.alloc_local((VALUES,), B_LOCAL)
            c = T.alloc_local((VALUES,), "float32")
            yv = T.alloc_local((VALUES,), IN)
            terms = T.alloc_local((VALUES,), "float32")
            acc = T.alloc_local((1,), "float32")
            tree = rows.tree_buffer()

            rows.load_input(x, residual, s, rv, t, n, lane, valid)
            if WDT is not None:
                rows.load_vector(weight, wv, lane, WDT)
            if BDT is not None:
                rows.load_vector(bias, bv, lane, BDT)
            # pass 1: the mean
            for i in T.unroll(VALUES):
                terms[i] = as_float(s, i)
            rows.row_sum(terms, tree, acc, lane, rows.slot(tx))
            row_mean = over_width(acc[0], D)
            rows.reuse_barrier()  # every lane has read the sum before the buffer is written again
            # pass 2: the variance of the centered values (held for the output)
            for i in T.unroll(VALUES):
                c[i] = T.ieee_sub(as_float(s, i), row_mean)
            for i in T.unroll(VALUES):
                terms[i] = T.ieee_mul(c[i], c[i])
            rows.row_sum(terms, tree, acc, lane, rows.slot(tx))
            row_rstd = T.ieee_fdiv(T.float32(1.0), T.ieee_fsqrt(T.ieee_add(over_width(acc[0], D),
                                                                          T.float32(EPS))))
            for i in T.unroll(VALUES):
                yv[i] = T.cast(output(c, wv, bv, i, row_rstd), IN)
            if spec.residual:
                rows.store_row(residual_out, s, t, n, lane, valid)
            if spec.stats:
                rows.store_statistic(mean, t, n, lane, valid, row_mean)
                rows.store_statistic(rstd, t, n, lane, valid, row_rstd)
            rows.store_row(y, yv, t, n, lane, valid)

    return kernel.with_attr("global_symbol", spec.name)
