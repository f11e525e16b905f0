"""Reference ``nearest_cast`` (docs/spec.md §10.2): round to nearest even, an e4m3 result
saturating at ±448 first (PyTorch's own conversion gives NaN past 448: here only NaN does);
widening and identity conversions are exact."""

from __future__ import annotations

import torch

from tileplug.core.call import NoOutputs
from tileplug.core.contracts.cast import NearestCastCall, NearestCastInputs
from tileplug.core.quant.formats import saturate_e4m3


def nearest_cast(call: NearestCastCall, inputs: NearestCastInputs, outputs: NoOutputs) -> None:
    """``result`` = ``x`` converted to its dtype."""
    x = inputs.x
    if call.target == torch.float8_e4m3fn and call.source != torch.float8_e4m3fn:
        converted = saturate_e4m3(x)  # NaN passes the clamp unchanged
    else:
        converted = x.to(call.target)
    inputs.result.copy_(converted)
