"""Ascend RoPE kernels: one module per op over the shared row macros (:mod:`tileplug.backend_ascend.rows`)."""

from tileplug.backend_ascend.rope import apply_rotary

KERNELS = {
    "apply_rotary": apply_rotary.KERNEL,
}
