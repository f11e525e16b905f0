"""CUDA ``rms_norm_backward`` (SPEC §5): ``grad_x`` and a deterministic, batch-invariant
``grad_weight``, in two kernels.

Per row (the forward's row tile, ``rows.RowMacros``), in registers: ``x̂ = s · rstd``,
``g = grad_y · ((float(w) + offset) · out_scale)``, ``proj = sum(g · x̂) / D`` (the reference's
pairwise order: ``rows.row_sum``), ``grad_x = round_to(x.dtype, rstd · (g − x̂ · proj) +
grad_residual_out)``, each operation rounded where the reference rounds (IEEE intrinsics):
``grad_x`` is the reference's, bit for bit.

``grad_weight = Σ_rows (grad_y · out_scale) · x̂`` (fp32): CTA ``b`` runs ``ROW_BLOCK``
consecutive iterations of its tile's rows (rows ``(b · ROW_BLOCK + i) · rows + slot``), each row
slot adding its rows' terms in iteration order into registers, and writes one partial row
``partials[b · rows + slot, :]``; the second kernel (:class:`ColumnSumSpec`) adds the
partials of each column in partial order. The blocking is a constant of the tile, so the
order of every addition depends on ``T`` alone (never on the SM count or the launch), and
no atomics are used: the same inputs give the same bytes on every run.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

from dataclasses import dataclass

import tilelang.language as T
import torch

from tileplug.backend_cuda.norm.kernels import NormKernel, make_launcher
from tileplug.backend_cuda.norm.rows import RowMacros, aligned_strides, f32, row_buffer, statistic_buffer, vector_buffer
from tileplug.backend_cuda.norm.spec import NormKernelSpec
from tileplug.core.contracts.norm import NormBackwardInputs, NormCall, NormGradients

ROW_BLOCK = 8
"""Iterations of its tile's rows one CTA runs: ``rows · ROW_BLOCK`` rows per partial block."""
COLUMN_THREADS = 256


@dataclass(frozen=True)
class ColumnSumSpec:
    """The column sum of ``partials [P, D]`` (fp32, any P and D: both runtime) into ``[D]``,
    each column added in row order: one thread per column."""

    @property
    def name(self) -> str:
        return "norm_column_sum_fp32"

    def build(self):
        P = T.dynamic("P")
        D = T.dynamic("D")

        @T.prim_func
        def kernel(partials: T.Tensor((P, D), "float32"), total: T.Tensor((D,), "float32")):
            with T.Kernel(T.ceildiv(D, COLUMN_THREADS), threads=COLUMN_THREADS) as bx:
                tx = T.get_thread_binding()
                acc = T.alloc_local((1,), "float32")
                col = bx * COLUMN_THREADS + tx
                if col < D:
                    acc[0] = partials[0, col]
                    for p in T.serial(P - 1):
                        acc[0] = T.ieee_add(acc[0], partials[p + 1, col])
                    total[col] = acc[0]

        return kernel.with_attr("global_symbol", self.name)


def build(spec: NormKernelSpec):
    """The ``T.prim_func`` of an ``rms_norm_backward`` specialisation: buffers ``(grad_y, x,
    weight, rstd, grad_residual_out, grad_x, partials)``, an absent one replaced by ``x``."""
    M = T.dynamic("M")
    R = M if spec.heads is None else M * spec.heads
    rows = RowMacros(spec, R)
    IN = spec.in_dtype
    WDT = spec.weight_dtype
    VEC = spec.vec
    VALUES = rows.VALUES
    D = spec.hidden
    OFFSET = f32(spec.weight_offset)
    SCALE = f32(spec.out_scale)
    GRAD_RESIDUAL = spec.grad_residual
    W_LOCAL = WDT or "float32"
    W_PARTIAL = "float32"
    g_t = row_buffer(spec, "g", IN, M)
    x_t = row_buffer(spec, "x", IN, M)
    w_t = vector_buffer(spec, "w", WDT)
    rstd_t = statistic_buffer(spec, "rstd", M, True)
    gr_t = row_buffer(spec, "gr", IN, M, GRAD_RESIDUAL)
    dx_t = row_buffer(spec, "dx", IN, M)
    partials_t = T.Tensor((T.dynamic("P"), D), "float32") if WDT is not None else vector_buffer(spec, "p", None)
    STRIDES = aligned_strides(spec, g_t, x_t, dx_t, *((gr_t,) if GRAD_RESIDUAL else ()))
    ROWS = rows.ROWS
    KS = list(range(rows.CHUNKS))

    def factor(wv, i):
        """``(float(w) + offset) · out_scale`` (no weight: ``out_scale``)."""
        if WDT is None:
            return T.float32(SCALE)
        shifted = T.ieee_add(T.cast(wv[i], "float32"), T.float32(OFFSET))
        return shifted if SCALE == 1.0 else T.ieee_mul(shifted, T.float32(SCALE))

    def normalized(sv, i, row_rstd):
        """``x̂ = s · rstd`` of value ``i``."""
        return T.ieee_mul(T.cast(sv[i], "float32"), row_rstd)

    def scaled(gv, wv, i):
        """``g = grad_y · ((float(w) + offset) · out_scale)`` of value ``i``."""
        return T.ieee_mul(T.cast(gv[i], "float32"), factor(wv, i))

    def statistic(rstd, t, n, valid):
        value = rstd[t] if spec.heads is None else rstd[t, n]
        return T.if_then_else(valid, value, T.float32(0.0))

    @T.prim_func
    def kernel(grad_y: g_t, x: x_t, weight: w_t, rstd: rstd_t, grad_residual_out: gr_t, grad_x: dx_t,
               partials: partials_t):
        with T.Kernel(T.ceildiv(R, ROWS * ROW_BLOCK), threads=rows.THREADS) as bx:
            for stride in STRIDES:
                T.assume(stride % VEC == 0)
            tx = T.get_thread_binding()
            gv = T.alloc_local((VALUES,), IN)
            sv = T.alloc_local((VALUES,), IN)
            rv = T.alloc_local((VALUES,), IN)  # grad_residual_out, then grad_x (in place)
            wv = T.alloc_local((VALUES,), W_LOCAL)
            terms = T.alloc_local((VALUES,), "float32")
            gw = T.alloc_local((VALUES,), W_PARTIAL)
            acc = T.alloc_local((1,), "float32")
            tree = rows.tree_buffer()
            lane = tx % rows.LANES
            if WDT is not None:
                rows.load_vector(weight, wv, lane, WDT)
                for i in T.unroll(VALUES):
                    gw[i] = T.float32(0.0)
            for block_row in T.serial(ROW_BLOCK):
                t, n, _, valid = rows.coords(bx * ROW_BLOCK + block_row, tx)
                rows.load_row(grad_y, gv, t, n, lane, valid, IN)
                rows.load_row(x, sv, t, n, lane, valid, IN)
                if GRAD_RESIDUAL:
                    rows.load_row(grad_residual_out, rv, t, n, lane, valid, IN)
                row_rstd = statistic(rstd, t, n, valid)
                for i in T.unroll(VALUES):
                    terms[i] = T.ieee_mul(scaled(gv, wv, i), normalized(sv, i, row_rstd))
                rows.row_sum(terms, tree, acc, lane, rows.slot(tx))
                projection = T.ieee_fdiv(acc[0], T.float32(D))
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
                    if valid:
                        for i in T.unroll(VALUES):
                            gw[i] = T.ieee_add(gw[i], T.ieee_mul(T.ieee_mul(T.cast(gv[i], "float32"), T.float32(SCALE)),
                                                                 normalized(sv, i, row_rstd)))
            if WDT is not None:
                for k in KS:
                    col = rows.column(k, lane)
                    for j in T.unroll(VEC):
                        if col + j < D:
                            partials[bx * ROWS + rows.slot(tx), col + j] = gw[k * VEC + j]

    return kernel.with_attr("global_symbol", spec.name)


class RmsNormBackward(NormKernel):
    """The ``rms_norm_backward`` kernel object: the row kernel, then the column sum of its
    weight-gradient partials (see the module docstring)."""

    op = "rms_norm_backward"

    def specs(self, call: NormCall) -> list:
        """Every specialisation a call runs (the row kernel, and the column sum with a weight)."""
        return [self.spec(call)] + ([ColumnSumSpec()] if call.weight_dtype is not None else [])

    def prepare(self, call: NormCall):
        from tileplug.backend_cuda import jit

        spec = self.spec(call)
        rows_launch = make_launcher(spec, jit.entry(spec), self.arguments(call))
        if call.weight_dtype is None:
            return rows_launch
        column_sum = jit.entry(ColumnSumSpec())
        heads = call.heads or 1
        per_block = spec.tile.rows * ROW_BLOCK

        def launch(inputs: NormBackwardInputs, outputs: NormGradients) -> None:
            blocks = -(-(inputs.x.shape[0] * heads) // per_block)
            partials = torch.empty((blocks * spec.tile.rows, call.hidden), dtype=torch.float32, device=inputs.x.device)
            rows_launch(inputs, outputs._replace(grad_bias=partials))
            column_sum(partials, outputs.grad_weight)

        return launch

    def arguments(self, call: NormCall):
        weighted = call.weight_dtype is not None
        grad_residual = call.grad_residual

        def order(inputs: NormBackwardInputs, outputs: NormGradients) -> tuple:
            x = inputs.x
            return (inputs.grad_y, x, inputs.weight if weighted else x, inputs.rstd,
                    inputs.grad_residual_out if grad_residual else x, outputs.grad_x,
                    outputs.grad_bias if weighted else x)  # grad_bias carries the partials (see prepare)

        return order
