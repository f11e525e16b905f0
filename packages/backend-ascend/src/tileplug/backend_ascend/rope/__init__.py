"""Ascend RoPE kernels: one module per op over the shared row macros (:mod:`tileplug.backend_ascend.rows`)."""

from tileplug.backend_ascend.rope import apply_rotary, rms_norm_rope

KERNELS = {
    "apply_rotary": apply_rotary.KERNEL,
    "rms_norm_rope": rms_norm_rope.KERNEL,
}
