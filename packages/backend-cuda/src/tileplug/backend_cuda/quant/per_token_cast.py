"""CUDA ``per_token_cast`` (groups ``1 × g``, g in 16/32/64/128) and its sf-only /
precomputed-sf variants, for bf16/fp32 and re-quantized ``(xq, sf)`` inputs.

Tile: 4 warps × 4 rows per thread = 16 rows × (32 lanes × one 128-bit load) columns; a group
is ``g / VEC`` adjacent lanes reduced with xor-shuffles (see ``grouped.py``). With fp32
scales (not ``round_sf``) the group's lanes share out the rows' divisions (``spread``): each
lane runs ``ceil(2 · rows / lanes)`` exact divisions instead of two per row, and the
inverses are shuffled back.
"""

from __future__ import annotations

from tileplug.backend_cuda.quant.kernels import QuantKernel, tile_override
from tileplug.core.contracts.quant import QuantCall

WARPS = 4
ROWS_PER_THREAD = 4


class PerTokenCast(QuantKernel):
    op = "per_token_cast"
    tile_op = "per_token"
    spread = True

    def geometry(self, call: QuantCall) -> tuple[int, int, int]:
        return tile_override("per_token", (WARPS, ROWS_PER_THREAD, 1))
