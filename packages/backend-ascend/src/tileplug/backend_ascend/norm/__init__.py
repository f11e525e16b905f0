"""Ascend norm kernels: one module per op over the shared row kernel (:mod:`.row_kernel`) and
row macros (:mod:`tileplug.backend_ascend.rows`); the backward ops over :mod:`.backward`."""

from tileplug.backend_ascend.norm import (
    layer_norm,
    layer_norm_backward,
    rms_norm,
    rms_norm_backward,
    rms_norm_per_token_cast,
)

KERNELS = {
    "rms_norm": rms_norm.KERNEL,
    "layer_norm": layer_norm.KERNEL,
    "rms_norm_per_token_cast": rms_norm_per_token_cast.KERNEL,
    "rms_norm_backward": rms_norm_backward.KERNEL,
    "layer_norm_backward": layer_norm_backward.KERNEL,
}
