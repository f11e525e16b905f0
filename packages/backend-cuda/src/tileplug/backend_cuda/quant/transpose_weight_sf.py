"""CUDA ``transpose_weight_sf`` (docs/spec.md §11): weights' fp32 block scales → the packed
UE8M0, MN-major ``sf0`` / ``sf1`` DeepGEMM reads. One launch writes every output of up to
64 weights of a call (``weight_scale_kernels`` holds the TileLang kernel). Nothing here imports
TileLang.

The kernel takes each weight as its three data pointers and its ``G``, ``R``, ``C`` (scalar
arguments: no view, no tensor check per weight on the host), so it is specialised only on the
block size, on a capacity of weight slots (the launch's weight count rounded up to a power of
two; the unused slots are zeros and get no CTA) and on the rank of the first weight's scales,
the one tensor it takes (the launch's device and stream). A launch takes up to
:data:`MOST_SLOTS` weights. Core hands out outputs it allocated
or checked (``out=``): 16-byte aligned, of the layout the kernel writes. An empty weight has
nothing to write and is left out of the launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tileplug.backend_cuda import jit
from tileplug.core.contracts.quant_reblock import WeightScaleCall

Launcher = Callable[[Any, Any], None]
SLOT_ARGUMENTS = 6
"""Scalar arguments per weight slot (``weight_scale_kernels.WEIGHT_ARGUMENTS``)."""
MOST_SLOTS = 64
"""Weights one launch takes at most (a call with more launches once per 64). Every slot adds 36
bytes of kernel arguments (CUDA takes 32 KB) and a leaf to six select trees: 64 slots lower in
about 3 s and 256 in 20 s (2-core machine), so 64 bounds the first call's compile."""


@dataclass(frozen=True)
class WeightScaleSpec:
    """``block_size``: the weight block side (16, 32, 64, 128); ``capacity``: weight slots of
    the launch (a power of two); ``anchor_groups``: the first weight's scales are stacked
    ``[G, R, C]`` (else ``[R, C]``)."""

    block_size: int
    capacity: int = 1
    anchor_groups: bool = False

    def build(self):
        """The TileLang ``PrimFunc`` (``tileplug.backend_cuda.jit``)."""
        from tileplug.backend_cuda.quant import weight_scale_kernels

        return weight_scale_kernels.build(self)

    @property
    def name(self) -> str:
        return (f"transpose_weight_sf_bs{self.block_size}_w{self.capacity}{'_g' if self.anchor_groups else ''}"
                "_t256")

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

    @staticmethod
    def _launches(call: WeightScaleCall) -> list[list[int]]:
        """The weights of each launch: those with something to write, :data:`MOST_SLOTS` at a time
        (none for a call whose every weight is empty)."""
        written = [index for index, shape in enumerate(call.shapes) if 0 not in shape]
        return [written[start:start + MOST_SLOTS] for start in range(0, len(written), MOST_SLOTS)]

    @staticmethod
    def _spec_of(call: WeightScaleCall, weights: list[int]) -> WeightScaleSpec:
        """The specialisation of a launch of ``weights``: slots for their count rounded up to a
        power of two, the first one's rank."""
        return WeightScaleSpec(call.block_size, 1 << (len(weights) - 1).bit_length(), len(call.shapes[weights[0]]) == 3)

    def spec(self, call: WeightScaleCall) -> WeightScaleSpec:
        """The first launch's specialisation (that of one 2-D weight for a call whose every weight is
        empty, which launches nothing)."""
        return self.specs(call)[0]

    def specs(self, call: WeightScaleCall) -> list[WeightScaleSpec]:
        launches = self._launches(call) or [[0]]
        return list(dict.fromkeys(self._spec_of(call, weights) for weights in launches))

    def source(self, call: WeightScaleCall, arch: str = jit.DEFAULT_ARCH) -> str:
        return jit.lower_source(self.spec(call), arch)

    def __call__(self, call: WeightScaleCall, inputs: Any, outputs: Any) -> None:
        self.prepare(call)(inputs, outputs)

    def prepare(self, call: WeightScaleCall) -> Launcher:
        from tileplug.backend_cuda.quant.weight_scale_kernels import chunks, weight_arguments

        launches = []
        for weights in self._launches(call):
            spec = self._spec_of(call, weights)
            grid = [max(chunks(call.block_size, call.shapes[index]) for index in weights), len(weights)]
            unused = [0] * (SLOT_ARGUMENTS * (spec.capacity - len(weights)))
            launches.append((jit.entry(spec), weights, grid, unused))

        def launch(inputs: Any, outputs: Any) -> None:
            for layout, weights, grid, unused in launches:
                arguments = [inputs[weights[0]], *grid]
                for index in weights:
                    arguments += weight_arguments(inputs[index], outputs[2 * index], outputs[2 * index + 1])
                layout(*arguments, *unused)

        return launch
