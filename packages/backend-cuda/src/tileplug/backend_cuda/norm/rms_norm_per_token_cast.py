"""CUDA ``rms_norm_per_token_cast``: ``rms_norm`` then ``per_token_cast`` of its output
(``[T, N·D]``), in one pass: the same bytes as this backend's two kernels (SPEC §4).

The norm is ``rms_norm.RmsNormMacros`` itself (so ``y`` rounded to x.dtype is the
``rms_norm`` kernel's, bit for bit); the cast reads that rounded ``y`` from registers
(``row_cast.RowCast``: the quant family's scale macros in the quant kernel's order of
operations).

Served: e4m3 / e2m1, groups 16 / 32 / 64 / 128, fp32 / e4m3-stored / packed UE8M0 (4 per
int32) scales, row- or TMA-aligned column-major; 3-D inputs whose ``D`` is a multiple of
the group (declined otherwise: a group would straddle two heads' rows).

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.norm.rms_norm import RmsNormMacros
from tileplug.backend_cuda.norm.row_cast import RowCast
from tileplug.backend_cuda.norm.rows import RowMacros, aligned_strides, row_buffer, vector_buffer
from tileplug.backend_cuda.norm.spec import NormKernelSpec, cast_threads_per_sm, long_row_ctas


def build(spec: NormKernelSpec):
    """The ``T.prim_func`` of an ``rms_norm_per_token_cast`` specialisation: buffers ``(x,
    weight, residual, residual_out, y, q, sf)`` (``sf``: the bytes of packed UE8M0 storage),
    an absent one replaced by ``x`` (never read)."""
    quant = spec.quant
    M = T.dynamic("M")
    R = M if spec.heads is None else M * spec.heads
    rows = RowMacros(spec, R)
    IN = spec.in_dtype
    VEC = spec.vec
    D = spec.hidden
    HEADS = spec.heads
    cast = RowCast(quant, rows, IN, VEC, D, HEADS, spec.vectorize)
    VPB, QDT = cast.values_per_byte, cast.q_dtype
    QW = D * (HEADS or 1) // VPB

    x_t = row_buffer(spec, "x", IN, M)
    w_t = vector_buffer(spec, "w", spec.weight_dtype)
    r_t = row_buffer(spec, "r", IN, M, spec.residual)
    ro_t = row_buffer(spec, "ro", IN, M, spec.residual)
    y_t = row_buffer(spec, "y", IN, M, quant.unquantized)
    q_t = T.Tensor((M, QW), QDT)
    sf_t = cast.sf_type()
    STRIDES = aligned_strides(spec, x_t, *((r_t, ro_t) if spec.residual else ()), *((y_t,) if quant.unquantized else ()))
    # a long row without a residual: cap the registers so that more rows share an SM (spec.CAST_THREADS_PER_SM)
    THREADS_PER_SM = cast_threads_per_sm()  # (read for every spec: a bad value is refused wherever it is set)
    CTAS_PER_SM = long_row_ctas(rows.ROWS, rows.THREADS, 0 if spec.residual else THREADS_PER_SM)
    rms = RmsNormMacros(spec, rows, capped=bool(CTAS_PER_SM))

    @T.prim_func
    def kernel(x: x_t, weight: w_t, residual: r_t, residual_out: ro_t, y: y_t, q: q_t, sf: sf_t):
        with T.Kernel(rows.grid(), threads=rows.THREADS, prelude=rms.prelude) as bx:
            if CTAS_PER_SM:
                T.annotate_min_blocks_per_sm(CTAS_PER_SM)
            for stride in STRIDES:
                T.assume(stride % VEC == 0)
            tx = T.get_thread_binding()
            t, n, lane, valid = rows.coords(bx, tx)
            s, rv, wv, yv, terms, acc, tree = RmsNormMacros.locals(spec, rows)
            amax = T.alloc_local((rows.CHUNKS,), "int32")
            inv = T.alloc_local((rows.CHUNKS,), "float32")
            qv = T.alloc_local((VEC // VPB,), QDT)
            rms.normalize(x, weight, residual, residual_out, x, s, rv, wv, yv, terms, acc, tree, t, n, lane, valid, tx)
            if quant.unquantized:
                rows.store_row(y, yv, t, n, lane, valid)
            cast.cast(yv, q, sf, t, n, lane, valid, amax, inv, qv)

    return kernel.with_attr("global_symbol", spec.name)
