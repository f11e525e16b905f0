"""The TileLang kernel of CUDA ``stochastic_cast``: element ``j`` of a thread's run rounds with
``r = word_j >> 8`` of its Philox block (``random.philox``), exactly as the reference does it on
integers (docs/spec.md §10.2): ``a = |x|`` between its neighbouring targets ``lo ≤ a < hi``
becomes ``hi`` iff ``floor((a − lo) / (hi − lo) · 2^24) + r ≥ 2^24``.

- fp32 → bf16, on the fp32 pattern: ``lo`` is the pattern with its low 16 bits cleared, the
  fraction ``(m & 0xFFFF) << 8``, ``hi`` the next bf16 pattern (``+ 0x10000``: past the largest
  finite, inf). The result is a bf16 value held in fp32; the store's rounding is exact.
- fp32 / bf16 → e4m3: ``a = min(a, 448)``, ``e`` its binade clamped below at −6 (e4m3's
  smallest normal exponent; its subnormals share that step), ``s = a · 2^(3 − e)`` (exact:
  a power-of-two scaling into [8, 16), or [0, 8) below 2^-6), ``lo = floor(s) · 2^(e − 3)``;
  the fraction ``floor((s − floor(s)) · 2^24)`` is exact in fp32 (``s − floor(s)`` is, and
  scaling by 2^24 is). ``(floor(s) + up) · 2^(e − 3)`` is an e4m3 value, stored exactly.

The sign is the input's (−0 stays −0), NaN stays NaN (found from its bits: TVM folds
``x != x`` to false). ``ieee_*`` arithmetic: no
contraction into FMAs, no fast-math rewrites.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.random.philox import RunLayout, philox_block, state_buffers

MANTISSA_SHIFT = 8
"""``word >> 8``: the 24 random bits of a word (those of ``fill_rand``)."""
FRACTION_ONE = 1 << 24
"""``2^24``: one unit of the target's last place, in the fraction's fixed point."""
SIGN_BIT = 0x80000000
MAGNITUDE_BITS = 0x7FFFFFFF
BF16_DROPPED_BITS = 16
E4M3_MAX = 448.0
E4M3_MANTISSA_BITS = 3
E4M3_MIN_EXPONENT = -6
FP32_BIAS = 127
FP32_MANTISSA_BITS = 23
FP32_INFINITY = 0x7F800000


def power_of_two(exponent):
    """``2^exponent`` (an int32 expression in [−126, 127]) as an fp32 built from its bits."""
    return T.reinterpret(T.cast(T.shift_left(exponent + FP32_BIAS, FP32_MANTISSA_BITS), "uint32"), "float32")


def is_nan(value):
    """fp32 ``value`` is a NaN, from its bits (``value != value`` is folded away as false)."""
    return (T.reinterpret(value, "uint32") & T.uint32(MAGNITUDE_BITS)) > T.uint32(FP32_INFINITY)


def with_sign_of(magnitude, value):
    """``magnitude`` (fp32, sign bit clear) with the sign bit of fp32 ``value``."""
    sign = T.reinterpret(value, "uint32") & T.uint32(SIGN_BIT)
    return T.reinterpret(T.reinterpret(magnitude, "uint32") | sign, "float32")


@T.macro
def round_to_bf16(value, random_bits, run, j):
    """``run[j]`` = fp32 ``value`` rounded stochastically to a bf16 value (held in fp32);
    ``random_bits``: int32 in [0, 2^24) (the fixed-point sums stay below 2^25)."""
    pattern = T.alloc_var("uint32")
    magnitude = T.alloc_var("uint32")
    pattern = T.reinterpret(value, "uint32")
    magnitude = pattern & T.uint32(MAGNITUDE_BITS)
    fraction = T.cast(T.shift_left(magnitude & T.uint32((1 << BF16_DROPPED_BITS) - 1), MANTISSA_SHIFT), "int32")
    up = T.if_then_else(fraction + random_bits >= FRACTION_ONE, T.uint32(1), T.uint32(0))
    rounded = T.shift_left(T.shift_right(magnitude, BF16_DROPPED_BITS) + up, BF16_DROPPED_BITS)
    run[j] = T.if_then_else(is_nan(value), value, T.reinterpret(rounded | (pattern & T.uint32(SIGN_BIT)), "float32"))


@T.macro
def round_to_e4m3(value, random_bits, run, j):
    """``run[j]`` = fp32 ``value`` saturated to ±448 and rounded stochastically to an e4m3 value
    (held in fp32); ``random_bits`` as for :func:`round_to_bf16`."""
    magnitude = T.alloc_var("float32")
    exponent = T.alloc_var("int32")
    scaled = T.alloc_var("float32")
    steps = T.alloc_var("float32")
    magnitude = T.min(T.abs(value), T.float32(E4M3_MAX))  # NaN: replaced below
    exponent = T.max(T.cast(T.shift_right(T.reinterpret(magnitude, "uint32"), FP32_MANTISSA_BITS), "int32")
                     - FP32_BIAS, E4M3_MIN_EXPONENT)
    scaled = T.ieee_mul(magnitude, power_of_two(E4M3_MANTISSA_BITS - exponent))
    steps = T.floor(scaled)
    fraction = T.cast(T.floor(T.ieee_mul(T.ieee_sub(scaled, steps), T.float32(FRACTION_ONE))), "int32")
    up = T.if_then_else(fraction + random_bits >= FRACTION_ONE, T.float32(1.0), T.float32(0.0))
    rounded = T.ieee_mul(T.ieee_add(steps, up), power_of_two(exponent - E4M3_MANTISSA_BITS))
    run[j] = T.if_then_else(is_nan(value), value, with_sign_of(rounded, value))


def build(spec):
    """The ``T.prim_func`` of ``spec`` (a ``quant.stochastic_cast.StochasticCastSpec``): buffers
    ``(result [N], x [N], seed [1], offset [1])``; it reads the offset, the second launch
    advances it."""
    N = T.dynamic("N", "int64")
    layout = RunLayout(spec, N)
    BLOCKS, RUN, THREADS = layout.BLOCKS, layout.RUN, layout.THREADS
    SOURCE, TARGET = spec.source, spec.target
    round_value = round_to_bf16 if TARGET == "bfloat16" else round_to_e4m3
    seed_t, offset_t = state_buffers()

    @T.prim_func
    def kernel(result: T.Tensor((N,), TARGET), x: T.Tensor((N,), SOURCE), seed: seed_t, offset: offset_t):
        with T.Kernel(layout.grid(N), threads=THREADS) as bx:
            tx = T.get_thread_binding()
            words = T.alloc_local((4,), "uint32")
            values = T.alloc_local((RUN,), SOURCE)
            run = T.alloc_local((RUN,), "float32")
            thread = T.cast(bx, "int64") * THREADS + tx
            for j in T.unroll(RUN):
                values[j] = T.cast(0, SOURCE)
            layout.load_run(x, thread * RUN, values)
            for k in T.unroll(BLOCKS):
                philox_block(seed[0], offset[0], thread * BLOCKS + k, words)
                for i in T.unroll(4):
                    round_value(T.cast(values[4 * k + i], "float32"),
                                T.cast(T.shift_right(words[i], MANTISSA_SHIFT), "int32"), run, 4 * k + i)
            layout.store_run(result, thread * RUN, run)

    return kernel.with_attr("global_symbol", spec.name)
