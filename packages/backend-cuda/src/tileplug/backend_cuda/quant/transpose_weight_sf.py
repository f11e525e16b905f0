"""CUDA ``transpose_weight_sf`` (docs/spec.md §11): weights' fp32 block scales → the packed
UE8M0, MN-major ``sf0`` / ``sf1`` DeepGEMM reads. One launch per scale tensor writes both of its
outputs (``weight_scale_kernels`` holds the TileLang kernel); G, R and C are runtime values.
Nothing here imports TileLang.

The kernel takes the scales and both outputs as the op hands them out (no view is made on the
host: five views per weight, a few µs of host time each, were more than the launch), so it is
specialised on the block size, on stacked ``[G, R, C]`` scales or not and on ``transpose_sf1``
(another view of the same integers); it writes in the outputs' memory order, ``[G, P, N]``
(sf0) and ``[G, P, K]`` (sf1).
Every store is 128 bits: core hands out 16-byte aligned outputs (fresh, or an ``out=`` it
checked), and each row of ``N`` or ``K`` integers, a multiple of 16, starts aligned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tileplug.backend_cuda import jit
from tileplug.core.contracts.quant_reblock import WeightScaleCall

Launcher = Callable[[Any, Any], None]


@dataclass(frozen=True)
class WeightScaleSpec:
    """``block_size``: the weight block side (16, 32, 64, 128); ``groups``: stacked
    ``[G, R, C]`` scales (else ``[R, C]``); ``transpose_sf1``: sf1 handed out as its
    ``[*g, P1, K]`` view. The kernel takes the tensors as the op returns them."""

    block_size: int
    groups: bool = False
    transpose_sf1: bool = False

    def build(self):
        """The TileLang ``PrimFunc`` (``tileplug.backend_cuda.jit``)."""
        from tileplug.backend_cuda.quant import weight_scale_kernels

        return weight_scale_kernels.build(self)

    @property
    def name(self) -> str:
        return (f"transpose_weight_sf_bs{self.block_size}{'_g' if self.groups else ''}"
                f"{'_sf1t' if self.transpose_sf1 else ''}_t256")

    @property
    def vector_buffers(self) -> tuple[str, ...]:
        """Buffers loaded 128 bits at a time: none (the scales are gathered; the 128-bit path is
        the stores of sf0 / sf1, which the compile test checks on its own)."""
        return ()


class TransposeWeightSf:
    """``transpose_weight_sf`` on CUDA: ``supports``, ``specs``, ``source``, ``prepare``."""

    op = "transpose_weight_sf"

    def supports(self, call: WeightScaleCall) -> str | None:
        return None  # every block size and shape of the contract (int64 indices)

    def _spec(self, call: WeightScaleCall, groups: bool) -> WeightScaleSpec:
        return WeightScaleSpec(call.block_size, groups, call.transpose_sf1)

    def spec(self, call: WeightScaleCall) -> WeightScaleSpec:
        """The specialisation of the call's first weight (``specs``: every one it runs)."""
        return self.specs(call)[0]

    def specs(self, call: WeightScaleCall) -> list[WeightScaleSpec]:
        return list(dict.fromkeys(self._spec(call, len(shape) == 3) for shape in call.shapes))

    def source(self, call: WeightScaleCall, arch: str = jit.DEFAULT_ARCH) -> str:
        return jit.lower_source(self.spec(call), arch)

    def __call__(self, call: WeightScaleCall, inputs: Any, outputs: Any) -> None:
        self.prepare(call)(inputs, outputs)

    def prepare(self, call: WeightScaleCall) -> Launcher:
        entries = {spec: jit.entry(spec) for spec in self.specs(call)}
        weights = [(index, entries[self._spec(call, len(shape) == 3)])
                   for index, shape in enumerate(call.shapes) if 0 not in shape]

        def launch(inputs: Any, outputs: Any) -> None:
            for index, layout in weights:
                layout(inputs[index], outputs[2 * index], outputs[2 * index + 1])

        return launch
