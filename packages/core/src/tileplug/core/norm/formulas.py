"""Per-row norm formulas, exact to the contract (SPEC §5, docs/spec.md "Norms").

Every function takes rows ``[R, D]`` (any strides; a 3-D ``[T, N, D]`` input is ``R = T·N``
rows) and computes in the *compute dtype*: fp32 for bf16 / fp16 / fp32 inputs, fp64 for
fp64 inputs (the dtype ``torch.autograd.gradcheck`` needs). The rounding points are the
contract's:

- ``s = x + residual`` is rounded to ``x.dtype`` (that rounded sum is ``residual_out``);
- statistics are computed over the true ``D`` with :func:`row_sum`, a fixed pairwise tree
  of elementwise IEEE additions: the bytes of a row's statistics depend on that row alone
  (any ``T``, any position, any run, any device with IEEE float arithmetic);
- ``rstd = 1 / sqrt(mean + eps)``: a correctly rounded square root, then a correctly
  rounded reciprocal;
- the output is rounded once, to ``x.dtype``; scalar arguments (``eps``, ``weight_offset``,
  ``out_scale``) are first rounded to the compute dtype.

A backend may reduce in another order (a warp tree): its statistics are compared within
4 ulp of fp32, its outputs within 1 ulp of the output dtype (SPEC §4-5).
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype norm statistics and intermediates are computed in: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def scalar(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``value`` rounded to ``dtype`` (a 0-d tensor): the explicit rounding of a Python float
    (a fill on the device: no host-to-device copy, so CUDA graph capture works)."""
    return torch.full((), value, dtype=dtype, device=device)


def row_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim ``[..., D] → [...]`` in a fixed order: a pairwise halving tree.

    With ``w`` the current width and ``h = w // 2``: element ``i`` (``i < h``) becomes
    ``v[i] + v[i + h]``, an odd last element is carried unchanged to the next level, until
    one value is left. Each level is one elementwise IEEE addition, so the result depends on
    the row's values alone (never on the row count or on how a library splits a reduction).
    ``D = 0`` gives 0.
    """
    width = values.shape[-1]
    if width == 0:
        return values.new_zeros(values.shape[:-1])
    while width > 1:
        half = width // 2
        paired = values[..., :half] + values[..., half:2 * half]
        values = torch.cat((paired, values[..., 2 * half:]), dim=-1) if width % 2 else paired
        width = values.shape[-1]
    return values[..., 0]


def column_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum over rows ``[R, D] → [D]`` in the fixed order of :func:`row_sum` (the weight
    gradient's reduction: deterministic, the same order on every device and run)."""
    return row_sum(values.transpose(0, 1))


def residual_sum(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``s = x + residual`` rounded to ``x.dtype`` (added in the compute dtype), or ``x``."""
    if residual is None:
        return x
    work = compute_dtype(x.dtype)
    return (x.to(work) + residual.to(work)).to(x.dtype)


def rms_rstd(s: torch.Tensor, eps: float) -> torch.Tensor:
    """``rstd = 1 / sqrt(sum(s²) / D + eps)`` per row ``[R, D] → [R]`` in the compute dtype."""
    work = compute_dtype(s.dtype)
    values = s.to(work)
    mean_square = row_sum(values * values) / s.shape[-1]
    return torch.sqrt(mean_square + scalar(eps, work, s.device)).reciprocal()


def _weight_factor(weight: torch.Tensor | None, weight_offset: float, out_scale: float, work: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """``(float(w) + weight_offset) · out_scale`` ``[D]`` in the compute dtype (no weight:
    ``out_scale`` alone, a 0-d tensor). The Gemma ``+ 1`` is taken here, never in bf16."""
    scale = scalar(out_scale, work, device)
    if weight is None:
        return scale
    return (weight.to(work) + scalar(weight_offset, work, device)) * scale


def rms_norm_rows(s: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0,
                  out_scale: float = 1.0, output_dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of rows ``s`` ``[R, D]`` (already the residual sum) → ``(y, rstd)``.

    ``y = round_to(output_dtype, (s · rstd) · ((float(w) + weight_offset) · out_scale))``,
    ``output_dtype`` defaulting to ``s.dtype`` (pass the compute dtype to get ``y`` before its
    rounding, as a fused op that keeps working on it does); ``rstd`` ``[R]`` in the compute dtype.
    """
    work = compute_dtype(s.dtype)
    rstd = rms_rstd(s, eps)
    normalized = s.to(work) * rstd.unsqueeze(-1)
    y = normalized * _weight_factor(weight, weight_offset, out_scale, work, s.device)
    return y.to(output_dtype or s.dtype), rstd


def layer_norm_rows(s: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm of rows ``s`` ``[R, D]`` → ``(y, mean, rstd)``.

    ``mean = sum(s) / D``; ``var = sum((s − mean)²) / D`` (two passes, never ``E[s²] − E[s]²``);
    ``rstd = 1 / sqrt(var + eps)``; ``y = round_to(s.dtype, ((s − mean) · rstd) · float(w) + float(b))``
    (no weight: no multiplication; no bias: no addition, so a ``−0`` stays ``−0``).
    """
    work = compute_dtype(s.dtype)
    values = s.to(work)
    width = s.shape[-1]
    mean = row_sum(values) / width
    centered = values - mean.unsqueeze(-1)
    variance = row_sum(centered * centered) / width
    rstd = torch.sqrt(variance + scalar(eps, work, s.device)).reciprocal()
    y = centered * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.to(work)
    if bias is not None:
        y = y + bias.to(work)
    return y.to(s.dtype), mean, rstd


def rms_norm_backward_rows(grad_y: torch.Tensor, s: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                           weight_offset: float = 0.0, out_scale: float = 1.0,
                           grad_residual_out: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm backward over rows ``[R, D]`` → ``(grad_x [R, D] in s.dtype, grad_weight [D] | None)``.

    ``x̂ = s · rstd``; ``g = grad_y · ((float(w) + offset) · out_scale)``;
    ``grad_x = round_to(s.dtype, rstd · (g − x̂ · (sum(g · x̂) / D)) + grad_residual_out)``;
    ``grad_weight = column_sum((grad_y · out_scale) · x̂)`` in the compute dtype (None without weight).
    """
    work = compute_dtype(s.dtype)
    rstd_column = rstd.to(work).unsqueeze(-1)
    normalized = s.to(work) * rstd_column
    upstream = grad_y.to(work)
    g = upstream * _weight_factor(weight, weight_offset, out_scale, work, s.device)
    projection = row_sum(g * normalized) / s.shape[-1]
    grad_x = rstd_column * (g - normalized * projection.unsqueeze(-1))
    if grad_residual_out is not None:
        grad_x = grad_x + grad_residual_out.to(work)
    grad_weight = None
    if weight is not None:
        grad_weight = column_sum((upstream * scalar(out_scale, work, s.device)) * normalized)
    return grad_x.to(s.dtype), grad_weight


def layer_norm_backward_rows(grad_y: torch.Tensor, s: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor,
                             rstd: torch.Tensor, grad_residual_out: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """LayerNorm backward over rows ``[R, D]`` → ``(grad_x, grad_weight | None, grad_bias)``.

    ``x̂ = (s − mean) · rstd``; ``g = grad_y · float(w)`` (``grad_y`` without weight);
    ``grad_x = round_to(s.dtype, rstd · ((g − sum(g) / D) − x̂ · (sum(g · x̂) / D)) + grad_residual_out)``;
    ``grad_weight = column_sum(grad_y · x̂)``, ``grad_bias = column_sum(grad_y)`` in the compute dtype.
    """
    work = compute_dtype(s.dtype)
    width = s.shape[-1]
    rstd_column = rstd.to(work).unsqueeze(-1)
    normalized = (s.to(work) - mean.to(work).unsqueeze(-1)) * rstd_column
    upstream = grad_y.to(work)
    g = upstream * weight.to(work) if weight is not None else upstream
    mean_g = row_sum(g) / width
    projection = row_sum(g * normalized) / width
    grad_x = rstd_column * ((g - mean_g.unsqueeze(-1)) - normalized * projection.unsqueeze(-1))
    if grad_residual_out is not None:
        grad_x = grad_x + grad_residual_out.to(work)
    grad_weight = column_sum(upstream * normalized) if weight is not None else None
    return grad_x.to(s.dtype), grad_weight, column_sum(upstream)
