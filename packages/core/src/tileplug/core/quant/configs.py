"""Frozen cast configurations: what a cast computes, independent of the tensors it runs on.

These are the compile-time constants a backend specialises its kernels on.
"""

from __future__ import annotations

from dataclasses import dataclass

from tileplug.core.quant.formats import QuantFormat
from tileplug.core.quant.layouts import E4M3_SF, FP32_SF, LayoutTraits, SfEncoding, pack_axis_of_block


@dataclass(frozen=True, slots=True)
class CastConfig:
    """One quantization: output format, group ``block = (bm, bn)``, and how scales are made
    and stored.

    Per-token groups are ``(1, g)``, per-block ``(bm, bn)``, per-channel ``(g, 1)``.
    ``clamp_min`` is the amax lower clamp in force (SPEC §2, overridable in config).
    """

    fmt: QuantFormat
    block: tuple[int, int]
    round_sf: bool = False
    use_packed_ue8m0: bool = False
    use_e4m3_sf: bool = False
    col_major_sf: bool = False
    clamp_min: float = 1e-4
    stochastic: bool = False
    """The narrowing of ``x · inv`` rounds stochastically (docs/spec.md §10.2) with the bits of
    the call's generator (``QuantInputs.seed`` / ``offset``); only the main per-token and
    per-block casts set it."""

    @property
    def pack_axis(self) -> int:
        """Axis UE8M0 bytes are packed along (1: channels, 0: tokens)."""
        return pack_axis_of_block(self.block)

    def sf_encoding(self, traits: LayoutTraits) -> SfEncoding:
        """How this cast stores its scales on a device family with ``traits``."""
        if self.use_packed_ue8m0:
            return SfEncoding("ue8m0", traits.ue8m0_pack_factor)
        if self.use_e4m3_sf:
            return E4M3_SF
        return FP32_SF


@dataclass(frozen=True, slots=True)
class QuantizedInput:
    """An already quantized input ``(xq, sf)``: its format, grouping and sf storage."""

    fmt: QuantFormat
    block: tuple[int, int]
    sf_encoding: SfEncoding
    sf_col_major: bool

    @property
    def pack_axis(self) -> int:
        return pack_axis_of_block(self.block)


@dataclass(frozen=True, slots=True)
class GivenScales:
    """A caller-given sf tensor (cast-only mode): its storage, read off dtype and strides."""

    encoding: SfEncoding
    col_major: bool
