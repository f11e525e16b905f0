"""Liger Kernel 0.8.5 (PyPI ``liger-kernel``) spelt as tileplug's norm and SwiGLU ops.

RMSNorm and LayerNorm through Liger's autograd functions (the forward: the bench times the
op, not a training step). Liger's RMSNorm has a weight offset but no residual input, no
``out_scale`` and no rstd output; its RoPE works on another layout ([B, H, S, D] with
per-token cos/sin tensors), so it is not offered as ``apply_rotary``.

Their backwards: Liger's ``rms_norm_backward`` / ``layer_norm_backward`` (the kernels its
autograd functions run) given tileplug's saved tensors (``x``, ``rstd``, ``mean``), with the
block size and warps its forward would have chosen (``calculate_settings``). The RMSNorm
backward runs as ``LigerRMSNormFunction`` runs it by default, in place: ``grad_x`` is written
over ``grad_y`` (the bench checks no values, and the kernel does not branch on them). Liger's
LayerNorm backward takes the bias only for the dtype of its gradient: a weight-dtype
stand-in is passed. No ``grad_residual_out``, no ``out_scale``; a weight is required.

SwiGLU: Liger's ``swiglu_forward`` / ``swiglu_backward`` (the kernels of ``LigerSiLUMulFunction``)
take the gate and up halves as two contiguous tensors of one stride, where tileplug takes
``x = [gate | up]``: the adapter splits an input once and keeps the halves for the same tensor
(same storage and version), so repeated timing of one input times Liger's kernel alone. Its
backward writes the gradients into those halves (its own in-place contract). No routed
weights, clamp or expert layout.
"""

from __future__ import annotations

import torch
from liger_kernel.ops.layer_norm import LigerLayerNormFunction
from liger_kernel.ops.layer_norm import layer_norm_backward as _layer_norm_backward
from liger_kernel.ops.rms_norm import LigerRMSNormFunction
from liger_kernel.ops.rms_norm import rms_norm_backward as _rms_norm_backward
from liger_kernel.ops.swiglu import swiglu_backward as _swiglu_backward
from liger_kernel.ops.swiglu import swiglu_forward as _swiglu_forward
from liger_kernel.ops.utils import calculate_settings

__all__ = ["layer_norm", "layer_norm_backward", "rms_norm", "rms_norm_backward", "swiglu", "swiglu_backward"]

_HALVES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_MAX_KEPT = 64


def _refuse(what: str, name: str, value: object, default: object) -> None:
    """A ``TypeError`` naming the argument where a case sets one Liger's ``what`` does not have."""
    if value is not default and value != default:
        raise TypeError(f"Liger's {what} has no '{name}' (this case sets it)")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
             residual: torch.Tensor | None = None, weight_offset: float = 0.0, out_scale: float = 1.0,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
             return_rstd: bool = False) -> torch.Tensor:
    """``LigerRMSNormFunction`` (Llama casting mode, out of place)."""
    for name, value, default in (("residual", residual, None), ("out_scale", out_scale, 1.0),
                                 ("out", out, None), ("return_rstd", return_rstd, False)):
        _refuse("RMSNorm", name, value, default)
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


def rms_norm_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                      weight_offset: float = 0.0, out_scale: float = 1.0,
                      grad_residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Liger's ``rms_norm_backward`` (Llama casting mode, in place: ``grad_x`` over ``grad_y``) →
    ``(grad_x, grad_weight)``; ``x`` / ``grad_y`` ``[T, D]``, ``rstd`` ``[T]`` fp32."""
    for name, value, default in (("out_scale", out_scale, 1.0), ("grad_residual_out", grad_residual_out, None)):
        _refuse("RMSNorm backward", name, value, default)
    if weight is None:
        raise TypeError("Liger's RMSNorm backward needs a weight")
    block, warps = calculate_settings(x.shape[-1])
    return _rms_norm_backward(grad_y, x, weight, rstd, weight_offset, "llama", block, warps, True, None)


def layer_norm_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor,
                        rstd: torch.Tensor, grad_residual_out: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Liger's ``layer_norm_backward`` → ``(grad_x, grad_weight, grad_bias)`` (the weight's dtype);
    ``x`` / ``grad_y`` ``[T, D]``, ``mean`` / ``rstd`` ``[T]`` fp32."""
    _refuse("LayerNorm backward", "grad_residual_out", grad_residual_out, None)
    if weight is None:
        raise TypeError("Liger's LayerNorm backward needs a weight")
    return _layer_norm_backward(grad_y, x, weight, weight, mean, rstd)  # the bias: only its dtype is read


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[N, 2H]`` → contiguous ``(gate, up)``, made once per input tensor (see the module docstring)."""
    key = (x.data_ptr(), x._version, tuple(x.shape), tuple(x.stride()), x.dtype)
    halves = _HALVES.get(key)
    if halves is None:
        if len(_HALVES) >= _MAX_KEPT:
            _HALVES.clear()
        width = x.shape[1] // 2
        halves = _HALVES[key] = (x[:, :width].contiguous(), x[:, width:].contiguous())
    return halves


def _plain(op: str, topk_weights, routed_scaling_factor, clamp_value, expert_ends) -> None:
    for name, value, default in (("topk_weights", topk_weights, None), ("routed_scaling_factor", routed_scaling_factor,
                                 1.0), ("clamp_value", clamp_value, None), ("expert_ends", expert_ends, None)):
        if value is not default and value != default:
            raise TypeError(f"Liger's {op} has no '{name}' (this case sets it)")


def swiglu(x: torch.Tensor, out_dtype: torch.dtype | None = None, topk_weights: torch.Tensor | None = None,
           routed_scaling_factor: float = 1.0, clamp_value: float | None = None,
           expert_ends: torch.Tensor | None = None, expert_alignment: int = 128) -> torch.Tensor:
    """Liger's ``swiglu_forward`` (output in x's dtype)."""
    _plain("SwiGLU", topk_weights, routed_scaling_factor, clamp_value, expert_ends)
    if out_dtype not in (None, x.dtype):
        raise TypeError("Liger's SwiGLU writes x's dtype only")
    return _swiglu_forward(*_halves(x))[2]


def swiglu_backward(x: torch.Tensor, grad_y: torch.Tensor, topk_weights: torch.Tensor | None = None,
                    routed_scaling_factor: float = 1.0, clamp_value: float | None = None,
                    expert_ends: torch.Tensor | None = None, expert_alignment: int = 128) -> object:
    """Liger's ``swiglu_backward`` (gradients written into the cached halves)."""
    _plain("SwiGLU backward", topk_weights, routed_scaling_factor, clamp_value, expert_ends)
    return _swiglu_backward(*_halves(x), grad_y)
