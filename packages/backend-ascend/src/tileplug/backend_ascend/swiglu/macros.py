"""The SwiGLU math of SPEC §8 on 64-lane fp32 registers, shared by the three Ascend SwiGLU kernels.

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

* The clamp is compare-and-select (``g = gate > c ? c : gate``; ``u`` likewise on both sides),
  so a NaN stays a NaN as ``torch.minimum`` / ``torch.clamp`` keep it; ``c`` is rounded to fp32
  as the reference rounds it.
* ``sigmoid(g) = (g >= 0 ? 1 : t) / (1 + t)`` with ``t = exp(−|g|)`` in ``(0, 1]`` (never
  overflows): the vector unit's 1-ulp fp32 exp with denormals kept, then a correctly rounded
  division. The reference's sigmoid is correctly rounded (fp64, rounded once); this one may be
  an ulp or two off it, and the division flushes a denormal quotient (``g`` below about −87)
  to zero where the reference keeps it. Where x is bf16 and ``y`` is fp32 (``swiglu`` with an fp32
  ``y``, the fused cast) the kernels read the reference's own value instead
  (:func:`table_sigmoid`: ``tileplug.core.swiglu.sigmoid_table`` in UB, gathered by the gate's bits).
* A row of an expert layout is valid when ``m <= floor(row / a)·a`` and ``row < max(ends)``,
  ``m`` the largest end at or before the row (0 if none): ``start[e] = align(ends[e − 1], a)``
  is at most the row exactly when the unaligned end is at most the row rounded down to the
  alignment. Integer compares on the ends in UB (read once per core), no division.
"""

import tilelang.ascend.language as T
from tvm import tirx

from tileplug.backend_ascend import rows
from tileplug.backend_ascend.quant.sf_macros import f32_value
from tileplug.backend_ascend.ub import LANES
from tileplug.core.swiglu import sigmoid_table as table_layout

F32 = "float32"
I32 = "int32"
U32 = "uint32"
EXP_PRECISE = "vexp_1ulp_ftz_false"
"""The vector unit's 1-ulp fp32 exp, denormals kept."""


@T.macro
def gate_cut(gate, clamp):
    """Lane mask: the clamp cuts the gate (``gate > c``; a NaN gate is not cut); None without a
    clamp. Taken once a register: the clamped gate, its table sigmoid and the backward's zeroed
    gradient all select on it."""
    if clamp is None:
        return None
    else:
        return T.simd.vcmps(gate, T.float32(f32_value(clamp)), op="gt")


@T.macro
def clamp_gate(gate, clamp, cut):
    """``min(gate, c)`` (NaN stays NaN) given ``cut`` (:func:`gate_cut`); ``gate`` itself without a clamp."""
    if clamp is None:
        return gate
    else:
        return T.simd.vsel(T.simd.vdup(T.float32(f32_value(clamp)), F32), gate, cut)


@T.macro
def clamp_up(up, clamp):
    """``clamp(up, −c, c)`` (NaN stays NaN); ``up`` itself without a clamp."""
    if clamp is None:
        return up
    else:
        limit = T.float32(f32_value(clamp))
        high = T.simd.vsel(T.simd.vdup(limit, F32), up, T.simd.vcmps(up, limit, op="gt"))
        return T.simd.vsel(T.simd.vdup(-limit, F32), high, T.simd.vcmps(high, -limit, op="lt"))


@T.macro
def sigmoid(g):
    """``1 / (1 + exp(−g))`` as ``(g >= 0 ? 1 : t) / (1 + t)``, ``t = exp(−|g|)``."""
    t = T.simd.vexp(T.simd.vneg(T.simd.vabs(g)), precision=EXP_PRECISE)
    numerator = T.simd.vsel(T.simd.vdup(T.float32(1.0), F32), t, T.simd.vcmps(g, T.float32(0.0), op="ge"))
    return T.simd.vdiv(numerator, T.simd.vadds(t, T.float32(1.0)), precision=rows.DIV_EXACT)


@T.macro
def table_sigmoid(gate, clamp, cut, table_ub):
    """``sigmoid(g)`` of a bf16 gate read from the table in UB (``table_ub``: the
    ``table_layout.ENTRIES`` fp32 values of ``table_layout.sigmoid_table``): ``gate`` is the bf16
    value widened to fp32, so its top 16 bits are the bf16 bits; the entry is
    ``clamp(bits & 0x7FFF, LOW, HIGH) − LOW + (sign · SPAN)`` (``table_layout.table_index``),
    gathered lane by lane; where the clamp cut (``cut``: :func:`gate_cut`; ``g = c``, not a bf16
    value) the constant ``sigmoid(c)`` as the reference rounds it."""
    bits = T.simd.vshrs(tirx.reinterpret("uint32x64", gate), T.uint32(16))
    magnitude = T.simd.vmins(T.simd.vmaxs(T.simd.vand(bits, T.simd.vdup(T.uint32(0x7FFF), U32)),
                                          T.uint32(table_layout.LOW)), T.uint32(table_layout.HIGH))
    sign_span = T.simd.vand(T.simd.vshrs(bits, T.uint32(3)), T.simd.vdup(T.uint32(table_layout.SPAN), U32))
    entry = T.simd.vsub(T.simd.vadd(magnitude, sign_span), T.simd.vdup(T.uint32(table_layout.LOW), U32))
    looked_up = T.simd.vgather2(table_ub[0], entry)
    if clamp is None:
        return looked_up
    else:
        return T.simd.vsel(T.simd.vdup(T.float32(table_layout.clamp_sigmoid(clamp)), F32), looked_up, cut)


@T.macro
def row_scale(w_ub, weighted, scaling):
    """The register of ``w' = w · routed_scaling_factor`` (the row's weight broadcast from
    ``w_ub[0]``, the product rounded to fp32; the factor alone without weights)."""
    if weighted:
        if scaling == 1.0:
            return T.simd.vld(w_ub[0], dist="BRC_B32")
        else:
            return T.simd.vmuls(T.simd.vld(w_ub[0], dist="BRC_B32"), T.float32(f32_value(scaling)))
    else:
        return T.simd.vdup(T.float32(f32_value(scaling)), F32)


def scale_of(w_ub, weighted: bool, scaling: float):
    """:func:`row_scale`, or None when ``w'`` is exactly 1 (no weights, factor 1: the products
    by it are skipped)."""
    return row_scale(w_ub, weighted, scaling) if weighted or scaling != 1.0 else None


def scaled(value, scale):
    """``value · scale``; ``value`` itself when ``scale`` is None (a factor of exactly 1)."""
    return value if scale is None else T.simd.vmul(value, scale)


@T.macro
def activation(gate, up, clamp, scale, table_ub):
    """``y = ((g · sigmoid(g)) · u) · w'`` in fp32, each product rounded (``scale`` None: no
    ``w'`` product); the sigmoid read from ``table_ub`` (:func:`table_sigmoid`), or evaluated
    (:func:`sigmoid`) where ``table_ub`` is None."""
    cut = gate_cut(gate, clamp)
    g = clamp_gate(gate, clamp, cut)
    if table_ub is None:
        return scaled(T.simd.vmul(T.simd.vmul(g, sigmoid(g)), clamp_up(up, clamp)), scale)
    else:
        return scaled(T.simd.vmul(T.simd.vmul(g, table_sigmoid(gate, clamp, cut, table_ub)), clamp_up(up, clamp)),
                      scale)


@T.macro
def row_kept(ends_ub, experts, alignment, row):
    """Predicate, the same in every lane: row ``row`` lies inside some expert's
    ``[start[e], ends[e])`` (``ends_ub``: the ``experts`` int32 ends in UB)."""
    zero = T.simd.vdup(T.int32(0), I32)
    below = T.simd.alloc_var(I32)
    below = zero
    top = T.simd.alloc_var(I32)
    top = zero
    full, tail = rows.chunks(experts)
    for c in T.serial(full):
        ends = T.simd.vld(ends_ub[c * LANES])
        below = T.simd.vmax(below, T.simd.vsel(ends, zero, T.simd.vcmps(ends, row, op="le")))
        top = T.simd.vmax(top, ends)
    if tail > 0:
        ends = T.simd.vsel(T.simd.vld(ends_ub[full * LANES]), zero, T.simd.update_mask(tail, 32))
        below = T.simd.vmax(below, T.simd.vsel(ends, zero, T.simd.vcmps(ends, row, op="le")))
        top = T.simd.vmax(top, ends)
    started = T.simd.vsel(T.simd.vdup(T.int32(1), I32), zero,
                          T.simd.vcmps(T.simd.vcmax(below), (row // alignment) * alignment, op="le"))
    inside = T.simd.vsel(started, zero, T.simd.vcmps(T.simd.vcmax(top), row, op="gt"))  # lane 0: 1 or 0
    return T.simd.vcmps(T.simd.vdupv(inside), T.int32(0), op="ne")


def keep_of(spec, buffers, row):
    """:func:`row_kept` of ``row`` (inside a ``T.SimdVF`` region), None without an expert layout."""
    if spec.experts is None:
        return None
    return row_kept(buffers["ends_ub"], spec.experts, spec.alignment, row)


@T.macro
def kept(value, keep):
    """``value`` where ``keep`` holds, +0 elsewhere (a padding row's result); ``keep`` None: ``value``."""
    if keep is None:
        return value
    else:
        return T.simd.vsel(value, T.simd.vdup(T.float32(0.0), F32), keep)
