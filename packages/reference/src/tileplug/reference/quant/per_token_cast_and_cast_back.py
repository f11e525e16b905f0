"""Reference per_token_cast_and_cast_back: the definition itself, ``per_token_cast`` (fp32
row-major scales) then ``cast_back`` to x's dtype, written over ``x``."""

from __future__ import annotations

import dataclasses

from tileplug.core.contracts import quant as contracts
from tileplug.core.contracts.quant import MODE_CAST, QuantCall, QuantInputs, QuantOutputs
from tileplug.core.quant.formats import OUTPUT_DTYPES
from tileplug.core.quant.layouts import CUDA_LAYOUT
from tileplug.reference.quant.grouped_cast import cast_back, grouped_cast

_OUTPUT_NAMES = {dtype: name for name, dtype in OUTPUT_DTYPES.items()}


def per_token_cast_and_cast_back(call: QuantCall, inputs: QuantInputs, outputs: QuantOutputs) -> None:
    """Quantize ``inputs.x`` [T, H] as ``per_token_cast`` with the call's groups and flags, then
    dequantize into it (only its ``[T, H]`` elements are written)."""
    x = inputs.x
    # (the route's call is the signature's: its token count may be another call's)
    cast_call = dataclasses.replace(call, op="per_token_cast", name="per_token_cast", mode=MODE_CAST,
                                    tokens=x.shape[0], device=x.device)
    quantized = cast_call.allocate(CUDA_LAYOUT)  # fp32 row-major scales: cast_back reads their values as stored
    grouped_cast(cast_call, inputs, quantized)
    back_call, back_inputs = contracts.cast_back((quantized.q, quantized.sf), _OUTPUT_NAMES[x.dtype], call.cast.block)
    cast_back(back_call, back_inputs, QuantOutputs(x, None))
