"""Ascend kernel of ``stochastic_cast`` (docs/spec.md §10.2): ``x`` (fp32 → bf16 or e4m3, bf16 →
e4m3) narrowed with stochastic rounding under the Philox draw of ``(seed, offset)``; then
``offset += 1``. Element ``i`` (row-major) takes a field of ``w`` random bits (:data:`FIELD_BITS`,
core's ``RANDOM_FIELD_BITS``: 16 for fp32 → bf16, 8 for fp32 → e4m3 and bf16 → e4m3): field
``i mod k`` of word ``i // k`` (``k = 32 / w`` fields a word, counted from its top; word ``j`` of
the draw is the word ``fill_rand`` gives element ``j``), and rounds with it shifted up to 24 bits,
``r_i = f_i · 2^(24 − w)`` (at ``w = 24``: ``word_i >> 8``), so one 24-bit rounding serves every
pair.

The draw kernel's machinery (:mod:`tileplug.backend_ascend.random.draw`): the same tiles of 4096
elements over the vector cores, the same state words DMA'd from the device tensors, the same Philox
rounds and word interleave, the same ``offset += 1`` queued on the stream after the launch. What
differs: each tile of ``x`` is DMA'd in (double-buffered, as the output tile), a group of 64 Philox
blocks (256 words) serves ``256·k`` elements (a tile of 4096 is ``16 / k`` groups, tile ``t``
starting at block ``t · 1024 / k``), and the fields round the tile's values (:func:`round_group`)
instead of becoming values. Per group (:func:`element_bits`): the four word registers (lane =
block) are interleaved into word order (``philox.element_order``: register ``m`` holds words
``64m .. 64m + 63``); each is split into its ``k`` field registers (:func:`word_fields`: a shift,
none for a field already in place, and a mask each, ``f_s`` of lane ``j`` = field ``s`` of word
``j`` at bits ``[24 − w, 24)``), and
those are interleaved (:func:`field_order`: one ``vintlv`` for ``k = 2``, the four of
``element_order`` for ``k = 4``) into ``k`` registers of consecutive elements, ``64k·m ..
64k·m + 64k − 1``, which line up with the loaded registers of ``x`` at the same index. So the
Philox rounds run once per ``k`` elements: per element 1/8 block for fp32 → bf16, 1/16 for fp32 →
e4m3 and bf16 → e4m3.

The rounding is integer work on the fp32 bit patterns (a bf16 ``x`` widened exactly: its 16 bits
shifted up), plain Python over ``ops`` (:mod:`~tileplug.backend_ascend.random.vector_ops`; the tests
run the same functions on numpy), and the results are stored as bit patterns / codes, so no
conversion instruction decides a rounding, a saturation or a NaN:

* **bf16** (:func:`bf16_patterns`): ``up = ((p & 0xFFFF) << 8) + r ≥ 2^24``, i.e. bit 24 of the
  sum; the result is ``(p >> 16) + up`` (the carry reaches the sign only from a NaN pattern) and a
  NaN becomes the quiet ``(p >> 16) | 0x40``.
* **e4m3** (:func:`e4m3_codes`): ``a = min(|p|, bits(448))`` as unsigned integers (non-negative
  patterns order as their values; a NaN is set aside first); ``E = max(a >> 23, 121)`` the biased
  exponent, e4m3's subnormals taking the smallest normal's (``2^-6``); ``s = a · 2^(130 − E)``
  (an exact product by a power of two built from exponent bits; ``[8, 16)`` for a normal value,
  ``[0, 8)`` below ``2^-6``); ``n = trunc(s)``, ``f = trunc((s − n) · 2^24)`` (both exact); the code
  is ``(E − 121) · 8 + n + ((f + r) >> 24)`` — one integer per e4m3 step, ``n + up = 16`` carrying
  into the next binade — with the sign byte or-ed on and ``0x7F`` for a NaN. ``f`` truncates
  ``(a − lo) / (hi − lo)`` to 24 fractional bits, as the reference does in fp64, and an fp32 value
  flushed to zero by ``vmul`` would have had ``f = 0`` anyway (below ``2^-33`` it is 0).
  The same integer rounding is :func:`grid_codes` over a :class:`CodeGrid` (the format's largest
  value, smallest normal exponent, mantissa bits, NaN code, sign bit): e4m3 here, and e2m1 too for
  the stochastic per-token / per-block casts of the quant tile kernel (``E = max(a >> 23, 127)``,
  ``s = a · 2^(128 − E)``, code ``(E − 127) · 2 + n + up``, NaN → 7, the sign as bit 3), which take
  their fields from :func:`element_bits` too (``w = 8``, core's ``QUANT_RANDOM_FIELD_BITS``).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

Served: the three pairs, any element count up to :data:`~tileplug.backend_ascend.random.draw.MAX_ELEMENTS`
(int32 index arithmetic, as the draw); larger casts fall to the reference.
"""

import struct
from dataclasses import dataclass
from typing import ClassVar

import tilelang.ascend.language as T
from tvm import tirx

from tileplug.backend_ascend.device import DeviceTarget, lowering_target
from tileplug.backend_ascend.random import draw, philox
from tileplug.backend_ascend.random.fill_rand import MANTISSA_SHIFT
from tileplug.backend_ascend.random.vector_ops import VECTOR
from tileplug.backend_ascend.ub import LANES, Plan, PlannedInSimdUb, VERSIONS
from tileplug.core.contracts.cast import RANDOM_FIELD_BITS
from tileplug.core.quant.formats import E2M1, E4M3

RANDOM_BITS = 32 - MANTISSA_SHIFT
"""The rounding's fixed point: an element's random field shifted up to 24 bits, added below the
target's last place (a 24-bit field, ``word >> 8``, as it is)."""
WORD_BITS = 32
MAGNITUDE_MASK = 0x7FFFFFFF
INF_PATTERN = 0x7F800000
"""Patterns of a magnitude above it are NaN."""
FP32_MANTISSA_BITS = 23
FP32_BIAS = 127
BF16_DROPPED_BITS = 16
"""fp32 → bf16 keeps the top 16 bits of the pattern."""
BF16_QUIET_BIT = 0x40
"""Or-ed into a NaN's top half: a quiet bf16 NaN, sign kept."""
E4M3_MAX_PATTERN = struct.unpack("<I", struct.pack("<f", E4M3.max_value))[0]
"""The fp32 pattern of 448, e4m3's largest finite value (the saturation)."""
E4M3_MIN_EXPONENT = -6
"""e4m3's smallest normal exponent: its subnormals are steps of ``2^(-6 - 3)``."""
E4M3_MANTISSA_BITS = 3
E4M3_MIN_BIASED = FP32_BIAS + E4M3_MIN_EXPONENT
"""The smallest fp32 biased exponent the e4m3 rounding uses (121)."""
E4M3_SIGN = 0x80
E4M3_NAN = 0x7F
E2M1_MAX_PATTERN = struct.unpack("<I", struct.pack("<f", E2M1.max_value))[0]
"""The fp32 pattern of 6, e2m1's largest value."""
E2M1_MIN_BIASED = FP32_BIAS
"""e2m1's smallest normal value is 1 (its one subnormal step is 0.5)."""
E2M1_MANTISSA_BITS = 1
E2M1_SIGN = 0x8
E2M1_NAN = 0x7
"""What the deterministic e2m1 encoder gives a NaN's magnitude: 6's code (the sign kept)."""


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (TileLang's name of the dtype)."""
    return str(dtype).removeprefix("torch.")


FIELD_BITS = {(dtype_name(source), dtype_name(target)): bits for (source, target), bits in RANDOM_FIELD_BITS.items()}
"""``(source, target)`` dtype names → ``w``, the random bits each element takes (core's
``RANDOM_FIELD_BITS``)."""
PAIRS = tuple(FIELD_BITS)
"""``(source, target)`` dtype names the kernel serves."""


def word_fields(ops, words, field_bits: int) -> tuple:
    """A register of words (lane ``j``: word ``j``) → its ``k = 32 / field_bits`` field registers:
    register ``s`` holds, in lane ``j``, field ``s`` of word ``j`` (counted from the top: bits
    ``[32 − w·(s + 1), 32 − w·s)``) moved to bits ``[24 − w, 24)``, i.e. ``f · 2^(24 − w)``: a shift
    by ``8 − w·s`` (right when positive, left when negative, none at 0: field 1 of ``w = 8``) and a
    mask."""
    fields = []
    mask = ((1 << field_bits) - 1) << (RANDOM_BITS - field_bits)
    for index in range(WORD_BITS // field_bits):
        shift = MANTISSA_SHIFT - field_bits * index  # the field's lowest bit 32 − w·(s + 1) onto 24 − w
        if shift > 0:
            moved = ops.shift_right(words, shift, f"field{index}_moved")
        elif shift < 0:
            moved = ops.shift_left(words, -shift, f"field{index}_moved")
        else:
            moved = words
        fields.append(ops.and_word(moved, mask, f"field{index}"))
    return tuple(fields)


def field_order(ops, fields) -> tuple:
    """:func:`word_fields`' ``k`` registers of words ``j0 .. j0 + 63`` → ``k`` registers of their
    ``64k`` elements in order (element ``k·j + s`` is field ``s`` of word ``j``): for ``k = 2`` one
    ``vintlv`` (``f0[j], f1[j]``), for ``k = 4`` the interleave that puts the four words of a
    Philox block in order (``f0[j], f1[j], f2[j], f3[j]``)."""
    if len(fields) == 1:
        return tuple(fields)
    if len(fields) == 2:
        return ops.interleave(fields[0], fields[1], "fields")
    return philox.element_order(ops, fields)


def element_bits(ops, words, field_bits: int):
    """The Philox words ``(r0, r1, r2, r3)`` of a group → the 24-bit ``r`` of its ``256·k``
    elements (``k = 32 / field_bits``), in element order: ``4k`` ``uint32`` registers of 64
    consecutive elements, yielded in order (a generator, so that the kernel emits each word
    register's fields just before the loads and roundings that use them). Serves this kernel's
    pairs and the stochastic per-token / per-block casts of the quant tile kernel (``field_bits``
    8: core's ``QUANT_RANDOM_FIELD_BITS``; ``quant/tile_kernel.py``'s ``group_random_bits``)."""
    for ordered in philox.element_order(ops, words):  # words 64m .. 64m + 63
        yield from field_order(ops, word_fields(ops, ordered, field_bits))


def bf16_patterns(ops, patterns, bits):
    """fp32 patterns (a ``uint32`` register) rounded to bf16 with the 24-bit ``bits`` → bf16
    patterns in the low 16 bits of each lane (a ``uint32`` register)."""
    magnitude = ops.and_word(patterns, MAGNITUDE_MASK, "magnitude")
    dropped = ops.and_word(patterns, (1 << BF16_DROPPED_BITS) - 1, "dropped")
    fraction = ops.shift_left(dropped, RANDOM_BITS - BF16_DROPPED_BITS, "fraction_bits")
    up = ops.shift_right(ops.add_words(fraction, bits, "fraction_sum"), RANDOM_BITS, "round_up")
    truncated = ops.shift_right(patterns, BF16_DROPPED_BITS, "truncated")
    rounded = ops.add_words(truncated, up, "rounded")  # the carry reaches the sign bit only from a NaN
    quiet = ops.or_word(truncated, BF16_QUIET_BIT, "quiet_nan")
    return ops.select(ops.above(magnitude, INF_PATTERN, "is_nan"), quiet, rounded, "bf16_pattern")


@dataclass(frozen=True)
class CodeGrid:
    """A quantized format whose non-negative finite values, ascending, are the codes ``0, 1, 2, ...``:
    ``2^mantissa_bits`` steps per binade from the smallest normal exponent up, as many equal steps
    below it (the subnormals), the largest value the saturation. e4m3 and e2m1 are such grids."""

    max_pattern: int
    """The fp32 pattern of the largest finite value (``|v|`` saturates at it)."""
    min_biased: int
    """The fp32 biased exponent of the smallest normal value."""
    mantissa_bits: int
    nan_code: int
    """The magnitude code of a NaN."""
    sign_bit: int
    """The code's sign bit (a power of two)."""

    @property
    def scale_biased(self) -> int:
        """``2^(mantissa_bits − e)`` has the biased exponent ``scale_biased − E`` (``E = e + 127``)."""
        return 2 * FP32_BIAS + self.mantissa_bits

    @property
    def sign_shift(self) -> int:
        """``(p >> sign_shift) & sign_bit``: the fp32 sign as the code's sign bit."""
        return 31 - (self.sign_bit.bit_length() - 1)


def e4m3_grid() -> CodeGrid:
    """e4m3 as a :class:`CodeGrid` (made from the module's constants when called)."""
    return CodeGrid(E4M3_MAX_PATTERN, E4M3_MIN_BIASED, E4M3_MANTISSA_BITS, E4M3_NAN, E4M3_SIGN)


def e2m1_grid() -> CodeGrid:
    """e2m1 (``0, 0.5, 1, 1.5, 2, 3, 4, 6``) as a :class:`CodeGrid`: the stochastic per-token /
    per-block casts' nibble codes."""
    return CodeGrid(E2M1_MAX_PATTERN, E2M1_MIN_BIASED, E2M1_MANTISSA_BITS, E2M1_NAN, E2M1_SIGN)


CODE_GRIDS = {"e4m3": e4m3_grid, "e2m1": e2m1_grid}
"""Quantized format name → its :class:`CodeGrid` (made when called)."""


def grid_steps(ops, patterns, grid: CodeGrid) -> tuple:
    """fp32 patterns (a ``uint32`` register) → ``(is_nan, exponent, scaled)``: the NaN lanes,
    ``E`` (the biased fp32 exponent of ``a = min(|p|, largest)``, at least ``grid.min_biased``) and
    ``s = a · 2^(scale_biased − E)`` (exact: ``[2^m, 2^(m+1))`` for a normal value, below it under
    the smallest normal binade), i.e. ``a`` counted in steps of its binade on ``grid``. Shared by
    the stochastic and the nearest rounding."""
    magnitude = ops.and_word(patterns, MAGNITUDE_MASK, "magnitude")
    is_nan = ops.above(magnitude, INF_PATTERN, "is_nan")  # before the min, which maps NaN to the largest value
    saturated = ops.min_word(magnitude, grid.max_pattern, "saturated")
    exponent = ops.max_word(ops.shift_right(saturated, FP32_MANTISSA_BITS, "biased_exponent"), grid.min_biased,
                            "step_exponent")
    factor = ops.shift_left(ops.sub(ops.splat(grid.scale_biased, "scale_bias"), exponent, "factor_exponent"),
                            FP32_MANTISSA_BITS, "factor_pattern")
    scaled = ops.mul(ops.bits_as_float(saturated, "a"), ops.bits_as_float(factor, "factor"), "scaled")
    return is_nan, exponent, scaled


def grid_code(ops, patterns, is_nan, exponent, steps, grid: CodeGrid):
    """The codes (low bits of each lane) of a rounded :func:`grid_steps`: ``steps`` the whole steps
    of ``s`` after rounding (``2^(m+1)`` carries into the next binade), the code
    ``(E − min_biased) · 2^m + steps`` with the pattern's sign bit or-ed on, ``grid.nan_code`` for a
    NaN lane."""
    binade = ops.shift_left(ops.sub(exponent, ops.splat(grid.min_biased, "min_exponent"), "binade"),
                            grid.mantissa_bits, "binade_code")
    code = ops.add_words(binade, steps, "magnitude_code")
    finite_or_nan = ops.select(is_nan, ops.splat(grid.nan_code, "nan_code"), code, "unsigned_code")
    sign = ops.and_word(ops.shift_right(patterns, grid.sign_shift, "top_bits"), grid.sign_bit, "sign_bit")
    return ops.or_words(finite_or_nan, sign, "grid_code")


def grid_codes(ops, patterns, bits, grid: CodeGrid):
    """fp32 patterns (a ``uint32`` register) rounded onto ``grid`` with the 24-bit ``bits``,
    saturating at its largest value → codes in the low bits of each lane (a ``uint32`` register):
    the magnitude code with the sign bit or-ed on, ``grid.nan_code`` for a NaN."""
    is_nan, exponent, scaled = grid_steps(ops, patterns, grid)
    whole = ops.truncate(scaled, "whole_steps")
    fraction = ops.sub(scaled, ops.to_float(whole, "whole_value"), "fraction")
    fraction_bits = ops.truncate(ops.scale(fraction, float(1 << RANDOM_BITS), "fraction_scaled"), "fraction_bits")
    up = ops.shift_right(ops.add_words(fraction_bits, bits, "fraction_sum"), RANDOM_BITS, "round_up")
    return grid_code(ops, patterns, is_nan, exponent, ops.add_words(whole, up, "rounded_steps"), grid)


def e4m3_steps(ops, patterns) -> tuple:
    """:func:`grid_steps` on e4m3 (``s = a · 2^(130 − E)``, ``E`` at least 121)."""
    return grid_steps(ops, patterns, e4m3_grid())


def e4m3_code(ops, patterns, is_nan, exponent, steps):
    """:func:`grid_code` on e4m3: ``(E − 121) · 8 + steps``, sign bit 0x80, NaN 0x7F."""
    return grid_code(ops, patterns, is_nan, exponent, steps, e4m3_grid())


def e4m3_codes(ops, patterns, bits):
    """fp32 patterns (a ``uint32`` register) rounded to e4m3 with the 24-bit ``bits``, saturating
    at ±448 → e4m3 codes in the low byte of each lane (a ``uint32`` register)."""
    return grid_codes(ops, patterns, bits, e4m3_grid())


ROUNDINGS = {"bfloat16": bf16_patterns, "float8_e4m3fn": e4m3_codes}
"""Target dtype → the rounding of a register of fp32 patterns."""


def source_patterns(ops, loaded, source: str):
    """A loaded register of ``x`` (a ``uint32`` register: fp32 patterns, or for bf16 the pattern in
    each lane's low 16 bits, the high half unspecified) → fp32 patterns (bf16 widens exactly)."""
    if source == "bfloat16":
        return ops.shift_left(loaded, BF16_DROPPED_BITS, "widened")
    return loaded


def round_group(ops, words, load, source: str, target: str):
    """One group: its Philox words (four registers, lane = block) and ``load(index)``, the loaded
    register ``index`` of its ``256·k`` elements (element order, ``4k`` registers) → yields
    ``(index, codes)``: the register of target patterns / codes of those 64 elements, in order,
    each rounded with its elements' fields (:func:`element_bits`; ``k`` by the pair's
    :data:`FIELD_BITS`). ``load`` is called once per register, just before its rounding."""
    rounding = ROUNDINGS[target]
    for index, bits in enumerate(element_bits(ops, words, FIELD_BITS[source, target])):
        yield index, rounding(ops, source_patterns(ops, load(index), source), bits)


# ---------------------------------------------------------------------- the kernel


@dataclass(frozen=True)
class ElementCastSpec(PlannedInSimdUb):
    """What an element-wise cast kernel over the draw's tiles is specialised on: the pair, the
    vector-core count, the tiles' buffer versions and width. The element count is dynamic.
    Subclasses name the op and whether it reads the generator state (``stochastic_cast`` here,
    ``nearest_cast`` in ``quant/nearest_cast.py``)."""

    source: str
    target: str
    vector_cores: int = 64
    num_buffers: int = VERSIONS
    tile: int = draw.TILE_ELEMENTS

    op: ClassVar[str]
    reads_state: ClassVar[bool]

    @property
    def elements_per_word(self) -> int:
        """``k``: the elements one Philox word serves (1 without state: then only the 256-element
        groups matter)."""
        return 1

    @property
    def elements_per_group(self) -> int:
        """The elements of one group of 64 Philox blocks: ``256·k``."""
        return philox.ELEMENTS_PER_GROUP * self.elements_per_word

    def plan(self) -> Plan:
        """``seed_ub`` / ``offset_ub`` the state words (read once; only when the op reads the
        state), ``x_ub`` one tile of ``x``, ``out_ub`` one tile of the result."""
        state = {
            "seed_ub": ((draw.STATE_WORDS,), "int32", 1),
            "offset_ub": ((draw.STATE_WORDS,), "int32", 1),
        } if self.reads_state else {}
        return {
            **state,
            "x_ub": ((self.tile,), self.source, self.num_buffers),
            "out_ub": ((self.tile,), self.target, self.num_buffers),
        }

    @property
    def layout(self) -> str:
        groups = f"{self.tile // self.elements_per_group} groups of " + (
            f"64 Philox blocks, {self.elements_per_word} element(s) a word" if self.reads_state
            else "256 elements")
        return f"tiles of {self.tile} elements ({groups}), tile t on vector core t % C, one per pipeline step"

    def describe(self) -> str:
        return f"{self.op} [N] {self.source} -> {self.target} tile={self.tile}"


@dataclass(frozen=True)
class StochasticCastSpec(ElementCastSpec):
    """The specialisation of ``stochastic_cast``: it reads the generator state."""

    op: ClassVar[str] = "stochastic_cast"
    reads_state: ClassVar[bool] = True

    @property
    def field_bits(self) -> int:
        """``w``: the random bits each element takes (:data:`FIELD_BITS`)."""
        return FIELD_BITS[self.source, self.target]

    @property
    def elements_per_word(self) -> int:
        """``k = 32 / w``: 2 for fp32 → bf16, 4 for fp32 → e4m3 and bf16 → e4m3."""
        return WORD_BITS // self.field_bits


def spec_of(call, target: DeviceTarget | None = None) -> StochasticCastSpec:
    """The specialisation of ``call`` (a ``StochasticCastCall``) on ``target``'s vector cores (None:
    the lowering stand-ins)."""
    cores = (target or lowering_target()).vector_cores
    return StochasticCastSpec(source=dtype_name(call.source), target=dtype_name(call.target), vector_cores=cores)


def decline_reason(call) -> str | None:
    """Why the kernel cannot serve ``call`` (None: it can): the draw's element limit, a pair
    outside the three (the contract refuses those; here for a call made by hand)."""
    if (dtype_name(call.source), dtype_name(call.target)) not in PAIRS:
        return f"{call.source} -> {call.target} is not a stochastic narrowing this kernel serves"
    return draw.decline_reason(call)



@T.macro
def load_patterns(x_ub, at, source):
    """Register ``at .. at + 63`` of the ``x`` tile as ``uint32`` lanes (bf16: the pattern in the
    low half of each lane, ``UNPK_B16``; e4m3: the code in the low byte, ``UNPK4_B8``; the other
    bits of the lane unspecified)."""
    if source == "bfloat16":
        return VECTOR.float_bits(T.simd.vld(x_ub[at], dist="UNPK_B16"), "loaded")
    elif source == "float8_e4m3fn":
        return VECTOR.float_bits(T.simd.vld(x_ub[at], dist="UNPK4_B8"), "loaded")
    else:
        return VECTOR.float_bits(T.simd.vld(x_ub[at]), "loaded")


@T.macro
def store_codes(out_ub, at, codes, target):
    """Store the low 16 bits (bf16) or the low byte (e4m3) of each lane of ``codes`` at
    ``out_ub[at ..]``: a narrowing ``vcvt`` of in-range integers, the bits reinterpreted as the
    target dtype, a packing store; fp32: the 32-bit patterns as they are."""
    if target == "float32":
        T.simd.vsts(out_ub[at], tirx.reinterpret("float32x64", codes))
    elif target == "bfloat16":
        narrow = T.simd.vcvt(codes, "uint16", sat=True, part=0)
        T.simd.vsts(out_ub[at], tirx.reinterpret("bfloat16x128", narrow), dist="PK_B32")
    else:
        narrow = T.simd.vcvt(codes, "uint8", sat=True, part=0)
        T.simd.vsts(out_ub[at], tirx.reinterpret("float8_e4m3fnx256", narrow), dist="PK4_B32")


def rounding_compute(spec: StochasticCastSpec):
    """The vector work of one tile (a macro, :func:`~tileplug.backend_ascend.random.draw.group_compute`):
    each group's words and its ``256·k`` values of ``x_ub`` (``at = 256·k·g``) through
    :func:`round_group`, register ``index`` loaded from and stored at ``at + 64·index``. Looked up
    by :func:`build` at trace time; tests/test_ascend_stochastic_cast_lowering.py replaces it with
    scalar code."""

    def store_group(buffers, at, words):
        def load(index):
            return load_patterns(buffers["x_ub"], at + index * LANES, spec.source)

        for index, codes in round_group(VECTOR, words, load, spec.source, spec.target):
            store_codes(buffers["out_ub"], at + index * LANES, codes, spec.target)

    return draw.group_compute(store_group, spec.elements_per_group)


def parameters(spec: StochasticCastSpec):
    """``(name, tensor type)`` of the GM tensors, in launch order: ``SEED`` and ``OFFSET`` the int32
    word views of the int64 ``[1]`` state, ``X`` the flat ``x`` ``[N]``, ``RESULT`` the flat result."""
    N = T.dynamic("N")
    return [
        ("SEED", T.Tensor((2,), "int32")),
        ("OFFSET", T.Tensor((2,), "int32")),
        ("X", T.Tensor((N,), spec.source)),
        ("RESULT", T.Tensor((N,), spec.target)),
    ], N


def build(spec: StochasticCastSpec):
    """The prim_func of ``spec`` (UB budget checked)."""
    params, N = parameters(spec)
    return draw.tile_kernel(spec, params, N, rounding_compute(spec), source=("X", "x_ub"), result="RESULT",
                            elements_per_word=spec.elements_per_word)


def arguments(spec: StochasticCastSpec, inputs, outputs) -> list:
    """Launch arguments: the int32 word views of seed and offset, the flat ``x`` and result."""
    import torch

    return [inputs.seed.view(torch.int32), inputs.offset.view(torch.int32), inputs.x.view(-1),
            inputs.result.view(-1)]


KERNEL = draw.advancing_kernel("stochastic_cast", spec_of, decline_reason, lambda spec: build(spec), arguments)
