"""SPEC §1-2 scale math as TileLang macros (device twins of ``tileplug.core.quant.sf_math``).

Every helper works on fp32 values and int32 bit patterns, in the exact order of operations
of the reference, so the kernels write the reference's bytes:

- amax is taken on the *bits* of ``|x|`` with an int32 max: for non-negative floats the
  bit order is the value order, and NaN bits sort above +inf, so the maximum propagates NaN
  (``fmaxf`` would drop it) — a non-finite group keeps a non-finite scale (SPEC §0).
- divisions are ``__fdiv_rn`` (exact whatever the math flags), products are single fp32
  multiplies (no add, so no FMA contraction can change them).
- e4m3 values use the hardware ``cvt.rn.satfinite`` conversion: clamp to ±448, round to
  nearest even, NaN stays NaN (docs/numerics.md); a non-finite e4m3-stored *scale* is NaN.

No ``from __future__ import annotations`` here: TileLang evaluates macro annotations.
"""

import struct

import tilelang.language as T

from tileplug.core.quant.sf_math import LOSSLESS_HEADROOM

F32_INF_BITS = 0x7F800000
F32_NAN_BITS = 0x7FC00000
NONFINITE_EXPONENT = 128


def f32_bits(value: float) -> int:
    """int32 bit pattern of ``value`` rounded to fp32 (host side, for constants)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def f32(value: float) -> float:
    """``value`` rounded to the nearest fp32 (host side, for constants)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def packed_sf_type(col_major: bool):
    """The ``sf`` parameter of a kernel writing packed UE8M0 scales: the caller's int32 tensor
    ``[R, C]`` as core allocated it, with its unit stride a constant (row-major ``(S, 1)``,
    column-major ``(1, S)``), so no view is taken on the host (the two views it replaces took
    1.9 µs a call on the H200 host, 2026-12-07; see :func:`packed_sf_bytes`)."""
    rows, columns, stride = T.dynamic("OR"), T.dynamic("OC"), T.dynamic("OS")
    return T.StridedTensor((rows, columns), (1, stride) if col_major else (stride, 1), "int32")


def packed_sf_bytes(sf, col_major: bool):
    """The bytes of a :func:`packed_sf_type` buffer, an alias of the same memory: row-major
    ``[R, 4C]`` (group ``g`` of row ``r`` at ``[r, g]``), column-major ``[C, 4R]`` (the bytes of
    one column's integers in a row: group ``g`` of row ``r`` at ``[g // 4, 4r + g % 4]``); last
    stride 1, so a store's address is a constant offset from its row's. Declare it inside the
    kernel's scope, once per kernel (or per store: the alias costs no instruction)."""
    rows, columns = sf.shape
    if col_major:
        return T.decl_buffer((columns, 4 * rows), "uint8", data=sf.data, strides=(4 * sf.strides[1], 1))
    return T.decl_buffer((rows, 4 * columns), "uint8", data=sf.data, strides=(4 * sf.strides[0], 1))


@T.macro
def as_f32(bits):
    return T.reinterpret(bits, "float32")


@T.macro
def abs_bits(value):
    """int32 bits of ``|value|`` (fp32): an order-preserving, NaN-propagating amax key."""
    return T.reinterpret(value, "int32") & 0x7FFFFFFF


@T.macro
def bf16_abs_bits(value):
    """Same key as ``abs_bits(float(value))`` for a bf16 ``value``, from its 16 raw bits."""
    return T.shift_left(T.cast(T.reinterpret(value, "uint16"), "int32") & 0x7FFF, 16)


@T.macro
def pow2(k):
    """Exact fp32 ``2^k`` for int32 ``k`` in [-149, 128] (128 gives +inf), built from bits."""
    return T.reinterpret(
        T.if_then_else(k >= -126, T.shift_left(k + 127, 23), T.shift_left(1, T.min(T.max(k + 149, 0), 30))), "float32"
    )


@T.macro
def ceil_log2_exponent(scale):
    """``e = ((bits(s) - 1) >> 23) + 1 - 127`` for fp32 ``s >= 0``; non-finite ``s`` gives 128."""
    bits = T.reinterpret(scale, "int32")
    return T.if_then_else(bits >= F32_INF_BITS, NONFINITE_EXPONENT, T.shift_right(bits - 1, 23) + 1 - 127)


@T.macro
def clamped_amax(amax_bits, clamp_min_bits):
    """``c = max(amax, clamp_min)`` on bits (NaN wins), as fp32."""
    return T.reinterpret(T.max(amax_bits, clamp_min_bits), "float32")


@T.macro
def e4m3_scale(c, fmt_max):
    """e4m3-stored sf: ``e4m3(c / max)`` with a non-finite ratio stored as NaN (not 448)."""
    ratio = T.ieee_fdiv(c, T.float32(fmt_max))
    return T.cast(T.if_then_else(T.isinf(ratio), T.reinterpret(T.int32(F32_NAN_BITS), "float32"), ratio),
                  "float8_e4m3fn")


@T.macro
def inverse_of_exponent(e):
    """``2^-e``, or 0 for a non-finite group (``e == 128``)."""
    return T.if_then_else(e == NONFINITE_EXPONENT, T.float32(0.0), pow2(0 - e))


@T.macro
def group_inverse(amax_bits, clamp_min_bits, fmt_max, fmt_rcp, round_sf, e4m3_sf):
    """The fp32 factor a group's values are multiplied by (SPEC §2), from its amax bits."""
    c = clamped_amax(amax_bits, clamp_min_bits)
    if round_sf:
        return inverse_of_exponent(ceil_log2_exponent(c * T.float32(fmt_rcp)))
    elif e4m3_sf:
        return T.ieee_fdiv(T.float32(1.0), T.cast(e4m3_scale(c, fmt_max), "float32"))
    else:
        return T.ieee_fdiv(T.float32(fmt_max), c)


@T.macro
def group_scale(amax_bits, clamp_min_bits, fmt_max, fmt_rcp, round_sf, e4m3_sf, packed_ue8m0):
    """The stored scale of a group: fp32 ``c/max`` or ``2^e``, e4m3 ``sf8``, or the UE8M0 byte."""
    c = clamped_amax(amax_bits, clamp_min_bits)
    if round_sf:
        if packed_ue8m0:
            return T.cast(ceil_log2_exponent(c * T.float32(fmt_rcp)) + 127, "uint8")
        else:
            return pow2(ceil_log2_exponent(c * T.float32(fmt_rcp)))
    elif e4m3_sf:
        return e4m3_scale(c, fmt_max)
    else:
        return T.ieee_fdiv(c, T.float32(fmt_max))


NONFINITE_KEY = 255  # the lossless key of a non-finite input scale (UE8M0's "no value" byte)


MANTISSA_MASK = 0x7FFFFF
MAGNITUDE_MASK = 0x7FFFFFFF
SUBNORMAL_HALF = 0x400000
"""A subnormal mantissa above 2^22 is a scale above 2^-127: ceil(log2 s) = -126."""


def ue8m0_byte(scale):
    """The UE8M0 byte (uint32 in [0, 255]) of fp32 ``scale``, from its bit pattern ``b``
    (exponent field ``E``, mantissa ``m``): ``E + (m ≠ 0)`` for a normal positive scale
    (``ceil(log2 s) + 127``; 254 with ``m ≠ 0`` gives 255, the marker of a scale above 2^127);
    for a subnormal one 1 when ``m > 2^22`` (its ``ceil(log2 s)`` is −126) else 0 (clamped at
    −127, zero of either sign too); 0xFF for a NaN, an infinity or a negative nonzero scale.
    This is ``e + 127`` of core's ``given_scale_exponent`` (``transpose_weight_sf``'s byte, and
    the key of a lossless re-blocking)."""
    bits = T.reinterpret(scale, "uint32")
    magnitude = bits & T.uint32(MAGNITUDE_MASK)
    exponent = T.shift_right(magnitude, T.uint32(23))
    mantissa = magnitude & T.uint32(MANTISSA_MASK)
    normal = exponent + T.if_then_else(mantissa != T.uint32(0), T.uint32(1), T.uint32(0))
    subnormal = T.if_then_else(mantissa > T.uint32(SUBNORMAL_HALF), T.uint32(1), T.uint32(0))
    invalid = T.Or(magnitude >= T.uint32(F32_INF_BITS), T.And(bits != magnitude, magnitude != T.uint32(0)))
    return T.if_then_else(invalid, T.uint32(NONFINITE_KEY), T.if_then_else(exponent > T.uint32(0), normal, subnormal))


def lossless_key(scale):
    """The key of an element in a lossless re-blocking: its input scale's UE8M0 byte
    (:func:`ue8m0_byte`) as int32, 0..255. Keys order as the exponents do, so a group's largest
    key is its largest exponent (and 255, a scale that is not finite, wins)."""
    return T.cast(ue8m0_byte(scale), "int32")


@T.macro
def lossless_inverse(key):
    """The factor of a lossless output group with largest input key ``key``: ``2^-e``,
    ``e = max(key - 127 - 6, -127)``; 0 for a non-finite group."""
    return T.if_then_else(key == NONFINITE_KEY, T.float32(0.0),
                          pow2(127 + LOSSLESS_HEADROOM - T.max(key, LOSSLESS_HEADROOM)))


@T.macro
def lossless_scale(key, packed_ue8m0):
    """The stored scale of that group: the UE8M0 byte ``e + 127`` (255 when non-finite), or
    fp32 ``2^e`` (+inf when non-finite; ``2^-127`` is the subnormal 0x00400000)."""
    if packed_ue8m0:
        return T.cast(T.if_then_else(key == NONFINITE_KEY, NONFINITE_KEY, T.max(key, LOSSLESS_HEADROOM)
                                     - LOSSLESS_HEADROOM), "uint8")
    else:
        return pow2(T.if_then_else(key == NONFINITE_KEY, NONFINITE_EXPONENT,
                                   T.max(key, LOSSLESS_HEADROOM) - 127 - LOSSLESS_HEADROOM))


@T.macro
def ue8m0_value(byte):
    """fp32 value of a UE8M0 byte ``b`` (int32 0..255): ``2^(b-127)``, 0xFF → NaN."""
    return T.if_then_else(byte == 255, T.reinterpret(T.int32(F32_NAN_BITS), "float32"), pow2(byte - 127))


@T.macro
def e2m1_value(code):
    """fp32 value of an e2m1 nibble ``code`` (int32 0..15); code 8 is -0.0. Built from bits,
    no int-to-float conversion: for a magnitude code ``m = 2e + f`` >= 2 (exponent field e >= 1)
    the fp32 pattern is ``(e + 126) << 23 | f << 22 = (m + 252) << 22``; m = 1 is 0.5, m = 0 zero;
    the sign is bit 3 moved to bit 31."""
    m = code & 7
    magnitude = T.if_then_else(m >= 2, T.shift_left(m + 252, 22), T.if_then_else(m == 1, 0x3F000000, 0))
    return T.reinterpret(magnitude | T.shift_left(code & 8, 28), "float32")


TWO_POW_23 = 8388608.0
"""2^23: adding it to a value in [0, 2^23) rounds the value to an integer (ties to even), which
then sits in the low mantissa bits of the sum."""


@T.macro
def e2m1_rounded(y):
    """int32 whose low 4 bits are the e2m1 code of fp32 ``y`` (SPEC §1) and whose bits 4–7 are
    zero (the bits above are not): sign bit 3 = signbit(y), magnitude ``a = min(|y|, 6)``
    (``fminf``: NaN and inf count as 6), ties to the even code.

    The code of ``a`` is ``rint(2a)`` below 2, ``rint(a) + 2`` in [2, 4) and ``rint(a/2) + 4``
    from 4 up (the reference's three branches), and it is also the *smallest* of the three
    for every ``a`` in [0, 6], so no compare or select is needed. Each candidate comes from
    one fused multiply-add ``a·s + (2^23 + offset)``: the product is exact (``s`` is a power of
    two) and the add rounds it to an integer, ties to even (the offsets are even, so adding
    them keeps the parity). The three sums lie in [2^23, 2^23 + 8), where fp32 order is int32
    order, so one 3-input integer min picks the code, which is the sum's low 3 bits (bit 3
    is clear, so the sign is OR-ed in without masking the rest). Per element that is 3
    FMA-pipe and 4 ALU instructions in the SASS (sm_90), where compare-and-select rounding on
    the bits took about 12, nearly all ALU (the e2m1 cast was ALU-bound on an H200, ncu
    2026-12-02). Checked equal to the reference encoding for all 2^32 fp32 bit patterns
    (tests/test_e2m1_encoder_identity.py re-checks the identity on the CPU).
    """
    a = T.min(T.abs(y), T.float32(6.0))
    twice = T.reinterpret(a * T.float32(2.0) + T.float32(TWO_POW_23), "int32")
    once = T.reinterpret(a + T.float32(TWO_POW_23 + 2.0), "int32")
    half = T.reinterpret(a * T.float32(0.5) + T.float32(TWO_POW_23 + 4.0), "int32")
    return T.min(T.min(twice, once), half) | (T.shift_right(T.reinterpret(y, "int32"), 28) & 8)


def e2m1_code_pair(low, high):
    """The int8 holding e2m1 codes ``low`` (bits 0–3) and ``high`` (bits 4–7), each an int32 / uint32 whose low
    4 bits are the code (bits above them dropped by the int8)."""
    # unsigned: the bits above 7 wrap (a signed overflow would be undefined in C++)
    return T.cast(T.cast(low, "uint32") + T.cast(high, "uint32") * T.uint32(16), "int8")


@T.macro
def e2m1_pair(low, high):
    """The int8 holding the e2m1 codes of fp32 ``low`` (bits 0–3) and ``high`` (bits 4–7)."""
    return e2m1_code_pair(e2m1_rounded(low), e2m1_rounded(high))
