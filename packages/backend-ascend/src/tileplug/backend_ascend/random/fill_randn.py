"""Ascend kernel of ``fill_randn`` (SPEC §9): Box–Muller on each block's word pairs
``(r0, r1)`` and ``(r2, r3)``: ``z_even = sqrt(−2 ln a)·cos(2πt)``, ``z_odd = sqrt(−2 ln a)·
sin(2πt)`` with ``a = ((r_even >> 8) + 1)·2^-24``, ``t = (r_odd >> 8)·2^-24``, in fp32 within
2 ulp of the reference (the formula in fp64 rounded once), rounded once to a 16-bit dtype.

The draw kernel (:mod:`.draw`) with :func:`normal_words` as its transform; plain Python over
``ops`` (see :mod:`.vector_ops`). The dialect has ``vln`` and ``vsqrt`` but no sine or cosine,
and 2 ulp leaves no room for the usual fp32 roundings (a rounded radius times a rounded cosine,
rounded again, is up to ~3 ulp from the reference even with a correctly rounded logarithm), so
everything but the logarithm is carried as a double-float ``high + low``:

* **radius**: ``h = −2·vln(a)`` (``a`` exact: a 24-bit integer times 2^-24); ``R = sqrt(h)``
  rounded, and its residual ``(h − R²) / 2R`` with ``R²`` exact (Dekker's product, below): the
  pair ``R + r`` is ``sqrt(h)`` to ~2^-47, so the radius only carries vln's error (half of it,
  through the square root).
* **angle**, reduced exactly on the integer ``s = t·2^24``: the top two bits are the quadrant,
  bit 21 the octant inside it; the octant's position ``k`` (``m`` or ``2^22 − m``, ``m`` the
  low 22 bits) gives ``x = k·2^-21`` in ``[0, 1]``, exact, the angle being ``π/4·x``:
  ``sin(π/4·x) = 0.75·x + x·P(x²)`` (``0.75·x`` exact; ``P``'s constant term is ``π/4 − 0.75``)
  and ``cos(π/4·x) = (1 − 0.3125·A) − (0.3125·(B + D) + c·x²) + x⁴·Q(x²)`` where
  ``x² = A + B + D`` exactly from ``k = 2^11·k_high + k_low`` (``A = k_high²·2^-20``,
  ``B = k_high·k_low·2^-30``, ``D = k_low²·2^-42``, each exact in fp32; ``1 − 0.3125·A`` is
  exact too) and ``c = π²/32 − 0.3125``. The exact leading part and the small rounded tail are
  joined by Fast2Sum into a ``high + low`` pair. ``P`` (degree 4 in ``x²``) and ``Q`` (degree 2)
  are fitted (weighted least squares, Lawson's iteration, in fp64 on [0, 1], relative error
  5e-12 and 1.2e-10) and rounded to fp32. The octant swaps sine and cosine, the quadrant rotates
  and negates them (``0 − v``, so an exact zero stays ``+0`` as in the reference).
* **product**: ``z = p + ((e + R·c_low) + r·c_high)`` with ``p + e = R·c_high`` exact
  (Dekker's product by Veltkamp splitting: ``vmul`` is not fused), so ``z`` is rounded once.

On the CPU, through this very code with numpy standing in for the instructions
(tests/test_ascend_rng_lowering.py): with a correctly rounded ``vln`` every value is within
1 ulp of the reference; with ``vln`` off by one ulp either way, within 2.
"""

from __future__ import annotations

from tileplug.backend_ascend.random.draw import make_kernel
from tileplug.backend_ascend.random.fill_rand import MANTISSA_SHIFT, UNIT

QUADRANT_BIT = 22
"""Bits 22 and 23 of ``s = t·2^24`` are the quadrant of the angle ``2πt``."""
OCTANT_BIT = 21
QUARTER_TURN = 1 << QUADRANT_BIT
OCTANT_UNIT = 2.0**-21
"""``x = k·2^-21``: the angle inside the octant over π/4."""
SPLIT_BITS = 11
"""``k = 2^11·k_high + k_low``: both halves' products are exact in fp32."""
SIN_LEAD = 0.75
"""``0.75·x`` is exact (``x`` has at most 21 significant bits)."""
SIN_TAIL = (0.03539816290140152, -0.08074551075696945, 0.002490393118932843, -3.65723499271553e-05,
            3.0897481906322355e-07)
"""``P(u)``: ``sin(π/4·x) = 0.75·x + x·P(x²)`` on [0, 1], constant term first (fp32 values)."""
COS_LEAD = 0.3125
"""The part of ``π²/32`` (the ``x²`` coefficient of ``cos(π/4·x)``) with 3 significant bits."""
COS_SQUARE_REST = -0.004074862692505121
"""``π²/32 − 0.3125`` (fp32)."""
COS_TAIL = (0.015854336321353912, -0.00032595498487353325, 3.537517841323279e-06)
"""``Q(u)``: ``cos(π/4·x) = 1 − (π²/32)·x² + x⁴·Q(x²)``, constant term first (fp32 values)."""
VELTKAMP = 4097.0
"""``2^12 + 1``: splits an fp32 value into two halves of 12 significant bits."""


def split(ops, value, name: str):
    """Veltkamp's split: ``value = high + low``, each with at most 12 significant bits."""
    spread = ops.scale(value, VELTKAMP, name + "_spread")
    high = ops.sub(spread, ops.sub(spread, value, name + "_gap"), name + "_hi")
    return high, ops.sub(value, high, name + "_lo")


def exact_product(ops, a, a_parts, b, b_parts, name: str):
    """Dekker's product: ``(p, e)`` with ``p = fl(a·b)`` and ``p + e = a·b`` exactly
    (``a_parts`` / ``b_parts``: their :func:`split`)."""
    (a_high, a_low), (b_high, b_low) = a_parts, b_parts
    product = ops.mul(a, b, name)
    error = ops.sub(ops.mul(a_high, b_high, name + "_hh"), product, name + "_e")
    error = ops.add(error, ops.mul(a_high, b_low, name + "_hl"), name + "_e")
    error = ops.add(error, ops.mul(a_low, b_high, name + "_lh"), name + "_e")
    return product, ops.add(error, ops.mul(a_low, b_low, name + "_ll"), name + "_error")


def fast_two_sum(ops, big, small, name: str):
    """``(high, low)`` with ``high + low = big + small`` exactly (``|big| >= |small|``)."""
    high = ops.add(big, small, name + "_hi")
    return high, ops.add(ops.sub(big, high, name + "_gap"), small, name + "_lo")


def polynomial(ops, u, coefficients, name: str):
    """``Σ coefficients[i]·u^i`` by Horner's rule (at least two coefficients)."""
    acc = ops.plus(ops.scale(u, coefficients[-1], name), coefficients[-2], name)
    for coefficient in reversed(coefficients[:-2]):
        acc = ops.plus(ops.mul(acc, u, name), coefficient, name)
    return acc


def radius(ops, even):
    """``sqrt(−2 ln a)`` of ``a = ((even >> 8) + 1)·2^-24`` as ``(high, low, split of high)``
    (``low`` = 0 where the radius is 0: ``a = 1``)."""
    count = ops.to_float(ops.shift_right(even, MANTISSA_SHIFT, "even_code"), "even_count")
    a = ops.scale(ops.plus(count, 1.0, "a_count"), UNIT, "a")
    squared = ops.scale(ops.ln(a, "log_a"), -2.0, "radius_squared")
    high = ops.sqrt(squared, "radius")
    parts = split(ops, high, "radius")
    square, square_error = exact_product(ops, high, parts, high, parts, "radius_square")
    residual = ops.sub(ops.sub(squared, square, "radius_gap"), square_error, "radius_residual")
    correction = ops.divide(residual, ops.scale(high, 2.0, "radius_twice"), "radius_correction")
    low = ops.select(ops.positive(high, "has_radius"), correction, ops.constant(0.0, "zero"), "radius_low")
    return high, low, parts


def octant_sin_cos(ops, steps):
    """``sin`` and ``cos`` of ``π/4·x`` as ``(high, low)`` pairs, ``x = k·2^-21`` and ``k`` the
    octant position of ``steps`` (a ``uint32`` register of ``s = t·2^24``); also the mask of
    the lanes in a quadrant's second octant (sine and cosine then swap)."""
    inside = ops.and_word(steps, QUARTER_TURN - 1, "quadrant_steps")
    second_octant = ops.bit_set(steps, OCTANT_BIT, "second_octant")
    complement = ops.sub(ops.splat(QUARTER_TURN, "quarter_turn"), inside, "complement_steps")
    position = ops.select(second_octant, complement, inside, "octant_steps")  # in [0, 2^21]
    x = ops.scale(ops.to_float(position, "octant_count"), OCTANT_UNIT, "x")
    x_squared = ops.mul(x, x, "x_squared")
    sin_pair = fast_two_sum(ops, ops.scale(x, SIN_LEAD, "sin_lead"),
                            ops.mul(x, polynomial(ops, x_squared, SIN_TAIL, "sin_poly"), "sin_tail"), "sin")
    position_high = ops.to_float(ops.shift_right(position, SPLIT_BITS, "position_high"), "k_high")
    position_low = ops.to_float(ops.and_word(position, (1 << SPLIT_BITS) - 1, "position_low"), "k_low")
    square_high = ops.scale(ops.mul(position_high, position_high, "k_high_squared"), 2.0**-20, "square_high")
    square_rest = ops.add(ops.scale(ops.mul(position_high, position_low, "k_cross"), 2.0**-30, "square_cross"),
                          ops.scale(ops.mul(position_low, position_low, "k_low_squared"), 2.0**-42, "square_low"),
                          "square_rest")
    cos_lead = ops.plus(ops.scale(square_high, -COS_LEAD, "cos_lead_term"), 1.0, "cos_lead")
    quartic = ops.mul(ops.mul(x_squared, x_squared, "x_fourth"), polynomial(ops, x_squared, COS_TAIL, "cos_poly"),
                      "cos_quartic")
    quadratic = ops.add(ops.scale(square_rest, COS_LEAD, "cos_rest_term"),
                        ops.scale(x_squared, COS_SQUARE_REST, "cos_small_term"), "cos_quadratic")
    cos_pair = fast_two_sum(ops, cos_lead, ops.sub(quartic, quadratic, "cos_tail"), "cos")
    return sin_pair, cos_pair, second_octant


def choose_pair(ops, mask, when_set, otherwise, name: str):
    """A ``(high, low)`` pair chosen lane-wise."""
    return (ops.select(mask, when_set[0], otherwise[0], name + "_hi"),
            ops.select(mask, when_set[1], otherwise[1], name + "_lo"))


def negated(ops, pair, zero, name: str):
    """``(0 − high, 0 − low)``: an exact zero stays +0."""
    return ops.sub(zero, pair[0], name + "_hi"), ops.sub(zero, pair[1], name + "_lo")


def turn_cos_sin(ops, odd):
    """``cos(2πt)`` and ``sin(2πt)`` of ``t = (odd >> 8)·2^-24`` as ``(high, low)`` pairs."""
    steps = ops.shift_right(odd, MANTISSA_SHIFT, "steps")
    sin_pair, cos_pair, second_octant = octant_sin_cos(ops, steps)
    cos_in = choose_pair(ops, second_octant, sin_pair, cos_pair, "quadrant_cos")
    sin_in = choose_pair(ops, second_octant, cos_pair, sin_pair, "quadrant_sin")
    zero = ops.constant(0.0, "zero")
    odd_quadrant = ops.bit_set(steps, QUADRANT_BIT, "odd_quadrant")  # + π/2: (cos, sin) → (−sin, cos)
    cos_rotated = choose_pair(ops, odd_quadrant, negated(ops, sin_in, zero, "minus_sin"), cos_in, "half_cos")
    sin_rotated = choose_pair(ops, odd_quadrant, cos_in, sin_in, "half_sin")
    second_half = ops.bit_set(steps, QUADRANT_BIT + 1, "second_half")  # + π: both negated
    cos_turn = choose_pair(ops, second_half, negated(ops, cos_rotated, zero, "minus_cos"), cos_rotated, "cos_turn")
    sin_turn = choose_pair(ops, second_half, negated(ops, sin_rotated, zero, "minus_sin"), sin_rotated, "sin_turn")
    return cos_turn, sin_turn


def scaled(ops, radius_pair, radius_parts, value_pair, name: str):
    """``(R + r)·(c + d)`` rounded once: ``R·c`` exact (Dekker), the cross terms added to its error."""
    high, low = radius_pair
    product, error = exact_product(ops, high, radius_parts, value_pair[0], split(ops, value_pair[0], name), name)
    cross = ops.add(ops.add(error, ops.mul(high, value_pair[1], name + "_cross"), name + "_cross"),
                    ops.mul(low, value_pair[0], name + "_cross_low"), name + "_cross")
    return ops.add(product, cross, name)


def normal_pair(ops, even, odd, name: str):
    """Box–Muller of one word pair: ``(z_even, z_odd)`` fp32 registers."""
    high, low, parts = radius(ops, even)
    cos_turn, sin_turn = turn_cos_sin(ops, odd)
    return (scaled(ops, (high, low), parts, cos_turn, name + "_even"),
            scaled(ops, (high, low), parts, sin_turn, name + "_odd"))


def normal_words(ops, words):
    """The transform of the draw kernel: Philox words ``(r0, r1, r2, r3)`` → their normal values."""
    r0, r1, r2, r3 = words
    return normal_pair(ops, r0, r1, "z01") + normal_pair(ops, r2, r3, "z23")


KERNEL = make_kernel("fill_randn", normal_words)
