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

from tileplug.backend_ascend import gm, rows
from tileplug.backend_ascend.kernel import SpecKernel
from tileplug.backend_ascend.rope.rotation import cache_parameters, load_cache_row, rotation
from tileplug.backend_ascend.rope.spec import RotarySpec, decline_reason, spec_of


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
    params += cache_parameters(spec.rotary_dim, spec.positions, spec.batched, batch, steps, tokens)
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
    rotate = rotation(spec.dtype, spec.half, spec.interleaved, spec.conjugate)

    @T.macro
    def compute(buffers, valid):
        with T.SimdVF():
            for tensor, heads in (("q", spec.query_heads), ("k", spec.key_heads)):
                if heads is not None:
                    first = buffers[tensor + spec.planes()[0]]
                    second = buffers[tensor + spec.planes()[-1]]
                    rotate.rotate_heads(first, second, 0, heads, buffers["cos_ub"], buffers["sin_ub"], valid)

    return compute


def build(spec: RotarySpec):
    """The prim_func of ``spec``; raises ``UBBudgetError`` when its plan does not fit the budget."""
    rows.check_budget(spec.footprint, spec.budget, spec.describe())
    params, count, steps = parameters(spec)
    plan = spec.plan()
    names = tuple(plan)
    C = spec.vector_cores
    tensors = [("q", "Q", spec.query_heads)] + ([("k", "K", spec.key_heads)] if spec.key_heads is not None else [])
    compute = rotate_compute(spec)
    load_cache = load_cache_row(spec.positions, spec.batched, spec.half, spec.rotary_dim)

    @T.macro
    def one_token(G, buffers, t):
        valid = load_cache(G, buffers["cos_ub"], buffers["sin_ub"], t, steps)
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
