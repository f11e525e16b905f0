"""CUDA ``fill_randn``: Box–Muller on each Philox block's pairs ``(r0, r1)``, ``(r2, r3)``
(SPEC §9), in fp64, rounded once to fp32 (and once more to a 16-bit dtype).

With ``a = ((r_even >> 8) + 1) · 2^-24`` and ``t = (r_odd >> 8) · 2^-24``: ``z_even =
sqrt(−2 ln a) · cos(2πt)``, ``z_odd = sqrt(−2 ln a) · sin(2πt)``, from inputs that are exact.
Two evaluations (``RandomKernelSpec.box_muller``):

- ``library`` (``TILEPLUG_CUDA_RANDN_BOX_MULLER=library``; the default until 2026-12-05): ``ln a = log1p(a − 1)`` with ``a − 1 = ((r >> 8) + 1 − 2^24) · 2^-24``
  (an integer times a power of two: no cancellation near ``a = 1``), CUDA's fp64 ``log1p`` and
  ``sqrt``, and the angle through ``sinpi`` / ``cospi`` of ``2t = (r >> 8) · 2^-23`` (no rounding
  of ``2π``; exact zeros and ones at the quadrant boundaries). The values are those of the
  reference's fp64 formula but for the last bits of two different fp64 libraries: equal in fp32
  but for a near-tie. (fp32 ``log1pf`` / ``sinpif`` / ``cospif`` — each within 1 ulp — put 2 in
  10^6 values 3 ulp away, past SPEC's 2, on the H200.) The library functions' range checks and
  slow paths make it the slowest part of a draw: 714 GB/s on the H200 for 2^28 fp32 values,
  against ``torch.randn``'s 1801.
- ``reduced`` (the default, :func:`box_muller_reduced`): each function a few fp64 FMAs on a reduced
  argument, within 2^-44 (radius) and 2^-43 (angle) of the reference's fp64 values
  (``tests/test_cuda_randn_reduced.py`` emulates it over every ``a`` and every ``t``), so its fp32
  values are the reference's but for a near-tie (2 of 2^24 values one ulp away in that test,
  SPEC allowing 2): 544 SASS instructions for a thread's 8 fp32 values with their Philox blocks,
  no branch, against 1360 (static, slow paths included) for the library evaluation; 840 for 16
  values since 2026-12-06 (52.5 a value: one ``mul.wide.u32`` a Philox product, the MUFU seeds
  without CUDA's subnormal fix-ups, 16 values a thread (``spec.RUN_BYTES``), ``u = 4s``, the
  products swapped in fp32; the same bits). On an H100
  (2026-12-05) 2^28 fp32 values took 698 us (1539 GB/s) against the library's 1514 us and
  ``torch.randn``'s 596; of 16 777 221 values under each of three states, 3 to 8 fp32 values
  differed from the reference's (within SPEC's 2 ulp) and no bf16 value.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import math

import tilelang.language as T

from tileplug.backend_cuda.random.philox import build_draw
from tileplug.backend_cuda.random.spec import RandomKernelSpec

MANTISSA_SHIFT = 8
STEPS = 1 << 24
"""``r >> 8`` takes this many values: ``a``'s and ``t``'s steps are ``2^-24``."""

# ---------------------------------------------------------------------- the reduced evaluation
SQRT_HALF_BITS = 0x3F3504F3
"""fp32 bits of ``√½`` (rounded): ``m = 2^e · f`` with ``f`` in ``[√½, √2)`` from ``m``'s bits."""
LN2 = math.log(2.0)
ATANH_TERMS = (0.6666666667602635, 0.39999995562918905, 0.2857211431827041, 0.2217600310532815, 0.195865119389113)
"""``(ln f − 2s) / s³`` in powers of ``s²``, ``s = (f − 1)/(f + 1)`` in ``±0.1716``: a least-squares fit at
Chebyshev nodes (within 2^-44.9 of ``ln f``, relative; the Taylor series needs six terms for 2^-40)."""
NEGATED_ATANH_TERMS = tuple(-2.0 * term for term in ATANH_TERMS)
"""``−2 ·`` :data:`ATANH_TERMS` (exact: a power of two)."""
SCALED_ATANH_TERMS = tuple(-term * 2.0 ** -(5 + 4 * k) for k, term in enumerate(ATANH_TERMS))
"""The kernel's polynomial in ``w = u²``, ``u = 4s``: :data:`NEGATED_ATANH_TERMS` ``[k] / (64 · 16^k)``
(exact: powers of two), so that ``u³ · P'(w)`` is the product ``s³ · P(s²)`` and each Horner step the
unscaled step's value times a power of two: the same fp64 bits (zeros included), one multiply fewer
(``−4s`` is ``−u``, a negated operand)."""
RSQRT_FLOOR = 2.0**-40
"""Below every nonzero ``−2 ln a`` (the smallest, at ``m = 2^24 − 1``, is about ``2^-23``)."""
QUADRANT_BITS = 22
"""``t · 2^24 >> 22`` is the angle's quadrant, the low 22 bits its position inside (the reference's)."""
ANGLE_STEP = math.pi / 2 * 2.0 ** -QUADRANT_BITS
"""The angle of one step inside a quadrant, rounded to fp64 (the reference's constant)."""
SIN_TERMS = (-0.16666666666629276, 0.00833333332493844, -0.00019841263668450766, 2.7555329023408484e-06,
             -2.4759792220946984e-08)
"""``(sin x − x) / x³`` in powers of ``x²`` on ``[0, π/4]``: a least-squares fit at Chebyshev nodes
(within 2^-47 of ``sin x``, relative)."""
COS_TERMS = (-0.4999999999947437, 0.04166666655152141, -0.001388888057839714, 2.4798946594713382e-05,
             -2.717391788483935e-07)
"""``(cos x − 1) / x²`` in powers of ``x²`` on ``[0, π/4]`` (within 2^-43.6 of ``cos x``, relative)."""


@T.macro
def box_muller(words, run, k):
    """``run[4k … 4k + 3]``: Box–Muller of the pairs ``(words[0], words[1])``, ``(words[2], words[3])``."""
    radius = T.alloc_local((1,), "float64")
    turns = T.alloc_local((1,), "float64")
    for pair in T.unroll(2):
        # a − 1 and 2t, both exact
        below_one = T.cast(T.cast(T.shift_right(words[2 * pair], MANTISSA_SHIFT), "int32") + (1 - STEPS),
                           "float64") * T.float64(1.0 / STEPS)
        radius[0] = T.sqrt(T.float64(-2.0) * T.log1p(below_one))
        turns[0] = T.cast(T.shift_right(words[2 * pair + 1], MANTISSA_SHIFT), "float64") * T.float64(2.0 / STEPS)
        run[4 * k + 2 * pair] = T.cast(radius[0] * T.call_extern("float64", "cospi", turns[0]), "float32")
        run[4 * k + 2 * pair + 1] = T.cast(radius[0] * T.call_extern("float64", "sinpi", turns[0]), "float32")


def _fma(a, b, c):
    """``a · b + c`` in fp64, rounded once."""
    return T.call_extern("float64", "__fma_rn", a, b, c)


def _mul(a, b):
    return T.call_extern("float64", "__dmul_rn", a, b)


def _add(a, b):
    return T.call_extern("float64", "__dadd_rn", a, b)


def _horner(z, terms):
    """``terms[0] + z · (terms[1] + z · (…))`` in fp64 FMAs."""
    value = T.float64(terms[-1])
    for term in reversed(terms[:-1]):
        value = _fma(value, z, T.float64(term))
    return value


@T.macro
def box_muller_reduced(words, run, k):
    """:func:`box_muller` with each function reduced to a few fp64 FMAs (the same formula and
    inputs, SPEC's rounding once to fp32):

    - ``ln a`` of ``a = m · 2^-24`` (``m`` in ``[1, 2^24]``): ``m = 2^e · f`` with ``f`` in
      ``[√½, √2)`` from ``m``'s fp32 bits (exact), ``ln a = (e − 24) ln 2 + 2 atanh(s)`` with ``s =
      (f − 1) / (f + 1)`` (an fp32 reciprocal seed and one FMA correction) and ``2 atanh(s) = 2s +
      s³ · P(s²)``: relative accuracy near ``a = 1`` too (``e = 24`` there); computed as ``u = 4s``
      (:data:`SCALED_ATANH_TERMS`: the same bits, one multiply fewer);
    - the radius ``sqrt(−2 ln a)`` from an fp32 ``rsqrt`` seed and one FMA correction (0 at ``a = 1``);
    - the angle's quadrant from the top two bits of ``t · 2^24`` (the reference's reduction), the
      rest ``r`` (22 bits) as ``x = r · ANGLE_STEP``, past ``π/4`` as ``(2^22 − r) · ANGLE_STEP``
      with ``sin`` and ``cos`` swapped; ``sin x = x + x³ · S(x²)``, ``cos x = 1 + x² · C(x²)``;
    - ``z = radius · cos`` and ``radius · sin`` in fp64, rounded once to fp32 (then swapped), then given the
      quadrant's sign as ``0 − z`` in fp32 (an exact zero stays +0; the reference's ``0 − cos``
      before the product gives the same values, and the same zeros but for ``a = 1``, where its
      ``0 · (−cos)`` is −0).

    Emulated over every ``a`` and every ``t`` (``tests/test_cuda_randn_reduced.py``): the radius
    within 2^-44 of the reference's, ``cos`` and ``sin`` within 2^-43 but where the reference's
    own rounding of ``r · ANGLE_STEP`` moves its ``cos`` near a zero (up to 2^-33 there)."""
    # named registers: each value below is used more than once
    m, bits, exponent, steps, quadrant, rest = (T.alloc_var("int32") for _ in range(6))
    f = T.alloc_var("float32")
    numerator, denominator, seed, quotient, u, w, square, rsqrt_seed, root = (T.alloc_var("float64") for _ in range(9))
    radius, x, angle_square, sine, cosine = (T.alloc_var("float64") for _ in range(5))
    first, second, radius_cosine, radius_sine = (T.alloc_var("float32") for _ in range(4))
    upper, swap = T.alloc_var("bool"), T.alloc_var("bool")
    for pair in T.unroll(2):
        # the radius
        m = T.cast(T.shift_right(words[2 * pair], MANTISSA_SHIFT), "int32") + 1
        bits = T.reinterpret(T.cast(m, "float32"), "int32")
        exponent = T.shift_right(bits - SQRT_HALF_BITS, 23)
        f = T.reinterpret(bits - T.shift_left(exponent, 23), "float32")
        # u = 4s = (4f − 4) / (f + 1): every step 4 times the unscaled step's value, exactly
        numerator = T.cast(f * T.float32(4.0) - T.float32(4.0), "float64")  # exact (f in [1/2, 2])
        denominator = _fma(numerator, T.float64(0.25), T.float64(2.0))  # exact: f + 1
        seed = T.cast(T.fast_rcp(f + T.float32(1.0)), "float64")
        quotient = _mul(numerator, seed)
        u = _fma(_fma(denominator * T.float64(-1.0), quotient, numerator), seed, quotient)
        w = _mul(u, u)
        # −2 ln a = (e − 24)(−2 ln 2) − 4s − 2 s³ P(s²) = (e − 24)(−2 ln 2) − u + u³ P'(u²)
        square = _fma(T.cast(exponent - 24, "float64"), T.float64(-2.0 * LN2),
                      _fma(_mul(u, w), _horner(w, SCALED_ATANH_TERMS), u * T.float64(-1.0)))
        # the seed of rsqrt(0) (a = 1) is kept finite, so the radius comes out 0 without a select
        rsqrt_seed = T.cast(T.call_extern("float32", "tileplug_rsqrt_approx_ftz",
                                           T.max(T.cast(square, "float32"), T.float32(RSQRT_FLOOR))), "float64")
        root = _mul(square, rsqrt_seed)
        radius = _fma(_fma(root * T.float64(-1.0), root, square), _mul(T.float64(0.5), rsqrt_seed), root)
        # the angle
        steps = T.cast(T.shift_right(words[2 * pair + 1], MANTISSA_SHIFT), "int32")
        quadrant = T.shift_right(steps, QUADRANT_BITS)
        rest = T.bitwise_and(steps, (1 << QUADRANT_BITS) - 1)
        upper = rest > (1 << (QUADRANT_BITS - 1))
        x = _mul(T.cast(T.if_then_else(upper, (1 << QUADRANT_BITS) - rest, rest), "float64"), T.float64(ANGLE_STEP))
        angle_square = _mul(x, x)
        sine = _fma(_mul(x, angle_square), _horner(angle_square, SIN_TERMS), x)
        cosine = _fma(angle_square, _horner(angle_square, COS_TERMS), T.float64(1.0))
        swap = upper != (T.bitwise_and(quadrant, 1) == 1)
        # both products rounded to fp32, then swapped (two fp32 selects, not four 32-bit halves)
        radius_cosine = T.cast(_mul(radius, cosine), "float32")
        radius_sine = T.cast(_mul(radius, sine), "float32")
        first = T.if_then_else(swap, radius_sine, radius_cosine)  # before the quadrant's sign
        second = T.if_then_else(swap, radius_cosine, radius_sine)
        run[4 * k + 2 * pair] = T.if_then_else(T.Or(quadrant == 1, quadrant == 2), T.float32(0.0) - first, first)
        run[4 * k + 2 * pair + 1] = T.if_then_else(quadrant >= 2, T.float32(0.0) - second, second)


def build(spec: RandomKernelSpec):
    """The ``T.prim_func``: buffers ``(values [N], seed [1], offset [1])``."""
    return build_draw(spec, box_muller_reduced if spec.box_muller == "reduced" else box_muller)
