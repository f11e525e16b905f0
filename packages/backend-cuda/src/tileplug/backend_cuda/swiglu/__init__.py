"""CUDA kernels of the SwiGLU family (TileLang): one module per op (``swiglu``,
``swiglu_per_token_cast``, ``swiglu_backward``) over the shared activation macros
(``activation``) and the norm family's row tile, specs in ``spec``, launchers in ``table``."""

from tileplug.backend_cuda.swiglu.table import Swiglu, SwigluBackward, SwigluPerTokenCast


def make_kernels() -> dict:
    """op name → kernel object (fresh)."""
    return {"swiglu": Swiglu(), "swiglu_per_token_cast": SwigluPerTokenCast(), "swiglu_backward": SwigluBackward()}


__all__ = ["Swiglu", "SwigluBackward", "SwigluPerTokenCast", "make_kernels"]
