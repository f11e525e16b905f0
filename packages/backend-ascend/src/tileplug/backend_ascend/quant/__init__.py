"""Ascend quant kernels: one module per op over one shared, pipelined tile kernel;
``stochastic_cast`` and ``nearest_cast`` are built on the random family's draw kernel instead
(``random/draw.py``)."""

from tileplug.backend_ascend.quant import (cast_back, nearest_cast, per_block_cast, per_block_cast_lossless,
                                           per_channel_cast, per_token_cast, per_token_cast_and_cast_back,
                                           stochastic_cast, transpose_weight_sf)

KERNELS = {
    "per_token_cast": per_token_cast.KERNEL,
    "per_block_cast": per_block_cast.KERNEL,
    "per_block_cast_lossless": per_block_cast_lossless.KERNEL,
    "per_channel_cast": per_channel_cast.KERNEL,
    "cast_back": cast_back.KERNEL,
    "per_token_cast_and_cast_back": per_token_cast_and_cast_back.KERNEL,
    "stochastic_cast": stochastic_cast.KERNEL,
    "nearest_cast": nearest_cast.KERNEL,
    "transpose_weight_sf": transpose_weight_sf.KERNEL,
}
