"""TileKernels 2.1.0 (PyPI ``tile-kernels``) spelt as tileplug's ops.

The quant ops share tileplug's names and arguments and are TileKernels' own functions (its
``per_token_cast`` spells ``stochastic_rounding`` as ``stochastic_cast``); the
norm ops map onto ``norm_forward``, ``norm_forward_and_per_token_cast`` and
``norm_backward``, RoPE onto ``tile_kernels.transform.apply_rotary``, the SwiGLU ops onto
``swiglu_forward``, ``swiglu_forward_and_per_token_cast`` and ``swiglu_backward`` (whose expert
layout is tileplug's ``expert_ends`` under TileKernels' token alignment, 128 by default), and the
MoE gates onto ``tile_kernels.moe``: ``topk_gate`` and ``normalize_weight`` (the same names and
arguments), ``moe_topk_gate_forward`` / ``moe_topk_gate_backward`` (sqrtsoftplus scoring with
renormalised weights, no groups, fp32 logits, 0–2 shared experts). Only the facts of its public
API are used here (argument names and return order, from its docstrings).
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
    swiglu_forward,
    swiglu_forward_and_per_token_cast,
)
from tile_kernels.moe import moe_topk_gate_backward as _moe_topk_gate_backward
from tile_kernels.moe import moe_topk_gate_forward as _moe_topk_gate_forward
from tile_kernels.moe import normalize_weight, topk_gate  # noqa: F401 - same names and arguments
from tile_kernels.quant import per_token_cast as _per_token_cast
from tile_kernels.quant import swiglu_backward as _swiglu_backward
from tile_kernels.transform import apply_rotary  # noqa: F401 - same name and arguments

__all__ = [
    "apply_rotary",
    "cast_back",
    "moe_topk_gate",
    "moe_topk_gate_backward",
    "normalize_weight",
    "per_block_cast",
    "per_channel_cast",
    "per_token_cast",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_per_token_cast",
    "swiglu",
    "swiglu_backward",
    "swiglu_per_token_cast",
    "topk_gate",
]


def per_token_cast(x: object, fmt: str = "e4m3", num_per_channels: int = 128, x_block_size: object = None,
                   use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False, use_packed_ue8m0: bool = False,
                   use_e4m3_sf: bool = False, stochastic_rounding: bool = False, generator: object = None,
                   out: object = None) -> object:
    """TileKernels' ``per_token_cast`` with tileplug's arguments: ``stochastic_rounding`` is its
    ``stochastic_cast`` (which draws its own bits: ``generator`` has no counterpart)."""
    return _per_token_cast(x, fmt, num_per_channels, x_block_size=x_block_size,
                           use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, round_sf=round_sf,
                           use_packed_ue8m0=use_packed_ue8m0, use_e4m3_sf=use_e4m3_sf,
                           stochastic_cast=stochastic_rounding, out=out)


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


TOKEN_ALIGNMENT = 128
"""TileKernels' default token alignment of an expert layout (``tile_kernels.config``)."""


def _routing(topk_weights: torch.Tensor | None, routed_scaling_factor: float, expert_ends: torch.Tensor | None,
             expert_alignment: int) -> float | None:
    """TileKernels' ``routed_scaling_factor`` argument (it takes one only with weights)."""
    if expert_ends is not None:
        _refuse("expert_alignment", expert_alignment, TOKEN_ALIGNMENT)
    if topk_weights is None:
        _refuse("routed_scaling_factor (without topk_weights)", routed_scaling_factor, 1.0)
        return None
    return routed_scaling_factor


def swiglu(x: torch.Tensor, out_dtype: torch.dtype | None = None, topk_weights: torch.Tensor | None = None,
           routed_scaling_factor: float = 1.0, clamp_value: float | None = None,
           expert_ends: torch.Tensor | None = None, expert_alignment: int = 128) -> torch.Tensor:
    """``swiglu_forward`` with tileplug's arguments (bf16 / fp32 output)."""
    factor = _routing(topk_weights, routed_scaling_factor, expert_ends, expert_alignment)
    fmt = "fp32" if (out_dtype or x.dtype) == torch.float32 else "bf16"
    return swiglu_forward(x, fmt, expert_ends, topk_weights, factor, clamp_value)


def swiglu_per_token_cast(x: torch.Tensor, fmt: str = "e4m3", num_per_channels: int = 128,
                          topk_weights: torch.Tensor | None = None, routed_scaling_factor: float = 1.0,
                          clamp_value: float | None = None, expert_ends: torch.Tensor | None = None,
                          expert_alignment: int = 128, round_sf: bool = False, use_packed_ue8m0: bool = False,
                          use_tma_aligned_col_major_sf: bool = False, use_e4m3_sf: bool = False) -> object:
    """``swiglu_forward_and_per_token_cast`` with tileplug's arguments (e4m3 1×32 / 1×128 only)."""
    _refuse("use_e4m3_sf", use_e4m3_sf, False)
    if (fmt, num_per_channels) not in (("e4m3", 32), ("e4m3", 128)):
        raise TypeError(f"TileKernels' SwiGLU cast takes e4m3 1×32 or 1×128 groups (this case: {fmt} "
                        f"1×{num_per_channels})")
    factor = _routing(topk_weights, routed_scaling_factor, expert_ends, expert_alignment)
    return swiglu_forward_and_per_token_cast(x, fmt, num_per_channels, expert_ends, topk_weights, factor,
                                             use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, clamp_value)


def swiglu_backward(x: torch.Tensor, grad_y: torch.Tensor, topk_weights: torch.Tensor | None = None,
                    routed_scaling_factor: float = 1.0, clamp_value: float | None = None,
                    expert_ends: torch.Tensor | None = None, expert_alignment: int = 128) -> object:
    """TileKernels' ``swiglu_backward`` (unquantized, x's dtype) with tileplug's arguments."""
    factor = _routing(topk_weights, routed_scaling_factor, expert_ends, expert_alignment)
    fmt = "fp32" if x.dtype == torch.float32 else "bf16"
    return _swiglu_backward(x, grad_y, fmt, expert_ends, topk_weights, factor, clamp_value)


SHARED_EXPERTS = (0, 1, 2)
"""The shared-expert slot counts TileKernels' gate takes."""


def _sqrtsoftplus_gate(scoring: str, renormalize: bool) -> None:
    """TileKernels' gates score by ``sqrt(softplus)`` and renormalise the routed weights."""
    if scoring != "sqrtsoftplus":
        raise TypeError(f"TileKernels' MoE gate scores by sqrtsoftplus only (this case: scoring={scoring!r})")
    _refuse("renormalize", renormalize, True)


def moe_topk_gate(logits: torch.Tensor, num_topk: int, scoring: str = "softmax", bias: torch.Tensor | None = None,
                  num_groups: int = 1, topk_groups: int = 1, renormalize: bool = True,
                  routed_scaling_factor: float = 1.0, num_shared_experts: int = 0, mask: torch.Tensor | None = None,
                  return_scores: bool = False) -> tuple[torch.Tensor, ...]:
    """``moe_topk_gate_forward`` with tileplug's arguments: sqrtsoftplus scores, renormalised
    weights, no groups, fp32 logits, 0–2 shared experts (its ``use_shared_as_routed``), the
    scores written into a tensor of its ``scores`` argument when asked for."""
    _sqrtsoftplus_gate(scoring, renormalize)
    _refuse("num_groups", num_groups, 1)
    _refuse("topk_groups", topk_groups, 1)
    if logits.dtype != torch.float32:
        raise TypeError(f"TileKernels' MoE gate takes fp32 logits (this case: {logits.dtype})")
    if num_shared_experts not in SHARED_EXPERTS:
        raise TypeError(f"TileKernels' MoE gate takes 0, 1 or 2 shared experts (this case: {num_shared_experts})")
    scores = torch.empty_like(logits) if return_scores else None
    topk_idx, topk_weights = _moe_topk_gate_forward(
        logits, num_topk, num_shared_experts > 0, num_shared_experts, routed_scaling_factor, 0,
        scoring_func="sqrtsoftplus", mask=mask, bias=bias, scores=scores)
    return (topk_idx, topk_weights, scores) if return_scores else (topk_idx, topk_weights)


def moe_topk_gate_backward(scores: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                           grad_topk_weights: torch.Tensor, scoring: str, renormalize: bool = True,
                           routed_scaling_factor: float = 1.0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """TileKernels' ``moe_topk_gate_backward`` with tileplug's arguments (sqrtsoftplus, renormalised;
    its ``mask`` belongs to an auxiliary-loss term tileplug's op has not, so a mask is refused)."""
    _sqrtsoftplus_gate(scoring, renormalize)
    if mask is not None:
        raise TypeError("TileKernels' gate backward takes a mask only for its auxiliary-loss term (this case sets one)")
    return _moe_topk_gate_backward(scores, topk_idx, topk_weights, grad_topk_weights, routed_scaling_factor,
                                   scoring_func="sqrtsoftplus")
