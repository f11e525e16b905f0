"""CUDA kernels of the norm family (TileLang): one module per op over the shared row tile
(``rows``: loads, two-stage reduction, stores), specs in ``spec``, launchers in ``kernels``."""

from tileplug.backend_cuda.norm.layer_norm import LayerNorm
from tileplug.backend_cuda.norm.rms_norm import RmsNorm
from tileplug.backend_cuda.norm.rms_norm_backward import RmsNormBackward
from tileplug.backend_cuda.norm.rms_norm_per_token_cast import RmsNormPerTokenCast


def make_kernels() -> dict:
    """op name → kernel object (fresh)."""
    return {
        "rms_norm": RmsNorm(),
        "layer_norm": LayerNorm(),
        "rms_norm_per_token_cast": RmsNormPerTokenCast(),
        "rms_norm_backward": RmsNormBackward(),
    }


__all__ = ["LayerNorm", "RmsNorm", "RmsNormBackward", "RmsNormPerTokenCast", "make_kernels"]
