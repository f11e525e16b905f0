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
keep for decoded values are free. GPU sweep 2026-12-04 (H200, MXFP4 1 x 32 -> 128 x 128, packed
UE8M0, H = 7168, CUDA-graph us at T = 4096 / 65536; TileKernels 49.3 / 692.0): 16 warps x 8 rows
x 2 CTAs/SM 34.0 / 471.7, 8 x 16 x 2 37.9 / 513.7, 16 x 8 x 1 40.3 / 586.5, and per_block_cast's
e2m1-input tile (8 x 16 x 1, before the e2m1 decoder was built from bits) 74.4 / 1378.9."""

SMALL_T_WARPS = 16
"""The small-T block and channel tiles (at most ``kernels.SMALL_TOKENS`` rows): two rows of 16
lanes per warp, so a tile is half as wide and twice as many CTAs cover a T that fills few group
rows (T = 128, H = 7168, 128 x 128: 28 CTAs of the full-width tile on 132 SMs)."""

_PER_TOKEN = PerTokenCast()


class PerBlockCastLossless(QuantKernel):
    op = LOSSLESS

    def spec(self, call: QuantCall) -> KernelSpec:
        rows, cols = call.cast.block
        if rows == 1:  # 1 x bn groups: the per-token tile, as it re-quantizes (xq, sf) inputs
            return _PER_TOKEN.spec(call)
        warps, _, min_blocks = tile_override("lossless", (WARPS, 0, _min_blocks(call)))
        warps = min(warps, rows)
        return make_spec(call, _tile_op(call), warps, rows // warps, min_blocks)

    def small_tokens_spec(self, call: QuantCall) -> KernelSpec | None:
        rows = call.cast.block[0]
        if rows == 1:
            return None
        warps = min(SMALL_T_WARPS, rows // 2)
        return make_spec(call, _tile_op(call), warps, rows // (2 * warps), _min_blocks(call), lanes_per_row=16)


def _min_blocks(call: QuantCall) -> int:
    """CTAs per SM the tile is compiled for: two for block tiles (<= 64 registers, no spill); one
    for channel tiles, whose 16 column keys per thread spilled 16-56 bytes under the cap of two
    (ptxas, tests/test_cuda_compile.py)."""
    return 1 if call.cast.block[1] == 1 else MIN_BLOCKS_PER_SM


def _tile_op(call: QuantCall) -> str:
    """The tile of ``bm × bn`` output groups with ``bm > 1``: per channel (bn = 1) or per block."""
    return "per_channel" if call.cast.block[1] == 1 else "per_block"
