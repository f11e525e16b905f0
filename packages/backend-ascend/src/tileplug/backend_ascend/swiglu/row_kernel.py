"""The pipelined (row, column tile) kernel the three SwiGLU ops are built on (``swiglu.py``,
``swiglu_per_token_cast.py``, ``swiglu_backward.py`` supply the per-tile vector work).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

Per vector core ``cid`` of ``T.Kernel(C)``: once, DMA ``expert_ends`` into UB; then one
:func:`~tileplug.backend_ascend.rows.row_loop` (``T.Pipelined``, every cross-stage buffer with
2 versions) over the items of rows ``cid, cid + C, ...`` (``N`` dynamic), ``tiles`` items a
row: DMA the tile's gate columns and the same columns of the up half (and of ``grad_y``), the
row's weight; the op's vector work (``compute(buffers, row, tile)``); DMA the results out. The
loop body branches on the tile kind (``W`` columns, or the narrower last tile), one loop over
the same buffers (two loops would lose the version rotation). Padding rows of an expert
layout are DMA'd like any row, and every value read from them is replaced by +0 before it
reaches a result or a statistic (NaN there changes nothing); their outputs are zeros.

GM parameters, in order (those the call has): ``X`` ``[N, 2H]`` (any row stride), ``GY``
``[N, H]`` (any row stride), ``W`` ``[N]``, ``ENDS`` ``[E]``; then ``Y`` ``[N, H]``, or
``Q`` / ``SF`` (column-major scales as their ``[columns, N]`` transpose), or ``GX`` ``[N, 2H]``
and ``GW`` ``[N]``.
"""

import tilelang.ascend.language as T

from tileplug.backend_ascend import gm, rows
from tileplug.backend_ascend.kernel import SpecKernel
from tileplug.backend_ascend.quant.row_cast import cast_tensors, store_cast
from tileplug.backend_ascend.swiglu.spec import F32, SwigluSpec, decline_reason, spec_of
from tileplug.core.contracts.swiglu import SWIGLU, SWIGLU_BACKWARD, SWIGLU_PER_TOKEN_CAST
from tileplug.core.quant.sf_math import ceil_div
from tileplug.core.swiglu.sigmoid_table import ENTRIES as TABLE_ENTRIES
from tileplug.core.swiglu.sigmoid_table import sigmoid_table


def parameters(spec: SwigluSpec):
    """``(name, tensor type)`` of the kernel's GM tensors, in launch order, and the row count symbol."""
    N = T.dynamic("N")
    H = spec.hidden
    params = [("X", T.StridedTensor((N, 2 * H), (T.dynamic("x_s0"), 1), spec.in_dtype))]
    if spec.op == SWIGLU_BACKWARD:
        params.append(("GY", T.StridedTensor((N, H), (T.dynamic("gy_s0"), 1), spec.out_dtype)))
    if spec.weighted:
        params.append(("W", T.Tensor((N,), F32)))
    if spec.experts is not None:
        params.append(("ENDS", T.Tensor((spec.experts,), "int32")))
    if spec.sigmoid_table:
        params.append(("TABLE", T.Tensor((TABLE_ENTRIES,), F32)))
    if spec.op == SWIGLU:
        params.append(("Y", T.Tensor((N, H), spec.out_dtype)))
    elif spec.op == SWIGLU_PER_TOKEN_CAST:
        e4m3, packed = spec.cast[0] == "e4m3", spec.cast[5]
        params += cast_tensors(N, (N, H if e4m3 else H // 2), spec.sf_columns, spec.cast[4],
                               "float8_e4m3fn" if e4m3 else "int8", "int16" if packed else F32)
    else:
        params.append(("GX", T.Tensor((N, 2 * H), spec.in_dtype)))
        if spec.weighted:
            params.append(("GW", T.Tensor((N,), F32)))
    return params, N


def _store(spec: SwigluSpec, width: int):
    """The macro ``store(G, buffers, row, start)``: a tile's results UB -> GM."""
    H = spec.hidden
    fmt, group, _, _, col_major, packed = spec.cast if spec.cast is not None else ("e4m3", 1, 0, 0, False, False)
    q_width = width if fmt == "e4m3" else width // 2
    per_column = 2 * group if packed else group  # a scale column holds this many values
    store_scales = store_cast(ceil_div(ceil_div(width, group), 2 if packed else 1), col_major)

    @T.macro
    def store(G, buffers, row, start):
        if spec.op == SWIGLU:
            T.copy(buffers["y_ub"][0:width], G["Y"][row, start:start + width])
        elif spec.op == SWIGLU_PER_TOKEN_CAST:
            q_start = start if fmt == "e4m3" else start // 2
            T.copy(buffers["q_ub"][0, 0:q_width], G["Q"][row, q_start:q_start + q_width])
            store_scales(G, buffers[rows.choose(packed, "sfp_ub", "sf_ub")], row, start // per_column)
        else:
            T.copy(buffers["gate_ub"][0:width], G["GX"][row, start:start + width])
            T.copy(buffers["up_ub"][0:width], G["GX"][row, H + start:H + start + width])
            if spec.weighted:
                T.copy(buffers["gw_ub"][0:1], G["GW"][row:row + 1])

    return store


def build(spec: SwigluSpec, tile_compute):
    """The prim_func of ``spec``, its per-tile vector work made by ``tile_compute(spec, width)``
    (a macro ``compute(buffers, row, tile)`` over the UB buffers by plan name, for tiles of
    ``width`` columns); raises ``UBBudgetError`` when the plan does not fit the budget (TileLang
    would lower it silently)."""
    rows.check_budget(spec.footprint, spec.budget, spec.describe())
    params, N = parameters(spec)
    plan = spec.plan()
    H, W, C, E = spec.hidden, spec.width, spec.vector_cores, spec.experts
    full, tail, tiles = spec.full_tiles, spec.tail, spec.tiles
    compute_full, store_full = tile_compute(spec, W), _store(spec, W)
    compute_tail, store_tail = (tile_compute(spec, tail), _store(spec, tail)) if tail else (None, None)

    @T.macro
    def item(G, buffers, row, tile, start, width, compute, store):
        T.copy(G["X"][row, start:start + width], buffers["gate_ub"][0:width])
        T.copy(G["X"][row, H + start:H + start + width], buffers["up_ub"][0:width])
        if spec.op == SWIGLU_BACKWARD:
            T.copy(G["GY"][row, start:start + width], buffers["grad_ub"][0:width])
        if spec.weighted:
            T.copy(G["W"][row:row + 1], buffers["w_ub"][0:1])
        compute(buffers, row, tile)
        store(G, buffers, row, start)

    def swiglu_kernel(tensors):
        G = gm.declare(tensors)
        with T.Kernel(C) as cid:
            buffers, versions = rows.plan_buffers(plan)
            if E is not None:
                T.copy(G["ENDS"][0:E], buffers["ends_ub"][0:E])
            if spec.sigmoid_table:
                T.copy(G["TABLE"][0:TABLE_ENTRIES], buffers["table_ub"][0:TABLE_ENTRIES])
            for it in rows.row_loop(T.ceildiv(N - cid, C) * tiles, versions, spec.num_buffers):
                if tiles == 1:  # whole rows
                    item(G, buffers, cid + it * C, 0, 0, W, compute_full, store_full)
                elif tail == 0 or it % tiles < full:  # (the second test is TIR when the first is False)
                    item(G, buffers, cid + (it // tiles) * C, it % tiles, (it % tiles) * W, W, compute_full,
                         store_full)
                else:  # the row's narrower last tile
                    item(G, buffers, cid + (it // tiles) * C, full, full * W, tail, compute_tail, store_tail)

    return gm.prim_func(swiglu_kernel, params)


FIELDS = {"X": "x", "GY": "grad_y", "W": "topk_weights", "ENDS": "expert_ends", "Y": "y", "Q": "q", "SF": "sf",
          "GX": "grad_x", "GW": "grad_topk_weights"}
"""GM parameter -> the field of the call's inputs (``SwigluInputs``) or outputs that holds it
(``TABLE``, the sigmoid table, is the device's own: ``sigmoid_table``)."""


def arguments(spec: SwigluSpec, inputs, outputs) -> list:
    """Launch arguments of ``spec``'s prim_func, in its parameter order (column-major scales
    as their ``[columns, N]`` transpose, unit last stride; the sigmoid table of x's device,
    computed by the reference's formula on the CPU, whose fp64 sigmoid the reference's bits are
    defined by, and copied there once)."""
    values = []
    for name in gm.argument_names(parameters(spec)[0]):
        if name == "TABLE":
            values.append(sigmoid_table(inputs.x.device, computed_on="cpu"))
            continue
        value = getattr(inputs if FIELDS[name] in inputs._fields else outputs, FIELDS[name])
        values.append(value.t() if name == "SF" and spec.cast[4] else value)
    return values


def kernel(op: str, build) -> SpecKernel:
    """The tileplug Kernel of SwiGLU op ``op`` built by ``build(spec)``."""
    return SpecKernel(op, spec_of, decline_reason, build, arguments)
