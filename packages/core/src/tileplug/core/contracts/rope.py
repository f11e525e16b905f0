"""Contracts of the RoPE family (SPEC.md §6, docs/spec.md "RoPE and the fused QK path").

``apply_rotary`` rotates ``query`` (and ``key``) in place; its call holds what a kernel
specialises on (head width, rotary width, head counts, dtype, pairing, positions mode)
and nothing that changes from step to step: the token count, the cache length and
``seqlen_offset`` (carried in the inputs) are runtime values, so a decode loop stays on one
cached route. ``rms_norm_rope`` / ``rms_norm_rope_per_token_cast`` add the per-head RMSNorm
in front and, for the latter, the per-token cast of ``y.view(T, N·D)`` behind.

Every check raises ContractError naming the argument; a memo of the checked argument
metadata (the relative address of ``key`` to ``query`` included, which decides their
overlap) is the fast path of repeated calls.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from tileplug.core import config
from tileplug.core.call import Call, Ledger, call_type, has_internal_overlap, share_memory
from tileplug.core.contracts.checks import check_bool, check_choice, check_same_device, check_tensor, describe
from tileplug.core.contracts.norm import check_rows
from tileplug.core.contracts.quant import (
    FLOAT_INPUT_DTYPES,
    MODE_CAST,
    PER_TOKEN_GROUPS,
    QuantCall,
    RecentCalls,
    cast_config,
    has_storage,
)
from tileplug.core.errors import ContractError
from tileplug.core.quant.configs import CastConfig
from tileplug.core.quant.layouts import LayoutTraits

HEAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
POSITION_DTYPES = (torch.int32, torch.int64)
OFFSET_LIMIT = 2**62
"""``|seqlen_offset|`` bound: a position plus the offset stays inside int64."""


# ---------------------------------------------------------------------- inputs and outputs


class RotaryInputs(NamedTuple):
    """What an ``apply_rotary`` kernel reads (and writes: ``query`` and ``key`` in place).

    ``query`` ``[T, Nq, D]`` or ``[B, S, Nq, D]``; ``key`` the same leading dims and ``D``
    with ``Nk`` heads, or None; ``cos_sin_cache`` fp32 ``[L, R]``; ``positions`` int32 /
    int64 ``[T]`` / ``[B, S]`` or None; ``seqlen_offset`` the int added to every position.
    """

    query: torch.Tensor
    key: torch.Tensor | None
    cos_sin_cache: torch.Tensor
    positions: torch.Tensor | None
    seqlen_offset: int


class NormRopeInputs(NamedTuple):
    """What a ``rms_norm_rope`` kernel reads: ``x`` ``[T, N, D]``, ``weight`` ``[D]``,
    ``cos_sin_cache`` fp32 ``[L, R]``, ``positions`` int32/int64 ``[T]`` or None, ``seqlen_offset``."""

    x: torch.Tensor
    weight: torch.Tensor
    cos_sin_cache: torch.Tensor
    positions: torch.Tensor | None
    seqlen_offset: int


class NormRopeOutputs(NamedTuple):
    """What a ``rms_norm_rope`` kernel writes: ``y`` ``[T, N, D]`` in ``x.dtype`` (None when
    the quantized op does not return it), and for the quantized op ``q`` ``[T, N·D]`` (e2m1:
    ``N·D/2``) and ``sf`` in the layout the flags ask for."""

    y: torch.Tensor | None
    q: torch.Tensor | None = None
    sf: torch.Tensor | None = None


# ---------------------------------------------------------------------- the calls


@call_type
class RotaryCall(Call):
    """One ``apply_rotary`` call: ``head_dim`` D, ``rotary_dim`` R (even, ≤ D), ``query_heads``,
    ``key_heads`` (None: no key), ``dtype``, ``batched`` (4-D ``[B, S, N, D]``: the implicit
    position is ``s``, not the row), ``interleaved`` (GPT-J pairs), ``conjugate`` (sin
    negated), ``positions_dtype`` (None: implicit positions). ``tokens`` is ``T`` or ``B·S``."""

    head_dim: int
    rotary_dim: int
    query_heads: int
    key_heads: int | None
    dtype: torch.dtype
    batched: bool = False
    interleaved: bool = False
    conjugate: bool = False
    positions_dtype: torch.dtype | None = None

    def ledger(self, traits: LayoutTraits) -> Ledger:
        """Bytes that must move: the rotated channels of every head read and written, one
        cache row and one position per token (the tail channels are never touched)."""
        heads = self.query_heads + (self.key_heads or 0)
        moved = self.tokens * heads * self.rotary_dim * self.dtype.itemsize
        positions = 0 if self.positions_dtype is None else self.tokens * self.positions_dtype.itemsize
        cache = self.tokens * self.rotary_dim * 4
        return Ledger(moved + positions + cache, moved, 3 * self.tokens * heads * self.rotary_dim)


@call_type
class NormRopeCall(Call):
    """One ``rms_norm_rope`` / ``rms_norm_rope_per_token_cast`` call: ``heads`` N, ``head_dim``
    D, ``rotary_dim`` R, ``dtype`` of ``x`` (and ``y``), ``weight_dtype``, ``eps``,
    ``weight_offset``, ``interleaved``, ``positions_dtype``; ``quant`` the ``per_token_cast``
    call of ``y.view(T, N·D)`` (None: no cast; a backend may run it as it runs that op) and
    ``return_unquantized`` (the quantized op also returns ``y``)."""

    heads: int
    head_dim: int
    rotary_dim: int
    dtype: torch.dtype
    weight_dtype: torch.dtype
    eps: float
    weight_offset: float = 0.0
    interleaved: bool = False
    positions_dtype: torch.dtype | None = None
    quant: QuantCall | None = None
    return_unquantized: bool = False

    @property
    def hidden(self) -> int:
        """``N·D``: the row width of ``y.view(T, N·D)``."""
        return self.heads * self.head_dim

    @property
    def cast(self) -> CastConfig | None:
        """The cast configuration a kernel specialises on (``quant.cast``; None: no cast)."""
        return None if self.quant is None else self.quant.cast

    def allocation_plan(self, traits: LayoutTraits) -> NormRopePlan:
        return NormRopePlan(self, traits)

    def result(self, outputs: NormRopeOutputs) -> Any:
        """``y``, ``(q, sf)`` or ``(q, sf, y)``."""
        if self.quant is None:
            return outputs.y
        if self.return_unquantized:
            return outputs.q, outputs.sf, outputs.y
        return outputs.q, outputs.sf

    def ledger(self, traits: LayoutTraits) -> Ledger:
        """One read of ``x``, ``weight``, a cache row and a position per token; writes of ``y``
        and / or ``q`` and ``sf`` (unpadded)."""
        tokens, width, itemsize = self.tokens, self.hidden, self.dtype.itemsize
        read = tokens * width * itemsize + self.head_dim * self.weight_dtype.itemsize + tokens * self.rotary_dim * 4
        read += 0 if self.positions_dtype is None else tokens * self.positions_dtype.itemsize
        written = tokens * width * itemsize if self.quant is None or self.return_unquantized else 0
        if self.quant is not None:  # q and sf: what per_token_cast of [T, N·D] writes
            written += self.quant.ledger(traits).bytes_written
        return Ledger(read, written, 7 * tokens * width)


class NormRopePlan:
    """Output allocation of one ``rms_norm_rope*`` signature: ``y`` contiguous ``[T, N, D]``
    (when returned) and the per-token cast's ``q`` / ``sf`` exactly as ``per_token_cast`` of
    ``[T, N·D]`` allocates them on the same layout."""

    __slots__ = ("heads", "head_dim", "dtype", "with_y", "cast_plan")

    def __init__(self, call: NormRopeCall, traits: LayoutTraits) -> None:
        self.heads, self.head_dim, self.dtype = call.heads, call.head_dim, call.dtype
        self.with_y = call.quant is None or call.return_unquantized
        self.cast_plan = None if call.quant is None else call.quant.allocation_plan(traits)

    def allocate(self, tokens: int, device: torch.device | None) -> NormRopeOutputs:
        y = None
        if self.with_y:
            y = torch.empty((tokens, self.heads, self.head_dim), dtype=self.dtype, device=device)
        if self.cast_plan is None:
            return NormRopeOutputs(y)
        q, sf = self.cast_plan.allocate(tokens, device)
        return NormRopeOutputs(y, q, sf)


# ---------------------------------------------------------------------- argument checks


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _check_heads(op: str, name: str, value: Any, ranks: tuple[int, ...]) -> torch.Tensor:
    """A ``[T, N, D]`` (or ``[B, S, N, D]`` where ``ranks`` allows) bf16/fp16/fp32 tensor with
    unit last stride and no internal overlap."""
    tensor = check_tensor(op, name, value)
    if tensor.dim() not in ranks:
        shapes = " or ".join(("[T, N, D]", "[B, S, N, D]")[rank - 3] for rank in ranks)
        raise ContractError(op, name, f"a {shapes} tensor", describe(tensor))
    if tensor.dtype not in HEAD_DTYPES:
        raise ContractError(op, name, f"dtype in ({_dtype_names(HEAD_DTYPES)})", describe(tensor))
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ContractError(op, name, "unit stride on the last dim", describe(tensor))
    if tensor.numel() and has_internal_overlap(tensor):
        raise ContractError(op, name, "a tensor whose elements do not overlap in memory", describe(tensor))
    return tensor


def _check_cache(op: str, value: Any, head_dim: int, device: torch.device) -> int:
    """``cos_sin_cache`` fp32 ``[L, R]``, unit last stride, ``R`` even with ``2 ≤ R ≤ D`` → R."""
    cache = check_tensor(op, "cos_sin_cache", value)
    if cache.dim() != 2:
        raise ContractError(op, "cos_sin_cache", "a 2-D [L, R] tensor (cos | sin)", describe(cache))
    if cache.dtype != torch.float32:
        raise ContractError(op, "cos_sin_cache", "dtype float32", describe(cache))
    rotary = int(cache.shape[1])
    if rotary % 2 or rotary < 2 or rotary > head_dim:
        raise ContractError(op, "cos_sin_cache", f"an even rotary width R with 2 <= R <= D = {head_dim} "
                            "(columns: R/2 cos, then R/2 sin)", describe(cache))
    if cache.stride(1) != 1:
        raise ContractError(op, "cos_sin_cache", "unit stride on the last dim", describe(cache))
    check_same_device(op, "cos_sin_cache", cache, device, of="the rotated tensor")
    return rotary


def _check_positions(op: str, value: Any, leading: tuple[int, ...], device: torch.device) -> torch.dtype | None:
    if value is None:
        return None
    positions = check_tensor(op, "positions", value)
    if positions.dtype not in POSITION_DTYPES:
        raise ContractError(op, "positions", f"dtype in ({_dtype_names(POSITION_DTYPES)})", describe(positions))
    if tuple(positions.shape) != leading:
        names = "[T]" if len(leading) == 1 else "[B, S]"
        raise ContractError(op, "positions", f"shape {names} = {list(leading)} (one position per token)",
                            describe(positions))
    check_same_device(op, "positions", positions, device, of="the rotated tensor")
    return positions.dtype


def check_offset(op: str, seqlen_offset: Any) -> int:
    """``seqlen_offset``: an int with ``|offset| < 2^62`` (added to every position)."""
    if seqlen_offset.__class__ is not int or not -OFFSET_LIMIT < seqlen_offset < OFFSET_LIMIT:
        raise ContractError(op, "seqlen_offset", "an int with |seqlen_offset| < 2**62", describe(seqlen_offset))
    return seqlen_offset


def _plain(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """Kernels get detached tensors (the family is not differentiable; a detached view of a
    query still writes the caller's storage)."""
    if tensor is not None and tensor.requires_grad:
        return tensor.detach()
    return tensor


# ---------------------------------------------------------------------- the fast path


recent_calls = RecentCalls()
"""Memo of checked RoPE-family calls (the quant family's LRU, an instance of its own)."""


def _tensor_key(tensor: Any) -> tuple | None:
    """What the checks read of a tensor (None: not a plain tensor with storage → checked path)."""
    if tensor is None:
        return ()
    cls = tensor.__class__
    if cls is not torch.Tensor and not (isinstance(tensor, torch.Tensor) and has_storage(cls)):
        return None
    return cls, tensor.dtype, tensor.shape, tensor.stride(), tensor.device


def _memo_key(name: str, tensors: tuple, arguments: tuple, current: Any) -> tuple | None:
    """The memo key of a call: every tensor's metadata, the addresses of all but the first
    relative to the first (overlap and alignment depend on nothing else), exactly-typed
    scalar ``arguments`` and the config in force; None when something is not memoisable."""
    keys = []
    for tensor in tensors:
        key = _tensor_key(tensor)
        if key is None:
            return None
        keys.append(key)
    for value in arguments:
        cls = value.__class__
        if not (cls is bool or cls is str or cls is int or cls is float or value is None):
            return None
    first = tensors[0]
    base = first.data_ptr()
    relative = tuple(None if t is None else t.data_ptr() - base for t in tensors[1:])
    return name, tuple(keys), relative, base & 15, tuple((v.__class__, v) for v in arguments), id(current)


# ---------------------------------------------------------------------- apply_rotary


def apply_rotary(query: Any, cos_sin_cache: Any, key: Any, positions: Any, interleaved: Any, conjugate: Any,
                 seqlen_offset: Any) -> tuple[RotaryCall, RotaryInputs]:
    """Contract of ``apply_rotary`` (SPEC §6): every check, ContractError naming the argument."""
    name = "apply_rotary"
    offset = check_offset(name, seqlen_offset)
    current = config.current()
    memo = None
    if query.__class__ is torch.Tensor:
        memo = _memo_key(name, (query, key, cos_sin_cache, positions), (interleaved, conjugate), current)
        if memo is not None:
            hit = recent_calls.get(memo)
            if hit is not None:
                return hit, RotaryInputs(_plain(query), _plain(key), _plain(cos_sin_cache), _plain(positions), offset)
    call = _checked_rotary(name, query, cos_sin_cache, key, positions, interleaved, conjugate)
    if memo is not None:
        recent_calls.put(memo, call, current)
    return call, RotaryInputs(_plain(query), _plain(key), _plain(cos_sin_cache), _plain(positions), offset)


def _checked_rotary(name: str, query: Any, cos_sin_cache: Any, key: Any, positions: Any, interleaved: Any,
                    conjugate: Any) -> RotaryCall:
    query = _check_heads(name, "query", query, (3, 4))
    device, head_dim = query.device, int(query.shape[-1])
    leading = tuple(int(size) for size in query.shape[:-2])
    key_heads = None
    if key is not None:
        key = _check_heads(name, "key", key, (query.dim(),))
        if key.dtype != query.dtype:
            raise ContractError(name, "key", f"dtype {query.dtype} (the query's)", describe(key))
        if tuple(key.shape[:-2]) != leading or key.shape[-1] != head_dim:
            dims = "[T, Nk, D]" if query.dim() == 3 else "[B, S, Nk, D]"
            raise ContractError(name, "key", f"a {dims} tensor with the query's leading dims {list(leading)} "
                                f"and D = {head_dim}", describe(key))
        check_same_device(name, "key", key, device, of="query")
        if share_memory(query, key):
            raise ContractError(name, "key", "a tensor sharing no memory with query (both are written in place)",
                                describe(key))
        key_heads = int(key.shape[-2])
    rotary = _check_cache(name, cos_sin_cache, head_dim, device)
    positions_dtype = _check_positions(name, positions, leading, device)
    check_bool(name, "interleaved", interleaved)
    check_bool(name, "conjugate", conjugate)
    tokens = leading[0] if len(leading) == 1 else leading[0] * leading[1]
    query_heads = int(query.shape[-2])
    heads = query_heads + (key_heads or 0)
    return RotaryCall(
        "apply_rotary", device.type, name, head_dim, rotary, query_heads, key_heads, query.dtype,
        query.dim() == 4, interleaved, conjugate, positions_dtype,
        tokens=tokens, device=device, empty=tokens == 0 or heads == 0,
    )


# ---------------------------------------------------------------------- rms_norm_rope


def _check_cast(name: str, fmt: Any, num_per_channels: Any, round_sf: Any, use_packed_ue8m0: Any,
                use_tma_aligned_col_major_sf: Any, head_dim: int, current: Any) -> CastConfig:
    """The per-token cast of ``y.view(T, N·D)``: ``per_token_cast``'s own checks and cast
    configuration object (:func:`tileplug.core.contracts.quant.cast_config`), groups ≤ D."""
    group = check_choice(name, "num_per_channels", num_per_channels, PER_TOKEN_GROUPS)
    if group > head_dim:
        raise ContractError(name, "num_per_channels", f"at most the head width D = {head_dim}", num_per_channels)
    return cast_config(name, fmt, (1, group), use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, False, current)


def _check_float(name: str, argument: str, value: Any, positive: bool = False) -> float:
    if value.__class__ not in (int, float) or value != value or value in (float("inf"), float("-inf")) \
            or (positive and value <= 0):
        expected = "a finite float > 0" if positive else "a finite float"
        raise ContractError(name, argument, expected, describe(value))
    return float(value)


def rms_norm_rope(x: Any, weight: Any, cos_sin_cache: Any, positions: Any, eps: Any, interleaved: Any,
                  weight_offset: Any, seqlen_offset: Any, quantize: bool = False, fmt: Any = "e4m3",
                  num_per_channels: Any = 128, round_sf: Any = False, use_packed_ue8m0: Any = False,
                  use_tma_aligned_col_major_sf: Any = False, return_unquantized: Any = False
                  ) -> tuple[NormRopeCall, NormRopeInputs]:
    """Contract of ``rms_norm_rope`` and, with ``quantize``, ``rms_norm_rope_per_token_cast``
    (the cast's arguments are read only then)."""
    name = "rms_norm_rope_per_token_cast" if quantize else "rms_norm_rope"
    offset = check_offset(name, seqlen_offset)
    current = config.current()
    memo = None
    if x.__class__ is torch.Tensor:
        memo = _memo_key(name, (x, weight, cos_sin_cache, positions),
                         (eps, interleaved, weight_offset, fmt, num_per_channels, round_sf, use_packed_ue8m0,
                          use_tma_aligned_col_major_sf, return_unquantized), current)
        if memo is not None:
            hit = recent_calls.get(memo)
            if hit is not None:
                return hit, NormRopeInputs(_plain(x), _plain(weight), _plain(cos_sin_cache), _plain(positions), offset)
    call = _checked_norm_rope(name, x, weight, cos_sin_cache, positions, eps, interleaved, weight_offset, quantize, fmt,
                              num_per_channels, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf,
                              return_unquantized, current)
    if memo is not None:
        recent_calls.put(memo, call, current)
    return call, NormRopeInputs(_plain(x), _plain(weight), _plain(cos_sin_cache), _plain(positions), offset)


def _checked_norm_rope(name: str, x: Any, weight: Any, cos_sin_cache: Any, positions: Any, eps: Any,
                       interleaved: Any, weight_offset: Any, quantize: bool, fmt: Any, num_per_channels: Any,
                       round_sf: Any, use_packed_ue8m0: Any, use_tma_aligned_col_major_sf: Any,
                       return_unquantized: Any, current: Any) -> NormRopeCall:
    # the chain's dtypes: apply_rotary's, and per_token_cast's (bf16 / fp32) for the quantized op
    x = check_rows(name, "x", x, FLOAT_INPUT_DTYPES if quantize else HEAD_DTYPES, dims=(3,))
    tokens, heads, head_dim = (int(size) for size in x.shape)
    device = x.device
    weight = check_tensor(name, "weight", weight)
    if weight.dim() != 1 or weight.shape[0] != head_dim:
        raise ContractError(name, "weight", f"a 1-D [D] = [{head_dim}] tensor", describe(weight))
    if not weight.dtype.is_floating_point or weight.dtype.itemsize == 1:
        raise ContractError(name, "weight", "a bf16, fp16, fp32 or fp64 tensor", describe(weight))
    check_same_device(name, "weight", weight, device)
    rotary = _check_cache(name, cos_sin_cache, head_dim, device)
    positions_dtype = _check_positions(name, positions, (tokens,), device)
    eps = _check_float(name, "eps", eps, positive=True)
    weight_offset = _check_float(name, "weight_offset", weight_offset)
    check_bool(name, "interleaved", interleaved)
    quant = None
    if quantize:
        cast = _check_cast(name, fmt, num_per_channels, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf,
                           head_dim, current)
        check_bool(name, "return_unquantized", return_unquantized)
        if cast.fmt.values_per_byte == 2 and heads * head_dim % 2:
            raise ContractError(name, "x", "an even N·D for fmt='e2m1' (two values per byte)", describe(x))
        quant = QuantCall("per_token_cast", device.type, "per_token_cast", MODE_CAST, heads * head_dim, x.dtype, cast,
                          host_layout=current.host_layout,
                          sf_alignment_bytes=current.token_alignment_bytes, tokens=tokens, device=device,
                          empty=tokens == 0 or heads == 0)
    return NormRopeCall(
        "rms_norm_rope", device.type, name, heads, head_dim, rotary, x.dtype, weight.dtype, eps, weight_offset,
        interleaved, positions_dtype, quant, quant is not None and return_unquantized,
        host_layout=current.host_layout, sf_alignment_bytes=current.token_alignment_bytes,
        tokens=tokens, device=device, empty=tokens == 0 or heads == 0,
    )
