"""The per-token cast of one UB row, shared by the fused kernels that end in a cast
(``rms_norm_per_token_cast``: one row of ``[T, D]``; ``rms_norm_rope_per_token_cast``: each
head of a token, its groups numbered on from the previous head's, as ``[T, N·D]`` numbers them).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

:func:`row_cast` is the macro over the quant family's :func:`~.sf_macros.sf_macros` (the
macros the Ascend ``per_token_cast`` runs): per 1 x g group of the rounded values in UB,
amax on the bits of ``|y|``, the scale math, ``q = saturate(y · inv)`` as e4m3. The same
macros on the same rounded values give the bytes of the Ascend chain ``per_token_cast(y)``.
:func:`cast_tensors` / :func:`store_cast` are the GM side (``Q``, ``SF`` row- or column-major)
and :func:`fused_cast_decline` what a fused kernel leaves to the reference.
"""

import tilelang.ascend.language as T

from tileplug.backend_ascend import rows
from tileplug.backend_ascend.quant.sf_macros import lane_mask, sf_macros, subgroups
from tileplug.backend_ascend.ub import LANES
from tileplug.core.quant.sf_math import ceil_div


def row_cast(cast, width: int, dtype: str, packed: bool = False):
    """The macro ``cast_row(x_ub, q_ub, sf_ub, row, first_group)``: quantize ``width`` values of
    UB row ``row`` of ``x_ub`` (None: a 1-D buffer; else a row of a 2-D one) into the same place
    of ``q_ub`` (e4m3 bytes; for e2m1 the codes, one per byte, that :func:`~.sf_macros.pack_macro`
    packs), their group scales into ``sf_ub[first_group ...]`` (fp32; with ``packed`` the biased
    UE8M0 exponents as int32, packed later); inside a ``T.SimdVF`` region. ``cast``: ``(fmt,
    group, round_sf, clamp_min, col_major)``."""
    fmt, group, round_sf, clamp_min, _ = cast
    macros = sf_macros(fmt, round_sf, clamp_min, packed, True)
    full, tail = rows.chunks(width)

    @T.macro
    def wide_group(x_ub, q_ub, sf_ub, row, start, gi, span):
        # a group of 64 or 128 values: whole registers (the last group of a row may be partial)
        pieces = [(k * LANES, min(LANES, span - k * LANES)) for k in range(ceil_div(span, LANES))]
        acc = T.simd.alloc_var("int32")
        acc = T.simd.vdup(T.int32(0), "int32")
        for k0, lanes in pieces:
            acc = T.simd.vmax(acc, macros.abs_bits(rows.load_f32(x_ub, rows.at(row, start + k0), dtype), lanes))
        inv = macros.group_inv(acc, sf_ub, sf_ub, gi)
        for k0, lanes in pieces:
            at = rows.at(row, start + k0)
            macros.store_quantized(q_ub, q_ub, at, T.simd.vmul(rows.load_f32(x_ub, at, dtype), inv))

    @T.macro
    def narrow_groups(x_ub, q_ub, sf_ub, row, start, first, lanes):
        # one register holding several groups of 16 or 32 values
        parts = subgroups(lanes, group)
        later = [(k, lo, hi) for k, (lo, hi) in enumerate(parts)][1:]  # a list: unrolled at trace time
        y = rows.load_f32(x_ub, rows.at(row, start), dtype)
        bits = macros.abs_bits(y, lanes)
        zero = T.simd.vdup(T.int32(0), "int32")
        inv = T.simd.alloc_var("float32")
        inv = macros.group_inv(T.simd.vsel(bits, zero, lane_mask(*parts[0])), sf_ub, sf_ub, first)
        for k, lo, hi in later:
            inv_k = macros.group_inv(T.simd.vsel(bits, zero, lane_mask(lo, hi)), sf_ub, sf_ub, first + k)
            inv = T.simd.vsel(inv_k, inv, lane_mask(lo, hi))
        macros.store_quantized(q_ub, q_ub, rows.at(row, start), T.simd.vmul(y, inv))

    @T.macro
    def cast_row(x_ub, q_ub, sf_ub, row, first_group):
        if group >= LANES:
            for j in T.serial(width // group):
                wide_group(x_ub, q_ub, sf_ub, row, j * group, first_group + j, group)
            if width % group:
                wide_group(x_ub, q_ub, sf_ub, row, (width // group) * group, first_group + width // group,
                           width % group)
        else:
            per = LANES // group
            for c in T.serial(full):
                narrow_groups(x_ub, q_ub, sf_ub, row, c * LANES, first_group + c * per, LANES)
            if tail:
                narrow_groups(x_ub, q_ub, sf_ub, row, full * LANES, first_group + full * per, tail)

    return cast_row


def cast_tensors(tokens, q_shape, groups: int, col_major: bool, q_dtype: str = "float8_e4m3fn",
                 sf_dtype: str = "float32"):
    """``(name, tensor type)`` of the cast's GM outputs: ``Q`` (``q_dtype``, ``q_shape``: ``[T, D]``,
    ``[T, D / 2]`` int8 for e2m1, or ``[T, N, D]`` for the ``[T, N·D]`` rows of a per-head kernel)
    and ``SF`` (``sf_dtype`` ``[T, groups]`` -- ``groups`` counts the stored scale columns, int16
    pairs for packed UE8M0 --, or its ``[groups, T]`` transpose for column-major scales)."""
    params = [("Q", T.Tensor(q_shape, q_dtype))]
    if col_major:
        params.append(("SF", T.StridedTensor((groups, tokens), (T.dynamic("sf_s0"), 1), sf_dtype)))
    else:
        params.append(("SF", T.Tensor((tokens, groups), sf_dtype)))
    return params


def store_cast(count: int, col_major: bool):
    """The macro ``store(G, sf_ub, row, first)``: ``count`` scales of one token UB -> GM, into its
    scale columns ``first .. first + count``."""

    @T.macro
    def store(G, sf_ub, row, first):
        if col_major:
            T.copy(sf_ub[0:count], G["SF"][first:first + count, row])
        else:
            T.copy(sf_ub[0:count], G["SF"][row, first:first + count])

    return store


def fused_cast_decline(quant) -> str | None:
    """Why a fused kernel's cast (``quant``: the per-token QuantCall of its output rows) is not
    served (None: it is): e2m1 and packed UE8M0 need a SIMT pack the fused kernels do not have,
    then the per-token cast kernel's own declines."""
    from tileplug.backend_ascend.quant.common import decline_reason as cast_decline_reason

    cast = quant.cast
    if cast.fmt.name != "e4m3":
        return f"fmt={cast.fmt.name}: the fused norm + cast writes e4m3 only (e2m1 nibble packing needs a SIMT region)"
    if cast.use_packed_ue8m0:
        return "packed UE8M0 scales are not produced by the fused norm + cast (the SIMT pack is not fused)"
    return cast_decline_reason(quant)


def cast_key(quant):
    """The cast a fused kernel specialises on: ``(fmt, group, round_sf, clamp_min, col_major)``."""
    config = quant.cast
    return (config.fmt.name, config.block[1], config.round_sf, config.clamp_min, bool(config.col_major_sf))
