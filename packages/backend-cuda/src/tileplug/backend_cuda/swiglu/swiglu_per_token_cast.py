"""CUDA ``swiglu_per_token_cast``: ``swiglu`` with an fp32 ``y`` then ``per_token_cast`` of it,
in one pass: ``y`` never leaves the registers (SPEC §8: the fp32 ``y`` is quantized directly).

The activation is ``swiglu``'s (``activation``), the cast the norm family's register cast
(``norm.row_cast.RowCast``: the quant kernel's scale macros in its order of operations, amax
on the bits of the fp32 ``|y|``), so ``(q, sf)`` are the bytes of this backend's
``swiglu(x, out_dtype=torch.float32)`` followed by its ``per_token_cast``. A padding row's
values are selected zeros (nothing from its bytes enters the amax), quantized as such, and
its scales are stored as 0.

With a bf16 x the sigmoid comes from the table of every bf16 gate's (``sigmoid_table``, copied
into shared memory once a CTA, which then runs ``row_steps`` row tiles; the default, see
``spec.SIGMOID_TABLE_VARIABLE``); otherwise it is evaluated in fp64 per value
(``activation.sigmoid_fp64``). Both give the reference's fp32 ``y``.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.norm.row_cast import RowCast
from tileplug.backend_cuda.norm.rows import RowMacros
from tileplug.backend_cuda.swiglu.activation import SwigluMacros, vector_strides
from tileplug.backend_cuda.swiglu.spec import SwigluKernelSpec


def build(spec: SwigluKernelSpec):
    """The ``T.prim_func`` of a ``swiglu_per_token_cast`` specialisation: buffers ``(x,
    topk_weights, expert_ends, q, sf)`` (``sf``: the bytes of packed UE8M0 storage), an absent
    one replaced by x (never read)."""
    M = T.dynamic("M")
    rows = RowMacros(spec, M)
    act = SwigluMacros(spec, rows)
    VALUES, VEC, H = rows.VALUES, spec.vec, spec.hidden
    cast = RowCast(spec.quant, rows, "float32", VEC, H, None, spec.vectorize)
    VPB, QDT = cast.values_per_byte, cast.q_dtype
    x_t = SwigluMacros.halves_buffer(spec, M)
    w_t = SwigluMacros.weights_buffer(spec, M)
    e_t = SwigluMacros.ends_buffer(spec)
    q_t = T.Tensor((M, H // VPB), QDT)
    sf_t = cast.sf_type()
    STRIDES = vector_strides(VEC, x_t) if spec.vectorize else []

    @T.macro
    def row_body(x, topk_weights, expert_ends, table, q, sf, tile):
        row = act.begin(tile)
        yv = T.alloc_local((VALUES,), "float32")
        amax = T.alloc_local((rows.CHUNKS,), "int32")
        inv = T.alloc_local((rows.CHUNKS,), "float32")
        qv = T.alloc_local((VEC // VPB,), QDT)
        act.load(x, topk_weights, row)
        act.settle(expert_ends, row, table)
        for i in T.unroll(VALUES):
            yv[i] = T.if_then_else(row.is_valid, act.forward_value(row.g, row.u, row.s, row.scale, i),
                                   T.float32(0.0))
        if spec.experts is None:
            cast.cast(yv, q, sf, row.row, 0, row.lane, row.exists, amax, inv, qv)
        else:
            cast.cast(yv, q, sf, row.row, 0, row.lane, row.exists, amax, inv, qv, row.is_valid)

    # one prim_func per buffer set (TileLang reads the signature off the annotations)
    if spec.sigmoid == "table":
        table_t = SwigluMacros.table_buffer()

        @T.prim_func
        def kernel(x: x_t, topk_weights: w_t, expert_ends: e_t, sigmoid_table: table_t, row_steps: T.int32,
                   q: q_t, sf: sf_t):
            with T.Kernel(T.ceildiv(rows.grid(), row_steps), threads=rows.THREADS) as bx:
                act.prologue(STRIDES)
                ends = act.shared_ends(expert_ends, T.get_thread_binding())
                table = act.shared_table(sigmoid_table, T.get_thread_binding())
                for step in T.serial(row_steps):
                    row_body(x, topk_weights, ends, table, q, sf, bx * row_steps + step)

    else:

        @T.prim_func
        def kernel(x: x_t, topk_weights: w_t, expert_ends: e_t, q: q_t, sf: sf_t):
            with T.Kernel(rows.grid(), threads=rows.THREADS) as bx:
                act.prologue(STRIDES)
                row_body(x, topk_weights, expert_ends, None, q, sf, bx)

    return kernel.with_attr("global_symbol", spec.name)
