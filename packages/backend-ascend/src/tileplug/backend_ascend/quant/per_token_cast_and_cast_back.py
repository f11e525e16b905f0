"""Ascend kernel of ``per_token_cast_and_cast_back`` (fake quantization in place): the shared
pipelined tile kernel of :mod:`tileplug.backend_ascend.quant.tile_kernel` in its fake-quant mode
(each 1 x g group quantized and dequantized in registers, written back over x; no q / sf in GM)."""

from __future__ import annotations

from tileplug.backend_ascend.quant.common import GroupedKernel


class Kernel(GroupedKernel):
    op = "per_token_cast_and_cast_back"


KERNEL = Kernel()
