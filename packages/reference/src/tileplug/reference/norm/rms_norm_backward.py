"""Reference ``rms_norm_backward``: SPEC §5, the weight gradient summed over rows in a fixed order."""

from __future__ import annotations

from tileplug.core.contracts.norm import NormBackwardInputs, NormCall, NormGradients
from tileplug.core.norm.formulas import rms_norm_backward_rows
from tileplug.reference.norm.rows import as_rows, write_rows


def rms_norm_backward(call: NormCall, inputs: NormBackwardInputs, outputs: NormGradients) -> None:
    grad_x, grad_weight = rms_norm_backward_rows(
        as_rows(inputs.grad_y), as_rows(inputs.x), inputs.weight, inputs.rstd.reshape(-1), call.weight_offset,
        call.out_scale, as_rows(inputs.grad_residual_out))
    write_rows(outputs.grad_x, grad_x)
    if grad_weight is not None:
        outputs.grad_weight.copy_(grad_weight)
