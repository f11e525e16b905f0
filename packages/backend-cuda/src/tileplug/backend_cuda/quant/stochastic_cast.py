"""CUDA ``stochastic_cast`` (docs/spec.md §10.2): fp32 → bf16, fp32 → e4m3, bf16 → e4m3 with
the words of one Philox draw, then the one-thread advance of the offset (as ``fill_rand``).

Thread ``i`` owns Philox blocks ``i·B … i·B + B − 1`` and so elements ``4·i·B … 4·i·B + 4B − 1``
of the flat tensors (``B`` chosen so a thread stores 16 bytes of ``result``): it loads its run
of ``x``, draws its blocks, rounds element ``j`` of the run with word ``j`` and stores the run
(``stochastic_rounding`` holds the TileLang kernel). 128-bit loads and stores when ``x`` and
``result`` are both 16-byte aligned (checked per call), element by element otherwise. Nothing
here imports TileLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from tileplug.backend_cuda import jit
from tileplug.backend_cuda.random.spec import ADVANCE, THREADS, WORDS_PER_BLOCK, RandomKernelSpec
from tileplug.backend_cuda.random.table import VECTOR_BYTES, AlignedEntry
from tileplug.core.contracts.cast import StochasticCastCall, StochasticCastInputs

TL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "float8_e4m3fn"}
SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float8_e4m3fn": "e4m3"}
ITEMSIZES = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}
RESULT_RUN_BYTES = 16
"""Bytes of ``result`` one thread writes: one 128-bit store (16 e4m3 or 8 bf16 values)."""

Launcher = Callable[[Any, Any], None]


@dataclass(frozen=True)
class StochasticCastSpec:
    """``source`` / ``target``: TileLang dtypes of ``x`` and ``result``; ``vectorize``: 128-bit
    loads and stores of whole runs. The element count is a runtime value."""

    source: str
    target: str
    vectorize: bool = True

    def build(self):
        """The TileLang ``PrimFunc`` (``tileplug.backend_cuda.jit``)."""
        from tileplug.backend_cuda.quant.stochastic_rounding import build

        return build(self)

    @property
    def dtype(self) -> str:
        """What a run stores (``random.philox.RunLayout``): the target."""
        return self.target

    @property
    def blocks_per_thread(self) -> int:
        return RESULT_RUN_BYTES // (WORDS_PER_BLOCK * ITEMSIZES[self.target])

    @property
    def name(self) -> str:
        form = "v128" if self.vectorize else "scalar"
        return f"stochastic_cast_{SHORT_NAMES[self.source]}_to_{SHORT_NAMES[self.target]}_{form}_t{THREADS}"


class StochasticCast:
    """``stochastic_cast`` on CUDA: ``supports``, ``specs``, ``source``, ``prepare``."""

    op = "stochastic_cast"

    def supports(self, call: StochasticCastCall) -> str | None:
        return None  # every pair of the contract, any element count (int64 indices)

    def spec(self, call: StochasticCastCall, vectorize: bool = True) -> StochasticCastSpec:
        return StochasticCastSpec(TL_DTYPES[call.source], TL_DTYPES[call.target], vectorize)

    def specs(self, call: StochasticCastCall) -> list:
        """The two load/store forms and the offset's advance."""
        return [self.spec(call), self.spec(call, vectorize=False), RandomKernelSpec(ADVANCE)]

    def source(self, call: StochasticCastCall, arch: str = jit.DEFAULT_ARCH) -> str:
        return "\n".join(jit.lower_source(spec, arch) for spec in (self.spec(call), RandomKernelSpec(ADVANCE)))

    def __call__(self, call: StochasticCastCall, inputs: StochasticCastInputs, outputs: Any) -> None:
        self.prepare(call)(inputs, outputs)

    def prepare(self, call: StochasticCastCall) -> Launcher:
        cast = AlignedEntry(self.spec(call), self.spec(call, vectorize=False))
        advance = jit.entry(RandomKernelSpec(ADVANCE))

        def launch(inputs: StochasticCastInputs, outputs: Any) -> None:
            result, x = inputs.result.view(-1), inputs.x.view(-1)
            aligned = (result.data_ptr() | x.data_ptr()) % VECTOR_BYTES == 0
            cast(aligned, result, x, inputs.seed, inputs.offset)
            advance(inputs.offset)

        return launch
