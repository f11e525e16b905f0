"""CUDA ``cast_back``: ``float(q) * sf`` of any (q, sf) layout §3 produces, rounded once to
bf16 / fp32.

Tile: 8 warps × 1 row per thread, each thread owning 2 chunks of its row (16 e4m3 bytes, or
8 bytes of e2m1 pairs, each; ``32 × 16`` columns apart), column tiles of a row tile adjacent
in launch order (``grid_cols``). A lane reads its group's scale (any sf encoding and
strides) and stores 16 results per chunk. Per-channel sf inputs (a scale per column: 16
per chunk) keep one chunk per thread. Per-token sf inputs run smaller tiles at small T
(:meth:`CastBack.token_tiers`): more CTAs than SMs.
"""

from __future__ import annotations

import dataclasses

from tileplug.backend_cuda.quant.kernels import QuantKernel, tile_override
from tileplug.backend_cuda.quant.spec import KernelSpec
from tileplug.core.contracts.quant import QuantCall

# GPU sweep 2026-12-02 (tests/gpu/sweep_tiles.py --peer, H200, per-token e4m3 -> bf16, H = 7168;
# CUDA-graph us at T = 128 / 1024 / 4096 / 16384 / 65536; TileKernels 2.30 / 6.26 / 23.88 / 99.49 / 388.69):
#   8 warps x 1 row x 2 chunks, grid_cols:  2.68 / 7.59 / 24.83 / 89.65 / 345.97  (the large-T tile)
#   8 x 1 x 4 chunks (the tile before):      3.42 / 9.16 / 27.72 / 95.33 / 362.46
#   4 x 1 x 1 chunk, grid_cols:              2.55 / 6.95 / 24.76 / 91.67 / 354.78  (T <= 2048)
#   4 x 4 rows x 1 chunk, 2-D grid:          2.02 / 9.87 / 35.47 / 126.5 / 481.8   (T <= 256)
WARPS = 8
ROWS_PER_THREAD = 1
CHUNKS = 2
SMALL_TIERS = ((256, dict(warps=4, rows_per_thread=4, column_chunks=1, grid_cols=False, inline_coords=False)),
               (2048, dict(warps=4, rows_per_thread=1, column_chunks=1)))
"""(most rows, KernelSpec fields replaced) of the small-T tiers of per-token sf inputs."""


class CastBack(QuantKernel):
    op = "cast_back"
    tile_op = "cast_back"
    grid_cols = True
    # GPU sweep 2026-12-01: with the coordinates in registers the stores ran at half the speed
    # (2026-12-02 again: 802.5 against 346.3 us at T = 65536). The SASS says why: ptxas then splits
    # the first chunk's 128-bit bf16 store into four 32-bit ones (sm_90, nvcc 13.0), although that
    # kernel has 240 instructions against 400 with the inlined coordinates.
    inline_coords = True

    def geometry(self, call: QuantCall) -> tuple[int, int, int]:
        return tile_override("cast_back", (WARPS, ROWS_PER_THREAD, 1))

    def column_chunks(self, call: QuantCall) -> int:
        return 1 if call.quantized_input.block[1] == 1 else CHUNKS

    def token_tiers(self, call: QuantCall) -> list[tuple[int | None, KernelSpec]]:
        spec = self.spec(call)
        block = call.quantized_input.block
        if block[0] != 1 or block[1] == 1:  # per-block / per-channel sf inputs: one tile for every T
            return [(None, spec)]
        return [(bound, dataclasses.replace(spec, **fields)) for bound, fields in SMALL_TIERS] + [(None, spec)]
