"""CUDA ``cast_back``: ``float(q) * sf`` of any (q, sf) layout §3 produces, rounded once to
bf16 / fp32.

Tile: 4 warps × 4 rows per thread × (32 lanes × 16 values) columns; a lane loads 16 e4m3
bytes (8 bytes of e2m1 pairs) per row, reads its group's scale (any sf encoding and
strides) and stores 16 results.
"""

from __future__ import annotations

from tileplug.backend_cuda.quant.kernels import QuantKernel, tile_override
from tileplug.core.contracts.quant import QuantCall

WARPS = 4
ROWS_PER_THREAD = 4


class CastBack(QuantKernel):
    op = "cast_back"
    tile_op = "cast_back"

    def geometry(self, call: QuantCall) -> tuple[int, int, int]:
        return tile_override("cast_back", (WARPS, ROWS_PER_THREAD, 1))
