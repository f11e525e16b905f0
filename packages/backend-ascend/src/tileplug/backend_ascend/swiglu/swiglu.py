"""Ascend kernel of ``swiglu`` (SPEC §8): the pipelined (row, column tile) kernel of
:mod:`.row_kernel` with the vector work below.

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

Per tile, one ``T.SimdVF`` region over 64-lane fp32 registers: the row's validity (with an
expert layout, :func:`~.macros.row_kept`) and ``w'`` (:func:`~.macros.row_scale`) once, then per
register ``y = ((g · sigmoid(g)) · u) · w'`` (:func:`~.macros.activation`; a bf16 x with an fp32
``y`` reads the sigmoid from the table in UB, ``spec.sigmoid_table``), +0 on a padding row, rounded
once to the output dtype (nearest even, no saturation) into ``y_ub``.
"""

import tilelang.ascend.language as T

from tileplug.backend_ascend import rows
from tileplug.backend_ascend.swiglu import macros, row_kernel
from tileplug.backend_ascend.swiglu.spec import SwigluSpec
from tileplug.backend_ascend.ub import LANES


def store_activation(spec: SwigluSpec, width: int, y_row, y_dtype: str):
    """The macro ``values(buffers, y_ub, keep)``: ``y`` of the tile's ``width`` columns (``keep``
    None, or the row's validity predicate) into ``y_ub`` (row ``y_row`` of a 2-D buffer, None
    for a 1-D one) rounded to ``y_dtype``; inside a ``T.SimdVF`` region."""
    dt = spec.in_dtype

    @T.macro
    def values(buffers, y_ub, keep):
        scale = macros.scale_of(buffers.get("w_ub"), spec.weighted, spec.scaling)
        for c in T.serial(rows.registers(width)):
            gate = rows.load_f32(buffers["gate_ub"], c * LANES, dt)
            up = rows.load_f32(buffers["up_ub"], c * LANES, dt)
            y = macros.activation(gate, up, spec.clamp, scale, buffers.get("table_ub"))
            rows.store_rounded(y_ub, rows.at(y_row, c * LANES), macros.kept(y, keep), y_dtype)

    return values


def tile_compute(spec: SwigluSpec, width: int):
    """The vector work of one tile ``width`` columns wide: a macro over the UB buffers. Looked
    up by :func:`build` at trace time (tests/ascend_bad_kernels.py replaces it with scalar code)."""
    values = store_activation(spec, width, None, spec.out_dtype)

    @T.macro
    def compute(buffers, row, tile):
        with T.SimdVF():
            values(buffers, buffers["y_ub"], macros.keep_of(spec, buffers, row))

    return compute


def build(spec: SwigluSpec):
    """The prim_func of ``spec`` (UB budget checked)."""
    return row_kernel.build(spec, tile_compute)


KERNEL = row_kernel.kernel("swiglu", build)
