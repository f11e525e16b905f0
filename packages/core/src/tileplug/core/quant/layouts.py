"""Scale-factor storage layouts (SPEC.md §2, "Scale-factor layouts") in plain PyTorch.

A layout is fixed by three things: the encoding (fp32, e4m3, or UE8M0 bytes packed
``pack_factor`` to an integer), the packing axis (channels for per-token/per-block groups,
tokens for per-channel groups), and row- or column-major storage with a column length
padded to the device family's alignment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tileplug.core.quant.sf_math import GroupScales, align, ceil_div, exp2_int

UE8M0_PACK_DTYPES: dict[int, torch.dtype] = {4: torch.int32, 2: torch.int16}
"""Integer dtype holding ``pack_factor`` UE8M0 bytes."""


@dataclass(frozen=True, slots=True)
class LayoutTraits:
    """What a device family fixes about sf storage.

    ``ue8m0_pack_factor``: UE8M0 bytes per integer (4 in int32 on CUDA, 2 in int16 on
    Ascend). ``col_major_sf_alignment_bytes``: column length of column-major sf is padded
    to this many bytes (16 on CUDA for TMA; 1, i.e. unpadded, on Ascend).
    """

    family: str
    ue8m0_pack_factor: int
    col_major_sf_alignment_bytes: int

    @property
    def ue8m0_pack_dtype(self) -> torch.dtype:
        return UE8M0_PACK_DTYPES[self.ue8m0_pack_factor]


CUDA_LAYOUT = LayoutTraits("cuda", 4, 16)
ASCEND_LAYOUT = LayoutTraits("ascend", 2, 1)
LAYOUTS: dict[str, LayoutTraits] = {CUDA_LAYOUT.family: CUDA_LAYOUT, ASCEND_LAYOUT.family: ASCEND_LAYOUT}


@dataclass(frozen=True, slots=True)
class SfEncoding:
    """How one group scale is stored: ``kind`` in {"fp32", "e4m3", "ue8m0"}; ``pack_factor``
    is the number of UE8M0 bytes per integer (1 for fp32 and e4m3)."""

    kind: str
    pack_factor: int = 1

    @property
    def dtype(self) -> torch.dtype:
        if self.kind == "fp32":
            return torch.float32
        if self.kind == "e4m3":
            return torch.float8_e4m3fn
        return UE8M0_PACK_DTYPES[self.pack_factor]


FP32_SF = SfEncoding("fp32")
E4M3_SF = SfEncoding("e4m3")


def encoding_of_dtype(dtype: torch.dtype) -> SfEncoding | None:
    """The sf encoding a tensor of ``dtype`` holds (None if no encoding uses that dtype)."""
    if dtype == torch.float32:
        return FP32_SF
    if dtype == torch.float8_e4m3fn:
        return E4M3_SF
    for factor, packed_dtype in UE8M0_PACK_DTYPES.items():
        if dtype == packed_dtype:
            return SfEncoding("ue8m0", factor)
    return None


def pack_axis_of_block(block: tuple[int, int]) -> int:
    """UE8M0 bytes are packed along channels (axis 1), or tokens (axis 0) when ``bn == 1``."""
    return 0 if block[1] == 1 else 1


def storage_shape(encoding: SfEncoding, pack_axis: int, rows: int, cols: int) -> tuple[int, int]:
    """Logical shape of the stored sf tensor of ``rows × cols`` groups."""
    factor = encoding.pack_factor
    if factor == 1:
        return rows, cols
    if pack_axis == 1:
        return rows, ceil_div(cols, factor)
    return ceil_div(rows, factor), cols


def column_length(rows: int, itemsize: int, alignment_bytes: int) -> int:
    """Stored column length of a column-major sf: ``align(rows, alignment / itemsize)``."""
    return align(rows, max(1, alignment_bytes // itemsize))


def standard_strides(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with row-major strides, size-1 dims included (``.contiguous()`` may keep odd
    strides on size-1 dims, which ``.view(dtype)`` rejects)."""
    if tensor.dim() and tensor.stride(-1) == 1 and tensor.is_contiguous():
        return tensor
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device).copy_(tensor)


def pack_ue8m0(exponent_bytes: torch.Tensor, pack_factor: int, pack_axis: int) -> torch.Tensor:
    """uint8 [rows, cols] → packed integers, little-endian along ``pack_axis``; pad bytes 0."""
    packed_dtype = UE8M0_PACK_DTYPES[pack_factor]
    data = exponent_bytes if pack_axis == 1 else exponent_bytes.t()
    count = data.shape[1]
    padded = standard_strides(torch.nn.functional.pad(data, (0, align(count, pack_factor) - count)))
    packed = padded.view(packed_dtype)
    return packed if pack_axis == 1 else packed.t()


def unpack_ue8m0(packed: torch.Tensor, pack_axis: int, rows: int, cols: int) -> torch.Tensor:
    """Packed integers (any strides) → uint8 [rows, cols] exponent bytes."""
    if packed.numel() == 0:
        return torch.empty((rows, cols), dtype=torch.uint8, device=packed.device)
    data = packed if pack_axis == 1 else packed.t()
    raw = standard_strides(data).view(torch.uint8)
    return raw[:, :cols] if pack_axis == 1 else raw[:, :rows].t()


def decode_ue8m0(exponent_bytes: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte b → fp32 ``2^(b-127)``; 0xFF → NaN."""
    exponent = exponent_bytes.to(torch.int32) - 127
    value = exp2_int(exponent)
    return torch.where(exponent_bytes == 0xFF, torch.full_like(value, float("nan")), value)


def write(
    sf: torch.Tensor, scales: GroupScales, encoding: SfEncoding, pack_axis: int
) -> None:
    """Store ``scales`` into the preallocated ``sf`` (whatever its strides)."""
    if encoding.kind == "fp32":
        sf.copy_(scales.value)
    elif encoding.kind == "e4m3":
        assert scales.e4m3 is not None, "e4m3 sf needs e4m3 scales"
        sf.copy_(scales.e4m3)
    else:
        assert scales.exponent is not None, "UE8M0 sf needs power-of-two scales"
        exponent_bytes = (scales.exponent + 127).to(torch.uint8)
        sf.copy_(pack_ue8m0(exponent_bytes, encoding.pack_factor, pack_axis))


def read(sf: torch.Tensor, encoding: SfEncoding, pack_axis: int, rows: int, cols: int) -> torch.Tensor:
    """Decode a stored sf tensor (any supported layout) → fp32 scales [rows, cols]."""
    if encoding.kind == "fp32":
        return sf.float()
    if encoding.kind == "e4m3":
        return sf.float()
    return decode_ue8m0(unpack_ue8m0(sf, pack_axis, rows, cols))
