"""The TileLang kernels of the CUDA element-wise casts (``element_cast``) and the stochastic
rounding macros the quant tile kernel shares (``carry_round_to_e4m3``, ``carry_code_e2m1``).

``nearest_cast``: a thread's run of ``x`` widened to fp32 (exact) and converted to the target by
the store (round to nearest even; e4m3 with ``satfinite``). ``stochastic_cast``: element ``i``
rounds with its ``w``-bit field of the draw (docs/spec.md §10.2: ``w`` = 16 for fp32 → bf16, 8 for
fp32 → e4m3 and bf16 → e4m3; field ``i mod k`` of word ``i // k``, ``k = 32 // w``, the first
at the word's top), so a thread's Philox block serves ``4k`` elements of its run. ``a = |x|``
between its neighbouring targets ``lo ≤ a < hi`` becomes ``hi`` iff
``floor((a − lo) / (hi − lo) · 2^w) + f ≥ 2^w``. Each rounding is a few integer operations:

- fp32 → bf16 (``w = 16``): the fraction is the 16 dropped bits ``m``, and ``m + f ≥ 2^16`` is a
  carry out of them: add ``f`` to the fp32 pattern and clear its low 16 bits (a carry is the step
  up, past the largest finite: inf).
- bf16 → e4m3, fp32 → e4m3 and the e4m3 values of the stochastic per-token / per-block casts
  (``w = 8``): a carry out of bits ``20 − w`` … 19 of the pattern of ``a`` (or of ``a + 2^-6`` below
  e4m3's normal range), :func:`carry_round_to_e4m3`.
- the e2m1 values of the stochastic per-token / per-block casts (``w = 8``): the same carry out of
  bits ``22 − w`` … 21 of ``a + max(a, 1)``, ``a = min(a, 6)`` (1 mantissa bit; ``2a`` from 1 up, ``a + 1``
  below 1, the subnormal 0.5 sharing [1, 2)'s step), the code read off the rounded pattern, :func:`carry_code_e2m1`.

The sign is the input's (−0 stays −0), NaN stays NaN (found from its bits: TVM folds
``x != x`` to false; e2m1 has no NaN: a NaN gets the code of ±6, as from the encoder). ``ieee_*``
arithmetic: no contraction into FMAs, no fast-math rewrites.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import functools

import tilelang.language as T

from tileplug.backend_cuda.random.philox import (
    RunLayout,
    advance_if_the_last_cta,
    arrivals_buffer,
    philox_block,
    read_the_offset_and_count_the_cta,
    state_buffers,
)

WORD_BITS = 32
SIGN_BIT = 0x80000000
MAGNITUDE_BITS = 0x7FFFFFFF
BF16_KEPT_BITS = 0xFFFF0000
FP32_INFINITY = 0x7F800000


def is_nan(value):
    """fp32 ``value`` is a NaN, from its bits (``value != value`` is folded away as false). CUDA's
    ``isnan`` saves an instruction an element but not the registers: the stochastic e4m3 kernels
    went from 64 to 88 registers, half the CTAs per SM, and 22 % slower (H200, 2026-12-04)."""
    return (T.reinterpret(value, "uint32") & T.uint32(MAGNITUDE_BITS)) > T.uint32(FP32_INFINITY)


def with_sign_of(magnitude, value):
    """``magnitude`` (fp32, sign bit clear) with the sign bit of fp32 ``value``."""
    sign = T.reinterpret(value, "uint32") & T.uint32(SIGN_BIT)
    return T.reinterpret(T.reinterpret(magnitude, "uint32") | sign, "float32")


def random_field(word, field, width: int, position: int):
    """Field ``field`` (an index, a loop variable of an unrolled loop) of ``width`` bits of uint32
    ``word`` (the first at the word's top; at width 24 the word's top 24 bits), moved so that its
    lowest bit is bit ``position``: shifted to the top (dropping the fields before it), down to
    ``position``, and the fields after it cleared from below ``position``."""
    moved = T.shift_right(T.shift_left(word, T.uint32(width) * T.cast(field, "uint32")),
                          T.uint32(WORD_BITS - width - position))
    return moved if position == 0 else moved & T.uint32(((1 << width) - 1) << position)


@T.macro
def round_to_bf16(value, field, run, j):
    """``run[j]`` = fp32 ``value`` rounded stochastically to a bf16 value (held in fp32) with the
    16 random bits ``field`` (uint32, bits 0–15). ``m + f ≥ 2^16`` (``m``: the 16 dropped bits) is a
    carry out of them, so the rounding is one add to the pattern and a truncation (a carry into
    the exponent is the step up; nothing carries into the sign below NaN)."""
    rounded = (T.reinterpret(value, "uint32") + field) & T.uint32(BF16_KEPT_BITS)
    run[j] = T.if_then_else(is_nan(value), value, T.reinterpret(rounded, "float32"))


E4M3_KEPT_BITS = 0xFFF00000
"""An fp32 pattern cut to e4m3's 3 mantissa bits: its dropped bits are 0–19."""
E4M3_SMALLEST_NORMAL = 2.0**-6
E2M1_DROPPED_BITS = 22
"""An fp32 pattern's bits below e2m1's last place on a normal step: bits 0–21."""
E2M1_LARGEST = 6.0
E4M3_DROPPED_BITS = 20
"""An fp32 pattern's bits below e4m3's last place on a normal step: bits 0–19."""


def e4m3_field_position(width: int) -> int:
    """Where :func:`carry_round_to_e4m3` wants a ``width``-bit field: its top at bit 19 (bit 12 for the
    8 bits every e4m3 target takes)."""
    return E4M3_DROPPED_BITS - width


@T.macro
def carry_round_to_e4m3(value, field, run, j):
    """``run[j]`` = fp32 ``value`` rounded stochastically onto e4m3's grid with its ``w`` random bits
    ``field`` (uint32, bits ``20 − w`` … 19: :func:`e4m3_field_position`), held in fp32; the store's
    ``satfinite`` encodes it exactly, and takes whatever lies past 448 (±inf included) to ±448, as
    saturating first would (a step up from 448 is 480: saturated back; no clamp here, 16
    instructions and 3 registers fewer a thread for bf16). On a normal step the pattern's bits
    ``20 − w`` … 19 of ``a`` are ``floor(p · 2^w)`` (the bits below them cannot carry into the sum:
    the field's are zero there), so ``floor(p · 2^w) + f ≥ 2^w`` is a carry out of them: add the
    field to the pattern and cut it to e4m3's mantissa (a carry into the exponent is the step up;
    past the largest finite fp32 it gives inf, 448 once stored; a NaN may carry into the sign, and
    is replaced by ``value``). Below 2^-6 the step is 2^-9, that of ``a + 2^-6``'s binade: the same
    carry on ``a + 2^-6`` added toward zero (its bits ``20 − w`` … 19 are then ``floor(p · 2^w)``
    exactly, the truncations composing), then minus 2^-6, exact. Serves the element casts (bf16 → e4m3
    and fp32 → e4m3) and the e4m3 values of the per-token / per-block casts (``w = 8`` each);
    :func:`carry_code_e2m1` is the same carry on e2m1's grid."""
    magnitude = T.alloc_var("float32")
    offset = T.alloc_var("float32")
    shifted = T.alloc_var("uint32")
    magnitude = T.abs(value)  # NaN: replaced below
    offset = T.if_then_else(magnitude < T.float32(E4M3_SMALLEST_NORMAL), T.float32(E4M3_SMALLEST_NORMAL),
                            T.float32(0.0))
    shifted = T.reinterpret(T.ieee_add(magnitude, offset, "rz"), "uint32")
    rounded = (shifted + field) & T.uint32(E4M3_KEPT_BITS)
    result = T.ieee_sub(T.reinterpret(rounded, "float32"), offset)
    # |value| + offset is a NaN (its sign clear) exactly when value is: one comparison, no mask
    run[j] = T.if_then_else(shifted > T.uint32(FP32_INFINITY), value, with_sign_of(result, value))


E2M1_ZERO_CODE_PATTERN = 0xFE << E2M1_DROPPED_BITS
"""The fp32 pattern of 1.0 (biased exponent 127, mantissa bit 0, the dropped bits 0), e2m1's code 0 in the form
:func:`carry_code_e2m1` rounds: the code is ``(pattern − this) >> 22``."""


@T.macro
def carry_code_e2m1(value, field, run, j):
    """``run[j]`` = the bits of the e2m1 code (a uint32 held in the fp32 slot: the value's own register, read back
    with ``T.reinterpret``; sign at bit 3) of fp32 ``value`` rounded stochastically onto e2m1's grid with its
    ``w`` random bits ``field`` (bits ``22 − w`` … 21): :func:`carry_round_to_e4m3`'s carry with 1 mantissa bit, on
    ``a = min(|value|, 6)`` (6 lies on the grid, so no field moves it, and a step up from (4, 6) is 6) moved to
    ``s = a + max(a, 1)``, added toward zero: ``2a`` from 1 up (exact: the same mantissa, the exponent one
    higher), ``a + 1`` below 1 (the subnormal step 0.5 is that of [1, 2)). The code is read off the rounded
    pattern of ``s``: its bits 22 … 30 are the biased exponent and the mantissa bit, 0xFE … 0x100 for ``a`` = 0,
    0.5, 1 and 0x100 … 0x105 for 1 … 6 (1.0 → 2.0, code 2; 6 → 12 = 1.5 · 8, code 7), so the code is ``(pattern +
    field − 1.0's pattern) >> 22`` for every ``a``: no select on ``a < 1`` (with ``a`` itself from 1 up, the
    subtrahend was 1.0's pattern or two codes less, chosen by a second test: per-token bf16 1 × 16, fp32 scales,
    1088 → 1016 SASS instructions, nvcc 13.0, sm_90). The sign is
    ``value``'s (``−0`` gives 8) and a NaN is ``min(NaN, 6) = 6`` with its sign: the codes
    ``sf_math.e2m1_rounded`` gives the rounded values, with no fp32 value and no encoder between (on an H100 the
    e2m1 1 × 16 cast took 659 µs at T = 65536, H = 7168, against 735 through an fp32 value and the encoder, 878
    with the grid's fixed point before)."""
    magnitude = T.alloc_var("float32")
    magnitude = T.min(T.abs(value), T.float32(E2M1_LARGEST))
    shifted = T.reinterpret(T.ieee_add(magnitude, T.max(magnitude, T.float32(1.0)), "rz"), "uint32")
    code = T.shift_right(shifted + field - T.uint32(E2M1_ZERO_CODE_PATTERN), T.uint32(E2M1_DROPPED_BITS))
    run[j] = T.reinterpret(code | (T.shift_right(T.reinterpret(value, "uint32"), T.uint32(28)) & T.uint32(8)),
                           "float32")


def on_normal_e4m3_steps(values, indices):
    """Whether every ``values[j]`` (``j`` in ``indices``) has ``|value| ≥ 2^-6``: e4m3's normal steps, no NaN
    (a NaN compares false), where :func:`carry_round_normal_to_e4m3` gives :func:`carry_round_to_e4m3`'s value.
    The per-token / per-block tiles branch on it a Philox block at a time: their ``x · inv`` lies below 2^-6 only
    under ``3.5e-5 · amax``, so a warp almost never takes both paths (on an H100, 2026-12-07, per-token 1 × 128
    658 → 547 µs at T = 65536, H = 7168). The element casts do not: a bf16 → e4m3 input of normal values has
    1.2 % of them under 2^-6, nearly every warp took both paths, and the same branch made it slower
    (467 → 520 µs)."""
    tests = [T.abs(values[j]) >= T.float32(E4M3_SMALLEST_NORMAL) for j in indices]
    return functools.reduce(T.And, tests)


@T.macro
def carry_round_normal_to_e4m3(value, field, run, j):
    """:func:`carry_round_to_e4m3` for a ``value`` with ``|value| ≥ 2^-6`` (±inf included): its offset is 0
    and it is no NaN, so the field goes onto the signed pattern (the carry stops below the sign: the
    pattern of ``|value|`` is at most inf's, the field under 2^20) and the cut keeps the sign — 3
    instructions where the general form takes 10."""
    run[j] = T.reinterpret((T.reinterpret(value, "uint32") + field) & T.uint32(E4M3_KEPT_BITS), "float32")


def build_nearest(spec):
    """The ``T.prim_func`` of a ``nearest_cast`` ``spec`` (a ``quant.element_cast.ElementCastSpec``):
    buffers ``(result [N], x [N])``."""
    N = T.dynamic("N", "int64")
    layout = RunLayout(spec, N)
    RUN, THREADS = layout.RUN, layout.THREADS
    SOURCE, TARGET = spec.source, spec.target

    @T.prim_func
    def kernel(result: T.Tensor((N,), TARGET), x: T.Tensor((N,), SOURCE)):
        with T.Kernel(layout.grid(N), threads=THREADS) as bx:
            tx = T.get_thread_binding()
            values = T.alloc_local((RUN,), SOURCE)
            run = T.alloc_local((RUN,), "float32")
            thread = T.cast(bx, "int64") * THREADS + tx
            for j in T.unroll(RUN):
                values[j] = T.cast(0, SOURCE)
            layout.load_run(x, thread * RUN, values)
            for j in T.unroll(RUN):
                run[j] = T.cast(values[j], "float32")
            layout.store_run(result, thread * RUN, run)

    return kernel.with_attr("global_symbol", spec.name)


def build_stochastic(spec):
    """The ``T.prim_func`` of a ``stochastic_cast`` ``spec`` (a ``quant.element_cast.ElementCastSpec``):
    buffers ``(result [N], x [N], seed [1], offset [1], arrivals [1])``; it reads the offset and its last
    CTA advances it (``random.philox.read_the_offset_and_count_the_cta``). A thread's run of ``R`` elements
    takes ``R / (4k)`` Philox blocks (``k`` fields a word): word ``i`` of block ``b`` serves elements
    ``(4b + i)·k … (4b + i)·k + k − 1``. Its Philox rounds take the split product (``__umulhi`` and a
    32-bit product): with one ``mul.wide.u32`` a product the bf16 → e4m3 cast took 836 µs at
    T = 65536, H = 7168 on an H100 (2026-12-06, a word an element) against 745 on an H200 with the
    split one (2026-12-04; the two GPUs time issue-bound kernels alike), as ``fill_rand`` fp32 slowed
    (``random.spec.RandomKernelSpec.wide_product``)."""
    N = T.dynamic("N", "int64")
    FIELDS, WIDTH = spec.fields_per_word, spec.field_bits
    layout = RunLayout(spec, N, spec.values_per_thread)
    BLOCKS, RUN, THREADS = layout.BLOCKS, layout.RUN, layout.THREADS
    assert BLOCKS * 4 * FIELDS == RUN, "a run is whole Philox blocks"
    SOURCE, TARGET = spec.source, spec.target
    TO_BF16 = TARGET == "bfloat16"
    # the rounding, and where it wants its field: a bf16 target adds it to the 16 dropped bits, an
    # e4m3 target to the 20 (its top at bit 19)
    if TO_BF16:
        round_value, POSITION = round_to_bf16, 0
    else:
        round_value, POSITION = carry_round_to_e4m3, e4m3_field_position(WIDTH)
    seed_t, offset_t = state_buffers()

    @T.prim_func
    def kernel(result: T.Tensor((N,), TARGET), x: T.Tensor((N,), SOURCE), seed: seed_t, offset: offset_t,
               arrivals: arrivals_buffer()):
        with T.Kernel(layout.grid(N), threads=THREADS) as bx:
            tx = T.get_thread_binding()
            words = T.alloc_local((4,), "uint32")
            values = T.alloc_local((RUN,), SOURCE)
            run = T.alloc_local((RUN,), "float32")
            thread = T.cast(bx, "int64") * THREADS + tx
            for j in T.unroll(RUN):
                values[j] = T.cast(0, SOURCE)
            layout.load_run(x, thread * RUN, values)
            drawn_offset, arrived = read_the_offset_and_count_the_cta(offset, arrivals, tx)
            for k in T.unroll(BLOCKS):
                philox_block(seed[0], drawn_offset[0], thread * BLOCKS + k, words, False)  # the split product
                for i in T.unroll(4):
                    for field in T.unroll(FIELDS):
                        round_value(T.cast(values[(4 * k + i) * FIELDS + field], "float32"),
                                    random_field(words[i], field, WIDTH, POSITION), run, (4 * k + i) * FIELDS + field)
            layout.store_run(result, thread * RUN, run)
            advance_if_the_last_cta(offset, arrivals, tx, arrived, T.cast(layout.grid(N), "int32"))

    return kernel.with_attr("global_symbol", spec.name)


BUILDS = {"nearest_cast": build_nearest, "stochastic_cast": build_stochastic}
"""Op → the build of its ``ElementCastSpec``."""
