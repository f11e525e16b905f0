"""Ascend kernel of ``rms_norm``: the pipelined row kernel of :mod:`.row_kernel` with the
RMSNorm vector work below (SPEC §5).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

Per row, in one ``T.SimdVF`` region over 64-lane fp32 registers: with a residual,
``s = round(x + residual)`` written over the residual row (``residual_out``); ``sum(s²)`` in the
fixed order of :func:`~tileplug.backend_ascend.rows.row_sum` over the true ``D``;
``rstd = 1 / sqrt(sum / D + eps)`` (correctly rounded division and square root);
``y = round((s · rstd) · wf)`` with ``wf = (float(w) + weight_offset) · out_scale`` prepared
once per core in fp32 (no weight: ``· out_scale``), written over the row of ``x``.
"""

import tilelang.ascend.language as T

from tileplug.backend_ascend import rows
from tileplug.backend_ascend.norm import row_kernel
from tileplug.backend_ascend.norm.spec import NormSpec
from tileplug.backend_ascend.ub import LANES


def square(v):
    """``v · v`` (the RMS statistic's term)."""
    return T.simd.vmul(v, v)


def row_compute(spec: NormSpec):
    """The per-row vector work of ``spec``: a macro over the row's UB buffers. Looked up by
    :func:`build` at trace time; tests/ascend_bad_kernels.py replaces it with scalar code to
    show the vector check failing."""
    D, dt = spec.hidden, spec.in_dtype
    has_w = spec.weight_dtype is not None

    @T.macro
    def compute(buffers):
        x_ub, r_ub, w_ub, rstd_ub = buffers["x_ub"], buffers.get("r_ub"), buffers.get("w_ub"), buffers.get("rstd_ub")
        with T.SimdVF():
            if spec.residual:
                rows.residual_add(x_ub, r_ub, dt, D)
            s_ub = rows.choose(spec.residual, r_ub, x_ub)
            rstd = rows.rsqrt_plus(rows.mean_of(rows.row_sum(s_ub, dt, D, square, None), D), spec.eps)
            if spec.stats:
                T.simd.vsts(rstd_ub[0], rstd, dist="ONEPT_B32")
            rstd_all = T.simd.vdupv(rstd)
            for c in T.serial(rows.registers(D)):
                normalized = T.simd.vmul(rows.load_f32(s_ub, c * LANES, dt), rstd_all)
                if has_w:
                    rows.store_rounded(x_ub, c * LANES, T.simd.vmul(normalized, T.simd.vld(w_ub[c * LANES])), dt)
                else:
                    rows.store_rounded(x_ub, c * LANES, T.simd.vmuls(normalized, T.float32(spec.out_scale)), dt)

    return compute


def build(spec: NormSpec):
    """The prim_func of ``spec`` (UB budget checked)."""
    return row_kernel.build(spec, row_compute)


KERNEL = row_kernel.kernel("rms_norm", build)
