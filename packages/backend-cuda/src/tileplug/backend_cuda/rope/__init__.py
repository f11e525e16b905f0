"""CUDA kernels of the RoPE family (TileLang): one module per op over the shared rotation
macros (``rotation``) and slot geometry (``spec``); compilation is the backend's ``jit``."""

from tileplug.backend_cuda.rope.apply_rotary import ApplyRotary
from tileplug.backend_cuda.rope.rms_norm_rope import RmsNormRope


def make_kernels() -> dict:
    """op name → kernel object, fresh (each holds its own launcher cache)."""
    return {"apply_rotary": ApplyRotary(), "rms_norm_rope": RmsNormRope()}


__all__ = ["ApplyRotary", "RmsNormRope", "make_kernels"]
