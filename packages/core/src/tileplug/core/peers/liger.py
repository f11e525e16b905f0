"""Liger Kernel 0.8.5 (PyPI ``liger-kernel``) spelt as tileplug's norm ops.

RMSNorm and LayerNorm through Liger's autograd functions (forward only: the bench times
the op, not a training step). Liger's RMSNorm has a weight offset but no residual input,
no ``out_scale`` and no rstd output; its RoPE works on another layout ([B, H, S, D] with
per-token cos/sin tensors), so it is not offered as ``apply_rotary``.
"""

from __future__ import annotations

import torch
from liger_kernel.ops.layer_norm import LigerLayerNormFunction
from liger_kernel.ops.rms_norm import LigerRMSNormFunction

__all__ = ["layer_norm", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
             residual: torch.Tensor | None = None, weight_offset: float = 0.0, out_scale: float = 1.0,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
             return_rstd: bool = False) -> torch.Tensor:
    """``LigerRMSNormFunction`` (Llama casting mode, out of place)."""
    for name, value, default in (("residual", residual, None), ("out_scale", out_scale, 1.0),
                                 ("out", out, None), ("return_rstd", return_rstd, False)):
        if value is not default and value != default:
            raise TypeError(f"Liger's RMSNorm has no '{name}' (this case sets it)")
    if weight is None:
        raise TypeError("Liger's RMSNorm needs a weight")
    return LigerRMSNormFunction.apply(x, weight, eps, weight_offset, "llama", False)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
               residual_out: torch.Tensor | None = None, return_stats: bool = False) -> torch.Tensor:
    """``LigerLayerNormFunction`` (weight and bias required)."""
    for name, value in (("residual", residual), ("out", out)):
        if value is not None:
            raise TypeError(f"Liger's LayerNorm has no '{name}'")
    if return_stats:
        raise TypeError("Liger's LayerNorm returns no statistics")
    if weight is None or bias is None:
        raise TypeError("Liger's LayerNorm needs a weight and a bias")
    return LigerLayerNormFunction.apply(x, weight, bias, eps)
