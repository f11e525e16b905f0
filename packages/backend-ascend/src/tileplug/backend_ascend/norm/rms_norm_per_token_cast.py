"""Ascend kernel of ``rms_norm_per_token_cast``: RMSNorm and the per-token cast of its output
in one pass over each row (SPEC §5; the fusion rule of §4).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

The pipelined row kernel of :mod:`.row_kernel` with, per row, the vector work of
:mod:`.rms_norm` (``y`` rounded to ``x.dtype``, written over the row of ``x``) and then one
``T.SimdVF`` region of the quant family's cast (:mod:`tileplug.backend_ascend.quant.sf_macros`,
the macros the Ascend ``per_token_cast`` runs) over that rounded ``y``: per 1 x g group, amax on
the bits of ``|y|``, the scale math, ``q = saturate(y · inv)`` as e4m3. The same macros on the
same rounded values: the bytes equal the Ascend chain ``per_token_cast(rms_norm(x))``. The row
never leaves UB between the two steps (the unfused chain writes and re-reads ``y``).

Served: 2-D ``x``, e4m3, groups 16 / 32 / 64 / 128, plain or power-of-two fp32 scales, row-
or column-major; ``return_unquantized`` writes ``y`` too.
"""

import tilelang.ascend.language as T

from tileplug.backend_ascend import rows
from tileplug.backend_ascend.norm import rms_norm, row_kernel
from tileplug.backend_ascend.norm.spec import NormSpec
from tileplug.backend_ascend.quant.sf_macros import lane_mask, sf_macros, subgroups
from tileplug.backend_ascend.ub import LANES
from tileplug.core.quant.sf_math import ceil_div


def cast_compute(spec: NormSpec):
    """The per-row cast of the rounded ``y`` in ``x_ub``: a macro over the UB buffers."""
    fmt, group, round_sf, clamp_min, _ = spec.cast
    D, dt = spec.hidden, spec.in_dtype
    cast = sf_macros(fmt, round_sf, clamp_min, False, True)
    full, tail = rows.chunks(D)

    @T.macro
    def wide_group(x_ub, q_ub, sf_ub, start, gi, width):
        # a group of 64 or 128 values: whole registers (the last group of a row may be partial)
        pieces = [(k * LANES, min(LANES, width - k * LANES)) for k in range(ceil_div(width, LANES))]
        acc = T.simd.alloc_var("int32")
        acc = T.simd.vdup(T.int32(0), "int32")
        for k0, lanes in pieces:
            acc = T.simd.vmax(acc, cast.abs_bits(rows.load_f32(x_ub, start + k0, dt), lanes))
        inv = cast.group_inv(acc, sf_ub, None, gi)
        for k0, lanes in pieces:
            cast.store_quantized(q_ub, None, start + k0, T.simd.vmul(rows.load_f32(x_ub, start + k0, dt), inv))

    @T.macro
    def narrow_groups(x_ub, q_ub, sf_ub, start, first_group, lanes):
        # one register holding several groups of 16 or 32 values
        parts = subgroups(lanes, group)
        later = [(k, lo, hi) for k, (lo, hi) in enumerate(parts)][1:]  # a list: unrolled at trace time
        y = rows.load_f32(x_ub, start, dt)
        bits = cast.abs_bits(y, lanes)
        zero = T.simd.vdup(T.int32(0), "int32")
        inv = T.simd.alloc_var("float32")
        inv = cast.group_inv(T.simd.vsel(bits, zero, lane_mask(*parts[0])), sf_ub, None, first_group)
        for k, lo, hi in later:
            inv_k = cast.group_inv(T.simd.vsel(bits, zero, lane_mask(lo, hi)), sf_ub, None, first_group + k)
            inv = T.simd.vsel(inv_k, inv, lane_mask(lo, hi))
        cast.store_quantized(q_ub, None, start, T.simd.vmul(y, inv))

    @T.macro
    def compute(buffers):
        x_ub, q_ub, sf_ub = buffers["x_ub"], buffers["q_ub"], buffers["sf_ub"]
        with T.SimdVF():
            if group >= LANES:
                for j in T.serial(D // group):
                    wide_group(x_ub, q_ub, sf_ub, j * group, j, group)
                if D % group:
                    wide_group(x_ub, q_ub, sf_ub, (D // group) * group, D // group, D % group)
            else:
                per = LANES // group
                for c in T.serial(full):
                    narrow_groups(x_ub, q_ub, sf_ub, c * LANES, c * per, LANES)
                if tail:
                    narrow_groups(x_ub, q_ub, sf_ub, full * LANES, full * per, tail)

    return compute


def row_compute(spec: NormSpec):
    """RMSNorm of the row (:func:`.rms_norm.row_compute`), then its cast."""
    norm = rms_norm.row_compute(spec)
    cast = cast_compute(spec)

    @T.macro
    def compute(buffers):
        norm(buffers)
        cast(buffers)

    return compute


def build(spec: NormSpec):
    """The prim_func of ``spec`` (UB budget checked)."""
    return row_kernel.build(spec, row_compute)


KERNEL = row_kernel.kernel("rms_norm_per_token_cast", build)
