"""Ascend kernel of ``nearest_cast`` (docs/spec.md §10.2): ``result = x`` converted with round to
nearest, ties to even, for every pair of fp32 / bf16 / float8_e4m3fn; an e4m3 result saturates at
±448 (an infinity too; only NaN gives NaN), widening and identity conversions are exact.

The machinery is the stochastic cast's (:mod:`~tileplug.backend_ascend.quant.stochastic_cast`),
itself the draw kernel's (:func:`tileplug.backend_ascend.random.draw.tile_kernel`): tiles of 4096
elements over the vector cores, each tile of ``x`` DMA'd in and the result DMA'd out
(double-buffered, the last tile cut at the element count), the same loads and packing stores. What
differs: no generator state is read (no ``SEED`` / ``OFFSET`` parameters, no Philox words, no
offset advance: the kernel object is a plain :class:`~tileplug.backend_ascend.kernel.SpecKernel`),
and each register of 64 elements is rounded to nearest instead of stochastically.

Every conversion is integer work on fp32 bit patterns, plain Python over ``ops``
(:mod:`~tileplug.backend_ascend.random.vector_ops`; the tests run the same functions on numpy),
and the results are stored as bit patterns / codes. TileLang's Ascend dialect documents ``vcvt``
to fp8 only as "``ROUND_R``, saturate on overflow": what it does with an infinity, a NaN or an fp32
denormal is not said, so no conversion instruction decides a rounding, a saturation or a NaN here:

* **widening** (:func:`source_patterns`): fp32 as loaded; bf16 shifted up 16 bits (the stochastic
  cast's); e4m3 (:func:`e4m3_patterns`) from its code ``c``: ``k = c & 0x7F``; a normal ``k ≥ 8``
  is the pattern ``(k << 20) + (120 << 23)`` (exponent and mantissa fields moved into fp32's, the
  bias 7 → 127), a subnormal ``k < 8`` the fp32 number ``k`` times ``2^-9`` (exact), ``k = 0x7F``
  the quiet NaN; the sign bit moved from bit 7 to bit 31.
* **to fp32**: the patterns as they are.
* **to bf16** (:func:`bf16_nearest`): ``(p + 0x7FFF + ((p >> 16) & 1)) >> 16``, RNE on the fp32
  pattern (a carry into the exponent is the step up: the largest finite fp32 values become inf,
  inf stays inf; the carry never reaches the sign below NaN); a NaN becomes the quiet
  ``(p >> 16) | 0x40``, sign kept.
* **to e4m3** (:func:`e4m3_nearest`): the stochastic cast's :func:`~.stochastic_cast.e4m3_steps`
  (``a = min(|p|, bits(448))`` as unsigned integers after setting a NaN aside, ``E`` its biased
  exponent clamped below at 121, the exact ``s = a · 2^(130 − E)`` in ``[0, 16)``), then
  ``n = bits(s + 2^23) & 0x7FFFFF``: fp32's step in ``[2^23, 2^24)`` is 1, so the addition rounds
  ``s`` to an integer, ties to even, and the mantissa field holds it; the code
  ``(E − 121) · 8 + n`` (:func:`~.stochastic_cast.e4m3_code`: ``n = 16`` carries into the next
  binade, ``E = 121`` with ``s < 8`` are the subnormals in steps of ``2^-9``), the sign or-ed on,
  ``0x7F`` for a NaN. The code's parity is ``n``'s, so ties go to the even code. An fp32 denormal
  that a flushing ``vmul`` / ``vadds`` took as zero would have rounded to zero anyway (``s <
  2^-117``).

Instruction behaviours assumed (the list in :mod:`~tileplug.backend_ascend.random.vector_ops`):
``vadds`` / ``vmuls`` / ``vmul`` on fp32 round to nearest even; ``vcvt`` s32 → f32 is exact below
2^24; ``vlds`` ``UNPK4_B8`` / ``UNPK_B16`` put element ``i`` in the low byte / half of lane ``i``
(the other bits are masked or shifted out, never assumed zero); the narrowing ``vcvt`` of integers
below 2^8 / 2^16 to ``uint8`` / ``uint16`` is exact; unsigned ``vmins`` / ``vmaxs`` / ``vcmps``.

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

Served: all nine pairs, any element count up to :data:`~tileplug.backend_ascend.random.draw.MAX_ELEMENTS`
(int32 index arithmetic, as the draw); larger casts fall to the reference.
"""

from dataclasses import dataclass
from typing import ClassVar

import tilelang.ascend.language as T

from tileplug.backend_ascend.device import DeviceTarget, lowering_target
from tileplug.backend_ascend.kernel import SpecKernel
from tileplug.backend_ascend.quant import stochastic_cast as element
from tileplug.backend_ascend.random import draw, philox
from tileplug.backend_ascend.random.vector_ops import VECTOR
from tileplug.backend_ascend.ub import LANES

DTYPES = ("float32", "bfloat16", "float8_e4m3fn")
"""The dtypes the kernel converts between, every pair of them (TileLang's names)."""
E4M3_MAGNITUDE = 0x7F
"""An e4m3 code's bits below its sign: exponent and mantissa."""
E4M3_FIELD_SHIFT = element.FP32_MANTISSA_BITS - element.E4M3_MANTISSA_BITS
"""``k << 20`` moves e4m3's exponent and mantissa fields onto fp32's."""
E4M3_REBIAS = (element.FP32_BIAS - 7) << element.FP32_MANTISSA_BITS
"""Added to the moved fields: the exponent bias 7 becomes fp32's 127."""
E4M3_LARGEST_SUBNORMAL = 7
"""Codes ``k ≤ 7`` have exponent field 0: the value ``k · 2^-9``."""
E4M3_SUBNORMAL_STEP = 2.0 ** (element.E4M3_MIN_EXPONENT - element.E4M3_MANTISSA_BITS)
"""``2^-9``, the step below e4m3's smallest normal."""
E4M3_LARGEST_FINITE = 0x7E
"""``k = 0x7F`` is e4m3's NaN (both signs)."""
E4M3_SIGN_TO_FP32 = 24
"""``c << 24`` puts the e4m3 sign (bit 7) on bit 31, and drops the lane's unspecified high bits."""
FP32_SIGN = 0x80000000
FP32_QUIET_NAN = 0x7FC00000
BF16_HALF_STEP = (1 << (element.BF16_DROPPED_BITS - 1)) - 1
"""``0x7FFF``: with the kept bits' last bit added, the RNE bias of fp32 → bf16."""
ROUNDING_ADDEND = 2.0 ** element.FP32_MANTISSA_BITS
"""``2^23``: fp32's step is 1 in ``[2^23, 2^24)``, so ``s + 2^23`` is ``s`` rounded to an integer."""
FP32_MANTISSA_MASK = (1 << element.FP32_MANTISSA_BITS) - 1
REGISTERS_PER_GROUP = philox.ELEMENTS_PER_GROUP // LANES
"""The tile kernel counts 256-element groups: four 64-lane registers each."""


def e4m3_patterns(ops, loaded):
    """Loaded e4m3 codes (a ``uint32`` register, the code in the low byte of each lane, the other
    bits unspecified) → their fp32 patterns (exact; a NaN code gives the quiet NaN)."""
    magnitude = ops.and_word(loaded, E4M3_MAGNITUDE, "code_magnitude")
    normal = ops.add_word(ops.shift_left(magnitude, E4M3_FIELD_SHIFT, "code_fields"), E4M3_REBIAS, "normal_pattern")
    subnormal = ops.float_bits(ops.scale(ops.to_float(magnitude, "subnormal_steps"), E4M3_SUBNORMAL_STEP,
                                         "subnormal_value"), "subnormal_pattern")
    finite = ops.select(ops.above(magnitude, E4M3_LARGEST_SUBNORMAL, "is_normal"), normal, subnormal,
                        "finite_pattern")
    unsigned = ops.select(ops.above(magnitude, E4M3_LARGEST_FINITE, "is_nan_code"),
                          ops.splat(FP32_QUIET_NAN, "quiet_nan_pattern"), finite, "magnitude_pattern")
    sign = ops.and_word(ops.shift_left(loaded, E4M3_SIGN_TO_FP32, "code_top"), FP32_SIGN, "sign")
    return ops.or_words(unsigned, sign, "widened")


def source_patterns(ops, loaded, source: str):
    """A loaded register of ``x`` (:func:`~.stochastic_cast.load_patterns`) → fp32 patterns, exact."""
    if source == "float8_e4m3fn":
        return e4m3_patterns(ops, loaded)
    return element.source_patterns(ops, loaded, source)


def fp32_patterns(ops, patterns):
    """To fp32: the patterns themselves."""
    return patterns


def bf16_nearest(ops, patterns):
    """fp32 patterns (a ``uint32`` register) rounded to nearest even bf16 → bf16 patterns in the low
    16 bits of each lane; a NaN becomes a quiet NaN of its sign."""
    magnitude = ops.and_word(patterns, element.MAGNITUDE_MASK, "magnitude")
    truncated = ops.shift_right(patterns, element.BF16_DROPPED_BITS, "truncated")
    kept_last = ops.and_word(truncated, 1, "kept_last_bit")
    biased = ops.add_word(ops.add_words(patterns, kept_last, "tie_to_even"), BF16_HALF_STEP, "rounding_sum")
    rounded = ops.shift_right(biased, element.BF16_DROPPED_BITS, "rounded")
    quiet = ops.or_word(truncated, element.BF16_QUIET_BIT, "quiet_nan")
    return ops.select(ops.above(magnitude, element.INF_PATTERN, "is_nan"), quiet, rounded, "bf16_pattern")


def e4m3_nearest(ops, patterns):
    """fp32 patterns (a ``uint32`` register) saturated at ±448 and rounded to nearest even e4m3 →
    e4m3 codes in the low byte of each lane (``0x7F`` or ``0xFF`` for a NaN)."""
    is_nan, exponent, scaled = element.e4m3_steps(ops, patterns)
    shifted = ops.float_bits(ops.plus(scaled, ROUNDING_ADDEND, "rounded_scaled"), "rounded_pattern")
    steps = ops.and_word(shifted, FP32_MANTISSA_MASK, "nearest_steps")
    return element.e4m3_code(ops, patterns, is_nan, exponent, steps)


NARROWINGS = {"float32": fp32_patterns, "bfloat16": bf16_nearest, "float8_e4m3fn": e4m3_nearest}
"""Target dtype → the rounding of a register of fp32 patterns to its patterns / codes."""


def convert_register(ops, loaded, source: str, target: str):
    """One loaded register of ``x`` → the register of ``target`` patterns / codes to store."""
    return NARROWINGS[target](ops, source_patterns(ops, loaded, source))


# ---------------------------------------------------------------------- the kernel


@dataclass(frozen=True)
class NearestCastSpec(element.ElementCastSpec):
    """The specialisation of ``nearest_cast``: the pair, the vector-core count, the tiles'
    buffer versions and width; no generator state."""

    op: ClassVar[str] = "nearest_cast"
    reads_state: ClassVar[bool] = False


def spec_of(call, target: DeviceTarget | None = None) -> NearestCastSpec:
    """The specialisation of ``call`` (a ``NearestCastCall``) on ``target``'s vector cores (None:
    the lowering stand-ins)."""
    cores = (target or lowering_target()).vector_cores
    return NearestCastSpec(source=element.dtype_name(call.source), target=element.dtype_name(call.target),
                           vector_cores=cores)


def decline_reason(call) -> str | None:
    """Why the kernel cannot serve ``call`` (None: it can): the draw's element limit, a dtype
    outside the three (the contract refuses those; here for a call made by hand)."""
    for dtype in (call.source, call.target):
        if element.dtype_name(dtype) not in DTYPES:
            return f"{dtype} is not one of the dtypes this kernel converts (float32, bfloat16, float8_e4m3fn)"
    return draw.decline_reason(call)


def conversion_compute(spec: NearestCastSpec):
    """The vector work of one tile (a macro of the tile kernel's ``compute`` signature; no Philox
    block is used): one ``T.SimdVF`` region, each register of the tile's groups loaded from
    ``x_ub``, converted by :func:`convert_register` and stored at the same index of ``out_ub``.
    Looked up by :func:`build` at trace time; tests/test_ascend_nearest_cast_lowering.py replaces
    it with scalar code."""

    def convert_at(buffers, at):
        loaded = element.load_patterns(buffers["x_ub"], at, spec.source)
        element.store_codes(buffers["out_ub"], at, convert_register(VECTOR, loaded, spec.source, spec.target),
                            spec.target)

    @T.macro
    def compute(buffers, first_block, groups):
        with T.SimdVF():
            for r in T.serial(groups * REGISTERS_PER_GROUP):
                convert_at(buffers, r * LANES)

    return compute


def parameters(spec: NearestCastSpec):
    """``(name, tensor type)`` of the GM tensors, in launch order: ``X`` the flat ``x`` ``[N]``,
    ``RESULT`` the flat result."""
    N = T.dynamic("N")
    return [
        ("X", T.Tensor((N,), spec.source)),
        ("RESULT", T.Tensor((N,), spec.target)),
    ], N


def build(spec: NearestCastSpec):
    """The prim_func of ``spec`` (UB budget checked)."""
    params, N = parameters(spec)
    return draw.tile_kernel(spec, params, N, conversion_compute(spec), source=("X", "x_ub"), result="RESULT",
                            state=spec.reads_state)


def arguments(spec: NearestCastSpec, inputs, outputs) -> list:
    """Launch arguments: the flat ``x`` and result."""
    return [inputs.x.view(-1), inputs.result.view(-1)]


KERNEL = SpecKernel("nearest_cast", spec_of, decline_reason, lambda spec: build(spec), arguments)
