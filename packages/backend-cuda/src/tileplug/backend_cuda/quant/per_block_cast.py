"""CUDA ``per_block_cast`` (groups ``bm × bn``, each side 16/32/64/128) and its sf-only /
precomputed-sf variants.

Tile: one group row — 8 warps × ``bm / 8`` rows per thread — by 32 lanes × one 128-bit
load of columns (a bf16 row is read as int32 pairs: one register holds two values, so two
128-row tiles fit an SM's registers). All of a thread's rows are loaded before any math and stay in registers: the
amax (thread rows → group lanes by shuffle → warps through shared memory) and the quantize
pass read ``x`` from DRAM once. Any token count: a partial last block row covers only the
valid rows.
"""

from __future__ import annotations

from tileplug.backend_cuda.quant.kernels import QuantKernel, tile_override
from tileplug.core.contracts.quant import QuantCall

WARPS = 8
MIN_BLOCKS_PER_SM = 2  # ≤ 128 registers: two tiles share an SM (one loads while one stores)


class PerBlockCast(QuantKernel):
    op = "per_block_cast"
    tile_op = "per_block"

    def geometry(self, call: QuantCall) -> tuple[int, int, int, bool]:
        bm = call.cast.block[0]
        warps, _, min_blocks = tile_override("per_block", (WARPS, 0, MIN_BLOCKS_PER_SM))
        warps = min(warps, bm)
        if call.quantized_input is not None:
            min_blocks = 1  # 16 values a row per thread: the register cap of 2 CTAs/SM would spill
        return warps, bm // warps, min_blocks, True
