"""TileKernels 2.1.0 (PyPI ``tile-kernels``) spelt as tileplug's ops.

The quant ops share tileplug's names and arguments and are TileKernels' own functions; the
norm ops map onto ``norm_forward``, ``norm_forward_and_per_token_cast`` and
``norm_backward``, RoPE onto ``tile_kernels.transform.apply_rotary``. Only the facts of its
public API are used here (argument names and return order, from its docstrings).
"""

from __future__ import annotations

import torch
from tile_kernels.quant import (  # noqa: F401 - re-exported under tileplug's op names
    cast_back,
    norm_backward,
    norm_forward,
    norm_forward_and_per_token_cast,
    per_block_cast,
    per_channel_cast,
    per_token_cast,
)
from tile_kernels.transform import apply_rotary  # noqa: F401 - same name and arguments

__all__ = [
    "apply_rotary",
    "cast_back",
    "per_block_cast",
    "per_channel_cast",
    "per_token_cast",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_per_token_cast",
]


def _refuse(name: str, value: object, default: object) -> None:
    if value != default:
        raise TypeError(f"TileKernels has no '{name}' (this case sets it to {value!r})")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
             residual: torch.Tensor | None = None, weight_offset: float = 0.0, out_scale: float = 1.0,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
             return_rstd: bool = False) -> object:
    """``norm_forward`` with tileplug's arguments (no ``weight_offset``)."""
    _refuse("weight_offset", weight_offset, 0.0)
    return norm_forward(x, weight, eps, residual, out_scale, out=out, residual_out=residual_out,
                        with_rstd=return_rstd)


def rms_norm_per_token_cast(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
                            fmt: str = "e4m3", num_per_channels: int = 128, residual: torch.Tensor | None = None,
                            weight_offset: float = 0.0, out_scale: float = 1.0, round_sf: bool = False,
                            use_packed_ue8m0: bool = False, use_tma_aligned_col_major_sf: bool = False,
                            use_e4m3_sf: bool = False, return_unquantized: bool = False,
                            residual_out: torch.Tensor | None = None) -> object:
    """``norm_forward_and_per_token_cast`` with tileplug's arguments (no ``weight_offset``, no
    e4m3-stored sf, e4m3 1×32 groups only)."""
    _refuse("weight_offset", weight_offset, 0.0)
    _refuse("use_e4m3_sf", use_e4m3_sf, False)
    if (fmt, num_per_channels) != ("e4m3", 32):
        raise TypeError(f"TileKernels' fused norm cast takes only e4m3 1×32 groups (this case: {fmt} 1×{num_per_channels})")
    return norm_forward_and_per_token_cast(
        x, weight, eps, fmt, num_per_channels, residual, out_scale,
        use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, round_sf=round_sf,
        use_packed_ue8m0=use_packed_ue8m0, with_out_bf16=return_unquantized, residual_out=residual_out,
    )


def rms_norm_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                      weight_offset: float = 0.0, out_scale: float = 1.0,
                      grad_residual_out: torch.Tensor | None = None) -> object:
    """``norm_backward`` with tileplug's arguments (no ``weight_offset``)."""
    _refuse("weight_offset", weight_offset, 0.0)
    return norm_backward(grad_y, x, weight, rstd, grad_residual_out, out_scale)
