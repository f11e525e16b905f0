"""The SwiGLU math of SPEC §8 with its rounding points, in the compute dtype (fp32; fp64 for fp64 x).

Forward: ``g = min(gate, c)``, ``u = clamp(up, −c, c)``, ``y = ((g · sigmoid(g)) · u) · w'``
with ``w' = w · routed_scaling_factor`` (``routed_scaling_factor`` alone without weights),
each product rounded to the compute dtype; the sigmoid is correctly rounded to fp32 (taken in
fp64 and rounded once, as the MoE scores' exp is: PyTorch's vectorized fp32 sigmoid is up to
2 ulp off and flushes below −88 to zero, which would spend the whole tolerance). Padding rows are replaced by zeros before any
arithmetic (so NaN there never reaches a result) and their results are zero. The backward's
sum over a row (``grad_topk_weights``) is the norms' pairwise halving tree: a fixed order.
"""

from __future__ import annotations

import torch

from tileplug.core.contracts.swiglu import SwigluCall, SwigluInputs
from tileplug.core.moe.formulas import correctly_rounded
from tileplug.core.norm.formulas import row_sum
from tileplug.core.swiglu.layout import valid_rows_of


def valid_rows(call: SwigluCall, inputs: SwigluInputs) -> torch.Tensor | None:
    """bool ``[N, 1]``: the rows inside some expert's range (None: no expert layout, all rows)."""
    if inputs.expert_ends is None:
        return None
    return valid_rows_of(inputs.x.shape[0], inputs.expert_ends, call.expert_alignment).unsqueeze(1)


def _only_valid(values: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    return values if valid is None else torch.where(valid, values, torch.zeros((), dtype=values.dtype,
                                                                                device=values.device))


def gate_up(call: SwigluCall, inputs: SwigluInputs, valid: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(g, u, gate_cut, up_cut)`` in the compute dtype: the clamped halves of x (padding rows
    zero) and where the clamp cut (None without a clamp)."""
    work, width = call.compute_dtype, call.hidden
    gate = _only_valid(inputs.x[:, :width].to(work), valid)
    up = _only_valid(inputs.x[:, width:].to(work), valid)
    if call.clamp_value is None:
        return gate, up, None, None
    limit = torch.tensor(call.clamp_value, dtype=work, device=gate.device)
    return torch.minimum(gate, limit), torch.clamp(up, -limit, limit), gate > limit, up.abs() > limit


def row_scale(call: SwigluCall, inputs: SwigluInputs, valid: torch.Tensor | None) -> torch.Tensor:
    """``w'`` ``[N, 1]`` (or a 0-dim scalar without weights): ``w · routed_scaling_factor``."""
    work = call.compute_dtype
    factor = torch.tensor(call.routed_scaling_factor, dtype=work, device=inputs.x.device)
    if inputs.topk_weights is None:
        return factor
    return _only_valid(inputs.topk_weights.to(work).unsqueeze(1), valid) * factor


def forward(call: SwigluCall, inputs: SwigluInputs) -> torch.Tensor:
    """``y`` ``[N, H]`` in the compute dtype (padding rows zero), before the output rounding."""
    valid = valid_rows(call, inputs)
    g, u, _, _ = gate_up(call, inputs, valid)
    y = g * correctly_rounded(torch.sigmoid, g) * u * row_scale(call, inputs, valid)
    return _only_valid(y, valid)


def backward(call: SwigluCall, inputs: SwigluInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(grad_x [N, 2H], grad_topk_weights [N] | None)`` in the compute dtype (padding rows zero)."""
    work = call.compute_dtype
    valid = valid_rows(call, inputs)
    g, u, gate_cut, up_cut = gate_up(call, inputs, valid)
    grad = _only_valid(inputs.grad_y.to(work), valid)
    scale = row_scale(call, inputs, valid)
    sigmoid = correctly_rounded(torch.sigmoid, g)
    silu = g * sigmoid
    one = torch.ones((), dtype=work, device=g.device)
    grad_gate = grad * u * scale * sigmoid * (one + g * (one - sigmoid))
    grad_up = grad * silu * scale
    zero = torch.zeros((), dtype=work, device=g.device)
    if gate_cut is not None:
        grad_gate = torch.where(gate_cut, zero, grad_gate)
        grad_up = torch.where(up_cut, zero, grad_up)
    grad_x = _only_valid(torch.cat((grad_gate, grad_up), dim=1), valid)
    if inputs.topk_weights is None:
        return grad_x, None
    factor = torch.tensor(call.routed_scaling_factor, dtype=work, device=g.device)
    grad_weights = _only_valid(row_sum(grad * silu * u).unsqueeze(1) * factor, valid)  # a fixed order: batch invariant
    return grad_x, grad_weights.squeeze(1)
