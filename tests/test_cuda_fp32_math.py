"""The CUDA backend's fp32 ``exp`` / ``log1p`` helpers (``tileplug.backend_cuda.fp32_math``), built
for the host with ``cc`` from the same C source the kernels carry, against the C library's fp64
functions rounded to fp32 (what the kernels called before, and what the reference rounds).

Every finite fp32 input was swept once (``python tests/test_cuda_fp32_math.py``, 2026-12-06, x86-64
glibc): no exp or log1p result differs from the library's rounding. exp's fast path took 2 237 399 042
inputs (``|t| ≤ 87``) and left 34 of them to the library, its largest error against ``expl`` 1.278 fp64
ulps; log1p's took 218 103 808 (``[2^-26, 1)``), left 19, largest error against ``log1pl`` 1.661 ulps
(the margin is 16). The sqrtsoftplus gate's fused helper, ``rn32(log1p(rn32(exp(−|x|))))`` with one range
test, was swept the same way over every non-negative finite ``x`` (its value depends on ``|x|`` only;
391 s on one core): no result differs from the library's two roundings, its fast path took 1 118 699 521 inputs and
left 20 to the library. The tests below sweep every 7919th bit pattern and the edges.
"""

from __future__ import annotations

import ctypes
import math
import shutil
import struct
import subprocess
import sys

import pytest

from tileplug.backend_cuda import fp32_math

DRIVER = r"""
static float from_bits(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static uint32_t to_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }
float exp_fast(float t) { return tileplug_exp_f32_fast(t); }
float exp_full(float t) { return tileplug_exp_f32(t); }
float log1p_fast(float e) { return tileplug_log1p_f32_fast(e); }
float log1p_full(float e) { return tileplug_log1p_f32(e); }
float softplus_log_fast(float x) { return tileplug_softplus_log_f32_fast(x); }
/* |y - truth| in fp64 ulps of y */
static double ulps(double y, long double truth) { int e; frexp(y, &e); return (double)(fabsl((long double)y - truth) / ldexpl(1.0L, e - 53)); }
/* Over the finite inputs with bit patterns first, first + stride, ... <= last: results differing from the
   library's rounding (returned; the first in *first_mismatch), the fast path's inputs (*fast) and those
   it left to the library (*unsure; the first in *first_unsure), its largest error (*max_ulps). */
long sweep(int op, uint32_t first, uint32_t last, uint32_t stride, long *fast, long *unsure, double *max_ulps,
           uint32_t *first_mismatch, uint32_t *first_unsure) {
  long mismatches = 0;
  for (uint64_t b = first; b <= last; b += stride) {
    float v = from_bits((uint32_t)b), got, want, quick;
    if (!isfinite(v)) continue;
    int in_range;
    double wide = 0.0;
    long double truth = 0.0L;
    if (op == 0) {
      got = tileplug_exp_f32(v); want = (float)exp((double)v); quick = tileplug_exp_f32_fast(v);
      in_range = fabsf(v) <= %(exp_limit)sf;
      if (in_range) { wide = tileplug_exp_wide(v); truth = expl((long double)v); }
    } else if (op == 1) {
      got = tileplug_log1p_f32(v); want = (float)log1p((double)v); quick = tileplug_log1p_f32_fast(v);
      in_range = v >= %(direct_below)sf && v < 1.0f;
      if (in_range) { wide = tileplug_log1p_wide(v); truth = log1pl((long double)v); }
    } else {  /* softplus's second term as the gate computes it: the fused fast value, else the library's */
      quick = tileplug_softplus_log_f32_fast(v);
      got = quick == quick ? quick : tileplug_softplus_log_f32_library(v);
      want = (float)log1p((double)(float)exp((double)-fabsf(v)));
      in_range = fabsf(v) <= %(exp_limit)sf;
    }
    if (to_bits(got) != to_bits(want) && !(isnan(got) && isnan(want))) {
      if (mismatches == 0) *first_mismatch = (uint32_t)b;
      mismatches++;
    }
    if (in_range) {
      double error = op == 2 ? 0.0 : ulps(wide, truth);
      if (error > *max_ulps) *max_ulps = error;
      (*fast)++;
      if (isnan(quick)) { if (*unsure == 0) *first_unsure = (uint32_t)b; (*unsure)++; }
    }
  }
  return mismatches;
}
"""


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def build_library(folder, compiler: str) -> ctypes.CDLL:
    """The helpers and :data:`DRIVER` built into a shared library in ``folder``."""
    source = folder / "fp32_math.c"
    source.write_text(fp32_math.host_source() + DRIVER % {
        "exp_limit": repr(fp32_math.EXP_FAST_LIMIT), "direct_below": fp32_math.LOG_DIRECT_BELOW.hex()})
    shared = folder / "fp32_math.so"
    subprocess.run([compiler, "-O2", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC", "-o", str(shared),
                    str(source), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(shared))
    for name in ("exp_fast", "exp_full", "log1p_fast", "log1p_full", "softplus_log_fast"):
        getattr(lib, name).restype = ctypes.c_float
        getattr(lib, name).argtypes = [ctypes.c_float]
    lib.sweep.restype = ctypes.c_long
    lib.sweep.argtypes = [ctypes.c_int, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32,
                          ctypes.POINTER(ctypes.c_long), ctypes.POINTER(ctypes.c_long), ctypes.POINTER(ctypes.c_double),
                          ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32)]
    return lib


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    compiler = _compiler()
    if compiler is None:
        pytest.skip("no C compiler (cc) on this machine")
    return build_library(tmp_path_factory.mktemp("fp32_math"), compiler)


def _f32(value: float) -> float:
    """``value`` rounded to fp32 (to nearest, ties to even; overflow to ±inf)."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or _bits(a) == _bits(b)


def _sweep(lib, op: int, first: int, last: int, stride: int):
    fast, unsure, max_ulps = ctypes.c_long(0), ctypes.c_long(0), ctypes.c_double(0.0)
    first_mismatch, first_unsure = ctypes.c_uint32(0), ctypes.c_uint32(0)
    mismatches = lib.sweep(op, first, last, stride, ctypes.byref(fast), ctypes.byref(unsure), ctypes.byref(max_ulps),
                           ctypes.byref(first_mismatch), ctypes.byref(first_unsure))
    return mismatches, fast.value, unsure.value, max_ulps.value, first_mismatch.value, first_unsure.value


# Both signs of every exponent: patterns 0 .. 0x7f7fffff and 0x80000000 .. 0xff7fffff.
SIGNS = ((0x00000000, 0x7F7FFFFF), (0x80000000, 0xFF7FFFFF))


@pytest.mark.parametrize("op, name", [(0, "exp"), (1, "log1p"), (2, "softplus_log")])
def test_sampled_sweep_gives_the_library_rounding(library, op, name) -> None:
    total_fast = 0
    for first, last in SIGNS:
        mismatches, fast, unsure, max_ulps, first_mismatch, _ = _sweep(library, op, first, last, 7919)
        assert mismatches == 0, f"{name}: {mismatches} differ, first at {_from_bits(first_mismatch)!r}"
        assert max_ulps <= fp32_math.ROUNDING_MARGIN / 4, (name, max_ulps)
        assert unsure <= max(2, fast // 100_000), (name, unsure, fast)
        total_fast += fast
    assert total_fast > (25_000 if op == 1 else 200_000), total_fast  # the fast path did run


EXP_EDGES = [0.0, -0.0, 1e-45, -1e-45, 1e-30, 0.5, -0.5, 1.0, -1.0, 10.0, -10.0, 86.99, -86.99, 87.0, -87.0,
             87.00001, -87.00001, 88.72, 88.73, -103.0, -103.97, -104.0, -150.0, 200.0, math.inf, -math.inf, math.nan]
LOG1P_EDGES = [0.0, -0.0, 1e-45, 2.0**-27, 2.0**-26, _from_bits(_bits(2.0**-26) - 1), _from_bits(_bits(2.0**-26) + 1),
               2.0**-7, 0.25, 0.5, 0.75, _from_bits(_bits(1.0) - 1), 1.0, 1.5, 3.0e38, -0.25, -1.0, -2.0, math.inf,
               math.nan]


@pytest.mark.parametrize("value", EXP_EDGES)
def test_exp_edges(library, value) -> None:
    value = _f32(value)
    want = math.nan if math.isnan(value) else _f32(math.exp(value)) if value < 709 else math.inf
    assert _same(library.exp_full(value), want), (value, library.exp_full(value), want)
    fast = library.exp_fast(value)
    assert math.isnan(fast) or _same(fast, want)
    if abs(value) > fp32_math.EXP_FAST_LIMIT or math.isnan(value):
        assert math.isnan(fast)  # outside the fast range the library decides


@pytest.mark.parametrize("value", LOG1P_EDGES)
def test_log1p_edges(library, value) -> None:
    value = _f32(value)
    want = _f32(math.log1p(value)) if value > -1 else (-math.inf if value == -1 else math.nan)
    assert _same(library.log1p_full(value), want), (value, library.log1p_full(value), want)
    fast = library.log1p_fast(value)
    assert math.isnan(fast) or _same(fast, want)
    if value < 0 or value > 1 or math.isnan(value):
        assert math.isnan(fast)
    if 0 <= value < fp32_math.LOG_DIRECT_BELOW or value == 1.0:
        assert _same(fast, want)  # decided without the library


SOFTPLUS_EDGES = [0.0, -0.0, 1e-45, -1e-45, 2.0**-26, -(2.0**-25), 1e-7, 0.5, -0.5, 1.0, -3.0, 17.0, -17.5, 18.5, 19.0,
                  -20.0, 60.0, 86.99, -87.0, 87.00001, -88.0, 103.0, -150.0, 3.0e38, math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("value", SOFTPLUS_EDGES)
def test_softplus_log_edges(library, value) -> None:
    """The gate's fused ``log1p(exp(−|x|))`` (each function rounded to fp32): its fast value where it has one,
    else NaN (and the library), on the edges of both functions' ranges."""
    value = _f32(value)
    if math.isnan(value):
        want = math.nan
    else:
        wide = math.exp(-abs(value)) if abs(value) < 745 else 0.0
        want = _f32(math.log1p(_f32(wide)))
    fast = library.softplus_log_fast(value)
    assert math.isnan(fast) or _same(fast, want), (value, fast, want)
    if abs(value) > fp32_math.EXP_FAST_LIMIT or math.isnan(value):
        assert math.isnan(fast)  # out of range: the library decides
    elif value == 0.0:
        assert _same(fast, _f32(math.log(2.0)))  # exp gives 1: log1p(1) without the library
    mismatches = _sweep(library, 2, _bits(value), _bits(value), 1)[0]
    assert mismatches == 0, value  # the settled value (fast, else the library's) is the library's rounding


NEAR_MIDPOINTS = [(0, 0x3FE67199), (0, 0x4001B249), (0, 0x40315B33), (1, 0x33800000), (1, 0x35400003),
                  (1, 0x36AAD563)]
"""Inputs whose fast fp64 value lies within the margin of an fp32 midpoint (found by sweeping: about one
input in 2^24 for exp; log1p(2^-24) = 2^-24 − 2^-49 + … sits just above one)."""


@pytest.mark.parametrize("op, bits", NEAR_MIDPOINTS, ids=[f"{op}-{bits:08x}" for op, bits in NEAR_MIDPOINTS])
def test_near_midpoints_go_to_the_library(library, op, bits) -> None:
    value = _from_bits(bits)
    fast, full, exact = ((library.exp_fast, library.exp_full, math.exp) if op == 0
                         else (library.log1p_fast, library.log1p_full, math.log1p))
    assert math.isnan(fast(value))
    assert _same(full(value), _f32(exact(value)))
    _, in_range, unsure, _, _, first_unsure = _sweep(library, op, bits, bits, 1)
    assert (in_range, unsure, first_unsure) == (1, 1, bits)


def _full_sweep() -> int:
    """Every finite fp32 input (minutes on one core): the numbers in the module docstring."""
    import tempfile
    from pathlib import Path

    lib = build_library(Path(tempfile.mkdtemp(prefix="fp32_math")), _compiler() or "cc")
    for op, name in ((0, "exp"), (1, "log1p"), (2, "softplus_log")):
        totals = [0, 0, 0, 0.0]
        for first, last in SIGNS[:1] if op == 2 else SIGNS:  # (softplus_log depends on |x| only)
            mismatches, fast, unsure, max_ulps, _, _ = _sweep(lib, op, first, last, 1)
            totals = [totals[0] + mismatches, totals[1] + fast, totals[2] + unsure, max(totals[3], max_ulps)]
        print(f"{name}: {totals[0]} differ from the library's rounding; fast path {totals[1]} inputs, "
              f"{totals[2]} left to the library; largest error {totals[3]:.3f} fp64 ulps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_full_sweep())


def test_the_gate_takes_the_tables_when_told(monkeypatch) -> None:
    """``moe_topk_gate`` evaluates with CUDA's fp64 functions inline under ``TILEPLUG_CUDA_MOE_SCORE_MATH=library``
    and with the fast helpers under ``tables``; by default (``auto``) the sqrtsoftplus gate takes the tables and the
    sigmoid one CUDA's functions; other values are refused, naming the variable."""
    pytest.importorskip("tilelang")
    import torch

    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.moe.spec import SCORE_MATH_VARIABLE
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core import ops
    from tileplug.core.lowering import describe_call

    logits = torch.empty(4, 256, dtype=torch.float32, device="meta")
    bias = torch.empty(256, device="meta")
    call = describe_call(ops.moe_topk_gate, logits, 8, "sqrtsoftplus", bias=bias)[0]
    sigmoid_call = describe_call(ops.moe_topk_gate, logits, 8, "sigmoid", bias=bias)[0]
    gate = _KERNELS["moe_topk_gate"]
    monkeypatch.setenv(SCORE_MATH_VARIABLE, "library")
    library = gate.spec(call)
    source = jit.lower_source(library)
    assert not library.table_math and "tileplug_" not in source  # no prelude, CUDA's functions inline
    assert "exp(((double)" in source and "log1p(((double)" in source
    monkeypatch.setenv(SCORE_MATH_VARIABLE, "tables")
    tables = gate.spec(call)
    assert tables.table_math and tables.name == library.name.replace("_w4", "_w4_tablemath")
    assert gate.spec(sigmoid_call).table_math
    source = jit.lower_source(tables)
    body = source[source.index("__global__ void __launch_bounds__"):]
    assert "tileplug_softplus_log_f32_fast(" in body and "tileplug_softplus_log_f32_library(" in body  # (the rare path)
    sigmoid = jit.lower_source(gate.spec(sigmoid_call))
    body = sigmoid[sigmoid.index("__global__ void __launch_bounds__"):]
    assert "tileplug_exp_f32_fast(" in body and "tileplug_exp_f32_library(" in body
    monkeypatch.delenv(SCORE_MATH_VARIABLE)
    assert gate.spec(call) == tables and not gate.spec(sigmoid_call).table_math
    monkeypatch.setenv(SCORE_MATH_VARIABLE, "fast")
    with pytest.raises(ValueError, match=f"{SCORE_MATH_VARIABLE}='fast': expected one of auto, library, tables"):
        gate.spec(call)
