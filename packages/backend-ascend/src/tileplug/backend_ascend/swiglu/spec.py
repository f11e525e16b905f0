"""Kernel specialisation (:class:`SwigluSpec`) of a SwiGLU-family call, its UB plan, its column
tile, and what the Ascend SwiGLU kernels decline.

Shapes: ``x`` ``[N, 2H]`` = ``[gate | up]``; each pipeline item is one (row, column tile) pair:
columns ``[start, start + w)`` of the row's gate, the same columns of its up half (and, for the
backward, of ``grad_y``), ``w = W`` for the full tiles and ``H mod W`` for a narrower last one.
``W`` is the whole row when its double-buffered plan fits the UB budget, else the widest
multiple of the tile unit (64 lanes; for the cast also whole groups and whole UE8M0 pairs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from tileplug.backend_ascend.device import UB_BYTES_SIMD, UB_BYTES_SIMT, DeviceTarget, lowering_target
from tileplug.backend_ascend.ub import LANES, VERSIONS, Plan, footprint, padded, widest_tile
from tileplug.core.contracts.swiglu import SWIGLU, SWIGLU_BACKWARD, SWIGLU_PER_TOKEN_CAST
from tileplug.core.quant.sf_math import align, ceil_div
from tileplug.core.swiglu.sigmoid_table import ENTRIES as TABLE_ENTRIES

OPS = (SWIGLU, SWIGLU_PER_TOKEN_CAST, SWIGLU_BACKWARD)
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
F32 = "float32"


@dataclass(frozen=True)
class SwigluSpec:
    """Everything a SwiGLU kernel is specialised on (all compile-time constants).

    ``op``: one of :data:`OPS`; ``hidden`` H; ``in_dtype`` of ``x`` (and ``grad_x``);
    ``out_dtype``: ``y``'s (``swiglu``), ``grad_y``'s (backward), fp32 (the cast's ``y``);
    ``weighted``: ``topk_weights`` are read; ``scaling`` the routed scaling factor and ``clamp``
    the clamp value (None: none), rounded to fp32 in the kernel as the reference rounds them;
    ``experts`` E of an ``expert_ends`` (None: every row valid) laid out with ``alignment``;
    ``cast``: ``(fmt, group, round_sf, clamp_min, col_major, packed)`` of the fused cast;
    ``width`` the column tile W.
    """

    op: str
    hidden: int
    in_dtype: str
    out_dtype: str
    weighted: bool
    scaling: float
    clamp: float | None
    experts: int | None
    alignment: int
    cast: tuple | None
    width: int
    vector_cores: int = 64
    num_buffers: int = VERSIONS

    @property
    def full_tiles(self) -> int:
        """Tiles of ``W`` columns per row."""
        return self.hidden // self.width

    @property
    def tail(self) -> int:
        """Columns of the narrower last tile (0: ``W`` divides H)."""
        return self.hidden % self.width

    @property
    def tiles(self) -> int:
        """Pipeline items per row."""
        return self.full_tiles + (1 if self.tail else 0)

    @property
    def groups(self) -> int:
        """Cast groups of a whole row (0 without a cast)."""
        return ceil_div(self.hidden, self.cast[1]) if self.cast is not None else 0

    @property
    def sf_columns(self) -> int:
        """Stored scale columns of a row: its groups, or their int16 pairs with packed UE8M0."""
        return ceil_div(self.groups, 2) if self.cast[5] else self.groups

    @property
    def sigmoid_table(self) -> bool:
        """The sigmoid is read from the table of every bf16 gate's (``tileplug.core.swiglu.
        sigmoid_table``, DMA'd into ``table_ub`` once per vector core): x is bf16 and ``y`` fp32
        (``swiglu`` with an fp32 ``y``, the fused cast), where SPEC §8 asks for the reference's
        bits, which the evaluated sigmoid misses in about 0.6 % of values (docs/ascend-backend.md);
        a bf16 result and the backward keep the evaluated one (within 1 ulp of a bf16 result)."""
        return self.in_dtype == "bfloat16" and (
            self.op == SWIGLU_PER_TOKEN_CAST or (self.op == SWIGLU and self.out_dtype == F32))

    @property
    def uses_simt(self) -> bool:
        """The tile ends in the SIMT pack (e2m1 nibbles, UE8M0 pairs)."""
        return self.cast is not None and (self.cast[0] == "e2m1" or self.cast[5])

    def plan(self) -> Plan:
        """UB buffers: name -> (shape, dtype, versions). ``gate_ub`` / ``up_ub`` a tile of each
        half (the backward writes ``grad_x`` over them), ``grad_ub`` of ``grad_y``, ``w_ub`` the
        row's weight, ``y_ub`` the tile's ``y`` (the cast's in fp32, a scratch row it quantizes),
        ``q_ub`` / ``code_ub`` / ``sf_ub`` / ``e_ub`` / ``sfp_ub`` the cast's (e2m1 codes one per
        byte and UE8M0 exponents as int32 before the SIMT pack), ``acc_ub`` / ``gw_ub`` the
        backward's row sum carried across a row's tiles and its ``grad_topk_weights`` value, ``ends_ub`` the expert ends
        and ``table_ub`` the sigmoid table (:attr:`sigmoid_table`; each read once per core)."""
        width, versions = padded(self.width), self.num_buffers
        plan: Plan = {"gate_ub": ((width,), self.in_dtype, versions), "up_ub": ((width,), self.in_dtype, versions)}
        if self.op == SWIGLU_BACKWARD:
            plan["grad_ub"] = ((width,), self.out_dtype, versions)
        if self.weighted:
            plan["w_ub"] = ((8,), F32, versions)
        if self.op == SWIGLU:
            plan["y_ub"] = ((width,), self.out_dtype, versions)
        if self.cast is not None:
            fmt, group, packed = self.cast[0], self.cast[1], self.cast[5]
            groups = ceil_div(self.width, group)
            plan["y_ub"] = ((1, width), F32, 1)
            if fmt == "e4m3":
                plan["q_ub"] = ((1, width), "float8_e4m3fn", versions)
            else:
                plan["code_ub"] = ((1, width), "uint8", 1)
                plan["q_ub"] = ((1, width // 2), "int8", versions)
            if packed:
                plan["e_ub"] = ((padded(groups),), "int32", 1)
                plan["sfp_ub"] = ((align(ceil_div(groups, 2), 16),), "int16", versions)
            else:
                plan["sf_ub"] = ((padded(groups),), F32, versions)
        if self.op == SWIGLU_BACKWARD and self.weighted:
            if self.tiles > 1:
                plan["acc_ub"] = ((LANES,), F32, 1)
            plan["gw_ub"] = ((8,), F32, versions)
        if self.experts is not None:
            plan["ends_ub"] = ((padded(self.experts),), "int32", 1)
        if self.sigmoid_table:
            plan["table_ub"] = ((TABLE_ENTRIES,), F32, 1)
        return plan

    @property
    def footprint(self) -> int:
        """UB bytes of :meth:`plan` (each version 32-byte aligned)."""
        return footprint(self.plan())

    @property
    def budget(self) -> int:
        """UB bytes per vector core (less when the tile ends in a SIMT pack)."""
        return UB_BYTES_SIMT if self.uses_simt else UB_BYTES_SIMD

    def unit(self) -> int:
        """Column alignment of a tile start: whole registers, and for the cast whole groups and
        whole UE8M0 pairs."""
        if self.cast is None:
            return LANES
        group = self.cast[1]
        return math.lcm(LANES, 2 * group if self.cast[5] else group)

    @property
    def layout(self) -> str:
        """How rows map to pipeline steps (the ``core.lower`` header)."""
        if self.tiles == 1:
            return "one row per pipeline step, whole in UB"
        tail = f" and one of {self.tail}" if self.tail else ""
        return f"one (row, column tile) per pipeline step: {self.full_tiles} tile(s) of {self.width} columns{tail}"

    def describe(self) -> str:
        bits = [self.op, f"[N, 2x{self.hidden}]", self.in_dtype]
        if self.op != SWIGLU_PER_TOKEN_CAST:
            bits.append(f"{'grad_y' if self.op == SWIGLU_BACKWARD else 'y'}={self.out_dtype}")
        if self.weighted:
            bits.append("weighted")
        if self.scaling != 1.0:
            bits.append(f"scaling={self.scaling!r}")
        if self.clamp is not None:
            bits.append(f"clamp={self.clamp!r}")
        if self.experts is not None:
            bits.append(f"experts={self.experts}/align={self.alignment}")
        if self.cast is not None:
            fmt, group, round_sf, clamp_min, col_major, packed = self.cast
            flags = "".join(name for name, on in (("/round_sf", round_sf), ("/ue8m0x2", packed),
                                                  ("/col_major", col_major)) if on)
            bits.append(f"cast={fmt}/1x{group}{flags}/clamp={clamp_min!r}")
        if self.sigmoid_table:
            bits.append("sigmoid=table")
        bits.append(f"W={self.width}")
        return " ".join(bits)


def cast_key(quant) -> tuple:
    """The cast a SwiGLU kernel specialises on: ``(fmt, group, round_sf, clamp_min, col_major, packed)``."""
    from tileplug.backend_ascend.quant.row_cast import cast_key as fused_cast_key

    return (*fused_cast_key(quant), bool(quant.cast.use_packed_ue8m0))


def spec_of(call, target: DeviceTarget | None = None) -> SwigluSpec:
    """The kernel specialisation of a SwiGLU ``call`` on ``target`` (default: the lowering
    stand-in), its column tile the widest that fits."""
    cores = (target or lowering_target()).vector_cores
    spec = SwigluSpec(
        op=call.op, hidden=call.hidden, in_dtype=DTYPE_NAMES[call.input_dtype],
        out_dtype=DTYPE_NAMES[call.output_dtype], weighted=call.weighted, scaling=call.routed_scaling_factor,
        clamp=call.clamp_value, experts=call.num_experts, alignment=call.expert_alignment,
        cast=cast_key(call.quant) if call.quant is not None else None, width=call.hidden, vector_cores=cores,
    )
    return _with_widest_tile(spec)


def _with_widest_tile(spec: SwigluSpec) -> SwigluSpec:
    """``spec`` with the widest column tile whose plan fits its budget (at least one unit)."""

    def fits(width: int) -> bool:
        tiled = replace(spec, width=width)
        return tiled.footprint <= tiled.budget

    return replace(spec, width=max(widest_tile(spec.hidden, spec.hidden, fits, spec.unit()), 1))


def decline_reason(call) -> str | None:
    """Why the Ascend SwiGLU kernels cannot serve ``call`` (None: they can). Compared fields only."""
    if call.op not in OPS:
        return f"no Ascend SwiGLU kernel for {call.op}"
    for name, dtype in (("x", call.input_dtype), ("y / grad_y", call.output_dtype)):
        if dtype not in DTYPE_NAMES:
            return (f"{name} dtype {dtype} is not served on Ascend (bf16 / fp32; fp64, the gradcheck dtype, falls to "
                    "the reference)")
    if call.quant is not None:
        from tileplug.backend_ascend.quant.common import decline_reason as cast_decline_reason

        why = cast_decline_reason(call.quant)  # the Ascend per_token_cast's own declines, its reasons
        if why is not None:
            return why
    spec = spec_of(call)
    if spec.footprint > spec.budget:
        ends = f" with {spec.experts} expert ends" if spec.experts is not None else ""
        return (f"H = {call.hidden}: even a {spec.width}-column tile{ends} needs a UB plan of {spec.footprint} bytes > "
                f"{spec.budget} per vector core; falls to the reference")
    return None
