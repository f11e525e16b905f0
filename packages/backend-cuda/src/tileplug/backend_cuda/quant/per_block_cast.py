"""CUDA ``per_block_cast`` (groups ``bm × bn``, each side 16/32/64/128) and its sf-only /
precomputed-sf variants.

Tile: one group row — 8 warps × ``bm / 8`` rows per thread — by 32 lanes × one 128-bit load
of columns. All of a thread's rows are loaded before any math and stay in registers: the
amax (thread rows → group lanes by shuffle → warps through shared memory) and the quantize
pass read ``x`` from DRAM once. Any token count: a partial last block row covers only the
valid rows.
"""

from __future__ import annotations

from tileplug.backend_cuda.quant.kernels import QuantKernel
from tileplug.core.contracts.quant import QuantCall

WARPS = 8


class PerBlockCast(QuantKernel):
    op = "per_block_cast"
    tile_op = "per_block"

    def geometry(self, call: QuantCall) -> tuple[int, int]:
        bm = call.cast.block[0]
        warps = min(WARPS, bm)
        return warps, bm // warps
