"""Kernel specialisation (:class:`RotarySpec`) of an ``apply_rotary`` call, its UB plan, and
what the Ascend RoPE kernel declines.

Shapes: ``query`` ``[T, Nq, D]`` or ``[B, S, Nq, D]`` (``T = B·S`` tokens), ``key`` the same
with ``Nk`` heads; one token per pipeline step: the first ``R`` channels of all its heads
(query and key) and its cache row sit in UB together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tileplug.backend_ascend.device import DeviceTarget, lowering_target
from tileplug.backend_ascend.ub import Plan, PlannedInSimdUb, VERSIONS, padded
from tileplug.core.quant.sf_math import align

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
POSITION_NAMES = {None: None, torch.int32: "int32", torch.int64: "int64"}
PAIR_BLOCK = 128  # channels of one GPT-J block (rope/rotation.py): two registers, de-interleaved into 64 pairs


@dataclass(frozen=True)
class RotarySpec(PlannedInSimdUb):
    """Everything an ``apply_rotary`` kernel is specialised on (compile-time constants).

    ``head_dim`` D, ``rotary_dim`` R (even, <= D), ``query_heads`` Nq, ``key_heads`` Nk (None:
    no key), ``dtype``, ``batched`` (4-D: the implicit position is ``s``), ``interleaved``
    (GPT-J pairs), ``conjugate`` (sin negated), ``positions`` ("int32" / "int64"; None:
    implicit). The token count, the cache length and ``seqlen_offset`` are runtime values.
    """

    head_dim: int
    rotary_dim: int
    query_heads: int
    key_heads: int | None
    dtype: str
    batched: bool
    interleaved: bool
    conjugate: bool
    positions: str | None
    vector_cores: int = 64
    num_buffers: int = VERSIONS

    @property
    def half(self) -> int:
        """``R / 2``: pairs per head."""
        return self.rotary_dim // 2

    def planes(self) -> tuple[str, ...]:
        """UB planes of one head's rotated channels: NeoX keeps the halves apart (``1``: channels
        ``[0, R/2)``, ``2``: ``[R/2, R)``, so a pair sits in one lane of two registers); GPT-J
        keeps the ``R`` channels together (``a``) and de-interleaves them in registers."""
        return ("a",) if self.interleaved else ("1", "2")

    @property
    def plane_width(self) -> int:
        """Allocated UB elements of one head in one plane."""
        return align(self.rotary_dim, PAIR_BLOCK) if self.interleaved else padded(self.half)

    def plan(self) -> Plan:
        """UB buffers: name -> (shape, dtype, versions). ``q<plane>`` / ``k<plane>``: the heads'
        rotated channels (rotated in place, written back), ``cos_ub`` / ``sin_ub``: the token's
        cache row (fp32)."""
        versions = self.num_buffers
        plan: Plan = {}
        for tensor, heads in (("q", self.query_heads), ("k", self.key_heads)):
            if heads is None:
                continue
            for plane in self.planes():
                plan[f"{tensor}{plane}"] = ((heads, self.plane_width), self.dtype, versions)
        plan["cos_ub"] = ((padded(self.half),), "float32", versions)
        plan["sin_ub"] = ((padded(self.half),), "float32", versions)
        return plan

    @property
    def layout(self) -> str:
        return "one token per pipeline step (all its heads' rotated channels and its cache row in UB)"

    def describe(self) -> str:
        shape = "[B, S, N, D]" if self.batched else "[T, N, D]"
        bits = [
            "apply_rotary", shape, self.dtype, f"D={self.head_dim}", f"R={self.rotary_dim}", f"Nq={self.query_heads}",
            f"Nk={self.key_heads}", "gptj" if self.interleaved else "neox", f"positions={self.positions}",
        ]
        if self.conjugate:
            bits.append("conjugate")
        return " ".join(bits)


def spec_of(call, target: DeviceTarget | None = None) -> RotarySpec:
    """The kernel specialisation of ``call`` on ``target`` (default: the lowering stand-in)."""
    return RotarySpec(
        head_dim=call.head_dim, rotary_dim=call.rotary_dim, query_heads=call.query_heads, key_heads=call.key_heads,
        dtype=DTYPE_NAMES[call.dtype], batched=call.batched, interleaved=call.interleaved, conjugate=call.conjugate,
        positions=POSITION_NAMES[call.positions_dtype], vector_cores=(target or lowering_target()).vector_cores,
    )


def decline_reason(call) -> str | None:
    """Why the Ascend RoPE kernel cannot serve ``call`` (None: it can). Compared fields only."""
    if call.op != "apply_rotary":
        return f"no Ascend RoPE kernel for {call.op}"
    if call.dtype not in DTYPE_NAMES:
        return f"dtype {call.dtype} is not served on Ascend (bf16 / fp16 / fp32)"
    spec = spec_of(call)
    if spec.footprint > spec.budget:
        return (
            f"{call.query_heads} + {call.key_heads or 0} heads x R = {call.rotary_dim}: one token's rotated channels "
            f"need {spec.footprint} bytes of UB > {spec.budget} per vector core (heads are not split across steps)"
        )
    return None
