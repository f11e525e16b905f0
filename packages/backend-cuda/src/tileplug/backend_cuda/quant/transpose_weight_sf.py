"""CUDA ``transpose_weight_sf`` (docs/spec.md §11): weights' fp32 block scales → the packed
UE8M0, MN-major ``sf0`` / ``sf1`` DeepGEMM reads. One launch per scale tensor writes both of its
outputs (``weight_scale_kernels`` holds the TileLang kernel); the kernel is specialised on the
block size only (G, R and C are runtime values). Nothing here imports
TileLang.

The outputs are handed to the kernel in their memory order, ``[G, P, N]`` (sf0) and
``[G, P, K]`` (sf1), which ``transpose_sf1`` does not change (it only returns another view of the
same integers). Every store is 128 bits: core hands out 16-byte aligned outputs (fresh, or an
``out=`` it checked), and each row of ``N`` or ``K`` integers, a multiple of 16, starts aligned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from tileplug.backend_cuda import jit
from tileplug.core.contracts.quant_reblock import WeightScaleCall

Launcher = Callable[[Any, Any], None]


@dataclass(frozen=True)
class WeightScaleSpec:
    """``block_size``: the weight block side (16, 32, 64, 128)."""

    block_size: int

    def build(self):
        """The TileLang ``PrimFunc`` (``tileplug.backend_cuda.jit``)."""
        from tileplug.backend_cuda.quant import weight_scale_kernels

        return weight_scale_kernels.build(self)

    @property
    def name(self) -> str:
        return f"transpose_weight_sf_bs{self.block_size}_t256"

    @property
    def vector_buffers(self) -> tuple[str, ...]:
        """Buffers loaded 128 bits at a time: none (the scales are gathered; the 128-bit path is
        the stores of sf0 / sf1, which the compile test checks on its own)."""
        return ()


def memory_order(sf: torch.Tensor, groups: bool) -> torch.Tensor:
    """An output ``[*g, M, P]`` with strides ``(M·P, 1, M)`` (or its ``[*g, P, M]`` view) as the
    contiguous ``[G, P, M]`` the kernel writes."""
    if sf.stride(-1) != 1:
        sf = sf.transpose(-1, -2)
    return sf if groups else sf.unsqueeze(0)


class TransposeWeightSf:
    """``transpose_weight_sf`` on CUDA: ``supports``, ``specs``, ``source``, ``prepare``."""

    op = "transpose_weight_sf"

    def supports(self, call: WeightScaleCall) -> str | None:
        return None  # every block size and shape of the contract (int64 indices)

    def spec(self, call: WeightScaleCall) -> WeightScaleSpec:
        return WeightScaleSpec(call.block_size)

    def specs(self, call: WeightScaleCall) -> list[WeightScaleSpec]:
        return [self.spec(call)]

    def source(self, call: WeightScaleCall, arch: str = jit.DEFAULT_ARCH) -> str:
        return jit.lower_source(self.spec(call), arch)

    def __call__(self, call: WeightScaleCall, inputs: Any, outputs: Any) -> None:
        self.prepare(call)(inputs, outputs)

    def prepare(self, call: WeightScaleCall) -> Launcher:
        layout = jit.entry(self.spec(call))
        weights = [(index, len(shape) == 3) for index, shape in enumerate(call.shapes) if 0 not in shape]

        def launch(inputs: Any, outputs: Any) -> None:
            for index, groups in weights:
                scales = inputs[index] if groups else inputs[index].unsqueeze(0)
                sf0 = memory_order(outputs[2 * index], groups)
                sf1 = memory_order(outputs[2 * index + 1], groups)
                layout(scales, sf0, sf1)

        return launch
