"""CUDA ``rms_norm`` (SPEC §5): optional weight, residual add (``residual_out``), Gemma
``weight_offset``, ``out_scale``, optional ``rstd``; 2-D ``[T, D]`` and per-head 3-D
``[T, N, D]``; bf16 / fp16 / fp32; any row strides; ``out=x`` / ``residual_out=residual``
in place.

Per row, in registers (``rows.RowMacros``): ``s = round_to(x.dtype, x + residual)``;
``rstd = 1 / sqrt(sum(s²) / D + eps)`` (the squares rounded, then added in the reference's
pairwise order by ``rows.row_sum``; the division, square root and reciprocal correctly
rounded, as the reference's: the statistic is the reference's, bit for bit);
``y = round_to(x.dtype, (s · rstd) · ((float(w) + weight_offset) · out_scale))`` with each
product and sum rounded separately (IEEE intrinsics: no FMA contraction changes them).

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.norm.rows import (
    PLUS_ZERO_HELPERS,
    RowMacros,
    aligned_strides,
    as_float,
    f32,
    over_width,
    plus_zero,
    row_buffer,
    statistic_buffer,
    takes_plus_zero,
    vector_buffer,
)
from tileplug.backend_cuda.norm.spec import NormKernelSpec, long_row_ctas, rms_norm_threads_per_sm


class RmsNormMacros:
    """The RMSNorm part of a kernel, shared with ``rms_norm_per_token_cast``:
    :attr:`normalize` loads a row (and its residual and the weight), forms ``s``, writes
    ``residual_out`` and ``rstd``, and leaves ``y`` (rounded to x.dtype) in a local buffer."""

    def __init__(self, spec: NormKernelSpec, rows: RowMacros, capped: bool = False) -> None:
        """``capped``: the kernel asks ptxas for a register cap (``__launch_bounds__``). Its
        normalization then reads each value of ``s`` again from its 16 bits rather than from the
        word the squares unpacked it from: one extract more a value, but the unpacked values are
        not kept live across the row sum (nvcc 13.0, the fused cast at D = 7168 bf16 capped at
        56 registers: 40 bytes spilled with the words, none this way)."""
        IN = spec.in_dtype
        WDT = spec.weight_dtype
        VALUES = rows.VALUES
        EPS = f32(spec.eps)
        OFFSET = f32(spec.weight_offset)
        SCALE = f32(spec.out_scale)
        D = spec.hidden
        # offset 0 on a 16-bit weight: its + 0 taken on the packed words once (see rows.plus_zero)
        PACKED_PLUS_ZERO = OFFSET == 0.0 and takes_plus_zero(WDT, VALUES)
        self.prelude = PLUS_ZERO_HELPERS if PACKED_PLUS_ZERO else None
        """The kernel's ``T.Kernel(prelude=...)`` (None: none needed)."""

        def weight_factor(wv, i):
            """``(float(w) + offset) · out_scale`` of value ``i`` (None: no factor at all)."""
            if WDT is None:
                return None if SCALE == 1.0 else T.float32(SCALE)
            shifted = as_float(wv, i) if PACKED_PLUS_ZERO else T.ieee_add(as_float(wv, i), T.float32(OFFSET))
            return shifted if SCALE == 1.0 else T.ieee_mul(shifted, T.float32(SCALE))

        def output(s, wv, i, rstd):
            normalized = T.ieee_mul(T.cast(s[i], "float32") if capped else as_float(s, i), rstd)
            factor = weight_factor(wv, i)
            return normalized if factor is None else T.ieee_mul(normalized, factor)

        @T.macro
        def normalize(x, weight, residual, residual_out, rstd_out, s, rv, wv, yv, terms, acc, tree, t, n, lane, valid,
                      tx):
            rows.load_input(x, residual, s, rv, t, n, lane, valid)
            if WDT is not None:
                rows.load_vector(weight, wv, lane, WDT)
                if PACKED_PLUS_ZERO:
                    plus_zero(wv)
            for i in T.unroll(VALUES):
                terms[i] = T.ieee_mul(as_float(s, i), as_float(s, i))
            rows.row_sum(terms, tree, acc, lane, rows.slot(tx))
            rstd = T.ieee_fdiv(T.float32(1.0), T.ieee_fsqrt(T.ieee_add(over_width(acc[0], D),
                                                                      T.float32(EPS))))
            for i in T.unroll(VALUES):
                yv[i] = T.cast(output(s, wv, i, rstd), IN)
            if spec.residual:
                rows.store_row(residual_out, s, t, n, lane, valid)
            if spec.stats:
                rows.store_statistic(rstd_out, t, n, lane, valid, rstd)

        self.normalize = normalize

    @staticmethod
    def locals(spec: NormKernelSpec, rows: RowMacros):
        """(s, rv, wv, yv, terms, acc, tree): the thread's row, residual, weight and output
        values, the fp32 terms of its sum, the row's sum, and the shared buffer of the reduction."""
        VALUES = rows.VALUES
        s = T.alloc_local((VALUES,), spec.in_dtype)
        rv = T.alloc_local((VALUES,), spec.in_dtype)
        wv = T.alloc_local((VALUES,), spec.weight_dtype or "float32")
        yv = T.alloc_local((VALUES,), spec.in_dtype)
        terms = T.alloc_local((VALUES,), "float32")
        acc = T.alloc_local((1,), "float32")
        return s, rv, wv, yv, terms, acc, rows.tree_buffer()


def build(spec: NormKernelSpec):
    """The ``T.prim_func`` of an ``rms_norm`` specialisation: buffers ``(x, weight, residual,
    y, residual_out, rstd)``, an absent one replaced by ``x`` (never read)."""
    M = T.dynamic("M")
    R = M if spec.heads is None else M * spec.heads
    rows = RowMacros(spec, R)
    IN = spec.in_dtype
    VEC = spec.vec
    x_t = row_buffer(spec, "x", IN, M)
    w_t = vector_buffer(spec, "w", spec.weight_dtype)
    r_t = row_buffer(spec, "r", IN, M, spec.residual)
    y_t = row_buffer(spec, "y", IN, M)
    ro_t = row_buffer(spec, "ro", IN, M, spec.residual)
    rstd_t = statistic_buffer(spec, "rstd", M, spec.stats)
    STRIDES = aligned_strides(spec, x_t, y_t, *((r_t, ro_t) if spec.residual else ()))
    CTAS_PER_SM = long_row_ctas(rows.ROWS, rows.THREADS, rms_norm_threads_per_sm())  # (a tuning knob, off)
    rms = RmsNormMacros(spec, rows, capped=bool(CTAS_PER_SM))

    @T.prim_func
    def kernel(x: x_t, weight: w_t, residual: r_t, y: y_t, residual_out: ro_t, rstd: rstd_t):
        with T.Kernel(rows.grid(), threads=rows.THREADS, prelude=rms.prelude) as bx:
            if CTAS_PER_SM:
                T.annotate_min_blocks_per_sm(CTAS_PER_SM)
            for stride in STRIDES:
                T.assume(stride % VEC == 0)
            tx = T.get_thread_binding()
            t, n, lane, valid = rows.coords(bx, tx)
            s, rv, wv, yv, terms, acc, tree = RmsNormMacros.locals(spec, rows)
            rms.normalize(x, weight, residual, residual_out, rstd, s, rv, wv, yv, terms, acc, tree, t, n, lane, valid,
                          tx)
            rows.store_row(y, yv, t, n, lane, valid)

    return kernel.with_attr("global_symbol", spec.name)
