"""Reference ``rms_norm_per_token_cast``: literally the composition of the reference
``rms_norm`` and the reference ``per_token_cast`` (the fusion rule of SPEC §4 in code)."""

from __future__ import annotations

import dataclasses

import torch

from tileplug.core.contracts.norm import NormCall, NormInputs, NormOutputs
from tileplug.core.contracts.quant import QuantInputs, QuantOutputs
from tileplug.reference.norm.rms_norm import rms_norm
from tileplug.reference.quant.per_token_cast import per_token_cast


def rms_norm_per_token_cast(call: NormCall, inputs: NormInputs, outputs: NormOutputs) -> None:
    x = inputs.x
    y = outputs.y if outputs.y is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rms_norm(call, inputs, NormOutputs(y, outputs.residual_out))
    cast = dataclasses.replace(call.quant, tokens=call.tokens, device=call.device)
    per_token_cast(cast, QuantInputs(y.reshape(x.shape[0], -1)), QuantOutputs(outputs.q, outputs.sf))
