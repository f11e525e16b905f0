"""Functional norms with ``torch.nn.functional``'s signatures, computed by tileplug's ops
(any leading dims; ``normalized_shape`` the trailing dims, flattened into one ``D``), and
the SwiGLU activation (any leading dims). Differentiable through the op table: the backward
is ``rms_norm_backward`` / ``layer_norm_backward`` / ``swiglu_backward``, eager and under
``torch.compile(fullgraph=True)``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tileplug.core.errors import ContractError


def normalized_size(op: str, shape: int | Sequence[int]) -> tuple[int, ...]:
    """``normalized_shape`` as a tuple of ints (an int is one dim)."""
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not dims or not all(type(d) is int and d >= 1 for d in dims):
        raise ContractError(op, "normalized_shape", "an int >= 1 or a non-empty sequence of them", shape)
    return dims


def _as_rows(op: str, input: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(input, torch.Tensor) or tuple(input.shape[input.dim() - len(dims):]) != dims:
        got = tuple(input.shape) if isinstance(input, torch.Tensor) else input
        raise ContractError(op, "input", f"a tensor whose trailing dims are normalized_shape {dims}", got)
    return input.reshape(-1, math.prod(dims))


def _flat(tensor: torch.Tensor | None, size: int) -> torch.Tensor | None:
    return None if tensor is None else tensor.reshape(size)


def rms_norm(input: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    """``torch.nn.functional.rms_norm``: ``input`` [..., *normalized_shape]; ``eps=None`` is
    ``torch.finfo(input.dtype).eps`` as in PyTorch. Returns input's shape and dtype."""
    from tileplug.core.ops import norm

    dims = normalized_size("rms_norm", normalized_shape)
    rows = _as_rows("rms_norm", input, dims)
    if eps is None:
        eps = torch.finfo(input.dtype).eps
    return norm.rms_norm(rows, _flat(weight, rows.shape[1]), eps).reshape(input.shape)


def layer_norm(input: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """``torch.nn.functional.layer_norm``: ``input`` [..., *normalized_shape] → input's shape and dtype."""
    from tileplug.core.ops import norm

    dims = normalized_size("layer_norm", normalized_shape)
    rows = _as_rows("layer_norm", input, dims)
    size = rows.shape[1]
    return norm.layer_norm(rows, _flat(weight, size), _flat(bias, size), eps).reshape(input.shape)


def swiglu(input: torch.Tensor, topk_weights: torch.Tensor | None = None, routed_scaling_factor: float = 1.0,
           clamp_value: float | None = None, expert_ends: torch.Tensor | None = None, expert_alignment: int = 128,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """SwiGLU of ``input`` ``[..., 2H]`` = ``[gate | up]`` (any leading dims, flattened into rows)
    → ``[..., H]``: ``silu(min(gate, c)) · clamp(up, −c, c) · (w · routed_scaling_factor)`` as
    :func:`tileplug.core.ops.swiglu` computes it (``topk_weights`` ``[rows]`` and
    ``expert_ends`` refer to the flattened rows). Differentiable w.r.t. ``input`` and
    ``topk_weights``; the backward is ``swiglu_backward`` through the op table."""
    from tileplug.core.ops.swiglu import swiglu as swiglu_op

    if not isinstance(input, torch.Tensor) or input.dim() < 1:
        raise ContractError("swiglu", "input", "a tensor [..., 2H]", input)
    rows = input.reshape(-1, input.shape[-1])
    y = swiglu_op(rows, out_dtype, topk_weights, routed_scaling_factor, clamp_value, expert_ends, expert_alignment)
    return y.reshape(*input.shape[:-1], y.shape[-1])
