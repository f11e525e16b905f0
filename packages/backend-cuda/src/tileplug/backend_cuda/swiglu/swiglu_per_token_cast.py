"""CUDA ``swiglu_per_token_cast``: ``swiglu`` with an fp32 ``y`` then ``per_token_cast`` of it,
in one pass: ``y`` never leaves the registers (SPEC §8: the fp32 ``y`` is quantized directly).

The activation is ``swiglu``'s (``activation``), the cast the norm family's register cast
(``norm.row_cast.RowCast``: the quant kernel's scale macros in its order of operations, amax
on the bits of the fp32 ``|y|``), so ``(q, sf)`` are the bytes of this backend's
``swiglu(x, out_dtype=torch.float32)`` followed by its ``per_token_cast``. A padding row's
values are selected zeros (nothing from its bytes enters the amax), quantized as such, and
its scales are stored as 0.

With ``spec.refine`` (opt-in, ``TILEPLUG_CUDA_SWIGLU_CAST_REFINE=1``) the same bytes come from
cheaper arithmetic: every ``y`` is first taken with the hardware-exponential sigmoid
(``activation.sigmoid_branchless``: above a gate of −80, ``__expf`` within ``2 + 1.173·|g|`` ulp
and ``__fdividef`` within 2 ulp, CUDA's documented bounds, so ``s`` within ``2^-16.3`` relative of
the correctly rounded one and ``y`` within :data:`FAST_BOUND` of the exact ``y`` after its three
rounded products), and only the values whose exact bits could change ``(q, sf)`` are recomputed
with the fp64 sigmoid (:func:`refine`):

- those that may hold their group's amax: ``|y| ≥ amax · (1 − 2^-14)`` of the fast values. The
  exact amax's own value is among them (its fast value is within :data:`FAST_BOUND` of it, and
  the fast amax within :data:`FAST_BOUND` of the exact one: ``2^-14`` is 2.5 times their sum),
  and every other value stays below the exact amax, so the amax, the scale and the factor of the
  group are the exact ones;
- those the relative bound does not cover: a gate below −80 (the sigmoid nears fp32's subnormal
  range), a product ``g · s``, ``g · s · u`` or ``y`` below ``2^-100`` in magnitude where no factor
  is zero (a rounding in the subnormal range, or an underflow to zero), and every nonzero value of
  a group whose fast amax is not finite;
- then, with the group's exact amax and ``inv``, those whose product ``y · inv`` lies within
  ``2^-11`` of a quantum of a rounding midpoint of the format (e4m3: quantum ``2^max(e − 3, −9)``;
  e2m1: ``2^max(e − 1, −1)``, for ``|y · inv|`` in ``[2^e, 2^(e+1))``): a quantum is at least
  ``|y · inv| / 16``, so the fast and the exact product lie within ``16 · 2^-16.2 = 2^-12.2``
  quanta of each other and elsewhere round to the same code.

Each stage marks its values in a bit mask and recomputes them one at a time in a rolled loop:
the fp64 code is emitted once a stage, and a warp runs it as often as its busiest lane has values
marked. (Recomputed in place, unrolled over the values, it was 16 copies of that code: 7824 SASS
instructions against the default cast's 3128, 52 bytes of spill stores and 76 of loads at 2 CTAs
an SM, and 1.6-1.8x the default cast's time on an H100, with the 1-ulp fp32 sigmoid as the fast
one. The rolled form with the branchless sigmoid, 1968 instructions at 2 CTAs an SM and no spill,
has not been timed yet; by SASS its common path is about as long as the default's, the tests and
masks costing about what the fp64 sigmoid did.)

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

from typing import Any, NamedTuple

import tilelang.language as T

from tileplug.backend_cuda.norm.row_cast import RowCast
from tileplug.backend_cuda.norm.rows import RowMacros
from tileplug.backend_cuda.quant.element_kernels import GRIDS, is_nan
from tileplug.backend_cuda.swiglu.activation import GUARD, SwigluMacros, sigmoid_fp64, vector_strides
from tileplug.backend_cuda.swiglu.spec import SwigluKernelSpec

FAST_BOUND = 2.0**-16.2
"""The relative distance of a fast ``y`` from the exact one, where the relative bound holds (a gate
at or above −80, every product a normal number): the sigmoid's ``2^-16.3`` and three roundings."""
AMAX_MARGIN = 2.0**-14
"""A value within this relative distance below its group's fast amax may hold the exact amax
(more than twice :data:`FAST_BOUND`)."""
MIDPOINT_MARGIN = 2.0**-11
"""Distance, in quanta of the format, from a rounding midpoint inside which ``y · inv`` is recomputed."""
TINY = 2.0**-100
"""Products below this magnitude (and not exactly zero) are recomputed: the relative bound of the
fast ``y`` holds only where every product is a normal fp32 number."""


class RefineRegisters(NamedTuple):
    """The refinement's one-value registers: ``pending`` (bits of the values still to recompute;
    those of :func:`outside_bound` are set with ``y``), ``count`` (the loop's trip count), ``index``
    (the value being recomputed), its ``g``, ``u``, fp64-rounded ``s`` and exact ``y``."""

    pending: Any
    count: Any
    index: Any
    g: Any
    u: Any
    s: Any
    y: Any


def build(spec: SwigluKernelSpec):
    """The ``T.prim_func`` of a ``swiglu_per_token_cast`` specialisation: buffers ``(x,
    topk_weights, expert_ends, q, sf)`` (``sf``: the bytes of packed UE8M0 storage), an absent
    one replaced by x (never read)."""
    M = T.dynamic("M")
    rows = RowMacros(spec, M)
    act = SwigluMacros(spec, rows)
    VALUES, VEC, H = rows.VALUES, spec.vec, spec.hidden
    cast = RowCast(spec.quant, rows, "float32", VEC, H, None, spec.vectorize)
    VPB, QDT = cast.values_per_byte, cast.q_dtype
    x_t = SwigluMacros.halves_buffer(spec, M)
    w_t = SwigluMacros.weights_buffer(spec, M)
    e_t = SwigluMacros.ends_buffer(spec)
    q_t = T.Tensor((M, H // VPB), QDT)
    sf_t = cast.sf_type()
    STRIDES = vector_strides(VEC, x_t) if spec.vectorize else []

    _, MANTISSA, SMALLEST_NORMAL = GRIDS["e2m1" if cast.e2m1 else "e4m3"]
    SMALLEST_QUANTUM = SMALLEST_NORMAL - MANTISSA  # the subnormals share the smallest binade's step
    SCALED = act.scaled

    def outside_bound(row, yv, i):
        """Whether the fast ``y`` of value ``i`` falls outside the relative bound: a gate below −80,
        or a nonzero product below :data:`TINY` (taken with ``y``, while ``s`` is in registers)."""
        g, u = row.g[i], row.u[i]
        nonzero = T.And(g != T.float32(0.0), u != T.float32(0.0))
        if SCALED:
            nonzero = T.And(nonzero, row.scale[0] != T.float32(0.0))
        small = T.Or(T.Or(T.abs(g * row.s[i]) < T.float32(TINY), T.abs(g * row.s[i] * u) < T.float32(TINY)),
                     T.abs(yv[i]) < T.float32(TINY))
        return T.Or(g < T.float32(GUARD), T.And(nonzero, small))

    def may_hold_amax(yv, i, threshold):
        """Whether the fast ``y`` of value ``i`` may hold its group's amax (``threshold``: the fast
        amax less :data:`AMAX_MARGIN`, 0 where that amax is not finite, so that a group holding an
        inf or a NaN is recomputed whole), or is a NaN."""
        size = T.abs(yv[i])
        return T.Or(T.And(threshold <= size, size != T.float32(0.0)), is_nan(yv[i]))

    def near_midpoint(product):
        """Whether ``|product|`` (``y · inv``) lies within :data:`MIDPOINT_MARGIN` quanta of a
        rounding midpoint of the format's grid (NaN, inf: no)."""
        bits = T.reinterpret(product, "int32") & 0x7FFFFFFF
        quantum = T.max(T.shift_right(bits, 23) - (127 + MANTISSA), SMALLEST_QUANTUM)
        # 2^-quantum from its exponent field (exact, no branch): the quanta of a product the cast meets
        # (|y · inv| ≤ the format's largest value, or inf / NaN) keep 127 − quantum in [1, 254]
        quanta = T.reinterpret(bits, "float32") * T.reinterpret(T.shift_left(127 - quantum, 23), "float32")
        return T.abs(quanta - T.floor(quanta) - T.float32(0.5)) <= T.float32(MIDPOINT_MARGIN)

    MASK = "int32" if VALUES <= 32 else "int64"  # a bit per value of the thread
    FIRST_SET, SET_COUNT = ("__ffs", "__popc") if VALUES <= 32 else ("__ffsll", "__popcll")
    assert VALUES <= 64, VALUES

    def pick(values, index):
        """``values[index]`` for a runtime ``index < VALUES``, from registers: a chain of selects
        (indexing a local array at a runtime index would put the array in local memory)."""
        picked = values[0]
        for other in range(1, VALUES):
            picked = T.if_then_else(index == other, values[other], picked)
        return picked

    @T.macro
    def mark(work, value_indices, needed):
        """Add to ``work.pending[0]`` the bits of the values ``i`` in ``value_indices`` (static) where
        ``needed(i)``."""
        for i in value_indices:
            work.pending[0] = work.pending[0] | T.shift_left(T.cast(needed(i), MASK), T.cast(i, MASK))

    @T.macro
    def recompute(row, yv, work):
        """``yv[i]`` again from the fp64 sigmoid for each bit ``i`` of ``work.pending[0]``, one value
        an iteration of a rolled loop (the fp64 code emitted once; see the module docstring)."""
        work.count[0] = T.call_extern("int32", SET_COUNT, work.pending[0])
        for _ in T.serial(work.count[0]):
            work.index[0] = T.call_extern("int32", FIRST_SET, work.pending[0]) - 1
            work.pending[0] = work.pending[0] & (work.pending[0] - T.cast(1, MASK))
            # from the loaded halves (x's dtype: half the registers), which stay live where g and u need not
            work.g[0] = act.gate_value(T.cast(pick(row.gate, work.index[0]), "float32"))
            work.u[0] = act.up_value(T.cast(pick(row.up, work.index[0]), "float32"))
            sigmoid_fp64(work.g[0], work.s, 0)
            work.y[0] = act.forward_value(work.g, work.u, work.s, row.scale, 0)
            for other in range(VALUES):
                yv[other] = T.if_then_else(work.index[0] == other, work.y[0], yv[other])

    GROUP_VALUES = [[k * VEC + j for k in chunks for j in range(VEC)] for chunks in cast.groups]

    @T.macro
    def refine(row, yv, amax, inv, work):
        """Recompute with the fp64 sigmoid the values of a valid row whose exact bits could change
        the cast: first those :func:`outside_bound` (already in ``work.pending``, marked with ``y``) and those
        that :func:`may_hold_amax` in every group, which makes each group's amax and
        ``inv`` exact, then those whose ``y · inv`` is :func:`near_midpoint` (``amax`` / ``inv``:
        the cast's registers, which the cast fills again). Each stage marks its values in a bit
        mask and recomputes them in one rolled loop."""
        for chunks, value_indices in zip(cast.groups, GROUP_VALUES):
            cast.group_amax(yv, row.lane, amax, chunks)
            threshold = T.if_then_else(amax[chunks[0]] < 0x7F800000,
                                       T.reinterpret(amax[chunks[0]], "float32") * T.float32(1.0 - AMAX_MARGIN),
                                       T.float32(0.0))
            mark(work, value_indices, lambda i: T.And(row.is_valid, may_hold_amax(yv, i, threshold)))
        recompute(row, yv, work)  # leaves pending at 0
        for chunks, value_indices in zip(cast.groups, GROUP_VALUES):
            group = chunks[0]
            cast.group_amax(yv, row.lane, amax, chunks)
            inv[group] = cast.inverse(amax[group])
            mark(work, value_indices, lambda i: T.And(row.is_valid, near_midpoint(yv[i] * inv[group])))
        recompute(row, yv, work)

    @T.macro
    def row_body(x, topk_weights, expert_ends, table, q, sf, tile):
        row = act.begin(tile)
        yv = T.alloc_local((VALUES,), "float32")
        amax = T.alloc_local((rows.CHUNKS,), "int32")
        inv = T.alloc_local((rows.CHUNKS,), "float32")
        qv = T.alloc_local((VEC // VPB,), QDT)
        if spec.refine:
            work = RefineRegisters(*(T.alloc_local((1,), dtype) for dtype in (MASK, "int32", "int32")),
                                   *(T.alloc_local((1,), "float32") for _ in range(4)))
        act.load(x, topk_weights, row)
        act.settle(expert_ends, row, table)
        if spec.refine:
            work.pending[0] = T.cast(0, MASK)
        for i in T.unroll(VALUES):
            yv[i] = T.if_then_else(row.is_valid, act.forward_value(row.g, row.u, row.s, row.scale, i),
                                   T.float32(0.0))
            if spec.refine:
                work.pending[0] = work.pending[0] | T.shift_left(
                    T.cast(T.And(row.is_valid, outside_bound(row, yv, i)), MASK), T.cast(i, MASK))
        if spec.refine:
            refine(row, yv, amax, inv, work)
        if spec.experts is None:
            cast.cast(yv, q, sf, row.row, 0, row.lane, row.exists, amax, inv, qv)
        else:
            cast.cast(yv, q, sf, row.row, 0, row.lane, row.exists, amax, inv, qv, row.is_valid)

    # one prim_func per buffer set (TileLang reads the signature off the annotations)
    if spec.sigmoid == "table":
        table_t = SwigluMacros.table_buffer()

        @T.prim_func
        def kernel(x: x_t, topk_weights: w_t, expert_ends: e_t, sigmoid_table: table_t, row_steps: T.int32,
                   q: q_t, sf: sf_t):
            with T.Kernel(T.ceildiv(rows.grid(), row_steps), threads=rows.THREADS) as bx:
                act.prologue(STRIDES)
                ends = act.shared_ends(expert_ends, T.get_thread_binding())
                table = act.shared_table(sigmoid_table, T.get_thread_binding())
                for step in T.serial(row_steps):
                    row_body(x, topk_weights, ends, table, q, sf, bx * row_steps + step)

    else:

        @T.prim_func
        def kernel(x: x_t, topk_weights: w_t, expert_ends: e_t, q: q_t, sf: sf_t):
            with T.Kernel(rows.grid(), threads=rows.THREADS) as bx:
                act.prologue(STRIDES)
                row_body(x, topk_weights, expert_ends, None, q, sf, bx)

    return kernel.with_attr("global_symbol", spec.name)
