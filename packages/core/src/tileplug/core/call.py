"""The generic call protocol every op family shares.

A :class:`Call` is the frozen, hashable description of one op call that its contract
produced: it compares and hashes on everything but the token count, the device index and
whether there is anything to compute, so it is at once the selection cache key and the
kernel specialisation. Each family subclasses it with typed fields (``QuantCall``). Modes
are enums owned here; backends compare against them, never against strings.

``check_out`` validates a caller's ``out=`` tensors against the allocation a plan would
make, for every family; ``share_memory`` / ``has_internal_overlap`` are the exact memory
checks of tensors an in-place op writes, whose plan is :data:`IN_PLACE_PLAN`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, NamedTuple

import torch

from tileplug.core.errors import ContractError


class QuantMode(enum.Enum):
    """What a quant-family call computes."""

    CAST = "cast"  # q and sf
    SF_ONLY = "sf_only"  # sf only
    PRECOMPUTED_SF = "precomputed_sf"  # q from the caller's sf
    CAST_BACK = "cast_back"  # dequantize (q, sf)
    CAST_AND_CAST_BACK = "cast_and_cast_back"  # quantize and dequantize x in place (fake quant)


class Scoring(enum.Enum):
    """How ``moe_topk_gate`` turns a row of logits ``x`` into scores ``u`` (fp32)."""

    SOFTMAX = "softmax"  # exp(x - max(x)) / sum(exp(x - max(x))) over the row
    SIGMOID = "sigmoid"  # 1 / (1 + exp(-x)), per element
    SQRTSOFTPLUS = "sqrtsoftplus"  # sqrt(log(1 + exp(x))), per element


class Ledger(NamedTuple):
    """Bytes an op must move (and flops it must do): the denominator of effective GB/s."""

    bytes_read: int
    bytes_written: int
    flops: int

    @property
    def bytes_total(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass(frozen=True, slots=True)
class Call:
    """Base of every family's call.

    ``op`` is the backend kernel-table key (one kernel may serve several public ops, e.g.
    ``per_token_cast`` and its sf-only variant), ``device_type`` the inputs' device type,
    ``name`` the public op (its declaration in the op table),
    ``host_layout`` / ``sf_alignment_bytes`` the configuration that shapes the outputs
    (``config.host_layout`` and ``config.token_alignment``, read once by the contract).
    ``tokens``, ``device`` and ``empty`` (nothing to compute: no kernel launch) take no
    part in equality or hashing.
    """

    op: str
    device_type: str
    name: str
    host_layout: Any = field(default=None, kw_only=True)
    sf_alignment_bytes: int | None = field(default=None, kw_only=True)
    tokens: int = field(default=0, compare=False, kw_only=True)
    device: torch.device | None = field(default=None, compare=False, kw_only=True)
    empty: bool = field(default=False, compare=False, kw_only=True)
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The hash of the compared fields, computed once: the route lookup of every call
        # hashes the call (see :func:`call_type`, which makes family subclasses use it).
        names = _COMPARED.get(type(self))
        if names is None:
            names = _COMPARED[type(self)] = tuple(f.name for f in fields(self) if f.compare)
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, name) for name in names)))

    def __hash__(self) -> int:
        return self._hash

    def summary(self) -> str:
        """A one-line description for error messages: the op, the token count and every
        compared field that is set (enums by value, dtypes by name)."""
        parts = [f"T={self.tokens}"]
        for item in fields(self):
            if not item.compare or item.name in ("op", "name", "host_layout", "device_type"):
                continue
            value = getattr(self, item.name)
            if value is None or value is False:
                continue
            parts.append(f"{item.name}={_short(value)}")
        parts.append(f"device={self.device}")
        return f"{getattr(self, 'name', None) or self.op}[{', '.join(parts)}]"


_COMPARED: dict[type, tuple[str, ...]] = {}


def call_type(cls: type) -> type:
    """Decorator of a family's Call subclass: ``@dataclass(frozen=True, slots=True)`` keeping
    the base class's cached hash (a plain frozen dataclass would generate a hash that re-hashes
    every field on every lookup)."""
    made = dataclass(frozen=True, slots=True)(cls)
    made.__hash__ = Call.__hash__
    return made


def _short(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if is_dataclass(value) and isinstance(getattr(value, "name", None), str):
        return value.name  # a named constant (a format)
    if is_dataclass(value):
        inner = ", ".join(f"{f.name}={_short(getattr(value, f.name))}" for f in fields(value)
                          if getattr(value, f.name) not in (None, False))
        return f"({inner})"
    return str(value)


def tensor_extent(tensor: torch.Tensor) -> tuple[int, int]:
    """``[start, end)`` byte addresses the tensor's elements span (empty: ``(0, 0)``)."""
    if tensor.numel() == 0:
        return 0, 0
    start = tensor.data_ptr()
    last = sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    return start, start + (last + 1) * tensor.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' byte extents on one device intersect (conservative)."""
    if a.device != b.device or a.device.type == "meta":
        return False
    a_start, a_end = tensor_extent(a)
    b_start, b_end = tensor_extent(b)
    return a_start < b_end and b_start < a_end


def _dims(tensor: torch.Tensor) -> list[tuple[int, int]]:
    """``(size, byte stride)`` of the dims of size > 1, largest stride first."""
    itemsize = tensor.element_size()
    dims = [(int(size), int(stride) * itemsize) for size, stride in zip(tensor.shape, tensor.stride()) if size > 1]
    return sorted(dims, key=lambda dim: -dim[1])


def _extent(dims: list[tuple[int, int]], itemsize: int) -> int:
    return sum((size - 1) * abs(stride) for size, stride in dims) + itemsize


def has_internal_overlap(tensor: torch.Tensor) -> bool:
    """Whether two elements of ``tensor`` may share a byte (conservative: every stride, in
    decreasing order, must step over everything inside it)."""
    dims = _dims(tensor)
    for index, (_, stride) in enumerate(dims):
        if stride <= 0 or stride < _extent(dims[index + 1:], tensor.element_size()):
            return True
    return False


_ROW_LIMIT = 64
"""How many rows of one tensor the disjointness test walks one by one before it gives up."""


def _disjoint(a: list[tuple[int, int]], a_item: int, b: list[tuple[int, int]], b_item: int, delta: int) -> bool:
    """Whether a lattice of elements ``a`` (dims ``(size, stride)``, elements ``a_item`` bytes)
    at 0 and a lattice ``b`` at byte ``delta`` share no byte. Exact for views of one buffer
    with the same strides (a fused QKV buffer); conservative (False) where it cannot tell."""
    a_extent, b_extent = _extent(a, a_item), _extent(b, b_item)
    if delta >= a_extent or -delta >= b_extent:
        return True
    if not a and not b:
        return False
    # Peel the outermost dim of the wider-strided side; rows must not interleave inside it.
    if not a or (b and b[0][1] > a[0][1]):
        return _disjoint(b, b_item, a, a_item, -delta)
    size, stride = a[0]
    inner = a[1:]
    if _extent(inner, a_item) > stride:
        return False
    if b and b[0][1] == stride and _extent(b[1:], b_item) <= stride:
        # Same outer stride: row r of b sits at delta + (r - i)·stride from row i of a, and
        # only the shifts k = r - i with |delta + k·stride| < stride can touch.
        other = b[0][0]
        low = (-delta - stride) // stride
        for shift in range(low, low + 4):
            exists = max(0, -shift) < min(size, other - shift)
            if exists and not _disjoint(inner, a_item, b[1:], b_item, delta + shift * stride):
                return False
        return True
    first = max(0, (delta - _extent(inner, a_item)) // stride)
    last = min(size - 1, (delta + b_extent) // stride)
    if last - first >= _ROW_LIMIT:
        return False
    return all(_disjoint(inner, a_item, b, b_item, delta - row * stride) for row in range(first, last + 1))


def share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' elements may share a byte (False for tensors without storage:
    meta, fake and functional tensors)."""
    from tileplug.core.contracts.quant import has_storage

    if a.device != b.device or a.device.type == "meta" or not has_storage(a.__class__) \
            or not has_storage(b.__class__):
        return False
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    return not _disjoint(_dims(a), a.element_size(), _dims(b), b.element_size(), b.data_ptr() - a.data_ptr())


class NoOutputs(NamedTuple):
    """An in-place op allocates nothing: its kernels write the inputs the op mutates."""


class InPlacePlan:
    """The allocation plan of an in-place op (nothing, for any token count)."""

    __slots__ = ()

    def allocate(self, tokens: int, device: torch.device | None) -> NoOutputs:
        return NoOutputs()


IN_PLACE_PLAN = InPlacePlan()


def _describe(value: Any) -> str:
    from tileplug.core.contracts.checks import describe

    return describe(value)


def check_out(op: str, expected: Sequence[torch.Tensor | None], out: Any, device: torch.device | None,
              inputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Validate ``out`` against ``expected`` (the meta allocation of the plan in force) and
    return the outputs in the plan's slots (None where the plan has no tensor).

    Each given tensor must match shape, dtype, strides and device, be 16-byte aligned, be
    writable here (not an inference tensor outside inference mode) and share no bytes with
    an input. Every failure is a ContractError naming ``out``.
    """
    wanted = [t for t in expected if t is not None]
    given = list(out) if isinstance(out, (tuple, list)) else [out]
    if len(given) != len(wanted):
        raise ContractError(op, "out", f"{len(wanted)} tensor(s)", _describe(out))
    inference_mode = torch.is_inference_mode_enabled()
    for have, want in zip(given, wanted):
        if not isinstance(have, torch.Tensor):
            raise ContractError(op, "out", "a torch.Tensor", _describe(have))
        if (
            have.shape != want.shape
            or have.dtype != want.dtype
            or have.stride() != want.stride()
            or have.device != device
            or have.data_ptr() % 16
        ):
            raise ContractError(
                op, "out",
                f"tensor(shape={tuple(want.shape)}, dtype={want.dtype}, stride={tuple(want.stride())}, "
                f"device={device}, 16-byte aligned data)",
                _describe(have),
            )
        if have.is_inference() and not inference_mode:
            raise ContractError(op, "out", "a tensor writable outside inference mode (made under "
                                "torch.inference_mode, it can only be written inside it)", _describe(have))
        if have.requires_grad:
            raise ContractError(op, "out", "a tensor that does not require grad (outputs are written in place)",
                                _describe(have))
        for source in inputs:
            if source is not None and overlaps(have, source):
                raise ContractError(op, "out", "tensors sharing no memory with the inputs", _describe(have))
    for index, first in enumerate(given):
        for second in given[index + 1:]:
            if overlaps(first, second):
                raise ContractError(op, "out", "tensors sharing no memory with each other", _describe(second))
    slots = iter(given)
    return [None if t is None else next(slots) for t in expected]
