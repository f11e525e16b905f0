"""Reference ``swiglu_backward``: :func:`tileplug.reference.swiglu.formulas.backward`, ``grad_x``
rounded once to x's dtype, ``grad_topk_weights`` in the compute dtype."""

from __future__ import annotations

from tileplug.core.contracts.swiglu import SwigluCall, SwigluGradients, SwigluInputs
from tileplug.reference.swiglu.formulas import backward


def swiglu_backward(call: SwigluCall, inputs: SwigluInputs, outputs: SwigluGradients) -> None:
    grad_x, grad_weights = backward(call, inputs)
    outputs.grad_x.copy_(grad_x.to(call.input_dtype))
    if outputs.grad_topk_weights is not None:
        outputs.grad_topk_weights.copy_(grad_weights)
