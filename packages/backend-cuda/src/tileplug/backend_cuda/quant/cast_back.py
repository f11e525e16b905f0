"""CUDA ``cast_back``: ``float(q) * sf`` of any (q, sf) layout §3 produces, rounded once to
bf16 / fp32.

Tile: 8 warps × 1 row per thread, each thread owning 4 chunks of its row (16 e4m3 bytes, or
8 bytes of e2m1 pairs, each; ``32 × 16`` columns apart), column tiles of a row tile adjacent
in launch order (``grid_cols``). A lane reads its group's scale (any sf encoding and
strides) and stores 16 results per chunk. Per-channel sf inputs (a scale per column: 16
per chunk) keep one chunk per thread.
"""

from __future__ import annotations

from tileplug.backend_cuda.quant.kernels import QuantKernel, tile_override
from tileplug.core.contracts.quant import QuantCall

# GPU sweep (tests/gpu/sweep_tiles.py, H200, per-token e4m3 → bf16, H = 7168, T = 4096 / 16384 /
# 65536, % of copy): 8 warps x 1 row x 4 chunks, column tiles adjacent 74.9 / 89.3 / 94.1;
# the previous 8 x 4 rows x 1 chunk 70.6 / 86.8 / 91.8; a row-major grid (4 x 4) 55.5 / 66.7 / 70.3.
WARPS = 8
ROWS_PER_THREAD = 1
CHUNKS = 4


class CastBack(QuantKernel):
    op = "cast_back"
    tile_op = "cast_back"
    grid_cols = True
    inline_coords = True  # GPU sweep 2026-12-01: in registers, the stores ran at half the speed (cause not found)

    def geometry(self, call: QuantCall) -> tuple[int, int, int]:
        return tile_override("cast_back", (WARPS, ROWS_PER_THREAD, 1))

    def column_chunks(self, call: QuantCall) -> int:
        return 1 if call.quantized_input.block[1] == 1 else CHUNKS
