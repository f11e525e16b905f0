"""The CUDA element-wise casts' shared kernel object and specialisation: ``nearest_cast`` and
``stochastic_cast`` (docs/spec.md §10.2) are one flat pass over ``x`` and ``result``.

Thread ``i`` owns elements ``i·R … i·R + R − 1`` of the flat tensors, ``R`` chosen so that its
loads and stores are whole 128-bit accesses (``R = 16 / the smaller itemsize``): it loads its
run of ``x``, converts it (``element_kernels`` holds the TileLang kernels) and stores it. The
stochastic cast draws Philox blocks ``i·R/(4k) …`` for its run (``k`` random fields a word: 2 for
fp32 → bf16, 4 for fp32 → e4m3 and bf16 → e4m3; element ``j`` rounds with field ``j mod k``
of word ``j // k``), its last CTA advancing the offset (as ``fill_rand``: one launch). 128-bit
loads and stores when ``x`` and ``result`` are both 16-byte aligned (checked per call),
element by element otherwise. Nothing here imports TileLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from tileplug.backend_cuda import jit
from tileplug.core.contracts.cast import RANDOM_FIELD_BITS
from tileplug.backend_cuda.random.arrivals import arrival_counter
from tileplug.backend_cuda.random.spec import THREADS, WORDS_PER_BLOCK
from tileplug.backend_cuda.random.table import VECTOR_BYTES, AlignedEntry

TL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "float8_e4m3fn"}
TORCH_DTYPES = {name: dtype for dtype, name in TL_DTYPES.items()}
SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float8_e4m3fn": "e4m3"}
ITEMSIZES = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}
WORD_BITS = 32
RUN_BYTES = 16
"""Bytes of the narrower of ``x`` and ``result`` one thread moves: one 128-bit access."""

Launcher = Callable[[Any, Any], None]


@dataclass(frozen=True)
class ElementCastSpec:
    """``op``: nearest_cast / stochastic_cast; ``source`` / ``target``: TileLang dtypes of ``x``
    and ``result``; ``vectorize``: 128-bit loads and stores of whole runs. The element count
    is a runtime value."""

    op: str
    source: str
    target: str
    vectorize: bool = True

    def build(self):
        """The TileLang ``PrimFunc`` (``tileplug.backend_cuda.jit``)."""
        from tileplug.backend_cuda.quant import element_kernels

        return element_kernels.BUILDS[self.op](self)

    @property
    def dtype(self) -> str:
        """What a run stores (``random.philox.RunLayout``): the target."""
        return self.target

    @property
    def vector_buffers(self) -> tuple[str, ...]:
        """Buffers whose every load is 128 bits wide: none, since a run that the element count
        cuts short is loaded element by element in the same kernel. The compile test checks the
        whole-run 128-bit loads of ``x`` and stores of ``result`` on its own."""
        return ()

    @property
    def values_per_thread(self) -> int:
        """A thread's run of elements: one 128-bit access of the narrower dtype."""
        return RUN_BYTES // min(ITEMSIZES[self.source], ITEMSIZES[self.target])

    @property
    def field_bits(self) -> int:
        """The random bits an element of a stochastic cast takes (core's ``RANDOM_FIELD_BITS``)."""
        return RANDOM_FIELD_BITS[TORCH_DTYPES[self.source], TORCH_DTYPES[self.target]]

    @property
    def fields_per_word(self) -> int:
        """Elements one word of the draw serves (1 at 24 bits: the word's top 24)."""
        return WORD_BITS // self.field_bits

    @property
    def blocks_per_thread(self) -> int:
        """A thread's Philox blocks: its run over the ``4k`` elements a block serves (the nearest
        cast draws none)."""
        per_block = WORDS_PER_BLOCK * (self.fields_per_word if self.op == "stochastic_cast" else 1)
        return self.values_per_thread // per_block

    @property
    def name(self) -> str:
        form = "v128" if self.vectorize else "scalar"
        return f"{self.op}_{SHORT_NAMES[self.source]}_to_{SHORT_NAMES[self.target]}_{form}_t{THREADS}"


class ElementCast:
    """An element-wise cast on CUDA: ``supports``, ``specs``, ``source``, ``prepare``. ``advances``:
    the op's kernel advances a generator's offset (``inputs.offset``, with its arrival counter)."""

    op = ""
    advances = False

    def supports(self, call: Any) -> str | None:
        return None  # every pair of the contract, any element count (int64 indices)

    def spec(self, call: Any, vectorize: bool = True) -> ElementCastSpec:
        return ElementCastSpec(self.op, TL_DTYPES[call.source], TL_DTYPES[call.target], vectorize)

    def specs(self, call: Any) -> list:
        """The two load/store forms."""
        return [self.spec(call), self.spec(call, vectorize=False)]

    def source(self, call: Any, arch: str = jit.DEFAULT_ARCH) -> str:
        return jit.lower_source(self.spec(call), arch)

    def __call__(self, call: Any, inputs: Any, outputs: Any) -> None:
        self.prepare(call)(inputs, outputs)

    def prepare(self, call: Any) -> Launcher:
        cast = AlignedEntry(self.spec(call), self.spec(call, vectorize=False))
        if not self.advances:

            def launch(inputs: Any, outputs: Any) -> None:
                result, x = inputs.result.view(-1), inputs.x.view(-1)
                cast((result.data_ptr() | x.data_ptr()) % VECTOR_BYTES == 0, result, x)

            return launch

        def launch_and_advance(inputs: Any, outputs: Any) -> None:
            result, x = inputs.result.view(-1), inputs.x.view(-1)
            offset = inputs.offset
            cast((result.data_ptr() | x.data_ptr()) % VECTOR_BYTES == 0, result, x, inputs.seed, offset,
                 arrival_counter(offset))

        return launch_and_advance
