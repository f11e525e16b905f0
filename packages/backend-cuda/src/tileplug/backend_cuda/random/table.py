"""The kernel objects of the CUDA random-number ops (``fill_rand``, ``fill_randn``): a draw is
one launch of the op's kernel over the values, whose last CTA advances the offset (``philox``,
with the generator's arrival counter: ``arrivals``). Nothing here imports TileLang.

A launcher is built once per call signature; per call it picks the 128-bit or the scalar
store specialisation by the values' data pointer (a contiguous view may start anywhere),
loading the scalar one at its first use. No host sync, no formatting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tileplug.backend_cuda import jit
from tileplug.backend_cuda.random.arrivals import arrival_counter
from tileplug.backend_cuda.random.spec import TL_DTYPES, RandomKernelSpec, box_muller, run_bytes
from tileplug.core.contracts.random import FILL_RANDN, RandomCall

Launcher = Callable[[Any, Any], None]
VECTOR_BYTES = 16


class RandomKernel:
    """``fill_rand`` / ``fill_randn`` on CUDA: ``supports``, ``specs``, ``source``, ``prepare``."""

    def __init__(self, op: str) -> None:
        self.op = op

    def supports(self, call: RandomCall) -> str | None:
        if call.op != self.op:
            return f"this kernel serves {self.op}, not {call.op}"
        return None

    def spec(self, call: RandomCall, vectorize: bool = True) -> RandomKernelSpec:
        normal = box_muller() if self.op == FILL_RANDN else None
        return RandomKernelSpec(self.op, TL_DTYPES[call.dtype], vectorize, normal, run_bytes(self.op))

    def specs(self, call: RandomCall) -> list:
        """The draw's two store forms."""
        return [self.spec(call), self.spec(call, vectorize=False)]

    def source(self, call: RandomCall, arch: str = jit.DEFAULT_ARCH) -> str:
        return jit.lower_source(self.spec(call), arch)

    def __call__(self, call: RandomCall, inputs: Any, outputs: Any) -> None:
        self.prepare(call)(inputs, outputs)

    def prepare(self, call: RandomCall) -> Launcher:
        draw = AlignedEntry(self.spec(call), self.spec(call, vectorize=False))

        def launch(inputs: Any, outputs: Any) -> None:
            values = inputs.values.view(-1)
            offset = inputs.offset
            draw(values.data_ptr() % VECTOR_BYTES == 0, values, inputs.seed, offset, arrival_counter(offset))

        return launch


class AlignedEntry:
    """A draw kernel's two forms as one callable: ``entry(aligned, *buffers)`` launches the
    128-bit form when ``aligned`` (every pointer it streams is 16-byte aligned), else the
    scalar form, loaded at its first use."""

    def __init__(self, aligned_spec: Any, scalar_spec: Any) -> None:
        self.aligned = jit.entry(aligned_spec)
        self.scalar_spec = scalar_spec
        self.scalar: Callable[..., None] | None = None

    def __call__(self, aligned: bool, *buffers: Any) -> None:
        if aligned:
            self.aligned(*buffers)
            return
        if self.scalar is None:
            self.scalar = jit.entry(self.scalar_spec)
        self.scalar(*buffers)
