"""Ascend kernel of ``layer_norm_backward``: the row kernel and column sum of :mod:`.backward`
with the LayerNorm backward vector work below (SPEC §5).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

Per row, in one ``T.SimdVF`` region over 64-lane fp32 registers, in the reference's order
(:func:`tileplug.core.norm.formulas.layer_norm_backward_rows`): ``x̂ = (s − mean) · rstd``,
``g = grad_y · float(w)`` (``grad_y`` without weight); ``a = sum(g) / D`` and ``c = sum(g · x̂) / D``,
each in the fixed order of :func:`~tileplug.backend_ascend.rows.row_sum_at` over the true ``D``;
``grad_x = round(rstd · ((g − a) − x̂ · c) (+ grad_residual_out))`` written over the ``grad_y``
row; the terms ``grad_y · x̂`` (weight) and ``grad_y`` (bias) added into the block's fp32
accumulators.
"""

import tilelang.ascend.language as T

from tileplug.backend_ascend import rows
from tileplug.backend_ascend.norm.backward import BackwardKernel, BackwardSpec
from tileplug.backend_ascend.ub import LANES


def row_compute(spec: BackwardSpec):
    """The per-row vector work of ``spec``: a macro over the row's UB buffers."""
    D, dt = spec.hidden, spec.in_dtype
    has_w = spec.weight_dtype is not None

    def normalized(x_ub, mean_all, rstd_all):
        """``off -> x̂`` of the columns ``off .. off + 63``."""
        return lambda off: T.simd.vmul(T.simd.vsub(rows.load_f32(x_ub, off, dt), mean_all), rstd_all)

    def weighted(gy_ub, w_ub):
        """``off -> g``: ``grad_y · w`` (``grad_y`` without weight)."""
        if has_w:
            return lambda off: T.simd.vmul(rows.load_f32(gy_ub, off, dt), T.simd.vld(w_ub[off]))
        return lambda off: rows.load_f32(gy_ub, off, dt)

    @T.macro
    def compute(buffers):
        gy_ub, x_ub, gr_ub, w_ub = buffers["gy_ub"], buffers["x_ub"], buffers.get("gr_ub"), buffers.get("w_ub")
        gw_acc, gb_acc = buffers.get("gw_acc"), buffers["gb_acc"]
        with T.SimdVF():
            mean_all = T.simd.vld(buffers["mean_ub"][0], dist="BRC_B32")
            rstd_all = T.simd.vld(buffers["rstd_ub"][0], dist="BRC_B32")
            x_hat_at = normalized(x_ub, mean_all, rstd_all)
            g_at = weighted(gy_ub, w_ub)
            mean_g = T.simd.vdupv(rows.mean_of(rows.row_sum_at(D, g_at), D))
            projection = rows.mean_of(rows.row_sum_at(D, lambda off: T.simd.vmul(g_at(off), x_hat_at(off))), D)
            projection_all = T.simd.vdupv(projection)
            for c in T.serial(rows.registers(D)):
                off = c * LANES
                upstream = rows.load_f32(gy_ub, off, dt)
                x_hat = x_hat_at(off)
                if has_w:
                    T.simd.vsts(gw_acc[off], T.simd.vadd(T.simd.vld(gw_acc[off]), T.simd.vmul(upstream, x_hat)))
                T.simd.vsts(gb_acc[off], T.simd.vadd(T.simd.vld(gb_acc[off]), upstream))
                centered = T.simd.vsub(g_at(off), mean_g)
                grad = T.simd.vmul(rstd_all, T.simd.vsub(centered, T.simd.vmul(x_hat, projection_all)))
                if spec.grad_residual:
                    grad = T.simd.vadd(grad, rows.load_f32(gr_ub, off, dt))
                rows.store_rounded(gy_ub, off, grad, dt)

    return compute


KERNEL = BackwardKernel("layer_norm_backward", row_compute)
