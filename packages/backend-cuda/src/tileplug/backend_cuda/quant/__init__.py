"""CUDA kernels of the quantization family (TileLang): one module per op, shared tile
kernel (``grouped``), scale math macros (``sf_math``); compilation is the backend's ``jit``."""

from tileplug.backend_cuda.quant.cast_back import CastBack
from tileplug.backend_cuda.quant.nearest_cast import NearestCast
from tileplug.backend_cuda.quant.per_block_cast import PerBlockCast
from tileplug.backend_cuda.quant.per_block_cast_lossless import PerBlockCastLossless
from tileplug.backend_cuda.quant.per_channel_cast import PerChannelCast
from tileplug.backend_cuda.quant.per_token_cast import PerTokenCast, PerTokenCastAndCastBack
from tileplug.backend_cuda.quant.stochastic_cast import StochasticCast
from tileplug.backend_cuda.quant.transpose_weight_sf import TransposeWeightSf


def make_kernels() -> dict:
    """op name → kernel object, fresh (each holds its own launcher cache)."""
    return {
        "per_token_cast": PerTokenCast(),
        "per_block_cast": PerBlockCast(),
        "per_channel_cast": PerChannelCast(),
        "per_block_cast_lossless": PerBlockCastLossless(),
        "cast_back": CastBack(),
        "per_token_cast_and_cast_back": PerTokenCastAndCastBack(),
        "stochastic_cast": StochasticCast(),
        "nearest_cast": NearestCast(),
        "transpose_weight_sf": TransposeWeightSf(),
    }


__all__ = ["CastBack", "NearestCast", "PerBlockCast", "PerBlockCastLossless", "PerChannelCast", "PerTokenCast", "PerTokenCastAndCastBack",
           "StochasticCast", "TransposeWeightSf", "make_kernels"]
