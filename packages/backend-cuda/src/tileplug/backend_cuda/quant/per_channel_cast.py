"""CUDA ``per_channel_cast`` (groups ``g × 1``, g in 32/128; UE8M0 packed along tokens).

Tile: one group row — 8 warps × ``g / 8`` rows per thread (bf16 read as int32 pairs) — by 32 lanes × one 128-bit load
of columns; each column's amax is reduced over the thread's rows, then across warps in
shared memory by one thread per (column, inverse | scale) job (``spread``): one exact
division per thread, the scale row stored coalesced, the inverses read back from shared
memory. Rows past ``T`` are never read (a partial last group covers only valid rows).
"""

from __future__ import annotations

from tileplug.backend_cuda.quant.kernels import QuantKernel, tile_override
from tileplug.core.contracts.quant import QuantCall

WARPS = 8  # GPU sweep (H200, T=65536, g=128): 8 warps x 16 rows, 1 CTA/SM = 94.3% of copy; 16 x 8, 2 CTAs/SM = 93.3%
# Two tiles per SM (≤ 64 registers at 512 threads) fit the plain e4m3 cast of a bf16 or
# fp32 input without spilling; the power-of-two scale paths, e2m1 and re-quantized inputs
# need more, so those run one 512-thread tile per SM (ptxas reports checked by
# tests/test_cuda_compile.py).
MIN_BLOCKS_PER_SM = 1


class PerChannelCast(QuantKernel):
    op = "per_channel_cast"
    tile_op = "per_channel"
    spread = True

    def geometry(self, call: QuantCall) -> tuple[int, int, int, bool]:
        g = call.cast.block[0]
        warps, _, min_blocks = tile_override("per_channel", (WARPS, 0, MIN_BLOCKS_PER_SM))
        warps = min(warps, g)
        lean = call.quantized_input is None and call.cast.fmt.name == "e4m3" and not call.cast.round_sf
        if not lean:
            min_blocks = 1
        return warps, g // warps, min_blocks, True
