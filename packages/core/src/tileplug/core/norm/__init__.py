"""The norm family's numeric authority in plain PyTorch (SPEC §5, docs/spec.md "Norms"):
the per-row RMSNorm / LayerNorm forward and backward formulas with every rounding point,
used by the reference backend, by the fused ops built on them (RMSNorm + RoPE) and by the
tests. See :mod:`tileplug.core.norm.formulas`."""

from tileplug.core.norm.formulas import (
    column_sum,
    compute_dtype,
    layer_norm_backward_rows,
    layer_norm_rows,
    residual_sum,
    rms_norm_backward_rows,
    rms_norm_rows,
    rms_rstd,
    row_sum,
    scalar,
)

__all__ = [
    "column_sum",
    "compute_dtype",
    "layer_norm_backward_rows",
    "layer_norm_rows",
    "residual_sum",
    "rms_norm_backward_rows",
    "rms_norm_rows",
    "rms_rstd",
    "row_sum",
    "scalar",
]
