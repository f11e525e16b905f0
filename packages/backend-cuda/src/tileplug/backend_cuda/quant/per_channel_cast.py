"""CUDA ``per_channel_cast`` (groups ``g × 1``, g in 32/128; UE8M0 packed along tokens).

Tile: one group row — 8 warps × ``g / 8`` rows per thread — by 32 lanes × one 128-bit load
of columns; each column's amax is reduced over the thread's rows, then across warps in
shared memory. Rows past ``T`` are never read (a partial last group covers only valid rows).
"""

from __future__ import annotations

from tileplug.backend_cuda.quant.kernels import QuantKernel
from tileplug.core.contracts.quant import QuantCall

WARPS = 8


class PerChannelCast(QuantKernel):
    op = "per_channel_cast"
    tile_op = "per_channel"

    def geometry(self, call: QuantCall) -> tuple[int, int]:
        g = call.cast.block[0]
        return WARPS, g // WARPS
