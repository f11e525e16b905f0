"""Contracts of the quantization ops (SPEC.md §0-3).

Each builder checks every argument (raising ContractError that names it) and returns a
:class:`QuantCall`, the frozen description of the call, plus the tensors to pass to the
kernel. A QuantCall compares and hashes on everything but the token count and the
device index: it is the selection cache key and the kernel specialisation at once.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from tileplug.core import config
from tileplug.core.call import Call, Ledger, QuantMode, call_type, has_internal_overlap
from tileplug.core.contracts.checks import (
    check_block,
    check_bool,
    check_choice,
    check_matrix,
    check_same_device,
    check_tensor,
    describe,
)
from tileplug.core.contracts.random import STATE_BYTES
from tileplug.core.errors import ContractError
from tileplug.core.quant import layouts
from tileplug.core.quant.configs import CastConfig, GivenScales, QuantizedInput
from tileplug.core.quant.formats import OUTPUT_DTYPES, QUANT_FORMATS, format_of_storage_dtype
from tileplug.core.quant.layouts import LayoutTraits
from tileplug.core.quant.sf_math import ceil_div

FLOAT_INPUT_DTYPES = (torch.bfloat16, torch.float32)
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8)
SF_DTYPES = (torch.float32, torch.float8_e4m3fn, torch.int32, torch.int16)
PER_TOKEN_GROUPS = (16, 32, 64, 128)
PER_BLOCK_SIDES = (16, 32, 64, 128)
PER_CHANNEL_GROUPS = (32, 128)
INPUT_BLOCK_SIDES = (1, 16, 32, 64, 128)

MODE_CAST = QuantMode.CAST
MODE_SF_ONLY = QuantMode.SF_ONLY
MODE_PRECOMPUTED_SF = QuantMode.PRECOMPUTED_SF
MODE_CAST_BACK = QuantMode.CAST_BACK
MODE_CAST_AND_CAST_BACK = QuantMode.CAST_AND_CAST_BACK


class QuantInputs(NamedTuple):
    """Tensors a quant kernel reads: ``x`` [T, H] (or quantized ``xq``), the input's own
    scales ``input_sf`` when ``x`` is quantized, the caller's ``given_sf`` in cast-only mode,
    and for a stochastic cast the generator's ``seed`` / ``offset`` (int64 ``[1]``; the
    backend advances the offset by one once its kernels are done reading it)."""

    x: torch.Tensor
    input_sf: torch.Tensor | None = None
    given_sf: torch.Tensor | None = None
    seed: torch.Tensor | None = None
    offset: torch.Tensor | None = None


class QuantOutputs(NamedTuple):
    """Tensors a quant kernel writes: ``q`` (quantized data, or the ``cast_back`` result)
    and ``sf`` (in the layout the call and the backend's traits fix)."""

    q: torch.Tensor | None
    sf: torch.Tensor | None


class AllocationPlan:
    """Output allocation of one call signature on one layout, for any token count: two
    ``torch.empty`` calls and a little integer math per call.

    ``q_columns`` None means no ``q``; ``sf_dtype`` None means no ``sf``. The sf holds
    ``ceil(T/bm) × sf_columns`` groups, packed ``pack_factor`` to an integer along
    ``pack_axis``; ``col_major_multiple`` > 0 stores it column-major with columns padded to
    that many elements.
    """

    __slots__ = ("q_columns", "q_dtype", "sf_dtype", "bm", "sf_columns", "pack_factor", "pack_axis",
                 "col_major_multiple", "allocate")

    def __init__(self, q_columns: int | None, q_dtype: torch.dtype, sf_dtype: torch.dtype | None = None, bm: int = 1,
                 sf_columns: int = 0, pack_factor: int = 1, pack_axis: int = 1, col_major_multiple: int = 0) -> None:
        self.q_columns = q_columns
        self.q_dtype = q_dtype
        self.sf_dtype = sf_dtype
        self.bm = bm
        self.pack_factor = pack_factor
        self.pack_axis = pack_axis
        self.sf_columns = -(-sf_columns // pack_factor) if pack_axis == 1 else sf_columns
        self.col_major_multiple = col_major_multiple
        self.allocate = self._allocator()

    def _allocator(self) -> Callable[[int, torch.device | None], QuantOutputs]:
        """``allocate(tokens, device)``: a closure over this plan's constants, so a call does
        the sf's row count and nothing else (the GPU host timed per_channel's allocation at 14.5 µs
        through the attribute-reading method this replaces, against 6.3 µs for per_token's closure).
        ``torch.empty`` takes the sizes as separate arguments: its argument parser takes 0.45 µs
        longer over a ``(rows, columns)`` tuple (torch 2.13, CPU; the same tensor either way)."""
        q_columns, q_dtype, sf_dtype, columns = self.q_columns, self.q_dtype, self.sf_dtype, self.sf_columns
        multiple = self.col_major_multiple
        tokens_per_sf_row = self.bm * (self.pack_factor if self.pack_axis == 0 else 1)  # (nested ceilings compose)
        empty, empty_strided = torch.empty, torch.empty_strided

        def allocate(tokens: int, device: torch.device | None) -> QuantOutputs:
            q = None if q_columns is None else empty(tokens, q_columns, dtype=q_dtype, device=device)
            if sf_dtype is None:
                return QuantOutputs(q, None)
            rows = tokens if tokens_per_sf_row == 1 else -(-tokens // tokens_per_sf_row)
            if multiple and rows and columns:
                # column-major, each column padded; an empty sf is allocated row-major (ordinary strides, viewable)
                padded = -(-rows // multiple) * multiple
                return QuantOutputs(q, empty_strided((rows, columns), (1, padded), dtype=sf_dtype, device=device))
            return QuantOutputs(q, empty(rows, columns, dtype=sf_dtype, device=device))

        return allocate


@call_type
class QuantCall(Call):
    """Frozen description of one quant-family call (a :class:`tileplug.core.call.Call`).

    ``op`` is the kernel-table key (per_token_cast, per_block_cast, per_channel_cast,
    cast_back), ``name`` the public op, ``mode`` what it computes. ``hidden`` is the
    logical H. ``cast`` describes the output quantization (None for cast_back),
    ``quantized_input`` a quantized ``(xq, sf)`` input, ``given_sf`` the caller's sf in
    cast-only mode, ``output_dtype`` the cast_back result dtype. ``input_alignment`` is the
    byte alignment (1..16, a power of two) that both the data pointer and the row stride of
    the input data share, so that a kernel can decline (or specialise away from) 128-bit
    loads.
    """

    mode: QuantMode
    hidden: int
    input_dtype: torch.dtype
    cast: CastConfig | None = None
    quantized_input: QuantizedInput | None = None
    given_sf: GivenScales | None = None
    output_dtype: torch.dtype | None = None
    input_alignment: int = 16

    # ------------------------------------------------------------------ outputs
    def sf_rows_cols(self) -> tuple[int, int]:
        """Group grid ``(ceil(T/bm), ceil(H/bn))`` of the output cast."""
        if self.cast is None:
            raise ValueError("cast_back has no output scales")
        bm, bn = self.cast.block
        return ceil_div(self.tokens, bm), ceil_div(self.hidden, bn)

    def allocation_plan(self, traits: LayoutTraits, alignment_bytes: int | None = None) -> AllocationPlan:
        """How to allocate this call's outputs on a backend with ``traits`` for any token count
        (``alignment_bytes``: column-major sf column alignment, default the traits')."""
        alignment = alignment_bytes or self.sf_alignment_bytes or traits.col_major_sf_alignment_bytes
        if self.mode == MODE_CAST_BACK:
            return AllocationPlan(self.hidden, self.output_dtype)
        cast = self.cast
        q_columns = None if self.mode == MODE_SF_ONLY else self.hidden // cast.fmt.values_per_byte
        if self.mode == MODE_PRECOMPUTED_SF:
            return AllocationPlan(q_columns, cast.fmt.storage_dtype)
        encoding = cast.sf_encoding(traits)
        bm, bn = cast.block
        return AllocationPlan(
            q_columns, cast.fmt.storage_dtype, encoding.dtype, bm, ceil_div(self.hidden, bn),
            encoding.pack_factor, cast.pack_axis,
            layouts.column_length(1, _itemsize(encoding.dtype), alignment) if cast.col_major_sf else 0,
        )

    def allocate(self, traits: LayoutTraits) -> QuantOutputs:
        """Fresh output tensors for a backend whose layout traits are ``traits``."""
        return self.allocation_plan(traits).allocate(self.tokens, self.device)

    def result(self, outputs: QuantOutputs) -> Any:
        """What the public op returns: ``(q, sf)``, ``sf``, ``q`` or the cast_back tensor."""
        if self.mode == MODE_CAST:
            return outputs.q, outputs.sf
        if self.mode == MODE_SF_ONLY:
            return outputs.sf
        return outputs.q

    # ------------------------------------------------------------------ ledger
    def ledger(self, traits: LayoutTraits) -> Ledger:
        """Bytes that must move for this call (the sf counted without layout padding)."""
        tokens, hidden = self.tokens, self.hidden
        if self.quantized_input is not None:
            qin = self.quantized_input
            bytes_read = tokens * hidden // qin.fmt.values_per_byte
            rows, cols = ceil_div(tokens, qin.block[0]), ceil_div(hidden, qin.block[1])
            shape = layouts.storage_shape(qin.sf_encoding, qin.pack_axis, rows, cols)
            bytes_read += shape[0] * shape[1] * _itemsize(qin.sf_encoding.dtype)
        else:
            bytes_read = tokens * hidden * _itemsize(self.input_dtype)
        if self.mode == MODE_CAST_BACK:
            return Ledger(bytes_read, tokens * hidden * _itemsize(self.output_dtype), 2 * tokens * hidden)
        if self.mode == MODE_CAST_AND_CAST_BACK:  # x read once and written back in place; nothing else moves
            return Ledger(bytes_read, tokens * hidden * _itemsize(self.input_dtype), 5 * tokens * hidden)
        cast = self.cast
        bytes_written = 0
        rows, cols = self.sf_rows_cols()
        if self.mode != MODE_SF_ONLY:
            bytes_written += tokens * hidden // cast.fmt.values_per_byte
        sf_bytes = 0
        if self.mode == MODE_PRECOMPUTED_SF:
            shape = layouts.storage_shape(self.given_sf.encoding, cast.pack_axis, rows, cols)
            bytes_read += shape[0] * shape[1] * _itemsize(self.given_sf.encoding.dtype)
        else:
            encoding = cast.sf_encoding(traits)
            shape = layouts.storage_shape(encoding, cast.pack_axis, rows, cols)
            sf_bytes = shape[0] * shape[1] * _itemsize(encoding.dtype)
        if cast.stochastic:  # the generator's two state words (the offset's advance is the public op's)
            bytes_read += 2 * STATE_BYTES
        return Ledger(bytes_read, bytes_written + sf_bytes, 3 * tokens * hidden)


def byte_alignment(tensor: torch.Tensor, limit: int = 16) -> int:
    """Largest power of two ≤ ``limit`` dividing the data address and the row stride in bytes
    (``limit`` for tensors without real storage: meta, fake and functional tensors, whose
    calls only describe shapes)."""
    if not has_storage(tensor.__class__):
        return limit
    bits = tensor.data_ptr()
    if tensor.shape[0] > 1:
        bits |= tensor.stride(0) * tensor.element_size()
    if bits == 0:
        return limit
    return min(limit, bits & -bits)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


# ---------------------------------------------------------------------- helpers


def _sf_is_col_major(sf: torch.Tensor) -> bool | None:
    """True for column-major, False for row-major, None for neither (strides read off)."""
    rows, cols = sf.shape
    if cols <= 1 or sf.stride(1) == 1:
        if rows <= 1 or sf.stride(0) >= cols:
            return False
    if rows <= 1 or sf.stride(0) == 1:
        if cols <= 1 or sf.stride(1) >= rows:
            return True
    return None


def _check_sf_tensor(
    op: str, name: str, sf: Any, device: torch.device, block: tuple[int, int], tokens: int, hidden: int, of: str
) -> tuple[layouts.SfEncoding, bool]:
    """An sf tensor for ``block`` groups of a [tokens, hidden] tensor, on ``device`` (the device of
    ``of``); layout read off dtype and strides."""
    sf = check_tensor(op, name, sf)
    if sf.dim() != 2:
        raise ContractError(op, name, "a 2-D scale tensor", describe(sf))
    encoding = layouts.encoding_of_dtype(sf.dtype)
    if encoding is None:
        raise ContractError(op, name, "scales of dtype float32, float8_e4m3fn, int32 or int16", describe(sf))
    check_same_device(op, name, sf, device, of)
    rows, cols = ceil_div(tokens, block[0]), ceil_div(hidden, block[1])
    shape = layouts.storage_shape(encoding, layouts.pack_axis_of_block(block), rows, cols)
    if tuple(sf.shape) != shape:
        raise ContractError(
            op, name, f"scales of shape {shape} for {block[0]}x{block[1]} groups of [{tokens}, {hidden}]", describe(sf)
        )
    col_major = _sf_is_col_major(sf)
    if col_major is None:
        raise ContractError(op, name, "row-major or column-major scale strides", describe(sf))
    return encoding, col_major


_FORMAT_NAMES = tuple(QUANT_FORMATS)
_OUTPUT_NAMES = tuple(OUTPUT_DTYPES)


def _check_fmt(op: str, fmt: Any):
    found = QUANT_FORMATS.get(fmt) if isinstance(fmt, str) else None
    return found if found is not None else QUANT_FORMATS[check_choice(op, "fmt", fmt, _FORMAT_NAMES)]


def _check_sf_flags(op: str, round_sf: Any, use_packed_ue8m0: Any, use_e4m3_sf: Any) -> None:
    if round_sf.__class__ is not bool or use_packed_ue8m0.__class__ is not bool or use_e4m3_sf.__class__ is not bool:
        check_bool(op, "round_sf", round_sf)
        check_bool(op, "use_packed_ue8m0", use_packed_ue8m0)
        check_bool(op, "use_e4m3_sf", use_e4m3_sf)
    if round_sf and use_e4m3_sf:
        raise ContractError(op, "use_e4m3_sf", "False when round_sf=True (they exclude each other)", use_e4m3_sf)
    if use_packed_ue8m0 and not round_sf:
        raise ContractError(op, "use_packed_ue8m0", "False unless round_sf=True (UE8M0 needs power-of-two sf)", True)


def read_quant_input(
    op: str, x: Any, input_block: Any, block_argument: str, quantized_allowed: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, int, QuantizedInput | None]:
    """``x`` as a float tensor or a quantized ``(xq, sf)`` tuple → (data, sf, H, description)."""
    if isinstance(x, (tuple, list)):
        if not quantized_allowed:
            raise ContractError(op, "x", "a bf16/fp32 tensor", describe(x))
        if len(x) != 2:
            raise ContractError(op, "x", "a tensor or a pair (xq, sf) of a quantized tensor and its scales", describe(x))
        xq = check_matrix(op, "x", x[0], QUANTIZED_DTYPES, "quantized (float8_e4m3fn or e2m1-in-int8)")
        fmt = format_of_storage_dtype(xq.dtype)
        if input_block is None:
            raise ContractError(op, block_argument, "the input's group shape when x is a quantized (xq, sf) pair", None)
        if block_argument == "num_per_channels":
            block = (1, check_choice(op, block_argument, input_block, PER_TOKEN_GROUPS))
        else:
            block = check_block(op, block_argument, input_block, INPUT_BLOCK_SIDES, INPUT_BLOCK_SIDES)
        hidden = int(xq.shape[1]) * fmt.values_per_byte  # int(): a traced (symbolic) H is specialised
        encoding, col_major = _check_sf_tensor(op, "x", x[1], xq.device, block, xq.shape[0], hidden, "x's data")
        return xq, x[1], hidden, QuantizedInput(fmt, block, encoding, col_major)
    tensor = check_matrix(op, "x", x, FLOAT_INPUT_DTYPES, "bf16/fp32")
    if input_block is not None:
        raise ContractError(op, block_argument, "None when x is a plain (unquantized) tensor", describe(input_block))
    return tensor, None, int(tensor.shape[1]), None


_cast_configs: dict[tuple, CastConfig] = {}
"""Validated cast configs by their (already checked) arguments: one object per configuration."""

_storage_classes: dict[type, bool] = {}


def has_storage(cls: type) -> bool:
    """Whether tensors of class ``cls`` have a real data pointer: ``torch.Tensor``,
    ``nn.Parameter`` and user subclasses do; the fake and functional tensors of
    ``torch.compile`` tracing do not. Decided once per class."""
    known = _storage_classes.get(cls)
    if known is None:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch._subclasses.functional_tensor import FunctionalTensor

        known = _storage_classes[cls] = issubclass(cls, torch.Tensor) and not issubclass(
            cls, (FakeTensor, FunctionalTensor)
        )
    return known


class RecentCalls:
    """LRU memo of checked calls: key (everything the checks read) → QuantCall.

    An entry also holds the config object whose ``id`` is in its key, so that id cannot be
    reused by another config while the entry lives.

    Hits move to the back, inserts past ``limit`` drop the least recently used entry, so
    traffic with many token counts keeps its hot signatures (no clear-all cliff).
    """

    def __init__(self, limit: int = 8192) -> None:
        self.limit = limit
        self._entries: OrderedDict[tuple, tuple[QuantCall, Any]] = OrderedDict()

    def get(self, key: tuple) -> QuantCall | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        try:
            self._entries.move_to_end(key)
        except KeyError:  # evicted by another thread in between: still a valid call
            pass
        return entry[0]

    def put(self, key: tuple, call: QuantCall, current: Any) -> None:
        entries = self._entries
        entries[key] = (call, current)
        while len(entries) > self.limit:
            try:
                entries.popitem(last=False)
            except KeyError:
                break

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def memoized(self, op: str, tensors: tuple, scalars: tuple, checked: Callable[[], Any],
                 scalar_classes: tuple[type, ...] = (float, int, bool, str)) -> Any:
        """The call of a signature seen before, else ``checked()`` — remembered when it passes.
        The key is everything the checks read: ``op``, each tensor's :func:`_tensor_key` (None
        for an absent one), each scalar with its exact class, and the config in force. A tensor
        without storage or a scalar of a class outside ``scalar_classes`` (compared exactly: a
        bool must not hit an int's entry) skips the memo: ``checked()`` alone."""
        parts: list[Any] = [op]
        for tensor in tensors:
            if tensor is None:
                parts.append(None)
                continue
            key = _tensor_key(tensor)
            if key is None:
                return checked()
            parts.append(key)
        for value in scalars:
            cls = value.__class__
            if cls not in scalar_classes:
                return checked()
            parts.append((cls, value))
        current = config.current()
        parts.append(id(current))
        key = tuple(parts)
        hit = self.get(key)
        if hit is not None:
            return hit
        call = checked()
        self.put(key, call, current)
        return call


recent_calls = RecentCalls()


def _tensor_key(tensor: Any) -> tuple | None:
    """What the checks read of a tensor (None: not a tensor with storage → checked path)."""
    cls = tensor.__class__
    if cls is not torch.Tensor and not (isinstance(tensor, torch.Tensor) and has_storage(cls)):
        return None
    return cls, tensor.dtype, tensor.shape, tensor.stride(), tensor.device, tensor.data_ptr() & 15


def _input_key(x: Any) -> tuple | None:
    if isinstance(x, tuple) and len(x) == 2:
        data, scales = _tensor_key(x[0]), _tensor_key(x[1])
        return None if data is None or scales is None else (data, scales)
    return _tensor_key(x)


def plain_tensor(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """Inputs reach kernels detached: the casts are not differentiable, outputs carry no history."""
    if tensor is not None and tensor.requires_grad:
        return tensor.detach()
    return tensor


def _inputs_of(x: Any, sf: Any, mode: QuantMode) -> QuantInputs:
    given = plain_tensor(sf) if mode is MODE_PRECOMPUTED_SF else None
    if isinstance(x, tuple):
        return QuantInputs(plain_tensor(x[0]), plain_tensor(x[1]), given)
    return QuantInputs(plain_tensor(x), None, given)


def _exact(value: Any) -> bool:
    """str, int, None, or a tuple of ints, each of exactly that class (``True == 1`` must
    not let a bool hit the memo entry of an int, nor a list-holding tuple fail to hash)."""
    cls = value.__class__
    if cls is str or cls is int or value is None:
        return True
    return cls is tuple and all(v.__class__ is int for v in value)


def _memo_key(name: str, x: Any, sf: Any, mode: QuantMode, arguments: tuple, flags: tuple, current: Any
              ) -> tuple | None:
    """The fast-path key of a call (None when an argument is not of an exact, memoisable
    type: ``arguments`` str / int / None / int tuples, ``flags`` bools)."""
    for value in arguments:
        if not _exact(value):
            return None
    for flag in flags:
        if flag.__class__ is not bool:
            return None
    x_key = _input_key(x)
    if x_key is None:
        return None
    sf_key = None
    if mode is MODE_PRECOMPUTED_SF:
        sf_key = _tensor_key(sf)
        if sf_key is None:
            return None
    return name, x_key, sf_key, arguments, flags, id(current)  # name fixes the mode


def _cast_call(
    op: str,
    name: str,
    mode: QuantMode,
    x: Any,
    fmt: Any,
    block: tuple[int, int],
    input_block: Any,
    input_block_argument: str,
    col_major_sf: Any,
    round_sf: Any,
    use_packed_ue8m0: Any,
    use_e4m3_sf: Any,
    sf: Any = None,
) -> tuple[QuantCall, QuantInputs]:
    # Fast path: exactly-typed arguments seen before. The key holds everything the checks
    # read (tensor metadata, arguments, the config in force), so a hit already passed them.
    current = config.current()
    if (
        x.__class__ is torch.Tensor
        and input_block is None
        and mode is not MODE_PRECOMPUTED_SF
        and fmt.__class__ is str
        and col_major_sf.__class__ is bool
        and round_sf.__class__ is bool
        and use_packed_ue8m0.__class__ is bool
        and use_e4m3_sf.__class__ is bool
    ):  # the common case, spelled out: a plain tensor (block was built by the caller's check)
        # (no mode: the public op's name fixes it, and an enum hashes in Python, not C)
        key = (name, x.dtype, x.shape, x.stride(), x.device, x.data_ptr() & 15, fmt, block, col_major_sf,
               round_sf, use_packed_ue8m0, use_e4m3_sf, id(current))
    else:  # parameters, subclasses, (xq, sf) pairs, given scales
        key = _memo_key(name, x, sf, mode, (fmt, block, input_block), (col_major_sf, round_sf, use_packed_ue8m0,
                                                                       use_e4m3_sf), current)
    if key is not None:
        hit = recent_calls.get(key)
        if hit is not None:
            if x.__class__ is torch.Tensor and not x.requires_grad and sf is None:
                return hit, QuantInputs(x)  # the common case: nothing to detach
            return hit, _inputs_of(x, sf, mode)
    call, inputs = _checked_cast_call(
        op, name, mode, x, fmt, block, input_block, input_block_argument, col_major_sf, round_sf, use_packed_ue8m0,
        use_e4m3_sf, sf, current,
    )
    if key is not None:
        recent_calls.put(key, call, current)
    return call, inputs


def cast_config(name: str, fmt: Any, block: tuple[int, int], col_major_sf: Any, round_sf: Any, use_packed_ue8m0: Any,
                use_e4m3_sf: Any, current: config.RuntimeConfig) -> CastConfig:
    """The checked output quantization of op ``name`` (format, sf flags; ``block`` already
    checked) with the clamp in force: one shared object per configuration. Other families
    that end in a cast (``rms_norm_per_token_cast``) build theirs here too."""
    quant_format = _check_fmt(name, fmt)
    if col_major_sf.__class__ is not bool:
        check_bool(name, "use_tma_aligned_col_major_sf", col_major_sf)
    _check_sf_flags(name, round_sf, use_packed_ue8m0, use_e4m3_sf)
    clamp_min = current.clamp_min(quant_format.name, use_e4m3_sf)
    cast_key = (quant_format.name, block, round_sf, use_packed_ue8m0, use_e4m3_sf, col_major_sf, clamp_min)
    cast = _cast_configs.get(cast_key)
    if cast is None:
        cast = CastConfig(quant_format, block, round_sf, use_packed_ue8m0, use_e4m3_sf, col_major_sf, clamp_min)
        _cast_configs[cast_key] = cast
    return cast


def _checked_cast_call(
    op: str,
    name: str,
    mode: QuantMode,
    x: Any,
    fmt: Any,
    block: tuple[int, int],
    input_block: Any,
    input_block_argument: str,
    col_major_sf: Any,
    round_sf: Any,
    use_packed_ue8m0: Any,
    use_e4m3_sf: Any,
    sf: Any,
    current: config.RuntimeConfig,
) -> tuple[QuantCall, QuantInputs]:
    cast = cast_config(name, fmt, block, col_major_sf, round_sf, use_packed_ue8m0, use_e4m3_sf, current)
    quant_format = cast.fmt
    data, input_sf, hidden, quantized_input = read_quant_input(name, x, input_block, input_block_argument)
    if quant_format.values_per_byte == 2 and hidden % 2:
        raise ContractError(name, "x", "an even hidden size for fmt='e2m1' (two values per byte)", describe(data))
    tokens = data.shape[0]
    given = None
    if mode is MODE_PRECOMPUTED_SF:
        encoding, sf_col_major = _check_sf_tensor(name, "sf", sf, data.device, block, tokens, hidden, "x")
        given = GivenScales(encoding, sf_col_major)
    call = QuantCall(
        op, data.device.type, name, mode, hidden, data.dtype, cast, quantized_input, given, None,
        byte_alignment(data), host_layout=current.host_layout, sf_alignment_bytes=current.token_alignment_bytes,
        tokens=tokens, device=data.device, empty=tokens == 0 or hidden == 0,
    )
    given_sf = plain_tensor(sf) if mode is MODE_PRECOMPUTED_SF else None
    inputs = QuantInputs(plain_tensor(data), plain_tensor(input_sf), given_sf)
    return call, inputs


_stochastic_casts: dict[CastConfig, CastConfig] = {}
_stochastic_calls = RecentCalls(1024)
"""A deterministic call (with its token count and device) → the same call rounding stochastically:
``dataclasses.replace`` per call was two thirds of the stochastic casts' contract."""


def with_stochastic_rounding(name: str, call: QuantCall, inputs: QuantInputs, stochastic_rounding: Any,
                             generator: Any) -> tuple[QuantCall, QuantInputs]:
    """``(call, inputs)`` of a main cast with its rounding option: unchanged when deterministic;
    with ``stochastic_rounding=True`` the call's cast rounds stochastically and the inputs
    carry the generator's state (``generator``, or the default generator of x's device)."""
    if stochastic_rounding is False and generator is None:
        return call, inputs
    if stochastic_rounding.__class__ is not bool:
        check_bool(name, "stochastic_rounding", stochastic_rounding)
    if not stochastic_rounding:
        raise ContractError(name, "generator", "None (deterministic rounding draws no bits)", describe(generator))
    from tileplug.core.random import generator_of_draw

    state = generator_of_draw(name, generator, call.device, "x")
    # keyed with the per-call fields, tokens and device, which the call's equality leaves out (a
    # symbolic token count under torch.compile does not hash: no memo then)
    key = (call, call.tokens, call.device) if call.tokens.__class__ is int else None
    stochastic_call = None if key is None else _stochastic_calls.get(key)
    if stochastic_call is None:
        cast = _stochastic_casts.get(call.cast)
        if cast is None:
            cast = _stochastic_casts.setdefault(call.cast, dataclasses.replace(call.cast, stochastic=True))
        stochastic_call = dataclasses.replace(call, cast=cast)
        if key is not None:
            _stochastic_calls.put(key, stochastic_call, None)
    return stochastic_call, inputs._replace(seed=state.seed_state, offset=state.offset_state)


# ---------------------------------------------------------------------- the four kernels' contracts


def per_token_cast(
    x: Any,
    fmt: Any,
    num_per_channels: Any,
    x_block_size: Any,
    use_tma_aligned_col_major_sf: Any,
    round_sf: Any,
    use_packed_ue8m0: Any,
    use_e4m3_sf: Any,
    mode: QuantMode = MODE_CAST,
    sf: Any = None,
    name: str = "per_token_cast",
    stochastic_rounding: Any = False,
    generator: Any = None,
) -> tuple[QuantCall, QuantInputs]:
    """Contract of ``per_token_cast`` and its variants (public op ``name``): groups ``1 × num_per_channels``;
    the main op's rounding option (:func:`with_stochastic_rounding`)."""
    group = check_choice(name, "num_per_channels", num_per_channels, PER_TOKEN_GROUPS)
    call, inputs = _cast_call(
        "per_token_cast", name, mode, x, fmt, (1, group), x_block_size, "x_block_size",
        use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, use_e4m3_sf, sf,
    )
    return with_stochastic_rounding(name, call, inputs, stochastic_rounding, generator)


def per_block_cast(
    x: Any,
    fmt: Any,
    block_size: Any,
    x_block_size: Any,
    use_tma_aligned_col_major_sf: Any,
    round_sf: Any,
    use_packed_ue8m0: Any,
    mode: QuantMode = MODE_CAST,
    sf: Any = None,
    name: str = "per_block_cast",
    stochastic_rounding: Any = False,
    generator: Any = None,
) -> tuple[QuantCall, QuantInputs]:
    """Contract of ``per_block_cast`` and its variants (public op ``name``): groups ``bm × bn``;
    the main op's rounding option (:func:`with_stochastic_rounding`)."""
    block = check_block(name, "block_size", block_size, PER_BLOCK_SIDES, PER_BLOCK_SIDES)
    call, inputs = _cast_call(
        "per_block_cast", name, mode, x, fmt, block, x_block_size, "x_block_size",
        use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, False, sf,
    )
    return with_stochastic_rounding(name, call, inputs, stochastic_rounding, generator)


def per_channel_cast(
    x: Any, fmt: Any, num_per_tokens: Any, round_sf: Any, num_per_channels: Any, use_packed_ue8m0: Any
) -> tuple[QuantCall, QuantInputs]:
    """Contract of ``per_channel_cast``: groups ``num_per_tokens × 1``, sf packed along tokens."""
    name = "per_channel_cast"
    group = check_choice(name, "num_per_tokens", num_per_tokens, PER_CHANNEL_GROUPS)
    return _cast_call(
        name, name, MODE_CAST, x, fmt, (group, 1), num_per_channels, "num_per_channels",
        False, round_sf, use_packed_ue8m0, False,
    )


def per_token_cast_and_cast_back(x: Any, fmt: Any, num_per_channels: Any, round_sf: Any,
                                 use_e4m3_sf: Any) -> tuple[QuantCall, QuantInputs]:
    """Contract of ``per_token_cast_and_cast_back``: a bf16/fp32 ``x`` [T, H] (any row stride, its
    elements not overlapping: it is rewritten in place) quantized as ``per_token_cast`` with
    groups ``1 × num_per_channels`` and the same flags, then dequantized into itself."""
    name = "per_token_cast_and_cast_back"
    if isinstance(x, (tuple, list)):
        raise ContractError(name, "x", "a bf16 or fp32 tensor (rewritten in place), not a quantized pair", describe(x))
    group = check_choice(name, "num_per_channels", num_per_channels, PER_TOKEN_GROUPS)
    call, inputs = _cast_call(name, name, MODE_CAST_AND_CAST_BACK, x, fmt, (1, group), None, "x_block_size", False,
                              round_sf, False, use_e4m3_sf)
    if inputs.x.numel() and has_internal_overlap(inputs.x):
        raise ContractError(name, "x", "a tensor whose elements do not overlap in memory (it is written in place)",
                            describe(x))
    return call, inputs


def cast_back(x: Any, fmt: Any, x_block_size: Any) -> tuple[QuantCall, QuantInputs]:
    """Contract of ``cast_back``: ``(q, sf)`` of any layout §3 produces → bf16/fp32 [T, H]."""
    name = "cast_back"
    current = config.current()
    key = _memo_key(name, x, None, MODE_CAST_BACK, (fmt, x_block_size), (), current) if isinstance(x, tuple) else None
    if key is not None:
        hit = recent_calls.get(key)
        if hit is not None:
            return hit, _inputs_of(x, None, MODE_CAST_BACK)
    output_dtype = OUTPUT_DTYPES[check_choice(name, "fmt", fmt, _OUTPUT_NAMES)]
    if not isinstance(x, (tuple, list)):
        raise ContractError(name, "x", "a pair (q, sf) of quantized data and its scales", describe(x))
    data, input_sf, hidden, quantized_input = read_quant_input(name, x, x_block_size, "x_block_size")
    call = QuantCall(
        name, data.device.type, name, MODE_CAST_BACK, hidden, data.dtype, None, quantized_input, None, output_dtype,
        byte_alignment(data), host_layout=current.host_layout, sf_alignment_bytes=current.token_alignment_bytes,
        tokens=data.shape[0], device=data.device, empty=data.shape[0] == 0 or hidden == 0,
    )
    if key is not None:
        recent_calls.put(key, call, current)
    return call, QuantInputs(plain_tensor(data), plain_tensor(input_sf), None)
