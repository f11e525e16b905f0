"""What a CUDA RoPE-family kernel is specialised on, and the slot geometry they share.

A *slot* is the unit of work of one thread on one head: ``pairs`` rotation pairs, held in
registers as ``2·pairs`` values. On the vector path (``vectorize``) a slot is two 128-bit
chunks of the head, channels ``[k·V, k·V + V)`` and ``[R/2 + k·V, R/2 + k·V + V)`` for
slot ``k`` and ``V`` values per 16 bytes: for NeoX those are the two halves of ``V`` pairs
``(p, p + R/2)`` (the pair's partner is read by the same thread, no exchange needed), for
GPT-J each chunk holds ``V/2`` adjacent pairs ``(2p, 2p + 1)``. Either way a head's rotated
channels are ``R / (2V)`` slots and every channel is read once, 16 bytes at a time. The
scalar path (misaligned views, or ``R/2`` not a multiple of ``V``) uses ``pairs`` = the
largest power of two ≤ ``V`` dividing ``R/2`` and reads each pair's two channels alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tileplug.backend_cuda.tuning import tuning_override

TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
TL_POSITIONS = {None: None, torch.int32: "int32", torch.int64: "int64"}
VECTOR_BYTES = 16
MAX_THREADS = 1024
NORM_ROPE_CTAS_PER_SM = 0
"""CTAs per SM the fused ``rms_norm_rope`` kernels (with or without the cast) ask ptxas to fit (``__launch_bounds__``'
second argument; 0, the default: ptxas' choice, 77–78 registers at a head of 128 bf16 on the 128-thread tile, 6 CTAs
an SM). A tuning knob under trial, ``TILEPLUG_CUDA_NORM_ROPE_CTAS_PER_SM`` (kernel index off: the index key does not
see it): 8 gives 64 registers (nvcc 13.0, thirty-third session: no spill without the cast, 4 bytes with it, at 744 /
1024 SASS instructions against ptxas' 688 / 952); 10 gives 48, spilling 8 / 12 bytes."""


def norm_rope_ctas_per_sm() -> int:
    return tuning_override("TILEPLUG_CUDA_NORM_ROPE_CTAS_PER_SM", NORM_ROPE_CTAS_PER_SM)


HEAD_VALUES = 32
"""Values of a head one thread of the fused ``rms_norm_rope`` kernel aims to hold
(``TILEPLUG_CUDA_NORM_ROPE_VALUES`` overrides, for tuning; see :func:`head_tile`)."""


def head_tile(head_dim: int, rotary_dim: int, dtype: torch.dtype, interleaved: bool):
    """The row tile of the fused ``rms_norm_rope`` kernel (``norm.spec.RowTile``, None: a head
    too long for one CTA).

    ``rms_norm``'s tile of a ``D``-row gives a small head one vector per lane; the fused
    kernel's per-row work (the position, the statistic's square root and division, the
    reduction's shuffles) is then spread over 8 values a thread, and it issues more
    instructions than the memory system can use. Where ``D`` is a whole number of vectors and
    a row fits one warp, this tile keeps 4 warps per CTA but gives a lane ``HEAD_VALUES``
    values (fewer lanes per row, more rows per CTA). For NeoX pairing the lanes also divide
    ``R/2 / VEC``: lane ``l``'s vector ``k < R/2 / (lanes·VEC)`` and its vector ``k + R/2 /
    (lanes·VEC)`` are then the two halves of the same pairs, so the pair exchange needs no
    shared memory. The statistic is the reference's tree on any tile (``norm.rows``), so the
    bytes are ``rms_norm``'s whatever the tile."""
    from tileplug.backend_cuda.norm.spec import SMALL_ROW_THREADS, RowTile, row_tile, vector_width

    tile = row_tile(head_dim, dtype)
    vec = vector_width(dtype)
    if tile is None or tile.rows == 1 or head_dim % vec:  # a long row (one per CTA), or no whole vectors
        return tile
    vectors = head_dim // vec
    target = max(1, tuning_override("TILEPLUG_CUDA_NORM_ROPE_VALUES", HEAD_VALUES) // vec)  # vectors per lane
    lanes = tile.lanes
    while lanes > 1 and -(-vectors // (lanes // 2)) <= target:
        lanes //= 2
    half = rotary_dim // 2
    if not interleaved and half % vec == 0:
        paired = lanes  # the most lanes dividing R/2 / VEC (pairs within a thread), unless that holds too much
        while (half // vec) % paired:
            paired //= 2
        if -(-vectors // paired) <= 2 * target:
            lanes = paired
    return RowTile(lanes, SMALL_ROW_THREADS // lanes, -(-vectors // lanes))


def pair_chunks(rotary_dim: int, lanes: int, vec: int, interleaved: bool) -> int | None:
    """NeoX pairs within one thread on a row tile of ``lanes`` lanes of ``vec``-value vectors: the
    ``P`` such that a lane's vector ``k < P`` holds the first halves of ``vec`` pairs and its vector
    ``k + P`` their second halves (``R/2`` a multiple of ``lanes · vec``); None where the pairs
    straddle lanes (or GPT-J, whose pairs lie within a vector)."""
    half, columns = rotary_dim // 2, lanes * vec
    if interleaved or half % columns:
        return None
    return half // columns


def values_per_vector(dtype: str) -> int:
    """Values of ``dtype`` in one 128-bit load."""
    return VECTOR_BYTES // (4 if dtype == "float32" else 2)


def slot_pairs(dtype: str, rotary_dim: int, vectorize: bool) -> int:
    """Rotation pairs per slot: ``V`` on the vector path, else the largest power of two
    ≤ ``V`` that divides ``R/2``."""
    vec = values_per_vector(dtype)
    if vectorize:
        return vec
    half = rotary_dim // 2
    pairs = vec
    while half % pairs:
        pairs //= 2
    return pairs


def can_vectorize(dtype: torch.dtype, rotary_dim: int) -> bool:
    """Whether the vector path exists for this dtype and rotary width (``R/2`` a multiple of
    the values per 128-bit load); misaligned views still take the scalar path at launch."""
    return (rotary_dim // 2) % values_per_vector(TL_DTYPES[dtype]) == 0


def slots_per_head(dtype: str, rotary_dim: int, vectorize: bool) -> int:
    return rotary_dim // 2 // slot_pairs(dtype, rotary_dim, vectorize)


def default_warps(slots: int, minimum: int = 4) -> int:
    """Warps per CTA: ``minimum``, or enough for one thread per slot of a head."""
    return max(minimum, -(-slots // 32))


@dataclass(frozen=True)
class RotarySpec:
    """Compile-time constants of one CUDA ``apply_rotary`` kernel.

    ``dtype`` (TileLang name of the heads' dtype), ``rotary_dim`` R, ``interleaved`` (GPT-J
    pairs), ``conjugate`` (sin negated), ``with_key``, ``batched`` (4-D ``[B, S, N, D]``),
    ``positions`` (TileLang dtype of explicit positions, None: implicit), ``vectorize``
    (128-bit path: the launcher checks pointers and strides per call), ``warps`` per CTA,
    ``heads_per_step`` (heads a thread loads before it computes: bytes in flight).
    Token count, head counts, head width D, every stride, the cache length and
    ``seqlen_offset`` are runtime values.
    """

    dtype: str
    rotary_dim: int
    interleaved: bool
    conjugate: bool
    with_key: bool
    batched: bool
    positions: str | None
    vectorize: bool
    warps: int = 4
    heads_per_step: int = 2

    @property
    def pairs(self) -> int:
        return slot_pairs(self.dtype, self.rotary_dim, self.vectorize)

    @property
    def slots(self) -> int:
        return slots_per_head(self.dtype, self.rotary_dim, self.vectorize)

    @property
    def vector_buffers(self) -> tuple[str, ...]:
        """Buffers the vector path reads and writes 128 bits at a time (compile-grid check)."""
        return ("q", "k") if self.with_key else ("q",)

    @property
    def name(self) -> str:
        """A short, unique, identifier-safe name (kernel symbol and cache key text)."""
        parts = ["apply_rotary", {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[self.dtype],
                 f"r{self.rotary_dim}", "gptj" if self.interleaved else "neox"]
        if self.conjugate:
            parts.append("conj")
        if self.with_key:
            parts.append("qk")
        parts.append("4d" if self.batched else "3d")
        parts.append(f"pos{self.positions}" if self.positions else "implicit")
        parts.append("v128" if self.vectorize else "scalar")
        parts.append(f"w{self.warps}h{self.heads_per_step}")
        return "_".join(parts)

    def build(self):
        """The TileLang ``PrimFunc`` of this specialisation (``tileplug.backend_cuda.jit``)."""
        from tileplug.backend_cuda.rope.apply_rotary import build_kernel

        return build_kernel(self)


@dataclass(frozen=True)
class NormRopeSpec:
    """Compile-time constants of one CUDA ``rms_norm_rope`` kernel: ``norm`` the RMSNorm
    row tile and constants (the ``rms_norm`` kernel's own ``NormKernelSpec`` for a per-head
    ``[T, N, D]`` input, so the fused kernel's ``y`` before the rotation is that kernel's,
    bit for bit), ``rotary_dim`` R, ``interleaved`` (GPT-J pairs), ``positions`` (TileLang
    dtype of explicit positions, None: ``offset + t``), ``quant`` the per-token cast of
    ``rms_norm_rope_per_token_cast`` (a norm ``QuantSpec``; None: ``y`` only). Tokens,
    strides, the cache length and ``seqlen_offset`` are runtime values."""

    norm: Any
    rotary_dim: int
    interleaved: bool
    positions: str | None
    quant: Any = None

    @property
    def vectorize(self) -> bool:
        """128-bit row accesses (the norm tile's)."""
        return self.norm.vectorize

    @property
    def vector_buffers(self) -> tuple[str, ...]:
        """Buffers the vector path loads 128 bits at a time (compile-grid check)."""
        return ("x",) if self.norm.vectorize else ()

    @property
    def name(self) -> str:
        """A short, unique, identifier-safe name (kernel symbol and cache key text)."""
        norm = self.norm.name.removeprefix("rms_norm_")
        pairing = "gptj" if self.interleaved else "neox"
        positions = f"pos{self.positions}" if self.positions else "implicit"
        name = f"rms_norm_rope_{norm}_r{self.rotary_dim}_{pairing}_{positions}"
        quant = self.quant
        if quant is not None:
            name += f"_{quant.fmt}_g{quant.group}_sf{quant.sf_kind}{'col' if quant.sf_col_major else ''}"
            name += ("_round" if quant.round_sf else "") + f"_c{quant.clamp_min.hex().replace('.', '_')}"
            name = name.replace("+", "p").replace("-", "m") + ("_y" if quant.unquantized else "")
        return name

    def build(self):
        """The TileLang ``PrimFunc`` of this specialisation (``tileplug.backend_cuda.jit``)."""
        from tileplug.backend_cuda.rope.rms_norm_rope import build_kernel

        return build_kernel(self)
