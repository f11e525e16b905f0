"""Contracts of the quant family's re-blocking and weight-scale layout ops (SPEC §11).

``per_block_cast_lossless`` describes itself with the family's :class:`QuantCall` (an e2m1
pair in, an e4m3 cast out), so its allocation plan, result and ledger are the family's.
``transpose_weight_sf`` has a call of its own: a list of weights' scale shapes in, two
packed UE8M0 tensors per weight out, whose shapes only the call fixes.
"""

from __future__ import annotations

from typing import Any

import torch

from tileplug.core import config
from tileplug.core.call import Call, Ledger, QuantMode, call_type
from tileplug.core.contracts.checks import check_block, check_bool, check_choice, check_same_device, describe
from tileplug.core.contracts.quant import (
    INPUT_BLOCK_SIDES,
    QuantCall,
    QuantInputs,
    plain_tensor,
    read_quant_input,
    byte_alignment,
    cast_config,
    recent_calls,
    _inputs_of,
    _memo_key,
)
from tileplug.core.errors import ContractError
from tileplug.core.quant.formats import E2M1
from tileplug.core.quant.layouts import LayoutTraits
from tileplug.core.quant.sf_math import ceil_div

LOSSLESS = "per_block_cast_lossless"
TRANSPOSE = "transpose_weight_sf"

OUTPUT_BLOCK_SIDES = INPUT_BLOCK_SIDES
"""Sides of a lossless output group: those of any group ``cast_back`` reads (1, 16, 32, 64,
128; not 1 × 1). Powers of two, so along each axis one side divides the other."""

WEIGHT_BLOCK_SIZES = (16, 32, 64, 128)
"""Side of the square weight blocks whose scales ``transpose_weight_sf`` lays out."""


# ---------------------------------------------------------------------- per_block_cast_lossless


def per_block_cast_lossless(
    x: Any,
    fmt: Any,
    x_block_size: Any,
    out_block_size: Any,
    use_tma_aligned_col_major_sf: Any,
    round_sf: Any,
    use_packed_ue8m0: Any,
) -> tuple[QuantCall, QuantInputs]:
    """Contract of ``per_block_cast_lossless``: an e2m1 pair ``(xq, sf)`` with power-of-two
    scales (fp32 or packed UE8M0) in ``x_block_size`` groups → e4m3 in ``out_block_size``
    groups (SPEC §11). Every refusal is a ContractError naming the argument. A signature seen
    before (exactly-typed arguments, the same tensor metadata and config) is the memo's call."""
    name = LOSSLESS
    current = config.current()
    key = None
    if x.__class__ is tuple:
        key = _memo_key(name, x, None, QuantMode.CAST, (fmt, x_block_size, out_block_size),
                        (use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0), current)
        hit = None if key is None else recent_calls.get(key)
        if hit is not None:
            return hit, _inputs_of(x, None, QuantMode.CAST)
    if fmt.__class__ is not str or fmt != "e4m3":
        raise ContractError(name, "fmt", "'e4m3' (only e4m3 holds every e2m1 value times the scale ratios; "
                            "SPEC §11)", describe(fmt))
    if not isinstance(x, (tuple, list)):
        raise ContractError(name, "x", "a pair (xq, sf) of e2m1 data (int8, two values per byte) and its scales",
                            describe(x))
    output_block = check_block(name, "out_block_size", out_block_size, OUTPUT_BLOCK_SIDES, OUTPUT_BLOCK_SIDES)
    cast = cast_config(name, fmt, output_block, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, False,
                       current)
    data, input_sf, hidden, quantized_input = read_quant_input(name, x, x_block_size, "x_block_size")
    if quantized_input.fmt is not E2M1:
        raise ContractError(name, "x", "e2m1 data (int8, two values per byte): e4m3 data has no room to shift "
                            "its scale losslessly (SPEC §11)", describe(data))
    if quantized_input.sf_encoding.kind == "e4m3":
        raise ContractError(name, "x", "power-of-two scales (float32 or packed UE8M0 integers): e4m3 scales carry "
                            "a mantissa, so two groups' scale ratio need not be a power of two (SPEC §11)",
                            describe(input_sf))
    tokens = data.shape[0]
    call = QuantCall(
        name, data.device.type, name, QuantMode.CAST, hidden, data.dtype, cast, quantized_input, None, None,
        byte_alignment(data), host_layout=current.host_layout, sf_alignment_bytes=current.token_alignment_bytes,
        tokens=tokens, device=data.device, empty=tokens == 0 or hidden == 0,
    )
    if key is not None:
        recent_calls.put(key, call, current)
    return call, QuantInputs(plain_tensor(data), plain_tensor(input_sf))


# ---------------------------------------------------------------------- transpose_weight_sf


class WeightScaleOutputs(tuple):
    """The tensors ``transpose_weight_sf`` writes: ``(sf0, sf1)`` of each weight, flat, in
    the order the weights were given (``WeightScaleOutputs(*tensors)``)."""

    def __new__(cls, *tensors: torch.Tensor) -> WeightScaleOutputs:
        return super().__new__(cls, tensors)


@call_type
class WeightScaleCall(Call):
    """One ``transpose_weight_sf`` call: ``block_size`` (the square weight block side),
    ``shapes`` (each weight's scale shape, ``(rows, cols)`` or ``(groups, rows, cols)``) and
    ``transpose_sf1`` (sf1 returned as its ``[P1, K]`` view). ``tokens`` is the total weight
    row count (Σ groups · rows · block_size), for reports only."""

    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    transpose_sf1: bool = False

    def layouts(self, traits: LayoutTraits) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """``(shape, strides)`` of every output, in order (SPEC §11): for a weight of scale
        shape ``[*g, R, C]`` (N = R·bs, K = C·bs, ``f`` the traits' UE8M0 pack factor,
        P0 = ceil(C/f), P1 = ceil(R/f)) sf0 is ``[*g, N, P0]`` with strides ``(N·P0, 1, N)``
        and sf1 ``[*g, K, P1]`` with strides ``(K·P1, 1, K)`` (``[*g, P1, K]``, strides
        ``(K·P1, K, 1)``, when ``transpose_sf1``). An empty output is contiguous."""
        factor = traits.ue8m0_pack_factor
        result = []
        for shape in self.shapes:
            groups, (rows, cols) = shape[:-2], shape[-2:]
            n, k = rows * self.block_size, cols * self.block_size
            packed_k, packed_n = ceil_div(cols, factor), ceil_div(rows, factor)
            group_stride = lambda inner: (inner,) if groups else ()  # noqa: E731
            sf0 = ((*groups, n, packed_k), (*group_stride(n * packed_k), 1, n))
            if self.transpose_sf1:
                sf1 = ((*groups, packed_n, k), (*group_stride(k * packed_n), k, 1))
            else:
                sf1 = ((*groups, k, packed_n), (*group_stride(k * packed_n), 1, k))
            result += [sf0, sf1]
        return result

    def allocation_plan(self, traits: LayoutTraits) -> WeightScalePlan:
        """The allocation of this call's outputs on a backend with ``traits``."""
        return WeightScalePlan(self.layouts(traits), traits.ue8m0_pack_dtype)

    def result(self, outputs: WeightScaleOutputs) -> tuple[torch.Tensor, ...]:
        """What the public op returns: ``(sf0, sf1)`` of each weight, flat."""
        return tuple(outputs)

    def ledger(self, traits: LayoutTraits) -> Ledger:
        """Bytes read (the fp32 scales) and written (every packed integer, pad bytes included)."""
        bytes_read = sum(_numel(shape) * 4 for shape in self.shapes)
        itemsize = traits.ue8m0_pack_dtype.itemsize
        bytes_written = sum(_numel(shape) * itemsize for shape, _ in self.layouts(traits))
        return Ledger(bytes_read, bytes_written, 0)


class WeightScalePlan:
    """Allocation of a :class:`WeightScaleCall`'s outputs: one ``torch.empty_strided`` each."""

    __slots__ = ("layouts", "dtype")

    def __init__(self, layouts: list[tuple[tuple[int, ...], tuple[int, ...]]], dtype: torch.dtype) -> None:
        self.layouts = layouts
        self.dtype = dtype

    def allocate(self, tokens: int, device: torch.device | None) -> WeightScaleOutputs:
        """The outputs (``tokens`` is not needed: the call's shapes fix every size)."""
        tensors = []
        for shape, strides in self.layouts:
            if _numel(shape) == 0:
                tensors.append(torch.empty(shape, dtype=self.dtype, device=device))
            else:
                tensors.append(torch.empty_strided(shape, strides, dtype=self.dtype, device=device))
        return WeightScaleOutputs(*tensors)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def transpose_weight_sf(sf: Any, block_size: Any, transpose_sf1: Any) -> tuple[WeightScaleCall, tuple]:
    """Contract of ``transpose_weight_sf``: one fp32 scale tensor, or a non-empty tuple of
    them, each contiguous ``[rows, cols]`` or ``[groups, rows, cols]``, all on one device. A
    signature seen before (the same tensor metadata, arguments and config) is the memo's call."""
    tensors = (sf,) if isinstance(sf, torch.Tensor) else sf
    if tensors.__class__ is tuple and tensors:
        call = recent_calls.memoized(TRANSPOSE, tensors, (block_size, transpose_sf1),
                                     lambda: _checked_transpose_weight_sf(tensors, block_size, transpose_sf1))
    else:
        call = _checked_transpose_weight_sf(tensors, block_size, transpose_sf1)
    return call, tuple(plain_tensor(tensor) for tensor in tensors)


def _checked_transpose_weight_sf(tensors: Any, block_size: Any, transpose_sf1: Any) -> WeightScaleCall:
    name = TRANSPOSE
    if not isinstance(tensors, (tuple, list)) or not tensors:
        raise ContractError(name, "sf", "a float32 scale tensor or a non-empty tuple of them", describe(tensors))
    block = check_choice(name, "block_size", block_size, WEIGHT_BLOCK_SIZES)
    check_bool(name, "transpose_sf1", transpose_sf1)
    device = None
    shapes = []
    for index, tensor in enumerate(tensors):
        which = "" if len(tensors) == 1 else f" (weight {index})"
        if not isinstance(tensor, torch.Tensor):
            raise ContractError(name, "sf", f"a torch.Tensor{which}", describe(tensor))
        if tensor.dim() not in (2, 3):
            raise ContractError(name, "sf", f"a 2-D [rows, cols] or 3-D [groups, rows, cols] scale tensor{which}",
                                describe(tensor))
        if tensor.dtype != torch.float32:
            raise ContractError(name, "sf", f"float32 power-of-two scales{which}", describe(tensor))
        if not tensor.is_contiguous():
            raise ContractError(name, "sf", f"a contiguous (row-major) tensor{which}", describe(tensor))
        if device is None:
            device = tensor.device
        else:
            check_same_device(name, "sf", tensor, device, of="the first scale tensor")
        shapes.append(tuple(int(size) for size in tensor.shape))
    current = config.current()
    rows = sum(_numel(shape[:-1]) for shape in shapes) * block
    return WeightScaleCall(
        name, device.type, name, block, tuple(shapes), transpose_sf1, host_layout=current.host_layout,
        tokens=rows, device=device, empty=all(_numel(shape) == 0 for shape in shapes),
    )
