"""Ascend norm kernels: one module per op over the shared row kernel (:mod:`.row_kernel`) and
row macros (:mod:`tileplug.backend_ascend.rows`)."""

from tileplug.backend_ascend.norm import layer_norm, rms_norm, rms_norm_per_token_cast

KERNELS = {
    "rms_norm": rms_norm.KERNEL,
    "layer_norm": layer_norm.KERNEL,
    "rms_norm_per_token_cast": rms_norm_per_token_cast.KERNEL,
}
