"""Reference ``swiglu``: :func:`tileplug.reference.swiglu.formulas.forward`, rounded once."""

from __future__ import annotations

from tileplug.core.contracts.swiglu import SwigluCall, SwigluInputs, SwigluOutputs
from tileplug.reference.swiglu.formulas import forward


def swiglu(call: SwigluCall, inputs: SwigluInputs, outputs: SwigluOutputs) -> None:
    outputs.y.copy_(forward(call, inputs).to(call.output_dtype))
