"""Reference ``layer_norm``: SPEC §5 (two-pass variance), outputs written after all are computed."""

from __future__ import annotations

from tileplug.core.contracts.norm import NormCall, NormInputs, NormOutputs
from tileplug.core.norm.formulas import layer_norm_rows, residual_sum
from tileplug.reference.norm.rows import as_rows, write_rows


def layer_norm(call: NormCall, inputs: NormInputs, outputs: NormOutputs) -> None:
    s = residual_sum(as_rows(inputs.x), as_rows(inputs.residual))
    y, mean, rstd = layer_norm_rows(s, inputs.weight, inputs.bias, call.eps)
    write_rows(outputs.residual_out, s)
    write_rows(outputs.y, y)
    write_rows(outputs.mean, mean)
    write_rows(outputs.rstd, rstd)
