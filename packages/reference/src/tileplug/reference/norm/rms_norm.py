"""Reference ``rms_norm``: SPEC §5, every output computed before any is written (so ``out`` /
``residual_out`` may be ``x`` / ``residual`` themselves)."""

from __future__ import annotations

from tileplug.core.contracts.norm import NormCall, NormInputs, NormOutputs
from tileplug.core.norm.formulas import residual_sum, rms_norm_rows
from tileplug.reference.norm.rows import as_rows, write_rows


def rms_norm(call: NormCall, inputs: NormInputs, outputs: NormOutputs) -> None:
    s = residual_sum(as_rows(inputs.x), as_rows(inputs.residual))
    y, rstd = rms_norm_rows(s, inputs.weight, call.eps, call.weight_offset, call.out_scale)
    write_rows(outputs.residual_out, s)
    write_rows(outputs.y, y)
    write_rows(outputs.rstd, rstd)
