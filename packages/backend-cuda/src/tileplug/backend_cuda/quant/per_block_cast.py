"""CUDA ``per_block_cast`` (groups ``bm × bn``, each side 16/32/64/128) and its sf-only /
precomputed-sf variants.

Tile: one group row — 16 warps × ``bm / 16`` rows per thread — by 32 lanes × one 128-bit
load of columns (a bf16 row is read as int32 pairs: one register holds two values, so two
128-row tiles fit an SM's registers). All of a thread's rows are loaded before any math and stay in registers: the
amax (thread rows → group lanes by shuffle → warps through shared memory) and the quantize
pass read ``x`` from DRAM once. Any token count: a partial last block row covers only the
valid rows.
"""

from __future__ import annotations

import torch

from tileplug.backend_cuda.quant.kernels import QuantKernel, tile_override
from tileplug.backend_cuda.quant.spec import KernelSpec, make_spec
from tileplug.core.contracts.quant import QuantCall

WARPS = 16  # GPU sweep (H200, T=65536, 128x128): 16 warps x 8 rows, 2 CTAs/SM = 93.5% of copy; 8 x 16 = 87.6%
MIN_BLOCKS_PER_SM = 2  # ≤ 128 registers: two tiles share an SM (one loads while one stores)
SMALL_T_WARPS = 16  # the small-T tile (two rows of 16 lanes per warp): 16 warps x bm / 32 rows


class PerBlockCast(QuantKernel):
    op = "per_block_cast"
    tile_op = "per_block"

    def grid_columns(self, call: QuantCall) -> bool:
        # GPU sweep 2026-12-01, 128 x 128 e4m3, 16 warps x 8 rows x 2 CTAs/SM: grid_cols 98.5% /
        # 101.7% of copy at T = 16384 / 65536 against 88.6% / 94.2% on the 2-D grid (6.6 against
        # 6.3 us at T = 128). Only on the lean path: the others run 8 warps x 2 CTAs/SM, where the
        # two registers of the tile coordinates spill 8 bytes (ptxas, tests/test_cuda_compile.py).
        return self._lean(call)

    @staticmethod
    def _lean(call: QuantCall) -> bool:
        return call.cast.fmt.name == "e4m3" and not call.cast.round_sf and call.quantized_input is None

    def small_tokens_spec(self, call: QuantCall) -> KernelSpec | None:
        # GPU sweep 2026-12-01 (H200, 128 x 128 e4m3, H = 7168, % of copy): two rows of 16 lanes
        # per warp (128-column tiles, twice the CTAs), 16 warps x 4 rows x 2 CTAs/SM: 12.3% / 48.6%
        # at T = 128 / 1024 against 9.9% / 49.5% for the default tile, 94.7% against 102.8% at T = 65536.
        if not (self._lean(call) and call.input_dtype == torch.bfloat16 and call.cast.block[1] <= 128):
            return None
        bm = call.cast.block[0]
        warps = min(SMALL_T_WARPS, bm // 2)
        return make_spec(call, self.tile_op, warps, bm // (2 * warps), MIN_BLOCKS_PER_SM, True,
                         grid_cols=True, lanes_per_row=16, philox_wide=self.philox_wide())

    def geometry(self, call: QuantCall) -> tuple[int, int, int, bool]:
        bm = call.cast.block[0]
        lean = self._lean(call)
        # The power-of-two and e2m1 paths need more registers: at 16 warps x 2 CTAs (<= 64
        # registers) they spill, so they keep 8 warps x 2 CTAs (<= 128 registers).
        warps, _, min_blocks = tile_override("per_block", (WARPS if lean else 8, 0, MIN_BLOCKS_PER_SM))
        warps = min(warps, bm)
        if call.quantized_input is not None:
            min_blocks = 1  # 16 values a row per thread: the register cap of 2 CTAs/SM would spill
        return warps, bm // warps, min_blocks, True
