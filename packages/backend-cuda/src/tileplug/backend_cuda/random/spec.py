"""What a CUDA random-number kernel is specialised on, derived from a ``RandomCall``.

A draw's element count is a runtime value; a spec fixes the op (uniform or normal), the values'
dtype and whether every thread's whole run of values is stored with 128-bit stores (the values'
data pointer 16-byte aligned: checked per call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tileplug.backend_cuda.tuning import tuning_choice

TL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
THREADS = 256
RUN_BYTES = {"fill_rand": 32, "fill_randn": 64}
"""Bytes of values one thread writes (16-byte stores), by op. Measured on an H100 (2^28 values, eager µs,
2026-12-06, ``tests/gpu/probe_random_bandwidth.py``), 32 / 64 bytes: ``fill_randn`` fp32 602.9 / 582.6
(``torch.randn`` 596.2), bf16 577.1 / 561.2; ``fill_rand`` fp32 449.4 / 786.7 (with the wide product, see
:attr:`RandomKernelSpec.wide_product`), bf16 226.0 / 290.2. The longer run spreads a thread's fixed cost
(the generator's state, the key schedule, its index) over twice the values: ``fill_randn`` fp32 60 → 54
SASS instructions a value; it takes 80 registers (3 CTAs an SM)."""
RUN_BYTES_VARIABLE = "TILEPLUG_CUDA_RANDOM_RUN_BYTES"
"""``32`` or ``64``: the bytes a thread of ``fill_rand`` / ``fill_randn`` writes (default :data:`RUN_BYTES`
of the op; read when a kernel is prepared; a run other than the op's default is in the kernel's name)."""
RUN_BYTES_CHOICES = ("32", "64")
WORDS_PER_BLOCK = 4
BOX_MULLER_VARIABLE = "TILEPLUG_CUDA_RANDN_BOX_MULLER"
"""How ``fill_randn`` evaluates Box–Muller in fp64: ``reduced`` (the default:
``fill_randn.box_muller_reduced``, a few fp64 FMAs a function, within 2^-43 of the reference's fp64
values; 2^28 fp32 values in 698 us on an H100 against 1514 us, 2026-12-05) or ``library`` (CUDA's
``log1p``, ``sqrt``, ``cospi``, ``sinpi``: the default before); the kernel's name says which."""
BOX_MULLERS = ("library", "reduced")
BOX_MULLER = "reduced"


def box_muller() -> str:
    """:data:`BOX_MULLER`, or what :data:`BOX_MULLER_VARIABLE` names (read when a kernel is prepared)."""
    return tuning_choice(BOX_MULLER_VARIABLE, BOX_MULLER, BOX_MULLERS)


def run_bytes(op: str) -> int:
    """:data:`RUN_BYTES` of ``op``, or what :data:`RUN_BYTES_VARIABLE` names."""
    return int(tuning_choice(RUN_BYTES_VARIABLE, str(RUN_BYTES[op]), RUN_BYTES_CHOICES))


@dataclass(frozen=True)
class RandomKernelSpec:
    """``op``: fill_rand / fill_randn; ``dtype``: the values' TileLang dtype;
    ``vectorize``: 128-bit stores of whole runs; ``box_muller``: how ``fill_randn`` evaluates
    its transform (:data:`BOX_MULLER_VARIABLE`; None for the other ops, which have none); ``run_bytes``:
    the bytes a thread writes (None: the op's :data:`RUN_BYTES`)."""

    op: str
    dtype: str = "float32"
    vectorize: bool = True
    box_muller: str | None = None
    run_bytes: int | None = None

    def __post_init__(self) -> None:
        # an absent run is the op's default, so that a spec equals (and indexes as) the table's of the same kernel
        if self.run_bytes is None and self.op in RUN_BYTES:
            object.__setattr__(self, "run_bytes", RUN_BYTES[self.op])

    def build(self):
        """The TileLang ``PrimFunc`` (``tileplug.backend_cuda.jit``), built by the op's module."""
        import importlib

        return importlib.import_module(f"tileplug.backend_cuda.random.{self.op}").build(self)

    @property
    def vector_buffers(self) -> tuple[str, ...]:
        """Buffers loaded 128 bits at a time: none (a draw loads only the seed and the offset; its
        128-bit path is the stores of ``values``, which the compile test checks on its own)."""
        return ()

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def blocks_per_thread(self) -> int:
        """Philox blocks one thread computes (its run of ``4 · blocks`` consecutive values)."""
        return self.run_bytes // (WORDS_PER_BLOCK * self.itemsize)

    @property
    def wide_product(self) -> bool:
        """Whether the Philox rounds take each 32 × 32 → 64-bit product as one ``mul.wide.u32``
        (``philox.DEVICE_HELPERS``) rather than ``__umulhi`` and a 32-bit product: fewer
        instructions (``fill_randn`` fp32 544 → 504 SASS for 8 values), and on an H100 (2026-12-06)
        ``fill_randn`` fp32 698 → 583 µs for 2^28 values with the other changes of that day,
        ``fill_rand`` bf16 279 → 226; but ``fill_rand`` fp32 346 → 449, so that kernel keeps the split
        product (not understood: it was the one kernel slower with fewer instructions)."""
        return not (self.op == "fill_rand" and self.dtype == "float32")

    @property
    def name(self) -> str:
        short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[self.dtype]
        name = f"{self.op}_{short}_{'v128' if self.vectorize else 'scalar'}_t{THREADS}"
        if self.run_bytes != RUN_BYTES[self.op]:
            name += f"_run{self.run_bytes}"
        return name + "_reduced" if self.box_muller == "reduced" else name
