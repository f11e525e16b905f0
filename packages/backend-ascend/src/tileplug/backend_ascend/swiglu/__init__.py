"""Ascend SwiGLU kernels (SPEC §8): one module per op over the shared (row, column tile) kernel
(:mod:`.row_kernel`), its specialisation (:mod:`.spec`) and the SwiGLU math (:mod:`.macros`)."""

from tileplug.backend_ascend.swiglu import swiglu, swiglu_backward, swiglu_per_token_cast

KERNELS = {
    "swiglu": swiglu.KERNEL,
    "swiglu_per_token_cast": swiglu_per_token_cast.KERNEL,
    "swiglu_backward": swiglu_backward.KERNEL,
}
