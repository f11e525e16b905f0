"""Correctly rounded fp32 ``exp`` and ``log1p`` for CUDA kernels, cheap on the common path.

The reference rounds each of ``exp`` / ``log1p`` once to fp32 from an fp64 result
(``tileplug.core.moe.formulas.correctly_rounded``). A kernel that calls CUDA's fp64 ``exp`` /
``log1p`` matches it, but pays about 30 fp64 instructions a function (the MoE gate's
``sqrt(softplus(x))`` took 72 fp64 instructions a score). These helpers compute the same fp32
results with table-driven fp64 polynomials (about 10 fp64 instructions each) whose error is a few
fp64 ulps, and test whether that error could change the fp32 rounding: the result lies farther than
:data:`ROUNDING_MARGIN` fp64 ulps from the midpoint of two fp32 values (an fp64 value's low 29
mantissa bits are its position between two fp32 values) or the helper falls back to CUDA's fp64
function. So the result is, for every input, the fp32 rounding of CUDA's fp64 function — the
value the kernels computed before. Over every fp32 input (``tests/test_cuda_fp32_math.py``) the
fallback takes 34 of exp's 2 237 399 042 fast-range inputs and 19 of log1p's 218 103 808.

- ``tileplug_exp_f32(t)``: ``rn32(exp(t))``. Fast path for ``|t| ≤ 87`` (normal fp32 results):
  ``k = rint(t · 64 / ln 2)``, ``r = t − k · ln 2 / 64`` (Cody–Waite, exact), ``exp(r) − 1`` by
  its degree-5 Taylor polynomial (``|r| ≤ ln 2 / 128``: truncation below 2^-54), times ``2^(j/64)``
  from a 64-entry table, ``j = k mod 64``, scaled by ``2^⌊k/64⌋`` in the exponent bits.
- ``tileplug_log1p_f32(e)`` for ``e`` in ``[0, 1]`` (softplus's ``exp(−|x|)``): ``e < 2^-26``
  gives ``e`` (``log1p(e)`` is within ``e²/2`` below it, less than a quarter of an fp32 step);
  ``e = 1`` gives ``rn32(ln 2)``; otherwise ``m = 1 + e`` (exact), ``j`` = the top 7 bits of
  its mantissa, ``z = R_j · m − 1`` (one exact FMA: ``R_j`` ≈ ``1 / m`` on a multiple of
  2^-12, so ``|z| < 2^-7``), ``log1p(e) = −ln R_j + log1p(z)`` with ``log1p(z)`` by its
  degree-8 Taylor polynomial (truncation below 2^-56 relative).
- ``tileplug_softplus_log_f32_fast(x)``: ``rn32(log1p(rn32(exp(−|x|))))``, softplus's second term,
  both fast paths at once: one range test (``|x| ≤ 87``) and no check between the two functions
  (``e`` lies in ``(0, 1]``); NaN unless both round surely, where ``..._library(x)`` (the two
  functions above, out of line) decides.

:data:`DEVICE_HELPERS` is a kernel prelude (``T.Kernel(prelude=...)``); :func:`host_source`
is the same C code for a host compiler (the tests build it with ``cc`` and sweep fp32 inputs
against the C library's fp64 functions). Every operation is an explicit IEEE fp64 operation
(``__fma_rn``, ``__dmul_rn``, ``__dadd_rn``; ``fma`` and ``-ffp-contract=off`` on the host), so
the host build computes the device's bits.

No ``from __future__ import annotations``: TileLang evaluates annotations of the modules it
traces (this one is imported by kernel modules).
"""

import math
import struct
from decimal import Decimal, localcontext
from functools import lru_cache

EXP_TABLE_BITS = 6
LOG_TABLE_BITS = 7
LOG_DIRECT_BELOW = 2.0**-26
"""``log1p(e)`` rounds to ``e`` itself below this (``e − e²/2`` is within a quarter step of ``e``)."""
EXP_FAST_LIMIT = 87.0
"""The fast ``exp`` path's ``|t|`` bound: its results are normal fp32 values."""
ROUNDING_MARGIN = 16
"""fp64 ulps: a fast result this close to an fp32 midpoint takes the fp64 library function.
The fast paths' largest error, over every fp32 input, is a few ulps (``tests/test_cuda_fp32_math.py``
sweeps them; the full sweep is in its docstring)."""


def _double(value: Decimal) -> float:
    """``value`` rounded to the nearest fp64 (``float(str)`` rounds correctly)."""
    return float(str(value))


def _hex(value: float) -> str:
    """A C literal of ``value``, exact."""
    return value.hex()


def _cleared(value: float, low_bits: int) -> float:
    """``value`` with its lowest ``low_bits`` mantissa bits cleared."""
    (bits,) = struct.unpack("<Q", struct.pack("<d", value))
    return struct.unpack("<d", struct.pack("<Q", bits & ~((1 << low_bits) - 1)))[0]


@lru_cache(maxsize=None)
def _constants() -> dict:
    """Every table and constant, from 60-digit decimal arithmetic rounded once to fp64."""
    with localcontext() as context:
        context.prec = 60
        return _constants_at_precision()


def _constants_at_precision() -> dict:
    ln2 = Decimal(2).ln()
    step = ln2 / (1 << EXP_TABLE_BITS)
    step_high = _cleared(_double(step), 14)  # k · step_high exact for |k| < 2^14 (|t| ≤ 87: |k| < 8100)
    log_rows = 1 << LOG_TABLE_BITS
    reciprocals = [1.0]  # R_0 = 1: z = e exactly on the first row, and −ln R_0 = 0
    for j in range(1, log_rows):
        centre = 1 + (Decimal(j) + Decimal("0.5")) / log_rows
        reciprocals.append(float(round(Decimal(4096) / centre)) / 4096)
    return {
        "exp_scale": _double((1 << EXP_TABLE_BITS) / ln2),
        "step_high": step_high,
        "step_low": _double(step - Decimal(step_high)),
        "exp_table": [_double(Decimal(2) ** (Decimal(j) / (1 << EXP_TABLE_BITS))) for j in range(1 << EXP_TABLE_BITS)],
        "log_reciprocals": reciprocals,
        "log_table": [_double(-Decimal(r).ln()) if r != 1.0 else 0.0 for r in reciprocals],
        "ln2_f32": struct.unpack("<f", struct.pack("<f", float(ln2)))[0],
        "exp_terms": {n: _double(1 / Decimal(math.factorial(n))) for n in (3, 4, 5)},
        "log_terms": {n: _double(Decimal((-1) ** (n + 1)) / n) for n in range(3, 9)},
    }


_BODY = r"""
TP_TABLE double tileplug_exp_table[%(exp_rows)d] = {%(exp_table)s};
TP_TABLE double tileplug_log_reciprocals[%(log_rows)d] = {%(log_reciprocals)s};
TP_TABLE double tileplug_log_table[%(log_rows)d] = {%(log_table)s};

/* Whether fp64 y (a normal fp32 value once rounded) lies more than the margin from an fp32 midpoint. */
TP_DEV int tileplug_rounds_surely(double y) {
  int offset = (int)(TP_LOW_WORD(y) & 0x1FFFFFFFu) - 0x10000000;
  return offset > %(margin)d || offset < -%(margin)d;
}

/* The fp64 library functions rounded to fp32: the rare path, out of line. */
TP_RARE float tileplug_exp_f32_library(float t) { return (float)exp((double)t); }
TP_RARE float tileplug_log1p_f32_library(float e) { return (float)log1p((double)e); }

/* exp(t) in fp64 within a few ulps, for |t| <= %(exp_limit)s. */
TP_DEV double tileplug_exp_wide(float t) {
  double x = (double)t;
  double shifted = TP_FMA(x, %(exp_scale)s, 0x1.8p52);
  int k = (int)TP_LOW_WORD(shifted);
  double whole = TP_ADD(shifted, -0x1.8p52);
  double r = TP_FMA(-whole, %(step_high)s, x);
  r = TP_FMA(-whole, %(step_low)s, r);
  double q = TP_FMA(%(exp_c5)s, r, %(exp_c4)s);
  q = TP_FMA(q, r, %(exp_c3)s);
  q = TP_FMA(q, r, 0.5);
  double scale = tileplug_exp_table[k & %(exp_mask)d];
  double y = TP_FMA(scale, TP_FMA(TP_MUL(r, r), q, r), scale);
  return TP_SCALE_POW2(y, k >> %(exp_bits)d);
}

/* rn32(exp(t)) where the fast value surely rounds so, else NaN (the library must decide: also NaN t). */
TP_DEV float tileplug_exp_f32_fast(float t) {
  double y = tileplug_exp_wide(t);
  int sure = tileplug_rounds_surely(y) & (t <= %(exp_limit)sf) & (t >= -%(exp_limit)sf);
  return sure ? (float)y : TP_NAN;
}

/* rn32(exp(t)): the fast value, or the fp64 library's. */
TP_DEV float tileplug_exp_f32(float t) {
  float rounded = tileplug_exp_f32_fast(t);
  if (rounded != rounded) rounded = tileplug_exp_f32_library(t);
  return rounded;
}

/* log1p(e) in fp64 within a few ulps, for e in [%(direct_below)s, 1). */
TP_DEV double tileplug_log1p_wide(float e) {
  double m = TP_ADD(1.0, (double)e);
  int j = (int)(TP_HIGH_WORD(m) >> %(log_shift)d) & %(log_mask)d;
  double z = TP_FMA(tileplug_log_reciprocals[j], m, -1.0);
  double q = TP_FMA(%(log_c8)s, z, %(log_c7)s);
  q = TP_FMA(q, z, %(log_c6)s);
  q = TP_FMA(q, z, %(log_c5)s);
  q = TP_FMA(q, z, %(log_c4)s);
  q = TP_FMA(q, z, %(log_c3)s);
  q = TP_FMA(q, z, -0.5);
  return TP_ADD(tileplug_log_table[j], TP_FMA(TP_MUL(z, z), q, z));
}

/* rn32(log1p(e)) where it is sure without the library: e itself below %(direct_below)s (0 and -0
   included), rn32(ln 2) at 1, the fast value where it surely rounds so; else NaN (negative, NaN and
   e > 1 too: the library must decide). */
TP_DEV float tileplug_log1p_f32_fast(float e) {
  double l = tileplug_log1p_wide(e);
  float rounded = (tileplug_rounds_surely(l) & (e >= %(direct_below)sf) & (e < 1.0f)) ? (float)l : TP_NAN;
  rounded = ((e >= -0.0f) & (e < %(direct_below)sf)) ? e : rounded;
  return e == 1.0f ? %(ln2_f32)sf : rounded;
}

/* rn32(log1p(e)): the fast value, or the fp64 library's. */
TP_DEV float tileplug_log1p_f32(float e) {
  float rounded = tileplug_log1p_f32_fast(e);
  if (rounded != rounded) rounded = tileplug_log1p_f32_library(e);
  return rounded;
}

/* softplus's second term, rn32(log1p(rn32(exp(-|x|)))), each function as above: the rare path, out of line. */
TP_RARE float tileplug_softplus_log_f32_library(float x) { return tileplug_log1p_f32(tileplug_exp_f32(-fabsf(x))); }

/* The same where the fast values surely round so, else NaN (also for |x| > %(exp_limit)s, infinite and NaN x). One
   range test for both functions: e = rn32(exp(-|x|)) lies in (0, 1] there, so log1p's tests reduce to e itself
   below %(direct_below)s and rn32(ln 2) at 1. */
TP_DEV float tileplug_softplus_log_f32_fast(float x) {
  float t = -fabsf(x);
  double y = tileplug_exp_wide(t);
  float e = (tileplug_rounds_surely(y) & (t >= -%(exp_limit)sf)) ? (float)y : TP_NAN;
  double l = tileplug_log1p_wide(e);
  float rounded = tileplug_rounds_surely(l) ? (float)l : TP_NAN;
  rounded = e < %(direct_below)sf ? e : rounded;
  return e == 1.0f ? %(ln2_f32)sf : rounded;  /* (NaN e: NaN l, so NaN) */
}
"""

_DEVICE_MACROS = r"""
#define TP_DEV __device__ __forceinline__
#define TP_RARE __device__ __noinline__
#define TP_NAN __int_as_float(0x7fffffff)
#define TP_TABLE __device__ const
#define TP_FMA(a, b, c) __fma_rn((a), (b), (c))
#define TP_MUL(a, b) __dmul_rn((a), (b))
#define TP_ADD(a, b) __dadd_rn((a), (b))
#define TP_LOW_WORD(y) ((unsigned)__double2loint(y))
#define TP_HIGH_WORD(y) ((unsigned)__double2hiint(y))
#define TP_SCALE_POW2(y, n) __hiloint2double(__double2hiint(y) + (n) * (1 << 20), __double2loint(y))
"""

_HOST_MACROS = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#define TP_DEV static inline
#define TP_RARE static
#define TP_NAN NAN
#define TP_TABLE static const
#define TP_FMA(a, b, c) fma((a), (b), (c))
#define TP_MUL(a, b) ((a) * (b))
#define TP_ADD(a, b) ((a) + (b))
static inline uint64_t tp_bits(double y) { uint64_t b; memcpy(&b, &y, 8); return b; }
static inline double tp_double(uint64_t b) { double y; memcpy(&y, &b, 8); return y; }
#define TP_LOW_WORD(y) ((unsigned)tp_bits(y))
#define TP_HIGH_WORD(y) ((unsigned)(tp_bits(y) >> 32))
#define TP_SCALE_POW2(y, n) tp_double(tp_bits(y) + ((uint64_t)(int64_t)(n) << 52))
"""


def _body() -> str:
    constants = _constants()

    def listed(values):
        return ", ".join(_hex(v) for v in values)

    return _BODY % {
        "exp_rows": 1 << EXP_TABLE_BITS, "log_rows": 1 << LOG_TABLE_BITS,
        "exp_table": listed(constants["exp_table"]), "log_reciprocals": listed(constants["log_reciprocals"]),
        "log_table": listed(constants["log_table"]), "margin": ROUNDING_MARGIN,
        "exp_limit": repr(EXP_FAST_LIMIT), "exp_scale": _hex(constants["exp_scale"]),
        "step_high": _hex(constants["step_high"]), "step_low": _hex(constants["step_low"]),
        "exp_mask": (1 << EXP_TABLE_BITS) - 1, "exp_bits": EXP_TABLE_BITS,
        "log_shift": 20 - LOG_TABLE_BITS, "log_mask": (1 << LOG_TABLE_BITS) - 1,
        "direct_below": _hex(LOG_DIRECT_BELOW), "ln2_f32": _hex(constants["ln2_f32"]),
        **{f"exp_c{n}": _hex(v) for n, v in constants["exp_terms"].items()},
        **{f"log_c{n}": _hex(v) for n, v in constants["log_terms"].items()},
    }


@lru_cache(maxsize=None)
def device_helpers() -> str:
    """The kernel prelude defining ``tileplug_exp_f32`` / ``tileplug_log1p_f32`` (guarded: a kernel
    may carry it beside other preludes)."""
    return "#ifndef TILEPLUG_FP32_MATH\n#define TILEPLUG_FP32_MATH\n" + _DEVICE_MACROS + _body() + "#endif\n"


@lru_cache(maxsize=None)
def host_source() -> str:
    """The same functions for a host C compiler (build with ``-ffp-contract=off -lm``)."""
    return _HOST_MACROS + _body()


FUNCTIONS = ("exp", "log1p", "softplus_log")


def fast_f32(function: str, value):
    """TileLang: ``rn32(function(value))`` (``function`` in :data:`FUNCTIONS`) where the fast path is
    sure of it, else NaN — branch-free, so a thread's values interleave; the kernel then replaces
    each NaN by :func:`library_f32` of the same value, behind a branch. The kernel's prelude is
    :func:`device_helpers`."""
    import tilelang.language as T

    return T.call_extern("float32", f"tileplug_{function}_f32_fast", value)


def library_f32(function: str, value):
    """TileLang: ``rn32`` of CUDA's fp64 ``function(value)`` (an out-of-line call: the rare path)."""
    import tilelang.language as T

    return T.call_extern("float32", f"tileplug_{function}_f32_library", value)
