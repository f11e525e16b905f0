"""Small helpers written from SPEC.md for the round-trip and property tests: integer layout
math and byte views (the byte views kept independent of tileplug's own implementation)."""

from __future__ import annotations

import torch

PACK = {"cuda": (4, torch.int32), "ascend": (2, torch.int16)}
"""UE8M0 bytes per packed integer, and the integer dtype, of each device layout."""


from tileplug.core.quant.sf_math import align, ceil_div  # noqa: E402,F401 - the one copy of the integer math


def std(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with plain row-major strides (so that ``.view(dtype)`` always works)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """Bytes of the tensor in logical row-major order, [..., last * itemsize] uint8."""
    if tensor.numel() == 0:
        return torch.empty((*tensor.shape[:-1], tensor.shape[-1] * tensor.element_size()), dtype=torch.uint8)
    return std(tensor).view(torch.uint8)
