"""Ascend kernel of ``cast_back`` (every mode and input kind it has): the shared pipelined tile
kernel of :mod:`tileplug.backend_ascend.quant.tile_kernel` specialised for this op's groups."""

from __future__ import annotations

from tileplug.backend_ascend.quant.common import GroupedKernel


class Kernel(GroupedKernel):
    op = "cast_back"


KERNEL = Kernel()
