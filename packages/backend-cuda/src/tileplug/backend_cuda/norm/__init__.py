"""CUDA kernels of the norm family (TileLang): one module per op over the shared row tile
(``rows``: loads, the reference-order reduction, stores), specs in ``spec``, launchers in
``kernels``, the backward ops' row-blocked weight/bias reduction in ``backward``."""

from tileplug.backend_cuda.norm.table import LayerNorm, LayerNormBackward, RmsNorm, RmsNormBackward, RmsNormPerTokenCast


def make_kernels() -> dict:
    """op name → kernel object (fresh)."""
    return {
        "rms_norm": RmsNorm(),
        "layer_norm": LayerNorm(),
        "rms_norm_per_token_cast": RmsNormPerTokenCast(),
        "rms_norm_backward": RmsNormBackward(),
        "layer_norm_backward": LayerNormBackward(),
    }


__all__ = ["LayerNorm", "LayerNormBackward", "RmsNorm", "RmsNormBackward", "RmsNormPerTokenCast", "make_kernels"]
