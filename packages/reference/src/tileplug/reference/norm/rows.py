"""Shared by the reference norm kernels: a ``[T, D]`` / ``[T, N, D]`` tensor as rows ``[R, D]``."""

from __future__ import annotations

import torch


def as_rows(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``[..., D] → [R, D]`` (a view where the strides allow, else a copy: the reference only reads it)."""
    return None if tensor is None else tensor.reshape(-1, tensor.shape[-1])


def write_rows(target: torch.Tensor | None, rows: torch.Tensor) -> None:
    """Write ``rows`` ``[R, D]`` (or ``[R]``) into ``target`` of any shape and strides (no-op for None)."""
    if target is not None:
        target.copy_(rows.reshape(target.shape))
