"""CUDA ``apply_rotary`` (SPEC §6): query and optional key rotated in place, one launch.

Geometry. A CTA of ``32·warps`` threads; thread ``tx`` owns slot ``tx % SLOTS`` (see
``spec.py``: ``SLOTS = R / (2·pairs)`` slots cover a head's rotated channels) of every
head it visits; its *lane* ``tx // SLOTS`` picks the token and the heads. With
``LANES = threads // SLOTS`` lanes and ``H = Nq + Nk`` heads (runtime), a CTA serves
``max(1, LANES // H)`` tokens, ``LANES // that`` lanes per token, and lane ``j`` of a
token visits heads ``j, j + lanes, …`` (query heads, then key heads): many heads per CTA,
and few tokens per CTA only when a token has many heads. A thread loads its token's
position and its slot's cos/sin once and keeps them in registers for all its heads
(the cache row is read from DRAM once per token and CTA); it loads ``heads_per_step``
heads (two 128-bit chunks each on the vector path) before rotating any, then stores them.

Channels past ``R`` are never read or written; a position outside ``[0, L)`` is never
read from the cache: its ``c`` and ``n`` are NaN, so that token's rotated channels become
NaN and nothing else changes. Offsets are 64-bit (TileLang's index math).

Buffers: ``q`` ``[S, Nq, D]`` or ``[B, S, Nq, D]`` and ``k`` (same leading dims, ``Nk``
heads), any strides but the unit last one; ``cache`` fp32 ``[L, R]`` (row stride runtime);
``positions`` int32/int64 ``[S]`` / ``[B, S]`` (any strides); ``offset`` int64 scalar.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

from collections.abc import Callable
from typing import Any

import torch

from tileplug.backend_cuda import jit
from tileplug.backend_cuda.tuning import tuning_override
from tileplug.backend_cuda.rope.spec import (
    MAX_THREADS,
    TL_DTYPES,
    TL_POSITIONS,
    RotarySpec,
    can_vectorize,
    default_warps,
    slots_per_head,
    values_per_vector,
)
from tileplug.core.call import NoOutputs
from tileplug.core.contracts.rope import RotaryCall, RotaryInputs

Launcher = Callable[[RotaryInputs, NoOutputs], None]

HEADS_PER_STEP = 2
"""Heads a thread loads before rotating (``TILEPLUG_CUDA_ROPE_HEADS`` overrides, for tuning)."""
WARPS = 4
"""Warps per CTA (``TILEPLUG_CUDA_ROPE_WARPS`` overrides; more when a head has more slots)."""


def build_kernel(spec: RotarySpec):
    """The ``T.prim_func`` of ``spec`` (see the module docstring)."""
    import tilelang.language as T

    from tileplug.backend_cuda.rope.rotation import SlotLayout

    layout = SlotLayout(spec.dtype, spec.rotary_dim, spec.interleaved, spec.conjugate, spec.vectorize)
    load_cos_sin = layout.make_load_cos_sin()
    rotate = layout.make_rotate()
    DT = spec.dtype
    VEC = layout.vec
    P = layout.pairs
    VALUES = layout.values  # registers of one slot
    SLOTS = spec.slots
    NT = 32 * spec.warps
    LANES = NT // SLOTS
    STEP = spec.heads_per_step
    R = spec.rotary_dim
    BATCHED, KEY, VECTOR = spec.batched, spec.with_key, spec.vectorize
    assert SLOTS <= NT, "one thread per slot of a head at least"

    S = T.dynamic("S")  # tokens (3-D) or sequence length (4-D)
    B = T.dynamic("B") if BATCHED else 1
    NQ, NK, D = T.dynamic("NQ"), T.dynamic("NK"), T.dynamic("D")
    QSB, QSS, QSN = T.dynamic("QSB"), T.dynamic("QSS"), T.dynamic("QSN")
    KSB, KSS, KSN = T.dynamic("KSB"), T.dynamic("KSS"), T.dynamic("KSN")
    L, CS = T.dynamic("L"), T.dynamic("CS")
    PSB, PSS = T.dynamic("PSB"), T.dynamic("PSS")
    TOKENS = B * S
    HEADS = NQ + NK if KEY else NQ

    def lead(batch, seq):
        return (batch, seq) if BATCHED else (seq,)

    def at(b, s, h, c):
        """Index of channel ``c`` of head ``h`` of token ``(b, s)`` (``b`` unused for 3-D)."""
        return (b, s, h, c) if BATCHED else (s, h, c)

    @T.macro
    def load_head(buf, b, s, h, slot, xv, x0):
        if VECTOR:
            for part in T.unroll(2):
                for j in T.vectorized(VEC):
                    xv[x0 + part * VEC + j] = buf[at(b, s, h, layout.chunk(slot, part) + j)]
        else:
            for i in T.unroll(P):
                xv[x0 + 2 * i] = buf[at(b, s, h, layout.channel(slot, i, 0))]
                xv[x0 + 2 * i + 1] = buf[at(b, s, h, layout.channel(slot, i, 1))]

    @T.macro
    def store_head(buf, b, s, h, slot, ov, o0):
        if VECTOR:
            for part in T.unroll(2):
                for j in T.vectorized(VEC):
                    buf[at(b, s, h, layout.chunk(slot, part) + j)] = ov[o0 + part * VEC + j]
        else:
            for i in T.unroll(P):
                buf[at(b, s, h, layout.channel(slot, i, 0))] = ov[o0 + 2 * i]
                buf[at(b, s, h, layout.channel(slot, i, 1))] = ov[o0 + 2 * i + 1]

    @T.macro
    def body(q, k, cache, positions, offset):
        with T.Kernel(T.ceildiv(TOKENS, T.max(1, LANES // HEADS)), threads=NT) as bx:
            if VECTOR:
                T.assume(QSN % VEC == 0)
                T.assume(QSS % VEC == 0)
                T.assume(CS % 4 == 0)
                if BATCHED:
                    T.assume(QSB % VEC == 0)
                if KEY:
                    T.assume(KSN % VEC == 0)
                    T.assume(KSS % VEC == 0)
                    if BATCHED:
                        T.assume(KSB % VEC == 0)
            tx = T.get_thread_binding()
            per_cta = T.alloc_var("int32")  # tokens of this CTA
            lanes = T.alloc_var("int32")  # lanes per token
            per_cta = T.max(1, T.truncdiv(LANES, HEADS))
            lanes = T.truncdiv(LANES, per_cta)
            slot = tx % SLOTS
            lane = tx // SLOTS
            token = bx * per_cta + T.truncdiv(lane, lanes)
            head0 = T.truncmod(lane, lanes)
            if lane < per_cta * lanes and head0 < HEADS and token < TOKENS:
                b = T.alloc_var("int32")
                s = T.alloc_var("int32")
                position = T.alloc_var("int64")
                if BATCHED:
                    b = T.truncdiv(token, S)
                    s = T.truncmod(token, S)
                else:
                    b = 0
                    s = token
                if positions is None:
                    position = T.cast(s, "int64") + offset
                else:
                    position = T.cast(positions[lead(b, s)], "int64") + offset
                cs = T.alloc_local((2 * P,), "float32")
                xv = T.alloc_local((STEP * VALUES,), DT)
                ov = T.alloc_local((STEP * VALUES,), DT)
                load_cos_sin(cache, position, position >= 0 and position < T.cast(L, "int64"), slot, cs)
                for step in T.serial(T.truncdiv(HEADS - head0 + lanes * STEP - 1, lanes * STEP)):
                    for u in T.unroll(STEP):
                        h = head0 + (step * STEP + u) * lanes
                        if h < NQ:
                            load_head(q, b, s, h, slot, xv, u * VALUES)
                        elif KEY:
                            if h < HEADS:
                                load_head(k, b, s, h - NQ, slot, xv, u * VALUES)
                    for u in T.unroll(STEP):
                        rotate(xv, u * VALUES, cs, ov, u * VALUES)
                    for u in T.unroll(STEP):
                        h = head0 + (step * STEP + u) * lanes
                        if h < NQ:
                            store_head(q, b, s, h, slot, ov, u * VALUES)
                        elif KEY:
                            if h < HEADS:
                                store_head(k, b, s, h - NQ, slot, ov, u * VALUES)

    q_t = T.StridedTensor((*lead(B, S), NQ, D), (*lead(QSB, QSS), QSN, 1), DT)
    k_t = T.StridedTensor((*lead(B, S), NK, D), (*lead(KSB, KSS), KSN, 1), DT)
    cache_t = T.StridedTensor((L, R), (CS, 1), "float32")
    positions_t = T.StridedTensor(lead(B, S), lead(PSB, PSS), spec.positions or "int32")

    # One prim_func per buffer set (TileLang reads the signature off the annotations).
    if KEY and spec.positions:

        @T.prim_func
        def kernel(q: q_t, k: k_t, cache: cache_t, positions: positions_t, offset: T.int64):
            body(q, k, cache, positions, offset)

    elif KEY:

        @T.prim_func
        def kernel(q: q_t, k: k_t, cache: cache_t, offset: T.int64):
            body(q, k, cache, None, offset)

    elif spec.positions:

        @T.prim_func
        def kernel(q: q_t, cache: cache_t, positions: positions_t, offset: T.int64):
            body(q, None, cache, positions, offset)

    else:

        @T.prim_func
        def kernel(q: q_t, cache: cache_t, offset: T.int64):
            body(q, None, cache, None, offset)

    return kernel.with_attr("global_symbol", spec.name)


# ---------------------------------------------------------------------- the kernel object


class ApplyRotary:
    """The CUDA ``apply_rotary`` kernel: ``supports``, ``spec``, ``source``, ``prepare``."""

    op = "apply_rotary"

    def supports(self, call: RotaryCall) -> str | None:
        if call.op != self.op:
            return f"this kernel serves {self.op}, not {call.op}"
        slots = slots_per_head(TL_DTYPES[call.dtype], call.rotary_dim, False)
        if slots > MAX_THREADS:
            return f"rotary width {call.rotary_dim} needs {slots} threads per head (at most {MAX_THREADS})"
        return None

    def spec(self, call: RotaryCall, vectorize: bool | None = None) -> RotarySpec:
        """The specialisation serving ``call``: the 128-bit one where it exists (``vectorize``
        None or True), else (or ``vectorize=False``) the scalar one misaligned views take."""
        dtype = TL_DTYPES[call.dtype]
        vector = can_vectorize(call.dtype, call.rotary_dim) if vectorize is None else \
            vectorize and can_vectorize(call.dtype, call.rotary_dim)
        slots = slots_per_head(dtype, call.rotary_dim, vector)
        return RotarySpec(
            dtype, call.rotary_dim, call.interleaved, call.conjugate, call.key_heads is not None, call.batched,
            TL_POSITIONS[call.positions_dtype], vector,
            warps=default_warps(slots, tuning_override("TILEPLUG_CUDA_ROPE_WARPS", WARPS)),
            heads_per_step=tuning_override("TILEPLUG_CUDA_ROPE_HEADS", HEADS_PER_STEP),
        )

    def specs(self, call: RotaryCall) -> list[RotarySpec]:
        """Every specialisation a call signature may launch (vector and scalar paths)."""
        return list(dict.fromkeys([self.spec(call), self.spec(call, vectorize=False)]))

    def source(self, call: RotaryCall, arch: str = jit.DEFAULT_ARCH) -> str:
        """Generated CUDA source of the kernel serving ``call`` (no GPU needed)."""
        return jit.lower_source(self.spec(call), arch)

    def __call__(self, call: RotaryCall, inputs: RotaryInputs, outputs: NoOutputs) -> None:
        self.prepare(call)(inputs, outputs)

    def prepare(self, call: RotaryCall) -> Launcher:
        """``launch(inputs, outputs)`` bound to ``call``'s signature: the 128-bit entry when
        pointers and strides are 16-byte aligned, else the scalar one (loaded on first use)."""
        vector_spec, scalar_spec = self.spec(call), self.spec(call, vectorize=False)
        vector_entry = jit.entry(vector_spec) if vector_spec.vectorize else None
        return make_launcher(vector_entry, scalar_spec, values_per_vector(vector_spec.dtype), call.rotary_dim,
                             call.key_heads is not None, call.positions_dtype is not None)


def _aligned(tensor: torch.Tensor, vec: int) -> bool:
    """16-byte aligned data pointer and every stride but the last a multiple of ``vec``."""
    return tensor.data_ptr() % 16 == 0 and all(stride % vec == 0 for stride in tensor.stride()[:-1])


def make_launcher(vector_entry: Any, scalar_spec: RotarySpec, vec: int, rotary_dim: int, with_key: bool,
                  with_positions: bool) -> Launcher:
    """A closure running the kernel on one call's inputs (argument order fixed here)."""
    scalar: list[Any] = []

    def entry(query: torch.Tensor, key: torch.Tensor | None, cache: torch.Tensor) -> Any:
        if vector_entry is not None and _aligned(query, vec) and (key is None or _aligned(key, vec)) \
                and _aligned(cache, 4):
            return vector_entry
        if not scalar:
            scalar.append(jit.entry(scalar_spec))
        return scalar[0]

    def usable(cache: torch.Tensor) -> torch.Tensor:
        # An empty cache has no row to read: every position is out of range, so a one-row
        # NaN cache gives the same result (NaN rows) without a zero-size buffer.
        if cache.shape[0]:
            return cache
        return torch.full((1, rotary_dim), float("nan"), dtype=torch.float32, device=cache.device)

    if with_key and with_positions:

        def launch(inputs: RotaryInputs, outputs: NoOutputs) -> None:
            query, key, cache = inputs.query, inputs.key, usable(inputs.cos_sin_cache)
            entry(query, key, cache)(query, key, cache, inputs.positions, inputs.seqlen_offset)

    elif with_key:

        def launch(inputs: RotaryInputs, outputs: NoOutputs) -> None:
            query, key, cache = inputs.query, inputs.key, usable(inputs.cos_sin_cache)
            entry(query, key, cache)(query, key, cache, inputs.seqlen_offset)

    elif with_positions:

        def launch(inputs: RotaryInputs, outputs: NoOutputs) -> None:
            query, cache = inputs.query, usable(inputs.cos_sin_cache)
            entry(query, None, cache)(query, cache, inputs.positions, inputs.seqlen_offset)

    else:

        def launch(inputs: RotaryInputs, outputs: NoOutputs) -> None:
            query, cache = inputs.query, usable(inputs.cos_sin_cache)
            entry(query, None, cache)(query, cache, inputs.seqlen_offset)

    return launch
