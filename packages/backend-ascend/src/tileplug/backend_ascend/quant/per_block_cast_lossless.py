"""Ascend kernel of ``per_block_cast_lossless`` (docs/spec.md §11): the shared pipelined tile kernel
of :mod:`tileplug.backend_ascend.quant.tile_kernel` in its lossless mode (``TileSpec.lossless``),
the re-quantization of an e2m1 ``(xq, sf)`` input with each element keyed by its input scale's
exponent; the tile of the output groups (per token ``1 x bn``, per channel ``bm x 1``, per block)."""

from __future__ import annotations

from tileplug.backend_ascend.quant.common import GroupedKernel
from tileplug.core.contracts.quant_reblock import LOSSLESS


class Kernel(GroupedKernel):
    op = LOSSLESS


KERNEL = Kernel()
