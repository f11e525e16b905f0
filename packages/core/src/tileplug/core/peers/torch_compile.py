"""Plain PyTorch formulations of the norm and RoPE ops under ``torch.compile`` — the
"torch.compile" peer the issues name (what a user writes without a kernel library), which
differs from ``bench``'s own ``torch.compile(reference)`` row: the reference spells out
tileplug's exact rounding points, this is the usual model code.

Each function is compiled once per process (``torch.compile`` recompiles per new shape as
usual; the bench warms up before timing). Out of place only: cases asking for ``out=``,
statistics or a residual written back are "not comparable".
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary", "layer_norm", "rms_norm"]


def _refuse(name: str, value: object, default: object) -> None:
    if value is not default and value != default:
        raise TypeError(f"the plain PyTorch formulation has no '{name}' (this case sets it)")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None,
              weight_offset: float) -> torch.Tensor:
    s = x.float() if residual is None else x.float() + residual.float()
    y = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.float() + weight_offset)
    return y.to(x.dtype)


def _layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                residual: torch.Tensor | None) -> torch.Tensor:
    s = x.float() if residual is None else x.float() + residual.float()
    y = torch.nn.functional.layer_norm(s, s.shape[-1:], None if weight is None else weight.float(),
                                       None if bias is None else bias.float(), eps)
    return y.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> None:
    """Rotate the first ``2·cos.shape[-1]`` channels of ``x`` ``[..., N, D]`` in place."""
    half = cos.shape[-1]
    rotated = x[..., : 2 * half].float()
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # one angle per token, every head
    if interleaved:
        first, second = rotated[..., 0::2], rotated[..., 1::2]
    else:
        first, second = rotated[..., :half], rotated[..., half:]
    out_first, out_second = first * cos - second * sin, second * cos + first * sin
    if interleaved:
        x[..., : 2 * half] = torch.stack((out_first, out_second), dim=-1).flatten(-2).to(x.dtype)
    else:
        x[..., : 2 * half] = torch.cat((out_first, out_second), dim=-1).to(x.dtype)


def _apply_rotary(query: torch.Tensor, cache: torch.Tensor, key: torch.Tensor | None, positions: torch.Tensor,
                  interleaved: bool, conjugate: bool) -> None:
    half = cache.shape[1] // 2
    cos, sin = cache[positions, :half], cache[positions, half:]
    if conjugate:
        sin = -sin
    _rotate(query, cos, sin, interleaved)
    if key is not None:
        _rotate(key, cos, sin, interleaved)


_compiled: dict[str, object] = {}


def _compiled_function(name: str, function: object) -> object:
    if name not in _compiled:
        _compiled[name] = torch.compile(function)
    return _compiled[name]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
             residual: torch.Tensor | None = None, weight_offset: float = 0.0, out_scale: float = 1.0,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
             return_rstd: bool = False) -> torch.Tensor:
    """``x · rsqrt(mean(x²) + eps) · (weight + offset)`` in fp32, compiled (residual added first)."""
    for name, value, default in (("out_scale", out_scale, 1.0), ("out", out, None),
                                 ("residual_out", residual_out, None), ("return_rstd", return_rstd, False)):
        _refuse(name, value, default)
    return _compiled_function("rms_norm", _rms_norm)(x, weight, eps, residual, weight_offset)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
               residual_out: torch.Tensor | None = None, return_stats: bool = False) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` in fp32, compiled (residual added first)."""
    for name, value, default in (("out", out, None), ("residual_out", residual_out, None),
                                 ("return_stats", return_stats, False)):
        _refuse(name, value, default)
    return _compiled_function("layer_norm", _layer_norm)(x, weight, bias, eps, residual)


def apply_rotary(query: torch.Tensor, cos_sin_cache: torch.Tensor, key: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, interleaved: bool = False, conjugate: bool = False,
                 seqlen_offset: int = 0) -> None:
    """RoPE in place on ``[T, N, D]`` / ``[B, S, N, D]``: the cache rows gathered per token,
    the rotation in fp32, compiled."""
    if positions is None:
        leading = query.shape[:-2]
        positions = torch.arange(leading[-1], device=query.device).expand(leading)
    positions = positions.long() + seqlen_offset
    _compiled_function("apply_rotary", _apply_rotary)(query, cos_sin_cache, key, positions, interleaved, conjugate)
