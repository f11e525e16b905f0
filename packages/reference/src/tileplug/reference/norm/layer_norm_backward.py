"""Reference ``layer_norm_backward``: SPEC §5, weight and bias gradients summed over rows in a fixed order."""

from __future__ import annotations

from tileplug.core.contracts.norm import NormBackwardInputs, NormCall, NormGradients
from tileplug.core.norm.formulas import layer_norm_backward_rows
from tileplug.reference.norm.rows import as_rows, write_rows


def layer_norm_backward(call: NormCall, inputs: NormBackwardInputs, outputs: NormGradients) -> None:
    grad_x, grad_weight, grad_bias = layer_norm_backward_rows(
        as_rows(inputs.grad_y), as_rows(inputs.x), inputs.weight, inputs.mean.reshape(-1), inputs.rstd.reshape(-1),
        as_rows(inputs.grad_residual_out))
    write_rows(outputs.grad_x, grad_x)
    if grad_weight is not None:
        outputs.grad_weight.copy_(grad_weight)
    outputs.grad_bias.copy_(grad_bias)
