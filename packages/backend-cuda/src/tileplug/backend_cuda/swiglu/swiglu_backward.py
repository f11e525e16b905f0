"""CUDA ``swiglu_backward``: ``grad_x`` ``[N, 2H]`` and (with routed weights) ``grad_topk_weights``
``[N]`` from x ``[N, 2H]`` and ``grad_y`` ``[N, H]`` in one pass.

Per value, in fp32 with the reference's rounding points (``s = sigmoid(g)``, ``w'`` the routed
weight times the factor): ``grad_gate = (((grad · u) · w') · s) · (1 + g · (1 − s))`` and
``grad_up = (grad · (g · s)) · w'``, each zero where the clamp cut; ``grad_topk_weights`` is
the row's sum of ``(grad · (g · s)) · u`` added in the reference's pairwise order (the norm
tile's ``row_sum``: the reference's bits, batch-invariant) times the factor. Padding rows'
gradients are written as zeros (their terms stay in their own row of the sum, which is
replaced by 0). With the sigmoid table (the default, ``spec.SIGMOID_TABLE_VARIABLE``) a CTA copies the
table into shared memory and runs ``row_steps`` row tiles, its row sum's tree reused after a
barrier.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.norm.rows import RowMacros
from tileplug.backend_cuda.swiglu.activation import GATE, UP, SwigluMacros, vector_strides
from tileplug.backend_cuda.swiglu.spec import SwigluKernelSpec


def build(spec: SwigluKernelSpec):
    """The ``T.prim_func`` of a ``swiglu_backward`` specialisation: buffers ``(x, grad_y,
    topk_weights, expert_ends, grad_x, grad_topk_weights)``, an absent one replaced by x."""
    M = T.dynamic("M")
    rows = RowMacros(spec, M)
    act = SwigluMacros(spec, rows)
    VALUES, IN, GRAD = rows.VALUES, spec.in_dtype, spec.out_dtype
    WEIGHTED, CLAMPED, SCALED = spec.weighted, act.clamped, act.scaled
    x_t = SwigluMacros.halves_buffer(spec, M)
    gy_t = SwigluMacros.single_buffer(spec, "gy", GRAD, M)
    w_t = SwigluMacros.weights_buffer(spec, M)
    e_t = SwigluMacros.ends_buffer(spec)
    gx_t = SwigluMacros.halves_buffer(spec, M)
    gw_t = T.Tensor((M,), "float32") if WEIGHTED else SwigluMacros.absent_buffer(spec, "gw")
    STRIDES = vector_strides(spec.vec, x_t, gy_t, gx_t) if spec.vectorize else []

    def scaled(value, scale):
        return value * scale[0] if SCALED else value

    @T.macro
    def row_body(x, grad_y, topk_weights, expert_ends, table, grad_x, grad_topk_weights, tree, tile):
        row = act.begin(tile)
        grad = T.alloc_local((VALUES,), GRAD)
        gate_grad = T.alloc_local((VALUES,), IN)
        up_grad = T.alloc_local((VALUES,), IN)
        if WEIGHTED:
            terms = T.alloc_local((VALUES,), "float32")
            total = T.alloc_local((1,), "float32")
        act.load(x, topk_weights, row)
        rows.load_row(grad_y, grad, row.row, 0, row.lane, row.exists, GRAD)
        act.settle(expert_ends, row, table)
        g, u, s = row.g, row.u, row.s
        for i in T.unroll(VALUES):
            dy = T.cast(grad[i], "float32")
            silu = g[i] * s[i]
            slope = T.ieee_add(T.float32(1.0), T.ieee_mul(g[i], T.float32(1.0) - s[i]))
            d_gate = scaled(dy * u[i], row.scale) * s[i] * slope
            d_up = scaled(dy * silu, row.scale)
            if CLAMPED:
                d_gate = T.if_then_else(act.gate_cut(T.cast(row.gate[i], "float32")), T.float32(0.0), d_gate)
                d_up = T.if_then_else(act.up_cut(T.cast(row.up[i], "float32")), T.float32(0.0), d_up)
            gate_grad[i] = T.cast(T.if_then_else(row.is_valid, d_gate, T.float32(0.0)), IN)
            up_grad[i] = T.cast(T.if_then_else(row.is_valid, d_up, T.float32(0.0)), IN)
            if WEIGHTED:
                terms[i] = dy * silu * u[i]
        rows.store_row(grad_x, gate_grad, row.row, GATE, row.lane, row.exists)
        rows.store_row(grad_x, up_grad, row.row, UP, row.lane, row.exists)
        if WEIGHTED:
            rows.row_sum(terms, tree, total, row.lane, rows.slot(row.tx))
            if row.exists and row.lane == 0:
                grad_topk_weights[row.row] = T.if_then_else(row.is_valid, total[0] * T.float32(act.scaling),
                                                            T.float32(0.0))

    # one prim_func per buffer set (TileLang reads the signature off the annotations)
    if spec.sigmoid == "table":
        table_t = SwigluMacros.table_buffer()

        @T.prim_func
        def kernel(x: x_t, grad_y: gy_t, topk_weights: w_t, expert_ends: e_t, sigmoid_table: table_t,
                   row_steps: T.int32, grad_x: gx_t, grad_topk_weights: gw_t):
            with T.Kernel(T.ceildiv(rows.grid(), row_steps), threads=rows.THREADS) as bx:
                act.prologue(STRIDES)
                ends = act.shared_ends(expert_ends, T.get_thread_binding())
                table = act.shared_table(sigmoid_table, T.get_thread_binding())
                tree = rows.tree_buffer() if WEIGHTED else None
                for step in T.serial(row_steps):
                    row_body(x, grad_y, topk_weights, ends, table, grad_x, grad_topk_weights, tree,
                             bx * row_steps + step)
                    if WEIGHTED:
                        rows.reuse_barrier()  # the next row's sum writes the tree this one read last

    else:

        @T.prim_func
        def kernel(x: x_t, grad_y: gy_t, topk_weights: w_t, expert_ends: e_t, grad_x: gx_t, grad_topk_weights: gw_t):
            with T.Kernel(rows.grid(), threads=rows.THREADS) as bx:
                act.prologue(STRIDES)
                tree = rows.tree_buffer() if WEIGHTED else None
                row_body(x, grad_y, topk_weights, expert_ends, None, grad_x, grad_topk_weights, tree, bx)

    return kernel.with_attr("global_symbol", spec.name)
