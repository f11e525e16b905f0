"""What a CUDA SwiGLU kernel is specialised on, derived from a ``SwigluCall``.

A :class:`SwigluKernelSpec` holds compile-time constants only: the op, ``H``, dtypes,
whether routed weights, a clamp or an expert layout come with the call, the scaling factor
and clamp value (fixed per model: folded into the code), the fused cast and the row tile.
The row count ``N`` and every row stride are runtime values, so one compiled kernel serves
every batch of a configuration.

Row tile: the norm family's (``norm.spec.row_tile`` of ``H`` values of x's dtype), so a row
of ``y`` is held by ``lanes`` threads exactly as a norm row is; x ``[N, 2H]`` is read as
``[N, 2, H]`` (row 0 the gate half, row 1 the up half) through the same loads, and the
backward's ``grad_topk_weights`` row sum is the norm tile's reference-order tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tileplug.backend_cuda.norm.spec import (
    MAX_SHARED_BYTES,
    MAX_VECTORS,
    TL_DTYPES,
    VECTOR_BYTES,
    QuantSpec,
    RowTile,
    _hex,
    reduction_plan,
    row_tile,
    vector_width,
)
from tileplug.backend_cuda.tuning import tuning_choice, tuning_flag, tuning_override
from tileplug.core.contracts.swiglu import SWIGLU_BACKWARD, SwigluCall
from tileplug.core.quant.layouts import CUDA_LAYOUT

SIGMOID_VARIABLE = "TILEPLUG_CUDA_SWIGLU_BF16_SIGMOID"
"""The sigmoid of a bf16 ``y``: ``branchless`` (the default: the hardware exponential, scaled
below ``g = −80``, selected without a branch), ``guarded`` (the same value behind a branch) or
``accurate`` (the 1-ulp fp32 one); tuning on a GPU host, a guarded or branchless kernel's name
says so, so the kernel index keeps them apart."""
BF16_SIGMOIDS = ("accurate", "guarded", "branchless")
BF16_SIGMOID = "branchless"
FP64_SIGMOID_VARIABLE = "TILEPLUG_CUDA_SWIGLU_FP64_SIGMOID"
"""Where a result is fp32, the sigmoid: ``reduced`` (the default: ``activation.sigmoid_fp64``, the
library's bits by a cheaper fp64 evaluation that defers to the library one near an fp32 rounding
midpoint) or ``library`` (CUDA's fp64 ``1 / (1 + exp(−g))``); tuning on a GPU host, a reduced
kernel's name says so."""
FP64_SIGMOIDS = ("reduced", "library")
FP64_SIGMOID = "reduced"
CHUNKS_VARIABLE = "TILEPLUG_CUDA_SWIGLU_CHUNKS"
"""Vectors a lane of a long row aims for (``norm.spec.row_tile``'s ``chunks``; default
:data:`CHUNKS`); tuning on a GPU host, the tile is part of the kernel's name."""
CHUNKS = 2
CTAS_PER_SM_VARIABLE = "TILEPLUG_CUDA_SWIGLU_CTAS_PER_SM"
"""CTAs per SM the kernels ask ptxas to fit (``__launch_bounds__``' second argument; default
:func:`ctas_per_sm`, 0 meaning ptxas' own register choice); tuning on a GPU host, the kernel's name
says so."""
SIGMOID_TABLE_VARIABLE = "TILEPLUG_CUDA_SWIGLU_SIGMOID_TABLE"
"""``1``: where x is bf16 and the sigmoid's bits reach an fp32 result or a gradient (``swiglu`` with an
fp32 ``y``, ``swiglu_per_token_cast``, ``swiglu_backward``), the kernels read ``s`` from the table of
every bf16 gate's sigmoid (``sigmoid_table``: the reference's fp64 formula, rounded once, on the
kernel's device) instead of evaluating it per value — in fp64 for the forward (the same values), in
fp32 within 1 ulp for the backward (the table gives the reference's values); the default since the
H100 ran it (2026-12-05: the fused e4m3 cast at T = 65536, H = 7168 in 766 us against 1879 us per
value, TileKernels 794; the backward within 3 % either way); ``0`` selects the per-value sigmoid;
the kernel's name says which."""
TWO_CTA_REGISTERS = 72
"""The most registers a thread of the three SwiGLU kernels took at 2 vectors a lane (ptxas, sm_90,
H = 7168 bf16: the weighted backward; 47 for ``swiglu``, 68-70 for the cast): a tile asks for 2
CTAs an SM only where that many fit (``2 · threads · 72 ≤ 65536``)."""

HALVES = 2
"""x's row is ``[gate | up]``: read as two rows of ``H`` (the norm tile's 3-D buffers)."""


@dataclass(frozen=True)
class SwigluKernelSpec:
    """Compile-time constants of one CUDA SwiGLU kernel.

    ``op``: swiglu / swiglu_per_token_cast / swiglu_backward. ``hidden``: ``H``. ``in_dtype``:
    x's TileLang dtype; ``out_dtype``: ``y``'s (forward) or ``grad_y``'s (backward).
    ``weighted``: ``topk_weights`` are read; ``scaling``: ``routed_scaling_factor`` (fp32);
    ``clamp``: the clamp value (None: none); ``experts``: the length of ``expert_ends`` (None:
    every row is valid) and ``expert_alignment`` its layout's alignment. ``vectorize``:
    128-bit accesses (every row 16-byte aligned and ``H`` a multiple of the vector).
    ``quant``: the fused cast (``norm.spec.QuantSpec``: the norm cast's macros serve it).
    ``bf16_sigmoid``: the sigmoid of a bf16 ``y`` (``guarded``, or ``accurate``: see :attr:`sigmoid`).
    ``table``: the kernel of a bf16 x reads the sigmoid table where :attr:`sigmoid` says so
    (:data:`SIGMOID_TABLE_VARIABLE`).
    """

    op: str
    hidden: int
    in_dtype: str
    out_dtype: str
    weighted: bool
    scaling: float
    clamp: float | None
    experts: int | None
    expert_alignment: int
    vectorize: bool
    tile: RowTile
    quant: QuantSpec | None = None
    bf16_sigmoid: str = BF16_SIGMOID
    fp64_sigmoid: str = FP64_SIGMOID
    ctas_per_sm: int = 0
    table: bool = True

    # what norm.rows.RowMacros reads of a spec: x as [N, 2, H], no residual
    heads = HALVES
    residual = False

    def build(self):
        """The TileLang ``PrimFunc`` (``tileplug.backend_cuda.jit``), built by the op's module
        ``tileplug.backend_cuda.swiglu.<op>``."""
        import importlib

        return importlib.import_module(f"tileplug.backend_cuda.swiglu.{self.op}").build(self)

    @property
    def sigmoid(self) -> str:
        """Which ``sigmoid`` evaluation the kernel uses (``activation``). Where a result is fp32 —
        an fp32 ``y``, the cast (it quantizes the fp32 ``y``), the gradients of an fp32 x — the fp64
        one rounded once, the reference's bits: ``fp64_sigmoid`` (``"library"`` or ``"reduced"``);
        ``"accurate"`` (fp32, within 1 ulp) for the gradients of a bf16 x; ``bf16_sigmoid`` for a
        bf16 ``y`` (``"guarded"``, ``"branchless"`` or ``"accurate"``);
        ``"table"`` for an fp32 ``y`` or the gradients of a bf16 x with ``table``: the reference's
        values read from ``sigmoid_table`` (a CTA copies it into shared memory, then runs
        ``row_steps`` row tiles).

        ``"guarded"`` is ``1 / (1 + __expf(−g))`` above ``g = −80`` and ``expf(g)`` below, where
        ``s = e^g`` in fp32. The plain hardware form failed the 2-ulp bound on 5·10^-5 of the
        values of ``tests/gpu/test_cuda_swiglu.py`` (``__expf`` flushes to zero below
        ``g ≈ −87``, where the reference's ``s`` is subnormal and ``y`` a nonzero bf16); the guarded
        one passed all 150 ``test_matches_reference`` cases on the H200 (2026-12-02) and ran
        T = 65536, H = 7168 in 779 us against 1113 us with the 1-ulp sigmoid (TileKernels 716).
        ``"branchless"`` is the same value above ``g = −80`` and a scaled ``__expf`` below, selected
        without a branch."""
        if self.op == SWIGLU_BACKWARD:
            if self.in_dtype == "float32":
                return self.fp64_sigmoid
            return "table" if self.table else "accurate"
        if self.quant is not None or self.out_dtype == "float32":
            return "table" if self.table and self.in_dtype == "bfloat16" else self.fp64_sigmoid
        return self.bf16_sigmoid

    @property
    def vec(self) -> int:
        """Values per vector (16 bytes of x's dtype)."""
        return {"bfloat16": 8, "float32": 4}[self.in_dtype]

    @property
    def name(self) -> str:
        """A short, unique, identifier-safe name (kernel symbol and cache key text)."""
        short = {"bfloat16": "bf16", "float32": "fp32"}
        parts = [self.op, short[self.in_dtype], short[self.out_dtype], f"h{self.hidden}"]
        if self.weighted:
            parts.append("w")
        if self.scaling != 1.0:
            parts.append(f"s{_hex(self.scaling)}")
        if self.clamp is not None:
            parts.append(f"c{_hex(self.clamp)}")
        if self.experts is not None:
            parts.append(f"e{self.experts}a{self.expert_alignment}")
        parts.append("v128" if self.vectorize else "scalar")
        parts.append(self.tile.name)
        if self.ctas_per_sm:
            parts.append(f"b{self.ctas_per_sm}")
        if self.quant is not None:
            parts += self.quant.name_parts(clamp_tag="m")  # "c" is the SwiGLU clamp's
        if self.sigmoid in ("guarded", "branchless", "reduced", "table"):
            parts.append(self.sigmoid)
        return "_".join(parts)


def reason(call: SwigluCall) -> str | None:
    """Why the CUDA kernels decline ``call`` (None: served)."""
    if call.input_dtype not in TL_DTYPES or call.input_dtype == torch.float16:
        return f"x dtype {call.input_dtype} is not served by the CUDA kernels (bf16, fp32)"
    if call.output_dtype not in TL_DTYPES or call.output_dtype == torch.float16:
        return f"output dtype {call.output_dtype} is not served by the CUDA kernels (bf16, fp32)"
    tile = row_tile(call.hidden, call.input_dtype)
    if tile is None:
        return (f"H = {call.hidden} {call.input_dtype} values per half row do not fit one CTA's registers "
                f"(at most {MAX_VECTORS * vector_width(call.input_dtype)})")
    if call.op == SWIGLU_BACKWARD and call.weighted:
        shared = tile.rows * reduction_plan(call.hidden, tile, vector_width(call.input_dtype)).width * 4
        if shared > MAX_SHARED_BYTES:
            return (f"H = {call.hidden} has no exact row tile: the grad_topk_weights row sum would need {shared} "
                    f"bytes of shared memory (more than {MAX_SHARED_BYTES})")
    return None


def vectorizes(call: SwigluCall) -> bool:
    """128-bit accesses: every row tensor 16-byte aligned and ``H`` a multiple of the vector
    (so the up half starts on a vector too)."""
    return call.alignment >= VECTOR_BYTES and call.hidden % vector_width(call.input_dtype) == 0


def quant_spec(call: SwigluCall) -> QuantSpec | None:
    """The cast part of ``swiglu_per_token_cast`` (None for the other ops)."""
    if call.quant is None:
        return None
    cast = call.quant.cast
    kind = cast.sf_encoding(CUDA_LAYOUT).kind
    return QuantSpec(fmt=cast.fmt.name, group=cast.block[1], sf_kind=kind,
                     sf_col_major=bool(cast.col_major_sf) and kind == "ue8m0", round_sf=bool(cast.round_sf),
                     clamp_min=float(cast.clamp_min), unquantized=False)


def make_spec(call: SwigluCall) -> SwigluKernelSpec:
    """The specialisation serving ``call`` (assumes :func:`reason` is None)."""
    tile = row_tile(call.hidden, call.input_dtype, tuning_override(CHUNKS_VARIABLE, CHUNKS))
    return SwigluKernelSpec(
        op=call.op,
        hidden=call.hidden,
        in_dtype=TL_DTYPES[call.input_dtype],
        out_dtype=TL_DTYPES[call.output_dtype],
        weighted=call.weighted,
        scaling=float(call.routed_scaling_factor),
        clamp=None if call.clamp_value is None else float(call.clamp_value),
        experts=call.num_experts,
        expert_alignment=call.expert_alignment,
        vectorize=vectorizes(call),
        tile=tile,
        quant=quant_spec(call),
        bf16_sigmoid=bf16_sigmoid(),
        fp64_sigmoid=tuning_choice(FP64_SIGMOID_VARIABLE, FP64_SIGMOID, FP64_SIGMOIDS),
        ctas_per_sm=tuning_override(CTAS_PER_SM_VARIABLE, ctas_per_sm(tile)),
        table=tuning_flag(SIGMOID_TABLE_VARIABLE, True),
    )


def ctas_per_sm(tile: RowTile) -> int:
    """The default ``__launch_bounds__`` CTAs per SM of ``tile``: 2 where the tile is one row
    with at most 2 vectors a lane and two CTAs get :data:`TWO_CTA_REGISTERS` registers a thread,
    else 0 (ptxas' choice: a longer lane needs more registers than two CTAs leave; a tile of
    several short rows has 128 threads, where the bound changes nothing). Measured on an H100 at
    H = 7168, T = 4096 / 65536, these defaults against the guarded / library sigmoids on 4 vectors
    a lane at ptxas' choice: ``swiglu`` 63.0 / 939.5 → 58.0 / 907.4 µs, ``swiglu_per_token_cast``
    145.9 / 2231 → 126.1 / 1882, ``swiglu_backward`` 143.0 / 2218 → 97.8 / 1541
    (``docs/benchmarks/h100-swiglu-norm-backward-2026-12-05-s20.txt``)."""
    fits = tile.chunks <= 2 and 2 * tile.threads * TWO_CTA_REGISTERS <= 65536
    return 2 if fits and tile.rows == 1 else 0


ROW_STEPS = 8
"""The most row tiles a CTA of a table kernel runs one after another (each CTA copies the 32 KiB
table into shared memory once, so at 8 tiles it moves 4 KiB of table a row instead of 32)."""
ROW_STEPS_CTAS = 1024
"""The fewest CTAs a table kernel's grid keeps when it gives a CTA several row tiles (about four
waves of 2 CTAs on each of an H100's 132 SMs), so that short batches still spread over the GPU."""


def row_steps(tiles: int) -> int:
    """Row tiles a CTA of a table kernel runs for a call of ``tiles`` row tiles: from 1 (fewer
    than ``2 · ROW_STEPS_CTAS`` tiles) up to :data:`ROW_STEPS`. Every row is computed alike
    whichever CTA runs it, so the choice never shows in the bytes."""
    return max(1, min(ROW_STEPS, tiles // ROW_STEPS_CTAS))


def bf16_sigmoid() -> str:
    """The sigmoid of a bf16 ``y``: :data:`BF16_SIGMOID`, or what :data:`SIGMOID_VARIABLE` names."""
    return tuning_choice(SIGMOID_VARIABLE, BF16_SIGMOID, BF16_SIGMOIDS)
