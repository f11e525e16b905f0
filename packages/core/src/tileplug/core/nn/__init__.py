"""``torch.nn`` drop-ins computed by tileplug's ops: :class:`SwiGLU` (the activation of a
``[gate | up]`` projection, no parameters); :class:`RMSNorm` and :class:`LayerNorm`
take ``torch.nn.RMSNorm`` / ``torch.nn.LayerNorm``'s constructor arguments, hold the same
parameters (so ``load_state_dict`` works both ways) and train eager and under
``torch.compile(fullgraph=True)`` (backward through the op table). The functional forms are
in :mod:`tileplug.core.nn.functional`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tileplug.core.nn import functional
from tileplug.core.nn.functional import normalized_size

__all__ = ["LayerNorm", "RMSNorm", "SwiGLU", "functional"]


class RMSNorm(torch.nn.Module):
    """``torch.nn.RMSNorm(normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None)``:
    ``y = x / sqrt(mean(x²) + eps) · weight`` over the trailing ``normalized_shape`` dims
    (``eps=None``: ``torch.finfo(x.dtype).eps``), statistics in fp32, output in x's dtype."""

    def __init__(self, normalized_shape: int | Sequence[int], eps: float | None = None,
                 elementwise_affine: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.normalized_shape = normalized_size("RMSNorm", normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class LayerNorm(torch.nn.Module):
    """``torch.nn.LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None,
    dtype=None)``: ``y = (x − mean) / sqrt(var + eps) · weight + bias`` over the trailing dims,
    two-pass statistics in fp32, output in x's dtype."""

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.normalized_shape = normalized_size("LayerNorm", normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
            if bias:
                self.bias = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class SwiGLU(torch.nn.Module):
    """``y = silu(min(gate, c)) · clamp(up, −c, c) · routed_scaling_factor`` of ``x`` ``[..., 2H]``
    = ``[gate | up]`` → ``[..., H]`` (``clamp_value=None``: no clamp), fp32 math, output in x's
    dtype; ``forward(x, topk_weights=None)`` multiplies each row by its routed weight too."""

    def __init__(self, clamp_value: float | None = None, routed_scaling_factor: float = 1.0) -> None:
        super().__init__()
        self.clamp_value = clamp_value
        self.routed_scaling_factor = routed_scaling_factor

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor | None = None) -> torch.Tensor:
        return functional.swiglu(x, topk_weights, self.routed_scaling_factor, self.clamp_value)

    def extra_repr(self) -> str:
        return f"clamp_value={self.clamp_value}, routed_scaling_factor={self.routed_scaling_factor}"
