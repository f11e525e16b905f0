"""The TileLang kernels of the CUDA element-wise casts (``element_cast``) and the stochastic
rounding macros the quant tile kernel shares (``grid_rounding``).

``nearest_cast``: a thread's run of ``x`` widened to fp32 (exact) and converted to the target by
the store (round to nearest even; e4m3 with ``satfinite``). ``stochastic_cast``: element ``j``
of a thread's run rounds with ``r = word_j >> 8`` of its Philox block (``random.philox``), to
the reference's bytes (docs/spec.md §10.2): ``a = |x|`` between its neighbouring targets
``lo ≤ a < hi`` becomes ``hi`` iff ``floor((a − lo) / (hi − lo) · 2^24) + r ≥ 2^24``. Both
roundings are a few integer operations:

- fp32 → bf16: the fraction is the 16 dropped bits ``m`` shifted up by 8, and
  ``(m << 8) + r ≥ 2^24`` iff ``m + (word >> 16) ≥ 2^16``: add ``word >> 16`` to the fp32
  pattern and clear its low 16 bits (a carry is the step up, past the largest finite: inf).
- fp32 / bf16 → e4m3 (and the quantized values of the stochastic per-token / per-block
  casts, e4m3 or e2m1: :func:`grid_rounding`): ``a = min(a, 448)``, ``e`` its binade clamped
  below at −6 (e4m3's smallest normal exponent; its subnormals share that step),
  ``s = a · 2^(3 − e)`` in [0, 16); ``fixed = floor(s · 2^24)`` is exact (a power-of-two
  scaling below 2^28, then one floor) and ``(fixed + r) >> 24`` is ``floor(s)`` plus the step;
  times ``2^(e − 3)`` it is an e4m3 value, which the store converts exactly. e2m1: 6, 1
  mantissa bit, smallest exponent 0.

The sign is the input's (−0 stays −0), NaN stays NaN (found from its bits: TVM folds
``x != x`` to false). ``ieee_*`` arithmetic: no contraction into FMAs, no fast-math rewrites.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.random.philox import RunLayout, philox_block, state_buffers

MANTISSA_SHIFT = 8
"""``word >> 8``: the 24 random bits of a word (those of ``fill_rand``)."""
FRACTION_BITS = 24
"""The fixed point of ``floor(p · 2^24)``: one unit of the target's last place is ``2^24``."""
WORD_BITS = 32
SIGN_BIT = 0x80000000
MAGNITUDE_BITS = 0x7FFFFFFF
BF16_DROPPED_BITS = 16
BF16_KEPT_BITS = 0xFFFF0000
GRIDS = {"e4m3": (448.0, 3, -6), "e2m1": (6.0, 1, 0)}
"""Grid → (largest value, mantissa bits, smallest normal exponent): the binades a stochastic
rounding steps through (a subnormal range shares the smallest normal exponent's step)."""
FP32_BIAS = 127
FP32_MANTISSA_BITS = 23
FP32_INFINITY = 0x7F800000


def power_of_two(exponent):
    """``2^exponent`` (an int32 expression in [−126, 127]) as an fp32 built from its bits."""
    return T.reinterpret(T.cast(T.shift_left(exponent + FP32_BIAS, FP32_MANTISSA_BITS), "uint32"), "float32")


def is_nan(value):
    """fp32 ``value`` is a NaN, from its bits (``value != value`` is folded away as false). CUDA's
    ``isnan`` saves an instruction an element but not the registers: the stochastic e4m3 kernels
    went from 64 to 88 registers, half the CTAs per SM, and 22 % slower (H200, 2026-12-04)."""
    return (T.reinterpret(value, "uint32") & T.uint32(MAGNITUDE_BITS)) > T.uint32(FP32_INFINITY)


def with_sign_of(magnitude, value):
    """``magnitude`` (fp32, sign bit clear) with the sign bit of fp32 ``value``."""
    sign = T.reinterpret(value, "uint32") & T.uint32(SIGN_BIT)
    return T.reinterpret(T.reinterpret(magnitude, "uint32") | sign, "float32")


@T.macro
def round_to_bf16(value, word, run, j):
    """``run[j]`` = fp32 ``value`` rounded stochastically to a bf16 value (held in fp32) with
    Philox ``word`` (uint32). ``(m << 8) + (word >> 8) ≥ 2^24`` iff ``m + (word >> 16) ≥ 2^16``
    (``m``: the 16 dropped bits), so the rounding is one add to the pattern and a truncation
    (a carry into the exponent is the step up; nothing carries into the sign below NaN)."""
    rounded = (T.reinterpret(value, "uint32") + T.shift_right(word, WORD_BITS - BF16_DROPPED_BITS)) & T.uint32(
        BF16_KEPT_BITS)
    run[j] = T.if_then_else(is_nan(value), value, T.reinterpret(rounded, "float32"))


def grid_rounding(grid: str):
    """The stochastic rounding macro ``round(value, word, run, j)`` onto ``grid`` ("e4m3" or
    "e2m1", :data:`GRIDS`): ``run[j]`` = fp32 ``value`` saturated to the grid's largest value
    and rounded with Philox ``word``, an exact grid value held in fp32 (the caller's
    deterministic conversion then encodes it). ``fixed = floor(s · 2^24)`` is exact (``s · 2^24``
    is a power-of-two scaling below 2^(mantissa + 25)), and ``(fixed + (word >> 8)) >> 24`` is
    ``floor(s)`` plus the rounding's step."""
    largest, mantissa_bits, min_exponent = GRIDS[grid]

    @T.macro
    def round_to_grid(value, word, run, j):
        magnitude = T.alloc_var("float32")
        exponent = T.alloc_var("int32")
        fixed = T.alloc_var("int32")
        magnitude = T.min(T.abs(value), T.float32(largest))  # NaN: replaced below
        exponent = T.max(T.cast(T.shift_right(T.reinterpret(magnitude, "uint32"), FP32_MANTISSA_BITS), "int32")
                         - FP32_BIAS, min_exponent)
        fixed = T.cast(T.floor(T.ieee_mul(magnitude, power_of_two(mantissa_bits + FRACTION_BITS - exponent))), "int32")
        steps = T.shift_right(fixed + T.cast(T.shift_right(word, MANTISSA_SHIFT), "int32"), FRACTION_BITS)
        rounded = T.ieee_mul(T.cast(steps, "float32"), power_of_two(exponent - mantissa_bits))
        run[j] = T.if_then_else(is_nan(value), value, with_sign_of(rounded, value))

    return round_to_grid


round_to_e4m3 = grid_rounding("e4m3")


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
    """The ``T.prim_func`` of a ``stochastic_cast`` ``spec`` (a ``quant.element_cast.ElementCastSpec``): buffers
    ``(result [N], x [N], seed [1], offset [1])``; it reads the offset, the second launch
    advances it. Its Philox rounds take the split product (``__umulhi`` and a 32-bit product): with one
    ``mul.wide.u32`` a product the bf16 → e4m3 cast took 836 µs at T = 65536, H = 7168 on an H100
    (2026-12-06) against 745 on an H200 with the split one (2026-12-04; the two GPUs time issue-bound
    kernels alike), as ``fill_rand`` fp32 slowed (``random.spec.RandomKernelSpec.wide_product``)."""
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
                philox_block(seed[0], offset[0], thread * BLOCKS + k, words, False)  # the split product (docstring)
                for i in T.unroll(4):
                    round_value(T.cast(values[4 * k + i], "float32"), words[i], run, 4 * k + i)
            layout.store_run(result, thread * RUN, run)

    return kernel.with_attr("global_symbol", spec.name)


BUILDS = {"nearest_cast": build_nearest, "stochastic_cast": build_stochastic}
"""Op → the build of its ``ElementCastSpec``."""
