"""Ascend kernel of ``layer_norm``: the pipelined row kernel of :mod:`.row_kernel` with the
LayerNorm vector work below (SPEC §5).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

Per row, in one ``T.SimdVF`` region over 64-lane fp32 registers, two passes over the row in
UB (never ``E[s²] − E[s]²``): with a residual, ``s = round(x + residual)`` written over the
residual row (``residual_out``); ``mean = sum(s) / D``; ``var = sum((s − mean)²) / D``, both
sums in the fixed order of :func:`~tileplug.backend_ascend.rows.row_sum` over the true ``D``;
``rstd = 1 / sqrt(var + eps)``; ``y = round(((s − mean) · rstd) · float(w) + float(b))``
(no weight: no product; no bias: no sum), written over the row of ``x``.
"""

import tilelang.ascend.language as T

from tileplug.backend_ascend import rows
from tileplug.backend_ascend.norm import row_kernel
from tileplug.backend_ascend.norm.spec import NormSpec
from tileplug.backend_ascend.ub import LANES


def identity(v):
    """``v`` (the mean's term)."""
    return v


def centered_square(mean_all):
    """The variance's term ``(v − mean)²``, ``mean_all`` the mean broadcast to every lane."""
    def term(v):
        centered = T.simd.vsub(v, mean_all)
        return T.simd.vmul(centered, centered)

    return term


def row_compute(spec: NormSpec):
    """The per-row vector work of ``spec``: a macro over the row's UB buffers. Looked up by
    :func:`build` at trace time."""
    D, dt = spec.hidden, spec.in_dtype
    has_w, has_b = spec.weight_dtype is not None, spec.bias_dtype is not None

    @T.macro
    def affine(v, w_ub, b_ub, off):
        # ((s - mean) * rstd) * w + b, each factor only where the call has it
        if has_w and has_b:
            return T.simd.vadd(T.simd.vmul(v, T.simd.vld(w_ub[off])), T.simd.vld(b_ub[off]))
        elif has_w:
            return T.simd.vmul(v, T.simd.vld(w_ub[off]))
        elif has_b:
            return T.simd.vadd(v, T.simd.vld(b_ub[off]))
        else:
            return v

    @T.macro
    def compute(buffers):
        x_ub, r_ub, w_ub = buffers["x_ub"], buffers.get("r_ub"), buffers.get("w_ub")
        b_ub, mean_ub, rstd_ub = buffers.get("b_ub"), buffers.get("mean_ub"), buffers.get("rstd_ub")
        with T.SimdVF():
            if spec.residual:
                rows.residual_add(x_ub, r_ub, dt, D)
            s_ub = rows.choose(spec.residual, r_ub, x_ub)
            mean = rows.mean_of(rows.row_sum(s_ub, dt, D, identity, None), D)
            mean_all = T.simd.vdupv(mean)
            variance = rows.mean_of(rows.row_sum(s_ub, dt, D, centered_square(mean_all), None), D)
            rstd = rows.rsqrt_plus(variance, spec.eps)
            if spec.stats:
                T.simd.vsts(mean_ub[0], mean, dist="ONEPT_B32")
                T.simd.vsts(rstd_ub[0], rstd, dist="ONEPT_B32")
            rstd_all = T.simd.vdupv(rstd)
            for c in T.serial(rows.registers(D)):
                normalized = T.simd.vmul(T.simd.vsub(rows.load_f32(s_ub, c * LANES, dt), mean_all), rstd_all)
                rows.store_rounded(x_ub, c * LANES, affine(normalized, w_ub, b_ub, c * LANES), dt)

    return compute


def build(spec: NormSpec):
    """The prim_func of ``spec`` (UB budget checked)."""
    return row_kernel.build(spec, row_compute)


KERNEL = row_kernel.kernel("layer_norm", build)
