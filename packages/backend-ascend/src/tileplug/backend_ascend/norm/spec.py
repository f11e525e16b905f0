"""Kernel specialisation (:class:`NormSpec`) of a forward norm call, its UB plan, and what the
Ascend norm kernels decline.

Shapes: a call normalizes ``rows = T`` rows of ``x`` ``[T, D]`` or ``rows = T·N`` rows of
``x`` ``[T, N, D]`` (row ``i`` is ``x[i // N, i % N]``); each row is one item of the
pipelined row loop, whole in UB (one read of ``x``, fp32 statistics over the true ``D``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tileplug.backend_ascend.device import UB_BYTES_SIMD, DeviceTarget, lowering_target
from tileplug.backend_ascend.ub import VERSIONS, Plan, footprint, padded, sf_rows

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
KIND_OF_OP = {"rms_norm": "rms", "layer_norm": "layer", "rms_norm_per_token_cast": "rms"}


@dataclass(frozen=True)
class NormSpec:
    """Everything a forward norm kernel is specialised on (all compile-time constants).

    ``kind``: "rms" / "layer"; ``hidden`` D; ``heads`` N of a 3-D input (None: 2-D);
    ``in_dtype`` of ``x`` / ``residual`` / ``y``; ``weight_dtype`` / ``bias_dtype`` (None:
    absent); ``residual`` (``residual_out`` written); ``stats`` (``rstd``, and ``mean`` for
    LayerNorm, written); ``eps``, ``weight_offset``, ``out_scale`` as the call gives them
    (rounded to fp32 in the kernel, as the reference rounds them). ``cast``: the per-token
    cast the row ends in (``rms_norm_per_token_cast``) as ``(fmt, group, round_sf, clamp_min,
    col_major)``; ``unquantized``: ``y`` is written too.
    """

    @property
    def groups(self) -> int:
        """Per-token cast groups of a row (0 without a cast)."""
        return -(-self.hidden // self.cast[1]) if self.cast is not None else 0

    kind: str
    hidden: int
    heads: int | None
    in_dtype: str
    weight_dtype: str | None
    bias_dtype: str | None
    residual: bool
    stats: bool
    eps: float
    weight_offset: float = 0.0
    out_scale: float = 1.0
    cast: tuple | None = None
    unquantized: bool = False
    vector_cores: int = 64
    num_buffers: int = VERSIONS

    def plan(self) -> Plan:
        """UB buffers: name -> (shape, dtype, versions). ``x_ub`` holds a row of ``x`` and then
        ``y`` (written over it); ``r_ub`` a row of ``residual`` and then the rounded sum
        ``residual_out``; ``w_ub`` / ``b_ub`` the fp32 weight factor / bias, prepared once per
        core (``*_raw`` the vector as given, when it is not fp32); ``mean_ub`` / ``rstd_ub``
        the row's statistics."""
        width, versions = padded(self.hidden), self.num_buffers
        plan: Plan = {"x_ub": ((width,), self.in_dtype, versions)}
        if self.residual:
            plan["r_ub"] = ((width,), self.in_dtype, versions)
        for name, dtype in (("w", self.weight_dtype), ("b", self.bias_dtype)):
            if dtype is not None:
                plan[f"{name}_ub"] = ((width,), "float32", 1)
                if dtype != "float32":
                    plan[f"{name}_raw"] = ((width,), dtype, 1)
        if self.cast is not None:
            plan["q_ub"] = ((width,), "float8_e4m3fn", versions)
            plan["sf_ub"] = ((sf_rows(self.groups),), "float32", versions)
        if self.stats:
            if self.kind == "layer":
                plan["mean_ub"] = ((8,), "float32", versions)
            plan["rstd_ub"] = ((8,), "float32", versions)
        return plan

    @property
    def footprint(self) -> int:
        """UB bytes of :meth:`plan` (each version 32-byte aligned)."""
        return footprint(self.plan())

    @property
    def layout(self) -> str:
        """How rows map to pipeline steps (the ``core.lower`` header)."""
        return "one row per pipeline step, whole in UB"

    @property
    def budget(self) -> int:
        """UB bytes per vector core (the kernels are pure SIMD)."""
        return UB_BYTES_SIMD

    def describe(self) -> str:
        shape = f"[T, {self.heads}, {self.hidden}]" if self.heads is not None else f"[T, {self.hidden}]"
        name = "rms_norm_per_token_cast" if self.cast is not None else f"{self.kind}_norm"
        bits = [name, shape, self.in_dtype, f"weight={self.weight_dtype}"]
        if self.kind == "layer":
            bits.append(f"bias={self.bias_dtype}")
        if self.residual:
            bits.append("residual")
        if self.stats:
            bits.append("stats")
        bits.append(f"eps={self.eps!r}")
        if self.weight_offset != 0.0 or self.out_scale != 1.0:
            bits.append(f"offset={self.weight_offset!r} scale={self.out_scale!r}")
        if self.cast is not None:
            fmt, group, round_sf, clamp_min, col_major = self.cast
            bits.append(f"cast={fmt}/1x{group}{'/round_sf' if round_sf else ''}{'/col_major' if col_major else ''}"
                        f"/clamp={clamp_min!r}{' +y' if self.unquantized else ''}")
        return " ".join(bits)


def spec_of(call, target: DeviceTarget | None = None) -> NormSpec:
    """The kernel specialisation of a forward norm ``call`` on ``target`` (default: the
    lowering stand-in)."""
    cores = (target or lowering_target()).vector_cores
    from tileplug.backend_ascend.quant.row_cast import cast_key

    cast = cast_key(call.quant) if call.quant is not None else None
    return NormSpec(
        kind=KIND_OF_OP[call.op], hidden=call.hidden, heads=call.heads, in_dtype=DTYPE_NAMES[call.input_dtype],
        weight_dtype=DTYPE_NAMES.get(call.weight_dtype), bias_dtype=DTYPE_NAMES.get(call.bias_dtype),
        residual=call.residual, stats=call.stats, eps=call.eps, weight_offset=call.weight_offset,
        out_scale=call.out_scale, cast=cast, unquantized=call.unquantized, vector_cores=cores,
    )


def decline_reason(call) -> str | None:
    """Why the Ascend norm kernels cannot serve ``call`` (None: they can). Compared fields only."""
    if call.op not in KIND_OF_OP:
        return f"no Ascend norm kernel for {call.op}"
    for name, dtype in (("x", call.input_dtype), ("weight", call.weight_dtype), ("bias", call.bias_dtype)):
        if dtype is not None and dtype not in DTYPE_NAMES:
            return f"{name} dtype {dtype} is not served on Ascend (bf16 / fp16 / fp32; fp64 falls to the reference)"
    if call.quant is not None:
        why = _cast_reason(call)
        if why is not None:
            return why
    spec = spec_of(call)
    if spec.footprint > spec.budget:
        return (
            f"D = {call.hidden}: the one-pass row kernel needs {spec.footprint} bytes of UB > {spec.budget} per vector "
            "core (no split-row form on Ascend)"
        )
    return None


def _cast_reason(call) -> str | None:
    """Why the fused RMSNorm + per-token cast is not served (None: it is): a 3-D input, then
    what every fused cast leaves to the reference."""
    from tileplug.backend_ascend.quant.row_cast import fused_cast_decline

    if call.heads is not None:
        return "3-D x (per-head norm, then a cast over N·D) is not fused on Ascend; falls to the reference"
    return fused_cast_decline(call.quant)
