"""Quantized number formats (SPEC.md §1) and their exact encoders/decoders in PyTorch.

This module is the one numeric authority for value encodings: the reference backend and
the tests both use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """A quantized data format.

    ``values_per_byte`` is 1 for e4m3 (one byte each) and 2 for e2m1 (two nibbles a byte).
    """

    name: str
    max_value: float
    storage_dtype: torch.dtype
    values_per_byte: int


E4M3 = QuantFormat("e4m3", 448.0, torch.float8_e4m3fn, 1)
E2M1 = QuantFormat("e2m1", 6.0, torch.int8, 2)

QUANT_FORMATS: dict[str, QuantFormat] = {E4M3.name: E4M3, E2M1.name: E2M1}
"""Formats a cast op can produce."""

OUTPUT_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""Unquantized formats ``cast_back`` can produce."""

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitude of each e2m1 code (bits 0-2); bit 3 is the sign."""


def format_of_storage_dtype(dtype: torch.dtype) -> QuantFormat | None:
    """The quantized format whose data is stored as ``dtype`` (None if none is)."""
    if dtype == torch.float8_e4m3fn:
        return E4M3
    if dtype == torch.int8:
        return E2M1
    return None


def saturate_e4m3(values: torch.Tensor) -> torch.Tensor:
    """fp32 → e4m3: clamp to ±448, then round to nearest even; NaN stays NaN (SPEC §1)."""
    return values.clamp(-E4M3.max_value, E4M3.max_value).to(torch.float8_e4m3fn)


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """fp32 → e2m1 nibble codes (uint8 0..15), one per value, ties to the even code."""
    magnitude = values.abs()
    magnitude = torch.where(torch.isnan(magnitude), E2M1.max_value, magnitude)
    magnitude = magnitude.clamp(max=E2M1.max_value)
    low = torch.round(2.0 * magnitude)
    middle = torch.round(magnitude) + 2.0
    high = torch.round(magnitude * 0.5) + 4.0
    code = torch.where(magnitude < 2.0, low, torch.where(magnitude < 4.0, middle, high))
    code = code.to(torch.uint8)
    return code | (torch.signbit(values).to(torch.uint8) << 3)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., H] codes → [..., H/2] int8: element 2i in the low nibble, 2i+1 in the high."""
    low = codes[..., 0::2]
    high = codes[..., 1::2]
    return (low | (high << 4)).view(torch.int8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., H/2] int8 → [..., H] uint8 codes (inverse of :func:`pack_nibbles`)."""
    raw = packed.view(torch.uint8)
    codes = torch.stack((raw & 0x0F, raw >> 4), dim=-1)
    return codes.reshape(*raw.shape[:-1], raw.shape[-1] * 2)


def decode_e2m1_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes → fp32 values (code 8 is -0.0)."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -magnitude, magnitude)


def encode(values: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Saturating cast of fp32 ``values`` [T, H] into ``fmt`` storage ([T, H] or [T, H/2])."""
    if fmt is E4M3:
        return saturate_e4m3(values)
    return pack_nibbles(e2m1_codes(values))


def decode(data: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Quantized storage → fp32 values [T, H] (exact: every code is an fp32 value)."""
    if fmt is E4M3:
        return data.float()
    return decode_e2m1_codes(unpack_nibbles(data))
