"""CUDA ``per_block_cast_lossless`` (SPEC §11): an e2m1 pair re-quantized to e4m3 in new
groups, every value kept.

The shared tile (``grouped.py``) in its lossless mode: the re-quantization of an ``(xq, sf)``
input that ``per_token_cast`` / ``per_block_cast`` / ``per_channel_cast`` run, with each
element keyed by its input scale's exponent instead of its magnitude, so a group's reduced
key is its largest input exponent and the group scale ``2^max(e_max - 6, -127)`` needs no
division. The tile is the one the output groups ask for: the per-token tile for ``1 × bn``
(its geometry for re-quantized inputs), the per-channel tile for ``bm × 1``, the per-block tile
otherwise (a geometry of their own, below).
"""

from __future__ import annotations

from tileplug.backend_cuda.quant.kernels import QuantKernel, tile_override
from tileplug.backend_cuda.quant.per_token_cast import PerTokenCast
from tileplug.backend_cuda.quant.spec import KernelSpec, make_spec
from tileplug.core.contracts.quant import QuantCall
from tileplug.core.contracts.quant_reblock import LOSSLESS

WARPS = 16
MIN_BLOCKS_PER_SM = 2
"""Block and channel tiles: 16 warps x bm / 16 rows, two CTAs per SM. The amax pass of a lossless
tile reads no value (its keys are the input scales), so the registers the re-quantization tiles
keep for decoded values are free: per_block_cast's e2m1-input tile (8 warps x 16 rows, one CTA
per SM) ran 1379 against TileKernels' 693 us at T = 65536 (H200, 128 x 128, graph)."""

_PER_TOKEN = PerTokenCast()


class PerBlockCastLossless(QuantKernel):
    op = LOSSLESS

    def spec(self, call: QuantCall) -> KernelSpec:
        rows, cols = call.cast.block
        if rows == 1:  # 1 x bn groups: the per-token tile, as it re-quantizes (xq, sf) inputs
            return _PER_TOKEN.spec(call)
        warps, _, min_blocks = tile_override("lossless", (WARPS, 0, MIN_BLOCKS_PER_SM))
        warps = min(warps, rows)
        return make_spec(call, "per_channel" if cols == 1 else "per_block", warps, rows // warps, min_blocks)
