"""CUDA ``per_channel_cast`` (groups ``g × 1``, g in 32/128; UE8M0 packed along tokens).

Tile: one group row — 8 warps × ``g / 8`` rows per thread (bf16 read as int32 pairs) — by 32 lanes × one 128-bit load
of columns; each column's amax is reduced over the thread's rows, then across warps in
shared memory by one thread per (column, inverse | scale) job (``spread``): one exact
division per thread, the scale row stored coalesced, the inverses read back from shared
memory. Rows past ``T`` are never read (a partial last group covers only valid rows).
"""

from __future__ import annotations

import torch

from tileplug.backend_cuda.quant.kernels import QuantKernel, count_override, tile_override
from tileplug.backend_cuda.quant.spec import KernelSpec, make_spec
from tileplug.core.contracts.quant import QuantCall

WARPS = 8  # GPU sweep (H200, T=65536, g=128): 8 warps x 16 rows, 1 CTA/SM = 94.3% of copy; 16 x 8, 2 CTAs/SM = 93.3%
# Two tiles per SM (≤ 64 registers at 512 threads) fit the plain e4m3 cast of a bf16 or
# fp32 input without spilling; the power-of-two scale paths, e2m1 and re-quantized inputs
# need more, so those run one 512-thread tile per SM (ptxas reports checked by
# tests/test_cuda_compile.py).
MIN_BLOCKS_PER_SM = 1
LANES_PER_ROW = 32  # a warp's slot is one row of 32 lanes (4 / 8 / 16: 32 / LANES rows of that many lanes)
SMALL_T_WARPS = 16  # the small-T tile (two rows of 16 lanes per warp): 16 warps x g / 32 rows, 2 CTAs/SM
# Tried 2026-12-02 (ninth session, H200, 128 x 1 e4m3, H = 7168): the tile staged in shared memory
# instead of registers (each 128-bit load folded into the column amax, then written to a 32 KB
# slot-major tile of 8 warps x 8 half-warp rows; 62 registers, 4 CTAs/SM) ran at 87.7% of copy at
# T = 65536 against 95.2% for this register tile (4096: 29.56 against 25.47 us, graph); with 2 CTAs/SM
# 87.9%. Removed again.


class PerChannelCast(QuantKernel):
    op = "per_channel_cast"
    tile_op = "per_channel"
    spread = True
    # H100 sweep 2026-12-07 (fortieth session, 128 x 1 e4m3, H = 7168, GB/s; graph us): the small-T tile
    # 465 / 1882 / 2986 at T = 128 / 1024 / 4096 against 360 / 1721 / 2906 for the default (graph at 4096
    # 32.93 against 33.75), 2919 against 2980 at 16384
    small_tokens = 4096

    def small_tokens_spec(self, call: QuantCall) -> KernelSpec | None:
        # GPU sweep 2026-12-01 (H200, 128 x 1 e4m3, H = 7168, % of copy): two rows of 16 lanes per
        # warp (128-column tiles), 16 warps x 4 rows x 2 CTAs/SM: 12.2% / 48.8% at T = 128 / 1024
        # against 9.2% / 47.0% for the default tile, 88.1% against 96.6% at T = 65536.
        if not (self._lean(call) and call.input_dtype == torch.bfloat16):
            return None
        g = call.cast.block[0]
        warps = min(SMALL_T_WARPS, g // 2)
        return make_spec(call, self.tile_op, warps, g // (2 * warps), 2, True, spread=True, lanes_per_row=16)

    @staticmethod
    def _lean(call: QuantCall) -> bool:
        return call.quantized_input is None and call.cast.fmt.name == "e4m3" and not call.cast.round_sf

    def lanes_per_row(self, call: QuantCall) -> int:
        return count_override(self.tile_op, "lanes_per_row", LANES_PER_ROW, allowed=(4, 8, 16, 32))

    def geometry(self, call: QuantCall) -> tuple[int, int, int, bool]:
        g = call.cast.block[0]
        rows_per_slot = 32 // self.lanes_per_row(call)
        warps, _, min_blocks = tile_override("per_channel", (WARPS, 0, MIN_BLOCKS_PER_SM))
        warps = min(warps, g // rows_per_slot)
        if not self._lean(call):
            min_blocks = 1
        return warps, g // (warps * rows_per_slot), min_blocks, True
