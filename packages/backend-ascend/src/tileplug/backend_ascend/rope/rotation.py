"""Shared TileLang macros of the RoPE kernels (``apply_rotary``, ``rms_norm_rope``).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

* :func:`cache_parameters` / :func:`load_cache_row`: the GM cache, positions and offset of a
  kernel, and per token its position (``positions[t]`` read from GM as a scalar, or the
  implicit ``t`` / ``s``, plus the runtime ``seqlen_offset``), the DMA of the cache row
  ``clamp(pos, 0, L − 1)`` (never an out-of-range row) and the validity flag.
* :func:`rotation`: the rotation of every head's first ``R`` channels in UB, in fp32:
  ``y1 = x1·c − x2·n``, ``y2 = x2·c + x1·n`` (two products, one sum, each rounded to fp32, as
  the reference evaluates them; ``n`` negated when conjugating; ``c`` and ``n`` NaN for an
  out-of-range position), rounded once to the dtype at the store. NeoX: the partner of lane
  ``j`` of the register at ``p`` is lane ``j`` of the register at ``p`` in the second half's
  UB plane (another buffer, or the same row ``R/2`` further on). GPT-J: two registers of 128
  channels are de-interleaved into 64 first / 64 second elements (``vdintlv``), rotated and
  re-interleaved (``vintlv``).
"""

from types import SimpleNamespace

import tilelang.ascend.language as T
from tvm import tirx as tir

from tileplug.backend_ascend import rows
from tileplug.backend_ascend.ub import LANES

PAIR_BLOCK = 128
"""Channels of one GPT-J block: two registers, de-interleaved into 64 pairs."""


def cache_parameters(rotary_dim: int, positions, batched: bool, batch, steps, tokens):
    """``(name, type)`` of the cache ``CS`` fp32 ``[L, R]`` (any row stride), the positions
    ``P`` (``[T]`` / ``[B, S]``, any strides; only when given) and the int64 ``offset``."""
    params = [("CS", T.StridedTensor((T.dynamic("L"), rotary_dim), (T.dynamic("cs_s0"), 1), "float32"))]
    if positions is not None:
        if batched:
            shape, strides = (batch, steps), (T.dynamic("p_s0"), T.dynamic("p_s1"))
        else:
            shape, strides = (tokens,), (T.dynamic("p_s0"),)
        params.append(("P", T.StridedTensor(shape, strides, positions)))
    params.append(("offset", tir.Var("offset", "int64")))
    return params


def load_cache_row(positions, batched: bool, half: int, rotary_dim: int):
    """A macro ``(G, cos_ub, sin_ub, t, steps) -> valid``: token ``t``'s position, the DMA of its
    cache row (cos into ``cos_ub``, sin into ``sin_ub``, ``R/2`` fp32 each), 1 when the
    position is inside ``[0, L)`` else 0."""

    @T.macro
    def load(G, cos_ub, sin_ub, t, steps):
        if positions is None and batched:
            pos = G["offset"] + T.Cast("int64", t % steps)
        elif positions is None:
            pos = G["offset"] + T.Cast("int64", t)
        elif batched:
            pos = G["offset"] + T.Cast("int64", G["P"][t // steps, t % steps])
        else:
            pos = G["offset"] + T.Cast("int64", G["P"][t])
        length = T.Cast("int64", G["CS"].shape[0])
        row = T.max(T.min(pos, length - 1), T.int64(0))
        T.copy(G["CS"][row, 0:half], cos_ub[0:half])
        T.copy(G["CS"][row, half:rotary_dim], sin_ub[0:half])
        return T.if_then_else(pos >= 0, T.if_then_else(pos < length, 1, 0), 0)

    return load


def rotation(dtype: str, half: int, interleaved: bool, conjugate: bool):
    """The macro ``rotate_heads(first, second, second_at, heads, cos_ub, sin_ub, valid)``: rotate
    ``heads`` rows of UB in place (inside a ``T.SimdVF`` region). NeoX: ``first`` holds the
    channels ``[0, R/2)`` of each head row, ``second`` the channels ``[R/2, R)`` from column
    ``second_at``; GPT-J: ``first`` holds the ``R`` channels (``second`` unused)."""

    @T.macro
    def rotate_pair(x1, x2, c, n):
        return (T.simd.vsub(T.simd.vmul(x1, c), T.simd.vmul(x2, n)),
                T.simd.vadd(T.simd.vmul(x2, c), T.simd.vmul(x1, n)))

    @T.macro
    def rotate_heads(first, second, second_at, heads, cos_ub, sin_ub, valid):
        ok = T.simd.vcmps(T.simd.vdup(valid, "int32"), T.int32(0), op="ne")
        nan = T.simd.vdup(T.float32(float("nan")), "float32")
        for p in T.serial(rows.registers(half)):
            c = T.simd.vsel(T.simd.vld(cos_ub[p * LANES]), nan, ok)
            sin = T.simd.vsel(T.simd.vld(sin_ub[p * LANES]), nan, ok)
            n = rows.choose(conjugate, T.simd.vneg(sin), sin)
            for h in T.serial(heads):
                if interleaved:
                    lo_at, hi_at = (h, p * PAIR_BLOCK), (h, p * PAIR_BLOCK + LANES)
                    x1, x2 = T.simd.vdintlv(rows.load_f32(first, lo_at, dtype), rows.load_f32(first, hi_at, dtype))
                    y1, y2 = rotate_pair(x1, x2, c, n)
                    lo, hi = T.simd.vintlv(y1, y2)
                    rows.store_rounded(first, lo_at, lo, dtype)
                    rows.store_rounded(first, hi_at, hi, dtype)
                else:
                    at, partner = (h, p * LANES), (h, second_at + p * LANES)
                    y1, y2 = rotate_pair(rows.load_f32(first, at, dtype), rows.load_f32(second, partner, dtype), c, n)
                    rows.store_rounded(first, at, y1, dtype)
                    rows.store_rounded(second, partner, y2, dtype)

    return SimpleNamespace(rotate_heads=rotate_heads)
