"""The pieces every CUDA SwiGLU kernel is built from: which rows are valid, the two halves'
loads, the clamp, the sigmoid and the routed weight, in the reference's order of operations.

Rows: the norm family's row tile (``norm.rows.RowMacros`` over x viewed as ``[N, 2, H]``):
thread ``tx`` works on row ``bx · rows + tx // lanes`` and holds the same columns of the gate
half (``x[:, 0, :]``) and the up half (``x[:, 1, :]``), one 128-bit load per vector.

Valid rows (SPEC §7, with ``expert_ends``): a row's expert is the number of ends ``<= row``
(a binary search over ``E`` ends in global memory, ``E.bit_length()`` steps, each an index
below ``E``: malformed ends give a wrong layout, never an out-of-bounds read); the row is
valid when that expert exists and the row is at or past its start ``align(ends[e − 1])``.
The row's halves, weight and ``grad_y`` are loaded before the search (its dependent loads
would otherwise stall the row's loads: 42 % slower at T = 65536 on the H200), so a padding
row's bytes reach registers, but nothing computed from them is stored: every result of a
padding row is a selected zero, before any statistic (the cast's amax, the backward's row sum).

Math (fp32, SPEC §8, the reference's rounding points): ``g = min(gate, c)`` and ``u =
clamp(up, −c, c)`` keeping NaN (a select, not ``fminf``, which would drop it);
``sigmoid(g)`` is one of two evaluations (``SwigluKernelSpec.sigmoid``): where a result is
stored in fp32 (an fp32 ``y``, the cast, which quantizes the fp32 ``y``, and ``grad_x`` of an
fp32 x) it is taken in fp64 and rounded once — the correctly rounded value the reference
uses, so the products that follow repeat the reference's bits (one ulp of ``s`` grows to 5
ulp of ``y`` through three products, and to thousands of ulp of the gate gradient where
``1 + g·(1 − s)`` cancels); where the results are bf16 it is :func:`sigmoid_fp32` (within 1
ulp of the correctly rounded value: a bf16 ``y`` within 1 ulp, the gate gradient's
cancellation below a bf16 ulp) at a fraction of fp64's cost; with the sigmoid table (the
default, ``spec.SIGMOID_TABLE_VARIABLE``) a bf16 x's fp32 ``y`` and gradients read the reference's value
from a shared copy of ``sigmoid_table`` instead (:func:`table_sigmoid`);
``w' = w · routed_scaling_factor``; every product is a separate fp32 rounding and nothing is
contracted into an FMA (``ieee_*`` where an addition follows a product).

No ``from __future__ import annotations``: TileLang evaluates the macro annotations.
"""

import math
from decimal import Decimal
from typing import Any, NamedTuple

import tilelang.language as T
from tilelang import tvm  # noqa: F401 - makes tvm.script importable
from tvm.script.ir_builder import IRBuilder

from tileplug.backend_cuda.norm.rows import RowMacros, f32
from tileplug.core.swiglu import sigmoid_table
from tileplug.backend_cuda.swiglu.spec import SwigluKernelSpec

GATE, UP = 0, 1
"""The halves of x's row, as the second index of its ``[N, 2, H]`` view."""

LOG2E = 1.4426950408889634
ROUND_MAGIC = 12582912.0
"""1.5 · 2^23: adding it rounds an fp32 value below 2^22 to an integer (and subtracting it back)."""
LN2_HIGH = 0.693145751953125
"""ln 2 to 16 bits: ``k · LN2_HIGH`` is exact for the ``k < 256`` the reduction produces."""
LN2_LOW = 1.4286068203094172e-06
"""``ln 2 − LN2_HIGH`` (rounded to fp32)."""
EXPM1_TERMS = (1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 0.5)
"""``(e^r − 1 − r) / r²`` to ``r^5`` (Taylor; the next term is below 2^-27 of ``e^r`` for ``|r| ≤ ln2/2``)."""
SATURATION = 110.0
"""``|g|`` above this gives ``sigmoid`` 0 or 1 in fp32 (``e^-110 < 2^-158``)."""
SCALE_BITS = 64
"""``e^-|g|`` is carried as ``2^(64 − k)·(1 + m)``: normal down to ``k = 159``, so results in fp32's
subnormal range are rounded once, by the final ``· 2^-64``."""


def sigmoid_library_fp64(g):
    """fp32 ``sigmoid(g)``: ``1 / (1 + exp(−g))`` in fp64 with CUDA's ``exp`` and IEEE division,
    rounded once — the operations of PyTorch's fp64 sigmoid on the GPU, which the reference
    rounds to fp32 (its bits, but for a double rounding at a near-tie of both)."""
    wide = T.cast(g, "float64")
    return T.cast(T.float64(1.0) / (T.float64(1.0) + T.exp(T.float64(0.0) - wide)), "float32")


EXP_STEPS = 8
"""``e^-a = 2^(-k/8) · e^x`` with ``k = rint(a · 8 / ln 2)`` and ``|x| <= ln 2 / 16``."""
STEP_HIGH = 0.08664339756995787
"""``ln 2 / 8`` with the low 12 bits of its significand cleared: ``k · STEP_HIGH`` is exact for ``k < 2^12``
(``a <= 110`` gives ``k <= 1270``)."""
STEP_LOW = 3.529411320378947e-14
"""``ln 2 / 8 − STEP_HIGH`` (rounded to fp64)."""
STEP_POWERS = tuple(float(Decimal(2) ** (Decimal(-j) / EXP_STEPS)) for j in range(EXP_STEPS))
"""``2^(-j/8)``, ``j < 8``, correctly rounded to fp64."""
EXP_TAYLOR = tuple(1.0 / math.factorial(n) for n in range(9))
"""``e^x`` to ``x^8`` (the next term is below 2^-59 for ``|x| <= ln 2 / 16``)."""
MAGIC64 = 6755399441055744.0
"""1.5 · 2^52: adding it rounds an fp64 value below 2^51 to an integer, held in the low bits."""
FP32_TAIL_BITS = 29
"""fp64 significand bits below fp32's: a normal fp32 ulp is ``2^29`` fp64 ulps."""
TIE_MARGIN = 64
"""fp64 ulps around an fp32 rounding midpoint in which the reduced sigmoid defers to
:func:`sigmoid_library_fp64`: both fp64 values are within a few ulps of ``sigmoid(g)``, so
outside this margin they round to the same fp32 (taken on ``2 · 64 / 2^29 ≈ 2.4·10^-7`` of values)."""


@T.macro
def sigmoid_fp64(g, s, i):
    """``s[i]`` = fp32 ``sigmoid(g)``, the bits of :func:`sigmoid_library_fp64` without the library
    exponential's range checks and the division's slow-path call (ptxas, H = 7168 cast at 224
    threads a row: 126 registers against 238; the same bits over 17.8M gates on an H100,
    ``tests/gpu/probe_swiglu_sigmoid.py``).

    ``E = e^-|g|`` (``|g|`` capped at 110, where fp32 ``sigmoid`` is 0 or 1) is ``2^(-k/8) · e^x``:
    ``k = rint(|g| · 8 / ln 2)`` by the magic-number rounding, ``x = k · ln2/8 − |g|`` (two FMAs,
    the first exact), ``e^x`` by its Taylor polynomial, ``2^(-k/8)`` a table entry whose exponent
    field drops by ``k >> 3``. ``sigmoid = N / (1 + E)`` with ``N = 1`` (``g >= 0``) or ``E``: an
    fp32 reciprocal seed and two FMA residual corrections. The fp64 value is then within a few
    ulps of ``sigmoid(g)``; where its fp32 rounding could differ from the library formula's — within
    :data:`TIE_MARGIN` fp64 ulps of an fp32 midpoint, or below fp32's normal range (``g < −87.3``) —
    the library formula decides. A NaN gate gives a finite ``s`` (``min(|g|, 110)`` drops the NaN), and
    a NaN ``y`` and gradients all the same: ``g`` is a factor of each (a ``g != g`` test would be
    folded away as false by TVM's simplifier)."""
    # named registers: each value below is used more than once
    size, scaled, steps, x, power, denominator, numerator = (T.alloc_var("float64") for _ in range(7))
    seed, quotient, residual = (T.alloc_var("float64") for _ in range(3))
    k = T.alloc_var("int32")
    tail = T.alloc_var("int64")
    size = T.cast(T.min(T.abs(g), T.float32(SATURATION)), "float64")
    scaled = _fma64(size, T.float64(EXP_STEPS / math.log(2)), T.float64(MAGIC64))
    steps = T.call_extern("float64", "__dsub_rn", scaled, T.float64(MAGIC64))
    k = T.cast(T.bitwise_and(T.reinterpret(scaled, "int64"), T.int64(0xFFFF)), "int32")
    x = _fma64(steps, T.float64(STEP_HIGH), T.float64(0.0) - size)
    x = _fma64(steps, T.float64(STEP_LOW), x)
    poly = T.float64(EXP_TAYLOR[-1])
    for term in reversed(EXP_TAYLOR[:-1]):
        poly = _fma64(poly, x, T.float64(term))
    entry = T.float64(STEP_POWERS[EXP_STEPS - 1])
    for j in reversed(range(EXP_STEPS - 1)):
        entry = T.if_then_else(T.bitwise_and(k, EXP_STEPS - 1) == j, T.float64(STEP_POWERS[j]), entry)
    scaled_entry = T.reinterpret(T.reinterpret(entry, "int64") - T.shift_left(T.cast(T.shift_right(k, 3), "int64"), 52),
                                 "float64")
    power = T.call_extern("float64", "__dmul_rn", scaled_entry, poly)
    denominator = T.call_extern("float64", "__dadd_rn", T.float64(1.0), power)
    numerator = T.if_then_else(g < T.float32(0.0), power, T.float64(1.0))
    seed = T.cast(T.call_extern("float32", "__fdividef", T.float32(1.0), T.cast(denominator, "float32")), "float64")
    quotient = T.call_extern("float64", "__dmul_rn", numerator, seed)
    residual = _fma64(T.float64(0.0) - denominator, quotient, numerator)
    quotient = _fma64(residual, seed, quotient)
    residual = _fma64(T.float64(0.0) - denominator, quotient, numerator)
    quotient = _fma64(residual, seed, quotient)
    tail = T.bitwise_and(T.reinterpret(quotient, "int64"), T.int64((1 << FP32_TAIL_BITS) - 1)) - T.int64(
        1 << (FP32_TAIL_BITS - 1))
    s[i] = T.cast(quotient, "float32")
    if quotient < T.float64(2.0 ** -126) or (tail <= T.int64(TIE_MARGIN) and tail >= T.int64(-TIE_MARGIN)):
        s[i] = sigmoid_library_fp64(g)


def _fma64(a, b, c):
    """``a · b + c`` in fp64, rounded once."""
    return T.call_extern("float64", "__fma_rn", a, b, c)


GUARD = -80.0
"""Below this the guarded sigmoid is ``expf(g)`` (``e^g < 2^-115``: ``1 + e^g`` is 1 in fp32)."""


def sigmoid_guarded(g):
    """fp32 ``sigmoid(g)`` from the hardware exponential for a bf16 result: ``1 / (1 + __expf(−g))``
    above :data:`GUARD` (``__expf`` within ``2 + 1.17·|g|`` ulp, so below 2^-17 relative: far inside
    a bf16 ulp; no overflow, the argument stays below 80), ``expf(g)`` below it (IEEE, subnormals
    kept, where the hardware exponential would flush to zero)."""
    bounded = T.max(g, T.float32(GUARD))
    main = T.call_extern("float32", "__fdividef", T.float32(1.0),
                         T.float32(1.0) + T.call_extern("float32", "__expf", T.float32(0.0) - bounded))
    return T.if_then_else(g > T.float32(GUARD), main, T.exp(g))  # exp(NaN) is NaN


SHARED_ENDS = 1024
"""The most experts whose ``expert_ends`` a table kernel copies into shared memory (4 KiB, beside the
table's 32 and a weighted backward's row-sum tree of up to 16: the runtime raises the dynamic
shared-memory limit past 48 KiB for such a kernel)."""
LOW_SHIFT = 44.361419555836500
"""``64 · ln 2``: below :data:`GUARD`, ``e^g = e^(g + 64 ln 2) · 2^-64`` keeps the hardware
exponential's result normal (it flushes below 2^-126) and rounds once into fp32's subnormals."""


def sigmoid_branchless(g):
    """:func:`sigmoid_guarded` without a branch: one ``__expf`` of ``−g`` above :data:`GUARD` (the
    same value) or of ``g + 64 ln 2`` below it, then ``1 / (1 + e)`` or ``e · 2^-64`` selected.
    Below the guard the argument's rounding and ``__expf`` put ``s`` within about 2^-16 relative of
    ``e^g``, far inside a bf16 ulp of ``y``; NaN gives NaN (the second form)."""
    above = g > T.float32(GUARD)
    power = T.call_extern("float32", "__expf", T.if_then_else(above, T.float32(0.0) - g, g + T.float32(LOW_SHIFT)))
    return T.if_then_else(above, T.call_extern("float32", "__fdividef", T.float32(1.0), T.float32(1.0) + power),
                          power * T.float32(2.0 ** -64))


@T.macro
def sigmoid_fp32(g, s, i):
    """``s[i]`` = ``sigmoid(g)`` in fp32 arithmetic, within 1 ulp of the correctly rounded value
    (about 97 % equal to it, measured by an exact emulation over 1.9·10^7 values in [−120, 25];
    ``tests/test_cuda_swiglu_random_host.py`` holds it to 1 ulp and 95 %).

    ``e^-|g| = 2^-k · (1 + m)`` with ``k = rint(|g| / ln 2)``, ``r = k·ln2 − |g|`` (Cody–Waite:
    two FMAs, the first exact) and ``m = e^r − 1`` by its Taylor polynomial; ``1 + m`` is never
    rounded (``t_high + t_low``), nor is the denominator ``D = 1 + 2^-k(1 + m)`` (``d_high +
    d_low``, error-free sums); ``s = N / D`` with ``N = 1`` (``g >= 0``) or ``2^-k(1 + m)``: an
    approximate quotient corrected by one FMA residual step, rounded once. A NaN gate gives a finite
    ``s`` and a NaN ``y`` and gradients, as :func:`sigmoid_fp64`."""
    # named registers: each value below is used more than once
    size, steps, r, m = (T.alloc_var("float32") for _ in range(4))
    scaled_power, power, one_plus, d_high, d_low = (T.alloc_var("float32") for _ in range(5))
    t_high, n_high, n_low, reciprocal, quotient, residual = (T.alloc_var("float32") for _ in range(6))
    size = T.min(T.abs(g), T.float32(SATURATION))
    steps = T.ieee_fmaf(size, T.float32(LOG2E), T.float32(ROUND_MAGIC)) - T.float32(ROUND_MAGIC)
    r = T.ieee_fmaf(steps, T.float32(LN2_HIGH), T.float32(0.0) - size)
    r = T.ieee_fmaf(steps, T.float32(LN2_LOW), r)
    poly = T.float32(EXPM1_TERMS[0])
    for term in EXPM1_TERMS[1:]:
        poly = T.ieee_fmaf(poly, r, T.float32(term))
    m = T.ieee_fmaf(T.ieee_mul(r, r), poly, r)
    scaled_power = T.reinterpret(T.shift_left(127 + SCALE_BITS - T.cast(steps, "int32"), 23), "float32")
    power = T.ieee_mul(scaled_power, T.float32(2.0 ** -SCALE_BITS))
    one_plus = T.ieee_add(T.float32(1.0), power)
    d_high = T.ieee_fmaf(power, m, one_plus)
    d_low = T.ieee_add(T.ieee_fmaf(power, m, one_plus - d_high), power - (one_plus - T.float32(1.0)))
    t_high = T.ieee_add(T.float32(1.0), m)
    n_high = T.if_then_else(g < T.float32(0.0), T.ieee_mul(scaled_power, t_high), T.float32(2.0 ** SCALE_BITS))
    n_low = T.if_then_else(g < T.float32(0.0), T.ieee_mul(scaled_power, (T.float32(1.0) - t_high) + m),
                           T.float32(0.0))
    reciprocal = T.call_extern("float32", "__fdividef", T.float32(1.0), d_high)
    quotient = T.ieee_mul(n_high, reciprocal)
    residual = T.ieee_fmaf(T.float32(0.0) - quotient, d_high, n_high)
    residual = T.ieee_fmaf(T.float32(0.0) - quotient, d_low, T.ieee_add(residual, n_low))
    corrected = T.ieee_fmaf(residual, reciprocal, quotient)
    s[i] = T.ieee_mul(corrected, T.float32(2.0 ** -SCALE_BITS))


def table_sigmoid(table, gate):
    """fp32 ``sigmoid(gate)`` of a bf16 ``gate`` read from ``table`` (the shared copy of
    ``sigmoid_table``): the entry of the gate's sign and its magnitude's bits clamped to
    ``[LOW, HIGH]``, from the gate's 16 bits (``sigmoid_table.table_index``)."""
    bits = T.cast(T.reinterpret(gate, "uint16"), "int32")
    magnitude = T.min(T.max(T.bitwise_and(bits, 0x7FFF), sigmoid_table.LOW), sigmoid_table.HIGH)
    return table[magnitude - sigmoid_table.LOW + T.bitwise_and(T.shift_right(bits, 3), sigmoid_table.SPAN)]


class SwigluMacros:
    """Trace-time constants of ``spec`` over its row tile ``rows`` and the macros over them."""

    def __init__(self, spec: SwigluKernelSpec, rows: RowMacros) -> None:
        self.rows = rows
        IN = spec.in_dtype
        VALUES = rows.VALUES
        EXPERTS = spec.experts
        ALIGNMENT = spec.expert_alignment
        WEIGHTED = spec.weighted
        SCALING = f32(spec.scaling)
        CLAMP = None if spec.clamp is None else f32(spec.clamp)
        # the binary search's steps: powers of two from the largest <= E down to 1
        STEPS = [] if EXPERTS is None else [1 << k for k in reversed(range(EXPERTS.bit_length()))]
        self.scaled = WEIGHTED or SCALING != 1.0  # w' = 1 is left out: a product by one changes no bit

        def gate_value(value):
            """``g = min(gate, c)`` of an fp32 gate value (NaN kept)."""
            return value if CLAMP is None else T.if_then_else(value > T.float32(CLAMP), T.float32(CLAMP), value)

        def up_value(value):
            """``u = clamp(up, −c, c)`` of an fp32 up value (NaN kept)."""
            if CLAMP is None:
                return value
            return T.if_then_else(value > T.float32(CLAMP), T.float32(CLAMP),
                                  T.if_then_else(value < T.float32(-CLAMP), T.float32(-CLAMP), value))

        def gate_cut(value):
            """Whether the clamp cut an fp32 gate value (its gradient is then 0)."""
            return value > T.float32(CLAMP)

        def up_cut(value):
            """Whether the clamp cut an fp32 up value (``|up| > c``)."""
            return T.abs(value) > T.float32(CLAMP)

        SIGMOID = spec.sigmoid
        THREADS = rows.THREADS
        # the clamped gate's sigmoid, for the table (the gate c is fp32, not a bf16 value the table holds)
        CLAMP_SIGMOID = None if CLAMP is None or SIGMOID != "table" else sigmoid_table.clamp_sigmoid(CLAMP)

        @T.macro
        def find_valid(ends, row, exists, valid):
            """``valid[0]`` = 1 when ``row`` (< N where ``exists``) lies inside some expert's
            range ``[start[e], ends[e])``, else 0 (every row of a call without ``expert_ends``)."""
            if EXPERTS is None:
                valid[0] = T.if_then_else(exists, 1, 0)
            else:
                below = T.alloc_var("int32")  # ends <= row found so far: the row's expert at the end
                below = 0
                for step in STEPS:
                    if below + step <= EXPERTS:
                        if ends[below + step - 1] <= row:
                            below = below + step
                valid[0] = 0
                if exists and below < EXPERTS:
                    if below == 0:
                        valid[0] = 1
                    elif row >= T.truncdiv(ends[below - 1] + (ALIGNMENT - 1), ALIGNMENT) * ALIGNMENT:
                        valid[0] = 1

        @T.macro
        def load_halves(x, gate, up, row, lane, exists):
            """``gate`` / ``up``: the thread's values of the row's two halves (zeros past the last row)."""
            rows.load_row(x, gate, row, GATE, lane, exists, IN)
            rows.load_row(x, up, row, UP, lane, exists, IN)

        @T.macro
        def load_scale(weights, row, exists, scale):
            """``scale[0]`` = ``w' = topk_weights[row] · routed_scaling_factor`` (fp32; the factor
            alone without weights; 0 past the last row)."""
            if WEIGHTED:
                scale[0] = T.float32(0.0)
                if exists:
                    scale[0] = weights[row] * T.float32(SCALING)
            else:
                scale[0] = T.float32(SCALING)

        @T.macro
        def copy_to_shared(source, shared, pieces, width, tx):
            """``shared`` = the global ``source`` (``pieces`` pieces of ``width`` values), a piece a thread
            an iteration (unrolled: the loads of a restrict source need not wait for the stores)."""
            for k in T.unroll(T.ceildiv(pieces, THREADS)):
                if k * THREADS + tx < pieces:
                    for j in T.vectorized(width):
                        shared[(k * THREADS + tx) * width + j] = source[(k * THREADS + tx) * width + j]

        @T.macro
        def activate(gate, up, scale, g, u, s, table):
            """Per value ``i`` of the thread: ``g[i]``, ``u[i]`` (clamped, fp32) and ``s[i] = sigmoid(g[i])``
            (``table``: the shared sigmoid table where the spec reads it, else None)."""
            for i in T.unroll(VALUES):
                g[i] = gate_value(T.cast(gate[i], "float32"))
                u[i] = up_value(T.cast(up[i], "float32"))
                if SIGMOID == "table":
                    if CLAMP_SIGMOID is None:
                        s[i] = table_sigmoid(table, gate[i])
                    else:
                        s[i] = T.if_then_else(T.cast(gate[i], "float32") > T.float32(CLAMP), T.float32(CLAMP_SIGMOID),
                                              table_sigmoid(table, gate[i]))
                elif SIGMOID == "reduced":
                    sigmoid_fp64(g[i], s, i)
                elif SIGMOID == "library":
                    s[i] = sigmoid_library_fp64(g[i])
                elif SIGMOID == "guarded":
                    s[i] = sigmoid_guarded(g[i])
                elif SIGMOID == "branchless":
                    s[i] = sigmoid_branchless(g[i])
                else:
                    sigmoid_fp32(g[i], s, i)

        def forward_value(g, u, s, scale, i):
            """``y = ((g · s) · u) · w'`` of value ``i`` (fp32)."""
            product = g[i] * s[i] * u[i]
            return product * scale[0] if self.scaled else product

        CTAS_PER_SM = spec.ctas_per_sm

        @T.macro
        def prologue(strides):
            """A kernel's first statements: the CTAs an SM asked of ptxas (it must come first) and the
            alignment of each runtime row stride (``vector_strides``)."""
            if CTAS_PER_SM:
                T.annotate_min_blocks_per_sm(CTAS_PER_SM)
            for stride, per_vector in strides:
                T.assume(stride % per_vector == 0)

        self.values = VALUES
        self.experts = EXPERTS
        self.prologue = prologue
        self.copy_to_shared = copy_to_shared
        self.in_dtype = IN
        self.find_valid = find_valid
        self.load_halves = load_halves
        self.load_scale = load_scale
        self.activate = activate
        self.forward_value = forward_value
        self.gate_value = gate_value
        self.up_value = up_value
        self.gate_cut = gate_cut
        self.up_cut = up_cut
        self.clamped = CLAMP is not None
        self.scaling = SCALING

    # ------------------------------------------------------------------ a kernel's row, at trace time
    def begin(self, bx) -> "RowState":
        """The thread's row in CTA ``bx`` and its registers (called in the kernel body, after its
        ``T.assume`` of :func:`vector_strides`: an assumption is a statement only there)."""
        rows = self.rows
        tx = T.get_thread_binding()
        row = bx * rows.ROWS + tx // rows.LANES
        shapes = {"valid": ((1,), "int32"), "scale": ((1,), "float32"), "gate": ((self.values,), self.in_dtype),
                  "up": ((self.values,), self.in_dtype), "g": ((self.values,), "float32"),
                  "u": ((self.values,), "float32"), "s": ((self.values,), "float32")}
        # named as the kernel body's own assignments would name them (the generated source stays readable)
        local = {name: IRBuilder.name(name, T.alloc_local(*shape)) for name, shape in shapes.items()}
        return RowState(tx=tx, row=row, lane=tx % rows.LANES, exists=row < rows.rows_total, **local)

    def load(self, x, weights, state: "RowState") -> None:
        """Issue the row's loads: both halves of x and its weight (before any dependent load)."""
        self.load_halves(x, state.gate, state.up, state.row, state.lane, state.exists)
        self.load_scale(weights, state.row, state.exists, state.scale)

    def settle(self, ends, state: "RowState", table=None) -> None:
        """Whether the row is valid (the ``expert_ends`` search) and its ``g``, ``u``, ``s``
        (``table``: the shared sigmoid table of a spec that reads one)."""
        self.find_valid(ends, state.row, state.exists, state.valid)
        self.activate(state.gate, state.up, state.scale, state.g, state.u, state.s, table)

    def shared_ends(self, ends, tx):
        """The ``expert_ends`` a table kernel's row searches read: a shared copy (the CTA's rows then
        search it at shared-memory latency; TileLang's thread-sync pass puts the barrier before
        the first read) where the call has an expert layout of at most :data:`SHARED_ENDS`
        experts, else ``ends`` itself."""
        experts = self.experts
        if experts is None or experts > SHARED_ENDS:
            return ends
        shared = T.alloc_shared((experts,), "int32")
        self.copy_to_shared(ends, shared, experts, 1, tx)
        return shared

    def shared_table(self, source, tx):
        """A shared copy of the global ``sigmoid_table`` ``source`` (TileLang's thread-sync pass
        puts the barrier before the first read: one ``__syncthreads``, checked by
        ``tests/test_cuda_swiglu_sigmoid_table.py``)."""
        table = T.alloc_shared((sigmoid_table.ENTRIES,), "float32")
        self.copy_to_shared(source, table, sigmoid_table.ENTRIES // 4, 4, tx)  # 128-bit pieces
        return table

    # ------------------------------------------------------------------ buffer types
    @staticmethod
    def halves_buffer(spec: SwigluKernelSpec, rows_count):
        """x viewed as ``[N, 2, H]`` (strides ``(S0, H, 1)``)."""
        return T.StridedTensor((rows_count, 2, spec.hidden), (T.dynamic("xS0"), T.dynamic("xS1"), 1), spec.in_dtype)

    @staticmethod
    def single_buffer(spec: SwigluKernelSpec, prefix: str, dtype: str, rows_count):
        """A ``[N, H]`` tensor viewed as ``[N, 1, H]`` (y, grad_y)."""
        return T.StridedTensor((rows_count, 1, spec.hidden), (T.dynamic(prefix + "S0"), T.dynamic(prefix + "S1"), 1),
                               dtype)

    @staticmethod
    def absent_buffer(spec: SwigluKernelSpec, prefix: str):
        """A buffer the call does not have (the launcher passes x, never read)."""
        return T.StridedTensor((T.dynamic(prefix + "A"), T.dynamic(prefix + "B")), (T.dynamic(prefix + "C"), 1),
                               spec.in_dtype)

    @staticmethod
    def weights_buffer(spec: SwigluKernelSpec, rows_count):
        return T.Tensor((rows_count,), "float32") if spec.weighted else SwigluMacros.absent_buffer(spec, "w")

    @staticmethod
    def table_buffer():
        """The global ``sigmoid_table`` (fp32 ``[ENTRIES]``)."""
        return T.Tensor((sigmoid_table.ENTRIES,), "float32")

    @staticmethod
    def ends_buffer(spec: SwigluKernelSpec):
        return T.Tensor((spec.experts,), "int32") if spec.experts is not None else SwigluMacros.absent_buffer(spec, "e")


class RowState(NamedTuple):
    """A thread's row at trace time: ``tx``, ``row``, ``lane``, ``exists`` (``row < N``) and its
    locals — ``valid`` (int32 flag: inside an expert's range), ``scale`` (``w'``), the halves'
    values ``gate`` / ``up`` (x's dtype) and their fp32 ``g``, ``u``, ``s = sigmoid(g)``."""

    tx: Any
    row: Any
    lane: Any
    exists: Any
    valid: Any
    scale: Any
    gate: Any
    up: Any
    g: Any
    u: Any
    s: Any

    @property
    def is_valid(self):
        return self.valid[0] != 0


def vector_strides(vec: int, *buffers) -> list:
    """``(stride, values)`` for each runtime row stride of ``buffers`` that their ``vec``-value
    accesses need aligned (``min(vec, 16 bytes of the buffer's dtype)`` values: one or more
    128-bit accesses, or one narrower one); a dim of static size 1 is never stepped over and
    is left out. The kernel states each with ``T.assume`` (checked by the launcher's runtime)."""
    pairs = []
    for buffer in buffers:
        values = min(vec, 16 // {"bfloat16": 2, "float32": 4}[str(buffer.dtype)])
        for size, stride in zip(buffer.shape[:-1], buffer.strides[:-1]):
            if getattr(size, "value", size) != 1:
                pairs.append((stride, values))
    return pairs
