"""Reference ``swiglu_per_token_cast``: literally the reference ``swiglu`` with an fp32 output
followed by the reference ``per_token_cast`` of it (the fusion rule of SPEC §4 in code); the
scale bytes of padding rows are then zeroed (their ``q`` is already zero: ``y`` is 0 there)."""

from __future__ import annotations

import dataclasses

import torch

from tileplug.core.contracts.quant import QuantInputs, QuantOutputs
from tileplug.core.contracts.swiglu import SWIGLU, SwigluCall, SwigluInputs, SwigluOutputs
from tileplug.reference.quant.per_token_cast import per_token_cast
from tileplug.reference.swiglu.formulas import valid_rows
from tileplug.reference.swiglu.swiglu import swiglu


def swiglu_per_token_cast(call: SwigluCall, inputs: SwigluInputs, outputs: SwigluOutputs) -> None:
    x = inputs.x
    y = torch.empty(x.shape[0], call.hidden, dtype=torch.float32, device=x.device)
    forward_call = dataclasses.replace(call, op=SWIGLU, name=SWIGLU, quant=None, output_dtype=torch.float32)
    swiglu(forward_call, inputs, SwigluOutputs(y))
    cast = dataclasses.replace(call.quant, tokens=call.tokens, device=call.device)
    per_token_cast(cast, QuantInputs(y), QuantOutputs(outputs.q, outputs.sf))
    valid = valid_rows(call, inputs)
    if valid is not None:
        outputs.sf[:x.shape[0]][~valid.squeeze(1)] = 0
