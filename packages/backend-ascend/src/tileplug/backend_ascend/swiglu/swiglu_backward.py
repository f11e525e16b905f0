"""Ascend kernel of ``swiglu_backward`` (SPEC §8): ``grad_x`` written over the row's gate and up
tiles in UB, ``grad_topk_weights`` summed over the row in a fixed order.

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

The pipelined (row, column tile) kernel of :mod:`.row_kernel` with, per tile, one
``T.SimdVF`` region over 64-lane fp32 registers, in the reference's order (each product
rounded to fp32): with ``s = sigmoid(g)`` and ``w'`` the row's scale,
``grad_gate = (((grad · u) · w') · s) · (1 + g · (1 − s))`` (+0 where the clamp cut the gate),
``grad_up = (grad · (g · s)) · w'`` (+0 where it cut the up value), both +0 on a padding row,
rounded once to x's dtype over the gate / up tiles they were computed from. With weights,
``(grad · (g · s)) · u`` is added into lane ``j`` of a running register (columns ``j, j + 64,
…`` in order, the partial last register masked: the order of
:func:`tileplug.backend_ascend.rows.row_sum_at`, carried across a row's column tiles in UB so
the order is the whole row's whatever the tiling), then the lanes by ``vcadd``, times the
routed scaling factor: batch-invariant (the order depends on H alone), not the reference's
pairwise tree (SPEC §8 allows a relative 1e-5). Each tile writes the running total; the row's
last tile writes the whole sum.
"""

import tilelang.ascend.language as T

from tileplug.backend_ascend import rows
from tileplug.backend_ascend.quant.sf_macros import f32_value
from tileplug.backend_ascend.swiglu import macros, row_kernel
from tileplug.backend_ascend.swiglu.spec import F32, SwigluSpec
from tileplug.backend_ascend.ub import LANES


def tile_compute(spec: SwigluSpec, width: int):
    """The vector work of one tile ``width`` columns wide: a macro over the UB buffers. Looked
    up by :func:`build` at trace time (tests/ascend_bad_kernels.py replaces it with scalar code)."""
    dt, gdt, clamp = spec.in_dtype, spec.out_dtype, spec.clamp
    full, tail = rows.chunks(width)
    sums = spec.weighted
    carried = spec.tiles > 1  # the row sum continues from the previous tile of the row

    @T.macro
    def gradients(buffers, off, lanes, scale, keep):
        # one register of the tile: grad_x stored over the gate / up values, the row-sum term returned
        gate = rows.load_f32(buffers["gate_ub"], off, dt)
        up = rows.load_f32(buffers["up_ub"], off, dt)
        grad = rows.load_f32(buffers["grad_ub"], off, gdt)
        cut = macros.gate_cut(gate, clamp)
        g = macros.clamp_gate(gate, clamp, cut)
        u = macros.clamp_up(up, clamp)
        s = macros.sigmoid(g)
        grad_silu = T.simd.vmul(grad, T.simd.vmul(g, s))
        slope = T.simd.vadds(T.simd.vmul(g, T.simd.vsub(T.simd.vdup(T.float32(1.0), F32), s)), T.float32(1.0))
        grad_gate = T.simd.vmul(T.simd.vmul(macros.scaled(T.simd.vmul(grad, u), scale), s), slope)
        grad_up = macros.scaled(grad_silu, scale)
        if clamp is not None:
            zero = T.simd.vdup(T.float32(0.0), F32)
            limit = T.float32(f32_value(clamp))
            grad_gate = T.simd.vsel(zero, grad_gate, cut)
            grad_up = T.simd.vsel(zero, grad_up, T.simd.vcmps(T.simd.vabs(up), limit, op="gt"))
        rows.store_rounded(buffers["gate_ub"], off, macros.kept(grad_gate, keep), dt)
        rows.store_rounded(buffers["up_ub"], off, macros.kept(grad_up, keep), dt)
        term = T.simd.vmul(grad_silu, u)
        if lanes < LANES:
            return rows.tail_only(term, lanes)
        else:
            return term

    @T.macro
    def compute(buffers, row, tile):
        with T.SimdVF():
            keep = macros.keep_of(spec, buffers, row)
            scale = macros.scale_of(buffers.get("w_ub"), spec.weighted, spec.scaling)
            acc = T.simd.alloc_var(F32)
            acc = T.simd.vdup(T.float32(0.0), F32)
            if sums and carried:
                first = T.simd.vcmps(T.simd.vdup(T.Cast("int32", tile), "int32"), T.int32(0), op="eq")
                acc = T.simd.vsel(acc, T.simd.vld(buffers["acc_ub"][0]), first)
            for c in T.serial(full):
                term = gradients(buffers, c * LANES, LANES, scale, keep)
                if sums:
                    acc = T.simd.vadd(acc, term)
            if tail > 0:
                term = gradients(buffers, full * LANES, tail, scale, keep)
                if sums:
                    acc = T.simd.vadd(acc, term)
            if sums:
                if carried:
                    T.simd.vsts(buffers["acc_ub"][0], acc)
                total = T.simd.vcadd(acc)
                if spec.scaling != 1.0:
                    total = T.simd.vmuls(total, T.float32(f32_value(spec.scaling)))
                T.simd.vsts(buffers["gw_ub"][0], macros.kept(total, keep), dist="ONEPT_B32")

    return compute


def build(spec: SwigluSpec):
    """The prim_func of ``spec`` (UB budget checked)."""
    return row_kernel.build(spec, tile_compute)


KERNEL = row_kernel.kernel("swiglu_backward", build)
