"""CUDA ``swiglu``: ``y = g·sigmoid(g)·u·w'`` of each row of x ``[N, 2H]`` → ``[N, H]``.

One read of x (both halves of a row by the threads holding the same columns of ``y``), one
write of ``y`` rounded once to its dtype; padding rows of an expert layout are written as
zeros, nothing computed from their bytes stored (``activation``).

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.norm.rows import RowMacros
from tileplug.backend_cuda.swiglu.activation import SwigluMacros, vector_strides
from tileplug.backend_cuda.swiglu.spec import SwigluKernelSpec


def build(spec: SwigluKernelSpec):
    """The ``T.prim_func`` of a ``swiglu`` specialisation: buffers ``(x, topk_weights,
    expert_ends, y)``, an absent one replaced by x (never read)."""
    M = T.dynamic("M")
    rows = RowMacros(spec, M)
    act = SwigluMacros(spec, rows)
    VALUES, OUT = rows.VALUES, spec.out_dtype
    x_t = SwigluMacros.halves_buffer(spec, M)
    w_t = SwigluMacros.weights_buffer(spec, M)
    e_t = SwigluMacros.ends_buffer(spec)
    y_t = SwigluMacros.single_buffer(spec, "y", OUT, M)
    STRIDES = vector_strides(spec.vec, x_t, y_t) if spec.vectorize else []

    @T.macro
    def row_body(x, topk_weights, expert_ends, table, y, tile):
        row = act.begin(tile)
        yv = T.alloc_local((VALUES,), OUT)
        act.load(x, topk_weights, row)
        act.settle(expert_ends, row, table)
        for i in T.unroll(VALUES):
            yv[i] = T.cast(T.if_then_else(row.is_valid, act.forward_value(row.g, row.u, row.s, row.scale, i),
                                          T.float32(0.0)), OUT)
        rows.store_row(y, yv, row.row, 0, row.lane, row.exists)

    # one prim_func per buffer set (TileLang reads the signature off the annotations)
    if spec.sigmoid == "table":
        table_t = SwigluMacros.table_buffer()

        @T.prim_func
        def kernel(x: x_t, topk_weights: w_t, expert_ends: e_t, sigmoid_table: table_t, row_steps: T.int32, y: y_t):
            with T.Kernel(T.ceildiv(rows.grid(), row_steps), threads=rows.THREADS) as bx:
                act.prologue(STRIDES)
                ends = act.shared_ends(expert_ends, T.get_thread_binding())
                table = act.shared_table(sigmoid_table, T.get_thread_binding())
                for step in T.serial(row_steps):
                    row_body(x, topk_weights, ends, table, y, bx * row_steps + step)

    else:

        @T.prim_func
        def kernel(x: x_t, topk_weights: w_t, expert_ends: e_t, y: y_t):
            with T.Kernel(rows.grid(), threads=rows.THREADS) as bx:
                act.prologue(STRIDES)
                row_body(x, topk_weights, expert_ends, None, y, bx)

    return kernel.with_attr("global_symbol", spec.name)
