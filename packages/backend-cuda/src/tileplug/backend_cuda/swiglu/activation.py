"""The pieces every CUDA SwiGLU kernel is built from: which rows are valid, the two halves'
loads, the clamp, the sigmoid and the routed weight, in the reference's order of operations.

Rows: the norm family's row tile (``norm.rows.RowMacros`` over x viewed as ``[N, 2, H]``):
thread ``tx`` works on row ``bx · rows + tx // lanes`` and holds the same columns of the gate
half (``x[:, 0, :]``) and the up half (``x[:, 1, :]``), one 128-bit load per vector.

Valid rows (SPEC §7, with ``expert_ends``): a row's expert is the number of ends ``<= row``
(a binary search over ``E`` ends in global memory, ``E.bit_length()`` steps, each an index
below ``E``: malformed ends give a wrong layout, never an out-of-bounds read); the row is
valid when that expert exists and the row is at or past its start ``align(ends[e − 1])``. A
padding row's halves, weight and ``grad_y`` are never loaded: its registers hold zeros and
its results are written as zeros.

Math (fp32, SPEC §8, the reference's rounding points): ``g = min(gate, c)`` and ``u =
clamp(up, −c, c)`` keeping NaN (a select, not ``fminf``, which would drop it);
``sigmoid(g)`` is taken in fp64 and rounded once to fp32 — the correctly rounded value the
reference uses (``expf`` is up to 2 ulp off) but for a double rounding at a near-tie;
``w' = w · routed_scaling_factor``; every product is a separate fp32 rounding and nothing is
contracted into an FMA (``ieee_*`` where an addition follows a product).

No ``from __future__ import annotations``: TileLang evaluates the macro annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.norm.rows import RowMacros, f32
from tileplug.backend_cuda.swiglu.spec import SwigluKernelSpec

GATE, UP = 0, 1
"""The halves of x's row, as the second index of its ``[N, 2, H]`` view."""


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

        def sigmoid(g):
            """fp32 ``sigmoid(g)`` correctly rounded: in fp64, rounded once."""
            wide = T.cast(g, "float64")
            return T.cast(T.float64(1.0) / (T.float64(1.0) + T.exp(T.float64(0.0) - wide)), "float32")

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
        def load_halves(x, gate, up, row, lane, valid):
            """``gate`` / ``up``: the thread's values of the row's two halves (zeros where not valid)."""
            rows.load_row(x, gate, row, GATE, lane, valid, IN)
            rows.load_row(x, up, row, UP, lane, valid, IN)

        @T.macro
        def load_scale(weights, row, valid, scale):
            """``scale[0]`` = ``w' = topk_weights[row] · routed_scaling_factor`` (fp32; the factor
            alone without weights; 0 for a row that is not valid, whose weight is not read)."""
            if WEIGHTED:
                scale[0] = T.float32(0.0)
                if valid:
                    scale[0] = weights[row] * T.float32(SCALING)
            else:
                scale[0] = T.float32(SCALING)

        @T.macro
        def activate(gate, up, scale, g, u, s):
            """Per value ``i`` of the thread: ``g[i]``, ``u[i]`` (clamped, fp32) and ``s[i] = sigmoid(g[i])``."""
            for i in T.unroll(VALUES):
                g[i] = gate_value(T.cast(gate[i], "float32"))
                u[i] = up_value(T.cast(up[i], "float32"))
                s[i] = sigmoid(g[i])

        def forward_value(g, u, s, scale, i):
            """``y = ((g · s) · u) · w'`` of value ``i`` (fp32)."""
            product = g[i] * s[i] * u[i]
            return product * scale[0] if self.scaled else product

        self.find_valid = find_valid
        self.load_halves = load_halves
        self.load_scale = load_scale
        self.activate = activate
        self.forward_value = forward_value
        self.gate_cut = gate_cut
        self.up_cut = up_cut
        self.clamped = CLAMP is not None
        self.scaling = SCALING

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
    def ends_buffer(spec: SwigluKernelSpec):
        return T.Tensor((spec.experts,), "int32") if spec.experts is not None else SwigluMacros.absent_buffer(spec, "e")


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
