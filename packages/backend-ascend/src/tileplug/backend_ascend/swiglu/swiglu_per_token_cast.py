"""Ascend kernel of ``swiglu_per_token_cast`` (SPEC §8; the fusion rule of §4): ``swiglu``'s
fp32 ``y`` quantized per token without leaving UB.

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

The pipelined (row, column tile) kernel of :mod:`.row_kernel` (tiles of whole groups, and of
whole UE8M0 pairs) with, per tile, one ``T.SimdVF`` region: ``y`` of :mod:`.swiglu`
(:func:`~.swiglu.store_activation`, +0 on a padding row) stored in fp32 (no rounding: the cast
quantizes the fp32 value), then the quant family's row cast
(:func:`tileplug.backend_ascend.quant.row_cast.row_cast`, over the macros the Ascend
``per_token_cast`` runs: per 1 x g group amax on the bits of ``|y|``, the scale math,
``q = saturate(y · inv)``), so the bytes are those of the Ascend chain
``per_token_cast(swiglu(x, out_dtype=fp32))``; on a padding row the scales (fp32, or the
UE8M0 exponents) are then set to 0 (its ``q`` is already 0: ``y`` is +0). For e2m1 and packed
UE8M0 a ``T.SimtVF`` region then packs the nibbles and the exponent pairs (the quant tile
kernel's :func:`~tileplug.backend_ascend.quant.sf_macros.pack_macro`).

Served: every cast flag the Ascend ``per_token_cast`` serves (e4m3 / e2m1, groups 16 / 32 /
64 / 128, plain / power-of-two / packed UE8M0 scales, row- or column-major); declined with its
reasons what it declines (e4m3-stored scales, H not a multiple of 16, denormal-scale clamps).
"""

import tilelang.ascend.language as T

from tileplug.backend_ascend import rows
from tileplug.backend_ascend.quant.row_cast import row_cast
from tileplug.backend_ascend.quant.sf_macros import pack_macro
from tileplug.backend_ascend.swiglu import macros, row_kernel
from tileplug.backend_ascend.swiglu.spec import F32, SwigluSpec
from tileplug.backend_ascend.swiglu.swiglu import store_activation
from tileplug.backend_ascend.ub import LANES
from tileplug.core.quant.sf_math import ceil_div


def tile_compute(spec: SwigluSpec, width: int):
    """The vector work of one tile ``width`` columns wide (a multiple of the group unless it is
    the row's last): a macro over the UB buffers. Looked up by :func:`build` at trace time."""
    fmt, group, _, _, _, packed = spec.cast
    e2m1 = fmt == "e2m1"
    values = store_activation(spec, width, 0, F32)
    cast_row = row_cast(spec.cast[:5], width, F32, packed)
    groups = ceil_div(width, group)
    pack = pack_macro(1, width, groups, e2m1, packed, False) if spec.uses_simt else None
    codes_name = rows.choose(e2m1, "code_ub", "q_ub")
    scales_name = rows.choose(packed, "e_ub", "sf_ub")
    scale_dtype = rows.choose(packed, "int32", F32)

    @T.macro
    def zero_scales_unless(scales_ub, keep):
        # a padding row's scales (or UE8M0 exponents) are 0, not the clamp floor of a zero row
        zero = T.simd.vdup(T.Cast(scale_dtype, 0), scale_dtype)
        for c in T.serial(rows.registers(groups)):
            T.simd.vsts(scales_ub[c * LANES], T.simd.vsel(T.simd.vld(scales_ub[c * LANES]), zero, keep))

    @T.macro
    def compute(buffers, row, tile):
        with T.SimdVF():
            keep = macros.keep_of(spec, buffers, row)
            values(buffers, buffers["y_ub"], keep)
            T.simd.mem_bar("VST_VLD")
            cast_row(buffers["y_ub"], buffers[codes_name], buffers[scales_name], 0, 0)
            if spec.experts is not None:
                T.simd.mem_bar("VST_VLD")
                zero_scales_unless(buffers[scales_name], keep)
        if spec.uses_simt:
            pack(buffers["q_ub"], buffers.get("code_ub"), buffers.get("e_ub"), buffers.get("sfp_ub"))

    return compute


def build(spec: SwigluSpec):
    """The prim_func of ``spec`` (UB budget checked)."""
    return row_kernel.build(spec, tile_compute)


KERNEL = row_kernel.kernel("swiglu_per_token_cast", build)
