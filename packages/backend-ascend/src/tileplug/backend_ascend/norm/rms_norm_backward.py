"""Ascend kernel of ``rms_norm_backward``: the row kernel and column sum of :mod:`.backward`
with the RMSNorm backward vector work below (SPEC §5).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

Per row, in one ``T.SimdVF`` region over 64-lane fp32 registers, in the reference's order
(:func:`tileplug.core.norm.formulas.rms_norm_backward_rows`): ``x̂ = s · rstd``,
``g = grad_y · wf`` with ``wf = (float(w) + weight_offset) · out_scale`` prepared once per block
(no weight: ``grad_y · out_scale``); ``c = sum(g · x̂) / D`` in the fixed order of
:func:`~tileplug.backend_ascend.rows.row_sum_at` over the true ``D``; ``grad_x = round(rstd · (g −
x̂ · c) (+ grad_residual_out))`` written over the ``grad_y`` row; the weight gradient's term
``(grad_y · out_scale) · x̂`` added into the block's fp32 accumulator.
"""

import tilelang.ascend.language as T

from tileplug.backend_ascend import rows
from tileplug.backend_ascend.norm.backward import BackwardKernel, BackwardSpec
from tileplug.backend_ascend.ub import LANES


def row_compute(spec: BackwardSpec):
    """The per-row vector work of ``spec``: a macro over the row's UB buffers. Looked up by
    :class:`~.backward.BackwardKernel` at trace time."""
    D, dt = spec.hidden, spec.in_dtype
    has_w = spec.weight_dtype is not None
    scale = T.float32(spec.out_scale)

    def normalized(x_ub, rstd_all):
        """``off -> x̂`` of the columns ``off .. off + 63``."""
        return lambda off: T.simd.vmul(rows.load_f32(x_ub, off, dt), rstd_all)

    def weighted(gy_ub, w_ub):
        """``off -> g``: ``grad_y`` times the weight factor (no weight: times ``out_scale``)."""
        if has_w:
            return lambda off: T.simd.vmul(rows.load_f32(gy_ub, off, dt), T.simd.vld(w_ub[off]))
        return lambda off: T.simd.vmuls(rows.load_f32(gy_ub, off, dt), scale)

    @T.macro
    def compute(buffers):
        gy_ub, x_ub, gr_ub, w_ub = buffers["gy_ub"], buffers["x_ub"], buffers.get("gr_ub"), buffers.get("w_ub")
        with T.SimdVF():
            rstd_all = T.simd.vld(buffers["rstd_ub"][0], dist="BRC_B32")
            x_hat_at = normalized(x_ub, rstd_all)
            g_at = weighted(gy_ub, w_ub)
            projection = rows.mean_of(rows.row_sum_at(D, lambda off: T.simd.vmul(g_at(off), x_hat_at(off))), D)
            projection_all = T.simd.vdupv(projection)
            for c in T.serial(rows.registers(D)):
                off = c * LANES
                x_hat = x_hat_at(off)
                if has_w:
                    term = T.simd.vmul(T.simd.vmuls(rows.load_f32(gy_ub, off, dt), scale), x_hat)
                    T.simd.vsts(buffers["gw_acc"][off], T.simd.vadd(T.simd.vld(buffers["gw_acc"][off]), term))
                grad = T.simd.vmul(rstd_all, T.simd.vsub(g_at(off), T.simd.vmul(x_hat, projection_all)))
                if spec.grad_residual:
                    grad = T.simd.vadd(grad, rows.load_f32(gr_ub, off, dt))
                rows.store_rounded(gy_ub, off, grad, dt)

    return compute


KERNEL = BackwardKernel("rms_norm_backward", row_compute)
