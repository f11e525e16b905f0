"""The RoPE rotation as TileLang macros, shared by the RoPE-family kernels.

SPEC §6 in fp32: ``y1 = x1·c − x2·n``, ``y2 = x2·c + x1·n`` with each product and the sum
rounded to fp32 on its own (``__fmul_rn`` / ``__fsub_rn`` / ``__fadd_rn``: no FMA
contraction, whatever nvcc's flags), which is the reference's order of operations; the
caller rounds once to the heads' dtype at the store. Every kernel that rotates uses these
macros, so a fused kernel and ``apply_rotary`` on the same values write the same bytes.

:class:`SlotLayout` is the trace-time description of a slot (``spec.py``): where pair ``i``
sits in the slot's registers, which cache columns its ``c`` / ``n`` come from, and the
macros that load a slot's cos/sin row (NaN, never read, when the position is out of
range) and a slot of one head.

No ``from __future__ import annotations``: TileLang evaluates macro annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.quant.sf_math import F32_NAN_BITS
from tileplug.backend_cuda.rope.spec import slot_pairs, values_per_vector


@T.macro
def rotated_first(x1, x2, c, n):
    """fp32 ``x1·c − x2·n`` (two rounded products, one rounded difference)."""
    return T.ieee_sub(T.ieee_mul(x1, c), T.ieee_mul(x2, n))


@T.macro
def rotated_second(x1, x2, c, n):
    """fp32 ``x2·c + x1·n`` (two rounded products, one rounded sum)."""
    return T.ieee_add(T.ieee_mul(x2, c), T.ieee_mul(x1, n))


@T.macro
def nan_f32():
    return T.reinterpret(T.int32(F32_NAN_BITS), "float32")


class SlotLayout:
    """One slot of a head (see ``spec.py``): ``pairs`` pairs in ``2·pairs`` registers.

    ``vectorize``: the registers hold chunk 0 (channels ``[k·V, k·V + V)``) then chunk 1
    (``R/2`` further); NeoX pair ``i`` is registers ``(i, V + i)`` with cache column
    ``k·V + i``; GPT-J pair ``i`` is registers ``(2i, 2i + 1)`` with column ``k·V/2 + i``
    in chunk 0 and ``R/4 + k·V/2 + i − V/2`` in chunk 1. Scalar: pair ``i`` of slot ``k``
    is pair ``p = k·pairs + i``, registers ``(2i, 2i + 1)``, channels ``(p, p + R/2)``
    (NeoX) or ``(2p, 2p + 1)`` (GPT-J), column ``p``.
    """

    def __init__(self, dtype: str, rotary_dim: int, interleaved: bool, conjugate: bool, vectorize: bool) -> None:
        self.dtype, self.rotary_dim, self.interleaved = dtype, rotary_dim, interleaved
        self.conjugate, self.vectorize = conjugate, vectorize
        self.vec = values_per_vector(dtype)
        self.pairs = slot_pairs(dtype, rotary_dim, vectorize)
        self.half = rotary_dim // 2
        self.values = 2 * self.pairs  # registers of one slot

    # ------------------------------------------------------------ trace-time index maps
    def register_step(self) -> tuple[int, int]:
        """``(step, second)``: pair ``i`` sits in registers ``(i·step, i·step + second)``."""
        if self.vectorize and not self.interleaved:
            return 1, self.vec
        return 2, 1

    def channel(self, slot, i, part: int):
        """Head channel of value ``part`` (0: x1, 1: x2) of pair ``i`` of ``slot`` (scalar path)."""
        p = slot * self.pairs + i
        return 2 * p + part if self.interleaved else p + part * self.half

    def chunk(self, slot, part: int):
        """First channel of chunk ``part`` (0 or 1) of ``slot`` (vector path)."""
        return slot * self.vec + part * self.half

    # ------------------------------------------------------------ macros
    def make_load_cos_sin(self):
        """``load_cos_sin(cache, row, valid, slot, cs)``: ``cs[0:pairs]`` = c, ``cs[pairs:]`` = n
        (sin, negated when conjugating) of the slot's pairs from cache row ``row``; NaN when
        not ``valid`` (the row is then never read)."""
        P, HALF, VEC = self.pairs, self.half, self.vec
        VECTOR, GPTJ, CONJ = self.vectorize, self.interleaved, self.conjugate
        QUARTER = self.rotary_dim // 4

        @T.macro
        def load_cos_sin(cache, row, valid, slot, cs):
            if valid:
                if VECTOR and not GPTJ:
                    for j in T.vectorized(P):
                        cs[j] = cache[row, slot * VEC + j]
                    for j in T.vectorized(P):
                        cs[P + j] = cache[row, HALF + slot * VEC + j]
                elif VECTOR:
                    for part in T.unroll(2):
                        for j in T.vectorized(P // 2):
                            cs[part * (P // 2) + j] = cache[row, part * QUARTER + slot * (VEC // 2) + j]
                    for part in T.unroll(2):
                        for j in T.vectorized(P // 2):
                            cs[P + part * (P // 2) + j] = cache[row, HALF + part * QUARTER + slot * (VEC // 2) + j]
                else:
                    for j in T.unroll(P):
                        cs[j] = cache[row, slot * P + j]
                        cs[P + j] = cache[row, HALF + slot * P + j]
                if CONJ:
                    for j in T.unroll(P):
                        cs[P + j] = -cs[P + j]
            else:
                for j in T.unroll(2 * P):
                    cs[j] = nan_f32()

        return load_cos_sin

    def make_rotate(self):
        """``rotate(xv, x0, cs, ov, o0)``: the slot at ``xv[x0:]`` rotated by ``cs`` into
        ``ov[o0:]``, each value rounded once to ``dtype``."""
        P, DT = self.pairs, self.dtype
        STEP, SECOND = self.register_step()

        @T.macro
        def rotate(xv, x0, cs, ov, o0):
            for i in T.unroll(P):
                a = i * STEP
                b = i * STEP + SECOND
                x1 = T.cast(xv[x0 + a], "float32")
                x2 = T.cast(xv[x0 + b], "float32")
                ov[o0 + a] = T.cast(rotated_first(x1, x2, cs[i], cs[P + i]), DT)
                ov[o0 + b] = T.cast(rotated_second(x1, x2, cs[i], cs[P + i]), DT)

        return rotate
