"""CUDA ``per_channel_cast`` (groups ``g × 1``, g in 32/128; UE8M0 packed along tokens).

Tile: one group row — 16 warps × ``g / 16`` rows per thread (bf16 read as int32 pairs) — by 32 lanes × one 128-bit load
of columns; each column's amax is reduced over the thread's rows, then across warps in
shared memory. Rows past ``T`` are never read (a partial last group covers only valid rows).
"""

from __future__ import annotations

from tileplug.backend_cuda.quant.kernels import QuantKernel, tile_override
from tileplug.core.contracts.quant import QuantCall

WARPS = 16
MIN_BLOCKS_PER_SM = 2  # caps registers so two tiles share an SM (one loads while one stores)


class PerChannelCast(QuantKernel):
    op = "per_channel_cast"
    tile_op = "per_channel"

    def geometry(self, call: QuantCall) -> tuple[int, int, int, bool]:
        g = call.cast.block[0]
        warps, _, min_blocks = tile_override("per_channel", (WARPS, 0, MIN_BLOCKS_PER_SM))
        warps = min(warps, g)
        return warps, g // warps, min_blocks, True
