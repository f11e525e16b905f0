"""Kernel specialisation (:class:`TileSpec`) of a quant call, its UB plan and tile width.

Shapes: a call works on ``[T, H]``; a *tile* is ``R`` rows x ``W`` columns (``R = bm`` for
per-block groups, ``bm`` or ``2 bm`` for per-channel groups -- two row groups share one int16
of packed UE8M0 --, ``1`` for per-token groups and ``cast_back``). ``W`` is derived from the UB
budget: the whole row when it fits, else the widest multiple of the alignment unit that fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tileplug.backend_ascend.device import UB_BYTES_SIMD, UB_BYTES_SIMT, UBBudgetError, check_budget
from tileplug.backend_ascend.ub import ITEMSIZE, LANES, UB_ALIGN, VERSIONS, footprint  # noqa: F401 - re-exported
from tileplug.core.call import QuantMode
from tileplug.core.quant.sf_math import align, ceil_div

STATE_SLOT = UB_ALIGN // ITEMSIZE["int32"]
"""int32 words of the UB slot of one int64 state tensor (2 used; one DMA unit), as
``random/draw.py``'s ``STATE_WORDS`` (that module imports TileLang; this one must not)."""


@dataclass(frozen=True)
class TileSpec:
    """Everything a kernel is specialised on (all compile-time constants).

    ``kind``: "token" / "block" / "channel" / "back". ``block``: output groups (bm, bn)
    (cast_back: the input's). ``mode``: the call's ``QuantMode`` (compared only through the
    properties). ``in_dtype``: TileLang dtype of the data read.
    ``qin``: (fmt, ibm, ibn, sf kind "fp32"|"ue8m0", col_major) of a quantized input.
    ``given``: (sf kind, col_major) of precomputed scales. ``out_dtype``: cast_back result.
    ``stochastic``: the narrowing of ``x·inv`` rounds stochastically (docs/spec.md §10.2), element
    ``i = t·H + h`` with the 8-bit field ``i mod 4`` of word ``i // 4`` of the Philox draw under
    the generator's (seed, offset).
    ``e4m3_sf``: scales rounded to e4m3 (fake quant only: the rounded value multiplies back,
    nothing is stored). Fake quant (mode ``CAST_AND_CAST_BACK``): ``out_dtype`` is x's dtype.
    ``lossless``: ``per_block_cast_lossless`` (docs/spec.md §11), a mode of the re-quantization of
    ``qin``: each element is keyed by its input scale's UE8M0 byte ``E(sf_in) + 127`` instead of
    the bits of ``|x|``, and a group's scale is ``2^max(key_max - 127 - 6, -127)`` (no clamp, no
    division; ``round_sf`` changes nothing).
    ``compact_decode`` (lossless e2m1 inputs with input groups ``1 x ibn``, ``ibn > 1``, whose
    per-element plan is over the UB budget; set by ``common.spec_of``): the decoded values ``d_ub``
    ``[R, wp]`` are bf16 (every e2m1 value is exact in bf16; widened to fp32 on load) and the input
    scales ``s_ub`` ``[R, ceil(wp / ibn)]`` fp32 are one per input group of the row, broadcast onto
    their lanes on load; the products are the same fp32 ``d · (s · inv)``.
    """

    kind: str
    hidden: int
    block: tuple[int, int]
    fmt: str | None
    mode: QuantMode
    in_dtype: str
    round_sf: bool = False
    packed: bool = False
    col_major: bool = False
    clamp_min: float = 1e-4
    qin: tuple | None = None
    given: tuple | None = None
    out_dtype: str | None = None
    stochastic: bool = False
    e4m3_sf: bool = False
    lossless: bool = False
    compact_decode: bool = False
    vector_cores: int = 64
    num_buffers: int = VERSIONS

    # ------------------------------------------------------------------ derived
    @property
    def rows(self) -> int:
        bm = self.block[0]
        if self.kind == "channel":
            return bm * (2 if self.packed else 1)
        if self.kind == "block":
            return bm
        return 1

    @property
    def writes_q(self) -> bool:
        """The kernel writes quantized data (cast_back: the dequantized result)."""
        return self.mode is not QuantMode.SF_ONLY

    @property
    def writes_sf(self) -> bool:
        """The kernel computes and writes scale factors."""
        return self.mode in (QuantMode.CAST, QuantMode.SF_ONLY)

    @property
    def is_cast_back(self) -> bool:
        """The kernel dequantizes (``cast_back``) instead of quantizing."""
        return self.mode is QuantMode.CAST_BACK

    @property
    def fake_quant(self) -> bool:
        """The kernel quantizes and dequantizes x in place (``per_token_cast_and_cast_back``):
        x is read and written, no q / sf leaves UB."""
        return self.mode is QuantMode.CAST_AND_CAST_BACK

    @property
    def uses_simt(self) -> bool:
        return (
            self.fmt == "e2m1" and self.writes_q and not self.is_cast_back and not self.fake_quant
            or (self.packed and self.writes_sf)
            or self.qin is not None
            or (self.given is not None and self.given[0] == "ue8m0")
        )

    def unit(self) -> int:
        """Column alignment of a tile start: whole registers, whole groups, whole UE8M0 pairs."""
        bn = self.block[1]
        parts = [LANES]
        if not self.is_cast_back:
            parts.append(bn)
            if bn > 1 and (self.packed or (self.given and self.given[0] == "ue8m0")):
                parts.append(2 * bn)
        if self.qin is not None:
            ibn = self.qin[2]
            parts.append(ibn)
            if ibn > 1 and self.qin[3] == "ue8m0":
                parts.append(2 * ibn)
        return math.lcm(*parts)

    def plan(self, width: int) -> dict[str, tuple[tuple[int, ...], str, int]]:
        """UB buffers for tiles ``width`` wide: name -> (shape, dtype, versions).

        The kernel allocates exactly these; :func:`footprint` sums them the way TileLang lays
        them out (each version 32-byte aligned).
        """
        R, V = self.rows, self.num_buffers
        wp = align(width, LANES)
        bn = self.block[1]
        p: dict[str, tuple[tuple[int, ...], str, int]] = {}
        if self.qin is None:
            p["x_ub"] = ((R, wp), self.in_dtype, V)
        else:
            qfmt, _, ibn, skind, _ = self.qin
            p["x_ub"] = ((R, wp), "float8_e4m3fn", V) if qfmt == "e4m3" else ((R, wp // 2), "int8", V)
            if ibn == 1:
                nsi = wp
            elif skind == "ue8m0":
                nsi = ceil_div(ceil_div(wp, ibn), 2)
            else:
                nsi = ceil_div(wp, ibn)
            sdt = "int16" if skind == "ue8m0" else "float32"
            p["sfin_ub"] = ((R, align(nsi, UB_ALIGN // ITEMSIZE[sdt])), sdt, V)
            if self.compact_decode:
                p["d_ub"] = ((R, wp), "bfloat16", 1)
                p["s_ub"] = ((R, align(ceil_div(wp, ibn), UB_ALIGN // ITEMSIZE["float32"])), "float32", 1)
            else:
                p["d_ub"] = ((R, wp), "float32", 1)
                p["s_ub"] = ((R, wp), "float32", 1)
        ng = ceil_div(width, bn) if not self.is_cast_back else 0
        ng64 = align(max(ng, 1), LANES)
        if self.given is not None:
            if self.given[0] == "ue8m0":
                p["graw_ub"] = ((align(ceil_div(ng, 2), 16),), "int16", V)
                p["gsf_ub"] = ((ng64,), "float32", 1)
            else:
                p["gsf_ub"] = ((ng64,), "float32", V)
            p["ginv_ub"] = ((ng64,), "float32", 1)
        if self.is_cast_back or self.fake_quant:
            p["o_ub"] = ((R, wp), self.out_dtype, V)
        elif self.writes_q:
            if self.fmt == "e4m3":
                p["q_ub"] = ((R, wp), "float8_e4m3fn", V)
            else:
                p["code_ub"] = ((R, wp), "uint8", 1)
                p["q_ub"] = ((R, wp // 2), "int8", V)
        if self.stochastic:
            # the generator's state words (read once) and the tile's random bits (each element's
            # field f as f << 16, uint32 held as int32), one per column of each row: the draw
            # stores whole registers and none past the row (tile_kernel.row_draw)
            p["seed_ub"] = ((STATE_SLOT,), "int32", 1)
            p["offset_ub"] = ((STATE_SLOT,), "int32", 1)
            p["bits_ub"] = ((R, wp), "int32", 1)
        if self.writes_sf:
            if bn == 1:
                if self.packed:
                    p["e_ub"] = ((2, wp), "int32", 1)
                    p["sfp_ub"] = ((wp,), "int16", V)
                else:
                    p["sf_ub"] = ((wp,), "float32", V)
            elif self.packed:
                p["e_ub"] = ((align(ng, 8),), "int32", 1)
                p["sfp_ub"] = ((align(ceil_div(ng, 2), 16),), "int16", V)
            else:
                p["sf_ub"] = ((align(ng, 8),), "float32", V)
        return p

    def budget(self) -> int:
        """UB bytes per vector core this kernel may use (less when it has a SIMT region)."""
        return UB_BYTES_SIMT if self.uses_simt else UB_BYTES_SIMD

    def width(self) -> int:
        """Tile width from the UB budget: all of H when it fits, else the widest multiple of
        :meth:`unit` that fits. Raises :class:`UBBudgetError` when not even one unit fits."""
        budget = self.budget()
        if footprint(self.plan(self.hidden)) <= budget:
            return self.hidden
        unit = self.unit()
        best = 0
        w = unit
        while w < self.hidden and footprint(self.plan(w)) <= budget:
            best = w
            w += unit
        if best == 0:
            check_budget(footprint(self.plan(unit)), budget, f"{self.describe()} (one {unit}-column tile)")
            raise UBBudgetError(f"{self.describe()}: no tile width fits the UB budget")  # pragma: no cover
        return best

    def describe(self) -> str:
        bm, bn = self.block
        bits = [self.kind, f"H={self.hidden}", f"{bm}x{bn}", self.fmt or str(self.out_dtype), self.mode.value, self.in_dtype]
        if self.round_sf:
            bits.append("round_sf")
        if self.packed:
            bits.append("ue8m0x2")
        if self.col_major:
            bits.append("col_major")
        if self.qin:
            bits.append(f"qin={self.qin}")
        if self.given:
            bits.append(f"given={self.given}")
        if self.stochastic:
            bits.append("stochastic")
        if self.e4m3_sf:
            bits.append("e4m3_sf")
        if self.lossless:
            bits.append("lossless")
        if self.compact_decode:
            bits.append("compact_decode")
        return " ".join(bits)


class Tiling:
    """Tile width, the number of full tiles and the width of the last partial one."""

    def __init__(self, spec: TileSpec, width: int | None = None):
        self.width = spec.width() if width is None else width
        self.full = spec.hidden // self.width
        self.tail = spec.hidden - self.full * self.width
        self.plan = spec.plan(self.width)
        self.footprint = footprint(self.plan)
        self.budget = spec.budget()
