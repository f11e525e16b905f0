"""CUDA ``swiglu_per_token_cast``: ``swiglu`` with an fp32 ``y`` then ``per_token_cast`` of it,
in one pass: ``y`` never leaves the registers (SPEC §8: the fp32 ``y`` is quantized directly).

The activation is ``swiglu``'s (``activation``), the cast the norm family's register cast
(``norm.row_cast.RowCast``: the quant kernel's scale macros in its order of operations, amax
on the bits of the fp32 ``|y|``), so ``(q, sf)`` are the bytes of this backend's
``swiglu(x, out_dtype=torch.float32)`` followed by its ``per_token_cast``. A padding row's
values are selected zeros (nothing from its bytes enters the amax), quantized as such, and
its scales are stored as 0.

With ``spec.refine`` (opt-in, ``TILEPLUG_CUDA_SWIGLU_CAST_REFINE=1``) the same bytes come from
cheaper arithmetic: every ``y`` is first taken with the fp32 sigmoid (``activation.sigmoid_fp32``,
within 1 ulp of the correctly rounded one, so ``y`` within ``2^-20`` relative of the exact ``y``:
three products, each rounded), and only the values whose exact bits could change ``(q, sf)`` are
recomputed with the fp64 sigmoid (:func:`refine`):

- those that may hold their group's amax: ``|y| ≥ amax · (1 − 2^-16)`` of the fast values. The
  exact amax's own value is among them (its fast value is within ``2^-20`` of it, and the fast
  amax within ``2^-20`` of the exact one), and every other value stays below the exact amax, so
  the amax, the scale and the factor of the group are the exact ones;
- those the relative bound does not cover: a gate below −80 (the sigmoid nears fp32's subnormal
  range), a product ``g · s``, ``g · s · u`` or ``y`` below ``2^-100`` in magnitude where no factor
  is zero (a rounding in the subnormal range, or an underflow to zero), and every nonzero value of
  a group whose fast amax is not finite;
- then, with the group's exact amax and ``inv``, those whose product ``y · inv`` lies within
  ``2^-11`` of a quantum of a rounding midpoint of the format (e4m3: quantum ``2^max(e − 3, −9)``;
  e2m1: ``2^max(e − 1, −1)``, for ``|y · inv|`` in ``[2^e, 2^(e+1))``): a quantum is at least
  ``|y · inv| / 16``, so elsewhere the fast and the exact product round to the same code.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.norm.row_cast import RowCast
from tileplug.backend_cuda.norm.rows import RowMacros
from tileplug.backend_cuda.quant import sf_math
from tileplug.backend_cuda.quant.element_kernels import GRIDS, is_nan
from tileplug.backend_cuda.swiglu.activation import GUARD, SwigluMacros, sigmoid_fp64, vector_strides
from tileplug.backend_cuda.swiglu.spec import SwigluKernelSpec

AMAX_MARGIN = 2.0**-16
"""A value within this relative distance below its group's fast amax may hold the exact amax."""
MIDPOINT_MARGIN = 2.0**-11
"""Distance, in quanta of the format, from a rounding midpoint inside which ``y · inv`` is recomputed."""
TINY = 2.0**-100
"""Products below this magnitude (and not exactly zero) are recomputed: the relative bound of the
fast ``y`` holds only where every product is a normal fp32 number."""


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

    def unvouched(row, yv, i, threshold):
        """Whether the fast ``y`` of value ``i`` may hold its group's amax (``threshold``: the fast
        amax less :data:`AMAX_MARGIN`, 0 where that amax is not finite, so that a group holding an
        inf or a NaN is recomputed whole) or falls outside the relative bound (a NaN, a gate below
        −80, a nonzero product below :data:`TINY`)."""
        g, u = row.g[i], row.u[i]
        size = T.abs(yv[i])
        nonzero = T.And(g != T.float32(0.0), u != T.float32(0.0))
        if SCALED:
            nonzero = T.And(nonzero, row.scale[0] != T.float32(0.0))
        small = T.Or(T.Or(T.abs(g * row.s[i]) < T.float32(TINY), T.abs(g * row.s[i] * u) < T.float32(TINY)),
                     size < T.float32(TINY))
        may_hold_amax = T.Or(T.And(threshold <= size, size != T.float32(0.0)), is_nan(yv[i]))
        return T.Or(T.Or(may_hold_amax, g < T.float32(GUARD)), T.And(nonzero, small))

    def near_midpoint(product):
        """Whether ``|product|`` (``y · inv``) lies within :data:`MIDPOINT_MARGIN` quanta of a
        rounding midpoint of the format's grid (NaN, inf: no)."""
        bits = T.reinterpret(product, "int32") & 0x7FFFFFFF
        quantum = T.max(T.shift_right(bits, 23) - (127 + MANTISSA), SMALLEST_QUANTUM)
        quanta = T.reinterpret(bits, "float32") * sf_math.pow2(0 - quantum)  # exact: a power of two
        return T.abs(quanta - T.floor(quanta) - T.float32(0.5)) <= T.float32(MIDPOINT_MARGIN)

    @T.macro
    def exact(row, yv, i):
        """``yv[i]`` again, from the fp64 sigmoid (a valid row's value)."""
        sigmoid_fp64(row.g[i], row.s, i)
        yv[i] = act.forward_value(row.g, row.u, row.s, row.scale, i)

    @T.macro
    def refine(row, yv, amax, inv):
        """Recompute with the fp64 sigmoid the values of a valid row whose exact bits could change
        the cast, group by group: first those :func:`unvouched`, which makes the group's amax and
        ``inv`` exact, then those whose ``y · inv`` is :func:`near_midpoint` (``amax`` / ``inv``:
        the cast's registers, which the cast fills again)."""
        for chunks in cast.groups:
            group = chunks[0]
            cast.group_amax(yv, row.lane, amax, chunks)
            threshold = T.if_then_else(amax[group] < 0x7F800000,
                                       T.reinterpret(amax[group], "float32") * T.float32(1.0 - AMAX_MARGIN),
                                       T.float32(0.0))
            for k in chunks:
                for j in T.unroll(VEC):
                    if T.And(row.is_valid, unvouched(row, yv, k * VEC + j, threshold)):
                        exact(row, yv, k * VEC + j)
            cast.group_amax(yv, row.lane, amax, chunks)
            inv[group] = cast.inverse(amax[group])
            for k in chunks:
                for j in T.unroll(VEC):
                    if T.And(row.is_valid, near_midpoint(yv[k * VEC + j] * inv[group])):
                        exact(row, yv, k * VEC + j)

    @T.prim_func
    def kernel(x: x_t, topk_weights: w_t, expert_ends: e_t, q: q_t, sf: sf_t):
        with T.Kernel(rows.grid(), threads=rows.THREADS) as bx:
            if spec.ctas_per_sm:
                T.annotate_min_blocks_per_sm(spec.ctas_per_sm)
            for stride, per_vector in STRIDES:
                T.assume(stride % per_vector == 0)
            row = act.begin(bx)
            yv = T.alloc_local((VALUES,), "float32")
            amax = T.alloc_local((rows.CHUNKS,), "int32")
            inv = T.alloc_local((rows.CHUNKS,), "float32")
            qv = T.alloc_local((VEC // VPB,), QDT)
            act.load(x, topk_weights, row)
            act.settle(expert_ends, row)
            for i in T.unroll(VALUES):
                yv[i] = T.if_then_else(row.is_valid, act.forward_value(row.g, row.u, row.s, row.scale, i),
                                       T.float32(0.0))
            if spec.refine:
                refine(row, yv, amax, inv)
            if spec.experts is None:
                cast.cast(yv, q, sf, row.row, 0, row.lane, row.exists, amax, inv, qv)
            else:
                cast.cast(yv, q, sf, row.row, 0, row.lane, row.exists, amax, inv, qv, row.is_valid)

    return kernel.with_attr("global_symbol", spec.name)
