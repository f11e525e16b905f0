"""Ascend kernel of ``apply_rotary``: ``query`` (and ``key``) rotated in place (SPEC §6).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

Per vector core ``cid`` of ``T.Kernel(C)``, one :func:`~tileplug.backend_ascend.rows.row_loop`
over tokens ``cid, cid + C, ...`` (``T = B·S`` dynamic). Per token:

* its position: ``positions[t]`` (read from GM as a scalar, int32 or int64) or the implicit
  ``t`` (3-D) / ``s`` (4-D), plus ``seqlen_offset`` (a runtime int64);
* the cache row: DMA of ``cos`` and ``sin`` (``R/2`` fp32 each) of row ``clamp(pos, 0, L−1)``
  (never an out-of-range row); a position outside ``[0, L)`` turns ``c`` and ``n`` into NaN
  in the registers, so only that token's rotated channels become NaN;
* the heads: one strided DMA per plane brings the first ``R`` channels of all ``N`` heads
  into UB (the tail channels are never read or written). NeoX: the DMA puts channels
  ``[0, R/2)`` and ``[R/2, R)`` in two UB planes at the same offsets, so the partner of
  lane ``j`` is lane ``j`` of the other plane's register — the pair exchange is done by
  where the halves land in UB, with no shuffle. GPT-J: one plane; two registers (128
  channels) are de-interleaved into 64 first / 64 second elements (``vdintlv``), rotated and
  re-interleaved (``vintlv``) before the store;
* in one ``T.SimdVF`` region, fp32: ``y1 = x1·c − x2·n``, ``y2 = x2·c + x1·n`` (two products and
  one sum, each rounded to fp32, as the reference evaluates them), ``n`` negated when
  conjugating, rounded once to the dtype at the store; DMA back into the same channels.
"""

import tilelang.ascend.language as T
from tvm import tirx as tir

from tileplug.backend_ascend import gm, rows
from tileplug.backend_ascend.kernel import SpecKernel
from tileplug.backend_ascend.rope.spec import PAIR_BLOCK, RotarySpec, decline_reason, spec_of
from tileplug.backend_ascend.ub import LANES


def _heads_tensor(name, spec, heads, batch, steps, tokens):
    D, dt = spec.head_dim, spec.dtype
    if spec.batched:
        strides = (T.dynamic(f"{name}_s0"), T.dynamic(f"{name}_s1"), T.dynamic(f"{name}_s2"), 1)
        return T.StridedTensor((batch, steps, heads, D), strides, dt)
    return T.StridedTensor((tokens, heads, D), (T.dynamic(f"{name}_s0"), T.dynamic(f"{name}_s1"), 1), dt)


def parameters(spec: RotarySpec):
    """``(name, tensor type)`` of the kernel's GM parameters in launch order, and the token
    count, batch and steps symbols (``T``; ``B``, ``S`` for 4-D, where ``T = B·S``)."""
    batch, steps, tokens = T.dynamic("B"), T.dynamic("S"), T.dynamic("T")
    count = batch * steps if spec.batched else tokens
    params = [("Q", _heads_tensor("q", spec, spec.query_heads, batch, steps, tokens))]
    if spec.key_heads is not None:
        params.append(("K", _heads_tensor("k", spec, spec.key_heads, batch, steps, tokens)))
    params.append(("CS", T.StridedTensor((T.dynamic("L"), spec.rotary_dim), (T.dynamic("cs_s0"), 1), "float32")))
    if spec.positions is not None:
        if spec.batched:
            shape, strides = (batch, steps), (T.dynamic("p_s0"), T.dynamic("p_s1"))
        else:
            shape, strides = (tokens,), (T.dynamic("p_s0"),)
        params.append(("P", T.StridedTensor(shape, strides, spec.positions)))
    params.append(("offset", tir.Var("offset", "int64")))
    return params, count, steps


def _channels(tensor, spec, t, steps, lo, hi):
    """Channels ``lo:hi`` of every head of token ``t`` (a ``[N, hi − lo]`` region)."""
    if spec.batched:
        return tensor[t // steps, t % steps, :, lo:hi]
    return tensor[t, :, lo:hi]


def _plane_columns(spec, plane):
    """GM channel range ``(lo, hi)`` of a plane."""
    return {"a": (0, spec.rotary_dim), "1": (0, spec.half), "2": (spec.half, spec.rotary_dim)}[plane]


def rotate_compute(spec: RotarySpec):
    """The per-token vector work of ``spec``: a macro over the token's UB buffers. Looked up by
    :func:`build` at trace time; tests/ascend_bad_kernels.py replaces it with scalar code."""
    dt, half = spec.dtype, spec.half

    @T.macro
    def rotate_pair(x1, x2, c, n):
        return (T.simd.vsub(T.simd.vmul(x1, c), T.simd.vmul(x2, n)),
                T.simd.vadd(T.simd.vmul(x2, c), T.simd.vmul(x1, n)))

    @T.macro
    def rotate_heads(first, second, heads, cos_ub, sin_ub, valid):
        # first / second: the two NeoX planes, or the GPT-J plane twice
        ok = T.simd.vcmps(T.simd.vdup(valid, "int32"), T.int32(0), op="ne")
        nan = T.simd.vdup(T.float32(float("nan")), "float32")
        for p in T.serial(rows.registers(half)):
            c = T.simd.vsel(T.simd.vld(cos_ub[p * LANES]), nan, ok)
            sin = T.simd.vsel(T.simd.vld(sin_ub[p * LANES]), nan, ok)
            n = rows.choose(spec.conjugate, T.simd.vneg(sin), sin)
            for h in T.serial(heads):
                if spec.interleaved:
                    lo_at, hi_at = (h, p * PAIR_BLOCK), (h, p * PAIR_BLOCK + LANES)
                    x1, x2 = T.simd.vdintlv(rows.load_f32(first, lo_at, dt), rows.load_f32(first, hi_at, dt))
                    y1, y2 = rotate_pair(x1, x2, c, n)
                    lo, hi = T.simd.vintlv(y1, y2)
                    rows.store_rounded(first, lo_at, lo, dt)
                    rows.store_rounded(first, hi_at, hi, dt)
                else:
                    at = (h, p * LANES)
                    y1, y2 = rotate_pair(rows.load_f32(first, at, dt), rows.load_f32(second, at, dt), c, n)
                    rows.store_rounded(first, at, y1, dt)
                    rows.store_rounded(second, at, y2, dt)

    @T.macro
    def compute(buffers, valid):
        with T.SimdVF():
            for tensor, heads in (("q", spec.query_heads), ("k", spec.key_heads)):
                if heads is not None:
                    first = buffers[tensor + spec.planes()[0]]
                    second = buffers[tensor + spec.planes()[-1]]
                    rotate_heads(first, second, heads, buffers["cos_ub"], buffers["sin_ub"], valid)

    return compute


def build(spec: RotarySpec):
    """The prim_func of ``spec``; raises ``UBBudgetError`` when its plan does not fit the budget."""
    rows.check_budget(spec.footprint, spec.budget, spec.describe())
    params, count, steps = parameters(spec)
    plan = spec.plan()
    names = tuple(plan)
    C, half, R = spec.vector_cores, spec.half, spec.rotary_dim
    tensors = [("q", "Q", spec.query_heads)] + ([("k", "K", spec.key_heads)] if spec.key_heads is not None else [])
    compute = rotate_compute(spec)

    @T.macro
    def one_token(G, buffers, t):
        if spec.positions is None:
            pos = G["offset"] + T.Cast("int64", rows.choose(spec.batched, t % steps, t))
        elif spec.batched:
            pos = G["offset"] + T.Cast("int64", G["P"][t // steps, t % steps])
        else:
            pos = G["offset"] + T.Cast("int64", G["P"][t])
        length = T.Cast("int64", G["CS"].shape[0])
        valid = T.if_then_else(pos >= 0, T.if_then_else(pos < length, 1, 0), 0)
        row = T.max(T.min(pos, length - 1), T.int64(0))
        T.copy(G["CS"][row, 0:half], buffers["cos_ub"][0:half])
        T.copy(G["CS"][row, half:R], buffers["sin_ub"][0:half])
        for tensor, name, heads in tensors:
            for plane in spec.planes():
                lo, hi = _plane_columns(spec, plane)
                T.copy(_channels(G[name], spec, t, steps, lo, hi), buffers[tensor + plane][0:heads, 0:hi - lo])
        compute(buffers, valid)
        for tensor, name, heads in tensors:
            for plane in spec.planes():
                lo, hi = _plane_columns(spec, plane)
                T.copy(buffers[tensor + plane][0:heads, 0:hi - lo], _channels(G[name], spec, t, steps, lo, hi))

    def rope_kernel(tensors):
        G = gm.declare(tensors)
        with T.Kernel(C) as cid:
            buffers = {name: T.alloc_shared(plan[name][0], plan[name][1]) for name in names}
            versions = {buffers[name]: plan[name][2] for name in names if plan[name][2] > 1}
            for it in rows.row_loop(T.ceildiv(count - cid, C), versions, spec.num_buffers):
                one_token(G, buffers, cid + it * C)

    return gm.prim_func(rope_kernel, params)


def arguments(spec: RotarySpec, inputs, outputs) -> list:
    """Launch arguments in the prim_func's parameter order. An empty cache (``L = 0``: every
    position is out of range) is passed as one NaN row, which gives the same NaN rows."""
    import torch

    cache = inputs.cos_sin_cache
    if cache.shape[0] == 0:
        cache = torch.full((1, cache.shape[1]), float("nan"), dtype=cache.dtype, device=cache.device)
    values = {"Q": inputs.query, "K": inputs.key, "CS": cache, "P": inputs.positions, "offset": inputs.seqlen_offset}
    return [values[name] for name in gm.argument_names(parameters(spec)[0])]


KERNEL = SpecKernel("apply_rotary", spec_of, decline_reason, build, arguments)
