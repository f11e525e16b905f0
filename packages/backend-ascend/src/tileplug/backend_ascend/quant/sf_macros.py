"""The quant family's scale-factor and quantize macros (SPEC §1-2), shared by the quant tile
kernel and every fused kernel that ends in a cast (``rms_norm_per_token_cast``).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

:func:`sf_macros` specialises them on the cast's constants. amax is taken on the integer
bits of ``|x|`` (for non-negative floats integer order is float order, and NaN bits exceed
+inf), so NaN and inf propagate into the group scale whatever the float max unit does with
NaN; the clamp is an integer max too. Plain scales are two correctly rounded divisions;
power-of-two scales are built from exponent bits (a non-finite scale gets e = 128: byte
0xFF, sf = +inf, inv = 0). The e4m3 clamp to +-448 is a compare-and-select (NaN stays NaN),
then a saturating RNE convert; e2m1 codes are built arithmetically (the convert unit has no
f32->fp4).
"""

import struct
from types import SimpleNamespace

import tilelang.ascend.language as T
from tvm import tirx

from tileplug.backend_ascend.quant.stochastic_cast import CODE_GRIDS, grid_codes, store_codes
from tileplug.backend_ascend.quant.transpose_weight_sf import (EXPONENT_SHIFT, NONFINITE_BYTE, SMALLEST_SCALE_PATTERN,
                                                               ue8m0_bytes)
from tileplug.backend_ascend.random.vector_ops import VECTOR
from tileplug.backend_ascend.ub import LANES
from tileplug.core.quant.formats import QUANT_FORMATS
from tileplug.core.quant.sf_math import LOSSLESS_HEADROOM


def f32_value(value: float) -> float:
    """``value`` rounded to fp32 (as a Python float)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def f32_bits(value: float) -> int:
    """The int32 bits of ``value`` rounded to fp32."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


@T.macro
def lane_mask(lo, hi):
    """Predicate of lanes ``[lo, hi)`` of a 32-bit register (one small group of it)."""
    if lo == 0:
        return T.simd.update_mask(hi, 32)
    else:
        full = T.simd.pset(32, "PAT_ALL")
        return T.simd.pxor(T.simd.update_mask(hi, 32), T.simd.update_mask(lo, 32), full)


def subgroups(lanes: int, group: int) -> list:
    """``(lo, hi)`` lane ranges of the groups of ``group`` lanes in a register of ``lanes``."""
    return [(lo, min(lo + group, lanes)) for lo in range(0, lanes, group)]


def lossless_group_scales(ops, largest_key):
    """The scales of lossless output groups (docs/spec.md §11) from their largest input key
    ``E(s) + 127`` (a ``uint32`` register, lanes 0..255, 255 = a scale not finite): ``(sf patterns,
    inv patterns, biased exponents)``, ``uint32`` registers. Biased exponent ``eb = max(key, 6) - 6``
    (``e_out + 127`` with ``e_out = max(e_max - 6, -127)``), 255 when not finite; ``sf = 2^(eb - 127)``
    (byte 0 is the subnormal ``2^-127``, 255 is +inf's pattern); ``inv = 2^(127 - eb)`` (at most
    ``2^127``, a normal), 0 when not finite. Plain Python over ``ops``
    (:mod:`~tileplug.backend_ascend.random.vector_ops`), so the tests run it on numpy."""
    nonfinite = ops.above(largest_key, NONFINITE_BYTE - 1, "nonfinite_group")
    floored = ops.max_word(largest_key, LOSSLESS_HEADROOM, "key_at_least_headroom")
    finite_exponent = ops.add_word(floored, (1 << 32) - LOSSLESS_HEADROOM, "finite_biased_exponent")
    biased = ops.select(nonfinite, ops.splat(NONFINITE_BYTE, "nonfinite_byte"), finite_exponent, "biased_exponent")
    sf = ops.max_word(ops.shift_left(biased, EXPONENT_SHIFT, "sf_exponent_field"), SMALLEST_SCALE_PATTERN,
                      "sf_pattern")
    inverse_exponent = ops.sub(ops.splat(2 * 127, "inverse_bias"), biased, "inverse_biased_exponent")
    inverse = ops.select(nonfinite, ops.splat(0, "zero_inverse"),
                         ops.shift_left(inverse_exponent, EXPONENT_SHIFT, "inverse_exponent_field"), "inv_pattern")
    return sf, inverse, biased


def sf_macros(fmt, round_sf: bool, clamp_min: float, packed: bool, writes_sf: bool, lossless: bool = False,
              e4m3_sf: bool = False):
    """The macros of one cast configuration: ``abs_bits(v, lanes)`` (int32 bits of ``|v|``,
    lanes past ``lanes`` zero), ``scale_math(amax_bits)`` -> ``(sf, inv, biased exponent)``,
    ``store_group_sf(sf, eb, sf_ub, e_ub, gi)``, ``group_inv(amax_bits, sf_ub, e_ub, gi)`` (a
    group's scales stored, ``inv`` broadcast) and ``store_quantized(q_ub, code_ub, at, y)``
    (``y = x · inv`` saturated to ``fmt`` and stored at index ``at``: e4m3 bytes, or e2m1
    codes one per byte, packed later). Fake quant: ``group_scales(amax_bits)`` -> ``(sf, inv)``
    broadcast, nothing stored, and ``dequantized(y, sf)``: ``float(q) · sf`` in fp32 for the code
    ``q`` that ``store_quantized`` gives ``y``. ``e4m3_sf`` (fake quant only): the scale is
    ``amax / fmax`` rounded to e4m3 (a non-finite one to NaN), ``inv = 1 / sf``.

    ``lossless`` (``per_block_cast_lossless``, docs/spec.md §11): what is reduced is not
    ``abs_bits`` of the values but ``scale_keys(s, lanes)`` of their input scales ``s``, the UE8M0
    byte ``E(s) + 127`` (0..254, 255 = not finite; :func:`~.transpose_weight_sf.ue8m0_bytes`, the
    byte rule of ``transpose_weight_sf``), and ``scale_math`` takes the group's largest key
    (:func:`lossless_group_scales`: biased exponent ``eb = max(key - 6, 0)``, 255 when not finite;
    ``sf = 2^(eb - 127)`` (+inf), ``inv = 2^(127 - eb)`` (0)). The integer max of the keys is the
    same instruction as the amax's (pad lanes give key 0, the floor anyway)."""
    f32 = T.float32
    fmax = QUANT_FORMATS[fmt].max_value if fmt is not None else 1.0
    rcp = f32_value(1.0 / f32_value(fmax))
    clamp_bits = f32_bits(f32_value(clamp_min))

    @T.macro
    def abs_bits(v, lanes):
        keep = T.simd.vdup(T.int32(0x7FFFFFFF), "int32")
        if lanes < LANES:
            return T.simd.vand(tirx.reinterpret("int32x64", v), keep, T.simd.update_mask(lanes, 32))
        else:
            return T.simd.vand(tirx.reinterpret("int32x64", v), keep)

    @T.macro
    def scale_keys(s, lanes):
        # s: fp32 input scales -> int32 keys E(s) + 127 (255: not finite), lanes past ``lanes`` zero
        keys = tirx.reinterpret("int32x64", ue8m0_bytes(VECTOR, VECTOR.float_bits(s, "input_scale_bits")))
        if lanes < LANES:
            return T.simd.vand(keys, T.simd.vdup(T.int32(NONFINITE_BYTE), "int32"), T.simd.update_mask(lanes, 32))
        else:
            return keys

    @T.macro
    def lossless_scale_math(key):
        # key: int32 largest E(s) + 127 of a group (0..255). Returns (sf, inv, biased exponent).
        sf_bits, inv_bits, eb = lossless_group_scales(VECTOR, tirx.reinterpret("uint32x64", key))
        return (tirx.reinterpret("float32x64", sf_bits), tirx.reinterpret("float32x64", inv_bits),
                tirx.reinterpret("int32x64", eb))

    @T.macro
    def amax_scale_math(amax_bits):
        # amax_bits: int32 bits of the group amax (>= 0, NaN bits above +inf). Returns
        # (sf as fp32, inv, biased exponent) elementwise.
        c = tirx.reinterpret("float32x64", T.simd.vmaxs(amax_bits, T.int32(clamp_bits)))
        if round_sf:
            s = T.simd.vmuls(c, f32(rcp))
            sb = tirx.reinterpret("int32x64", s)
            expo = T.simd.vand(sb, T.simd.vdup(T.int32(0x7F800000), "int32"))
            nonfinite = T.simd.vcmps(expo, T.int32(0x7F800000), op="eq")
            e0 = T.simd.vadds(T.simd.vshrs(T.simd.vadds(sb, T.int32(-1)), T.int32(23)), T.int32(1 - 127))
            e = T.simd.vsel(T.simd.vdup(T.int32(128), "int32"), e0, nonfinite)
            eb = T.simd.vadds(e, T.int32(127))
            sf = tirx.reinterpret("float32x64", T.simd.vshls(eb, T.int32(23)))
            inv_b = T.simd.vshls(T.simd.vsub(T.simd.vdup(T.int32(127), "int32"), e), T.int32(23))
            inv = T.simd.vsel(T.simd.vdup(f32(0.0), "float32"), tirx.reinterpret("float32x64", inv_b), nonfinite)
            return sf, inv, eb
        elif e4m3_sf:
            ratio = T.simd.vdiv(c, T.simd.vdup(f32(fmax), "float32"), precision="vdiv_0ulp_ftz_true")
            # (ratio >= 0: its bits at or above +inf's are inf / NaN, stored as e4m3 NaN)
            nonfinite = T.simd.vcmps(tirx.reinterpret("int32x64", ratio), T.int32(0x7F800000), op="ge")
            nan = tirx.reinterpret("float32x64", T.simd.vdup(T.int32(0x7FC00000), "int32"))
            ratio = T.simd.vsel(nan, T.simd.vmins(ratio, f32(448.0)), nonfinite)
            stored = T.simd.vcvt(ratio, "float8_e4m3fn", round="ROUND_R", sat=True, part=0)
            sf = T.simd.vcvt(stored, "float32", part=0)
            inv = T.simd.vdiv(T.simd.vdup(f32(1.0), "float32"), sf, precision="vdiv_0ulp_ftz_true")
            return sf, inv, sf
        else:
            mx = T.simd.vdup(f32(fmax), "float32")
            sf = T.simd.vdiv(c, mx, precision="vdiv_0ulp_ftz_true")
            inv = T.simd.vdiv(mx, c, precision="vdiv_0ulp_ftz_true")
            return sf, inv, sf

    scale_math = lossless_scale_math if lossless else amax_scale_math

    @T.macro
    def store_group_sf(sf, eb, sf_ub, e_ub, gi):
        # one group's scale (lane 0) into the tile's sf row
        if packed:
            T.simd.vsts(e_ub[gi], eb, dist="ONEPT_B32")
        else:
            T.simd.vsts(sf_ub[gi], sf, dist="ONEPT_B32")

    @T.macro
    def group_inv(amax_bits, sf_ub, e_ub, gi):
        # amax over the group -> lane 0 -> scales -> inv broadcast to every lane
        sf, inv, eb = scale_math(T.simd.vcmax(amax_bits))
        if writes_sf:
            store_group_sf(sf, eb, sf_ub, e_ub, gi)
        return T.simd.vdupv(inv)

    @T.macro
    def e4m3_clamped(y):
        # y clamped to +-448 by compare-and-select (NaN stays NaN), for the saturating convert
        hi = T.simd.vsel(T.simd.vdup(f32(fmax), "float32"), y, T.simd.vcmps(y, f32(fmax), op="gt"))
        return T.simd.vsel(T.simd.vdup(f32(-fmax), "float32"), hi, T.simd.vcmps(hi, f32(-fmax), op="lt"))

    @T.macro
    def e2m1_scaled(y):
        # |y| saturated to 6 (NaN -> 6) in units of its e2m1 step: (2|y| below 2, |y| below 4,
        # |y| / 2 above; an integer once rounded), and the masks |y| < 2, |y| < 4
        m = T.simd.vabs(y)
        six = T.simd.vdup(f32(fmax), "float32")
        m = T.simd.vsel(six, T.simd.vmins(m, f32(fmax)), T.simd.vcmp(m, m, op="ne"))
        lt2 = T.simd.vcmps(m, f32(2.0), op="lt")
        lt4 = T.simd.vcmps(m, f32(4.0), op="lt")
        scaled = T.simd.vsel(T.simd.vmuls(m, f32(2.0)), T.simd.vsel(m, T.simd.vmuls(m, f32(0.5)), lt4), lt2)
        return scaled, lt2, lt4

    @T.macro
    def store_quantized(q_ub, code_ub, at, y):
        if fmt == "e4m3":
            lo = e4m3_clamped(y)
            T.simd.vsts(q_ub[at], T.simd.vcvt(lo, "float8_e4m3fn", round="ROUND_R", sat=True), dist="PK4_B32")
        else:
            scaled, lt2, lt4 = e2m1_scaled(y)
            base = T.simd.vsel(
                T.simd.vdup(T.int32(0), "int32"),
                T.simd.vsel(T.simd.vdup(T.int32(2), "int32"), T.simd.vdup(T.int32(4), "int32"), lt4),
                lt2,
            )
            mag = T.simd.vadd(T.simd.vcvt(scaled, "int32", round="ROUND_R", sat=True), base)
            sign = T.simd.vand(
                T.simd.vshrs(tirx.reinterpret("int32x64", y), T.int32(28)), T.simd.vdup(T.int32(8), "int32")
            )
            T.simd.vsts(code_ub[at], T.simd.vcvt(T.simd.vor(mag, sign), "uint8", sat=True), dist="PK4_B32")

    @T.macro
    def group_scales(amax_bits):
        # fake quant: amax over the group -> lane 0 -> (sf, inv) broadcast to every lane
        sf, inv, eb = scale_math(T.simd.vcmax(amax_bits))
        return T.simd.vdupv(sf), T.simd.vdupv(inv)

    @T.macro
    def dequantized(y, sf):
        # fake quant: float(q) * sf in fp32, q the code store_quantized gives y
        if fmt == "e4m3":
            code = T.simd.vcvt(e4m3_clamped(y), "float8_e4m3fn", round="ROUND_R", sat=True, part=0)
            return T.simd.vmul(T.simd.vcvt(code, "float32", part=0), sf)
        else:
            # the code's magnitude is its rounded step count times the step (0.5, 1, 2), exact in
            # fp32; the sign is y's sign bit (code 8 is -0.0, a NaN keeps its sign on 6)
            scaled, lt2, lt4 = e2m1_scaled(y)
            steps = T.simd.vcvt(T.simd.vcvt(scaled, "int32", round="ROUND_R", sat=True), "float32")
            step = T.simd.vsel(T.simd.vdup(f32(0.5), "float32"),
                               T.simd.vsel(T.simd.vdup(f32(1.0), "float32"), T.simd.vdup(f32(2.0), "float32"), lt4),
                               lt2)
            sign = T.simd.vand(tirx.reinterpret("int32x64", y), T.simd.vdup(T.int32(-0x80000000), "int32"))
            magnitude = tirx.reinterpret("int32x64", T.simd.vmul(steps, step))
            return T.simd.vmul(tirx.reinterpret("float32x64", T.simd.vor(magnitude, sign)), sf)

    return SimpleNamespace(abs_bits=abs_bits, scale_keys=scale_keys, scale_math=scale_math,
                           store_group_sf=store_group_sf, group_inv=group_inv, store_quantized=store_quantized,
                           group_scales=group_scales, dequantized=dequantized)


def stochastic_store(fmt: str):
    """The stochastic narrowing of the casts with ``stochastic_rounding=True`` (docs/spec.md §10.2):
    the macro ``store(q_ub, code_ub, at, y, bits_ub)`` rounds ``y = x · inv`` onto ``fmt``'s grid
    with the random bits at ``bits_ub[at]`` (each element's 8-bit field ``f`` as ``f << 16``, the
    rounding's 24-bit fixed point, :func:`~.tile_kernel.group_random_bits`; uint32 held as int32)
    -- the integer rounding of ``stochastic_cast`` (:func:`~.stochastic_cast.grid_codes`), saturating, sign kept,
    NaN as the deterministic encoder of :func:`sf_macros` gives it (e4m3 0x7F, e2m1 6's code) --
    and stores the codes where :func:`sf_macros`' ``store_quantized`` does: e4m3 bytes at
    ``q_ub[at]``, e2m1 codes one per byte at ``code_ub[at]`` (packed later). The codes are the
    deterministic encoder's codes of the exact grid values, so no conversion instruction decides a
    rounding."""
    grid = CODE_GRIDS[fmt]()

    @T.macro
    def store(q_ub, code_ub, at, y, bits_ub):
        patterns = VECTOR.float_bits(y, "scaled_pattern")
        bits = VECTOR.bind(tirx.reinterpret("uint32x64", T.simd.vld(bits_ub[at])), "random_bits")
        codes = grid_codes(VECTOR, patterns, bits, grid)
        if fmt == "e4m3":
            store_codes(q_ub, at, codes, "float8_e4m3fn")
        else:
            T.simd.vsts(code_ub[at], T.simd.vcvt(codes, "uint8", sat=True, part=0), dist="PK4_B32")

    return store


def pack_macro(rows: int, width: int, groups: int, pack_codes: bool, pack_exponents: bool, per_channel: bool):
    """The SIMT pack after a tile's SIMD cast: the macro ``pack(q_ub, code_ub, e_ub, sfp_ub)``.

    ``pack_codes``: the e2m1 codes ``code_ub`` ``[rows, width]`` (one per byte) become nibble
    pairs in ``q_ub`` ``[rows, width / 2]`` (element ``2i`` in the low nibble). ``pack_exponents``:
    the biased UE8M0 exponents in ``e_ub`` (int32) become bytes packed two per int16 in
    ``sfp_ub``: ``e_ub`` ``[groups]`` of one tile row, consecutive groups paired (a missing
    last partner is 0), or with ``per_channel`` ``e_ub`` ``[2, width]``, the two row groups of
    each column paired."""

    @T.macro
    def pack(q_ub, code_ub, e_ub, sfp_ub):
        with T.SimtVF(threads=128):
            if pack_codes:
                for i in T.Parallel(rows * (width // 2), coalesced_width=T.int32(1)):
                    r = i // (width // 2)
                    p = i % (width // 2)
                    q_ub[r, p] = T.Cast("int8", code_ub[r, 2 * p] | (code_ub[r, 2 * p + 1] << T.uint8(4)))
            if pack_exponents:
                if per_channel:
                    for k in T.Parallel(width, coalesced_width=T.int32(1)):
                        sfp_ub[k] = T.Cast("int16", (e_ub[0, k] & 0xFF) | ((e_ub[1, k] & 0xFF) << 8))
                else:
                    for p in T.Parallel((groups + 1) // 2, coalesced_width=T.int32(1)):
                        hi = T.if_then_else(2 * p + 1 < groups, e_ub[2 * p + 1], 0)
                        sfp_ub[p] = T.Cast("int16", (e_ub[2 * p] & 0xFF) | ((hi & 0xFF) << 8))

    return pack
