"""Scale-factor math of SPEC.md §2 in plain PyTorch: the numeric authority for scales.

Shapes: ``values`` is fp32 ``[T, H]``; a group is ``block = (bm, bn)`` input values;
group tensors are ``[ceil(T/bm), ceil(H/bn)]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tileplug.core.quant.formats import E2M1, E4M3, QuantFormat, saturate_e4m3

NONFINITE_EXPONENT = 128
"""Exponent given to a group whose scale is not finite: byte 0xFF, fp32 sf = +inf, inv = 0."""

DEFAULT_CLAMP_MIN: dict[tuple[str, bool], float] = {
    ("e4m3", False): 1e-4,
    ("e4m3", True): E4M3.max_value * 2.0**-9,
    ("e2m1", False): E2M1.max_value * 2.0**-126,
    ("e2m1", True): E2M1.max_value * 2.0**-9,
}
"""amax lower clamp keyed by (fmt, sf stored as e4m3) (SPEC §2)."""


@dataclass(frozen=True, slots=True)
class GroupScales:
    """Scales of every group, ``[rows, cols]`` each.

    ``value`` is the scale as fp32 (what ``cast_back`` multiplies by), ``inverse`` the fp32
    factor the data is multiplied by, ``exponent`` the int32 power of two when ``round_sf``,
    ``e4m3`` the stored e4m3 scale when the sf is stored as e4m3.
    """

    value: torch.Tensor
    inverse: torch.Tensor
    exponent: torch.Tensor | None = None
    e4m3: torch.Tensor | None = None


def ceil_div(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def align(a: int, b: int) -> int:
    """``a`` rounded up to a multiple of ``b``."""
    return ceil_div(a, b) * b


def grouped_view(values: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[T, H] → [ceil(T/bm), bm, ceil(H/bn), bn], zero-padded where the last groups are partial."""
    bm, bn = block
    tokens, hidden = values.shape
    rows, cols = ceil_div(tokens, bm), ceil_div(hidden, bn)
    if rows * bm != tokens or cols * bn != hidden:
        values = torch.nn.functional.pad(values, (0, cols * bn - hidden, 0, rows * bm - tokens))
    return values.reshape(rows, bm, cols, bn)


def ungrouped(grouped: torch.Tensor, tokens: int, hidden: int) -> torch.Tensor:
    """Inverse of :func:`grouped_view`: [rows, bm, cols, bn] → [T, H] (padding dropped)."""
    rows, bm, cols, bn = grouped.shape
    flat = grouped.reshape(rows * bm, cols * bn)
    if rows * bm == tokens and cols * bn == hidden:
        return flat
    return flat[:tokens, :hidden]


def group_amax(values: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |x| over each ``bm × bn`` group of fp32 ``values`` [T, H] → [ceil(T/bm), ceil(H/bn)].

    Partial last groups cover only valid elements (padding with zeros cannot raise a max of
    absolute values; NaN propagates).
    """
    return grouped_view(values.abs(), block).amax(dim=(1, 3))


def scale_groups(values: torch.Tensor, factors: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``values`` [T, H] times each group's factor from ``factors`` [rows, cols], in fp32."""
    tokens, hidden = values.shape
    product = grouped_view(values, block) * factors[:, None, :, None]
    return ungrouped(product, tokens, hidden)


def expand_groups(groups: torch.Tensor, block: tuple[int, int], tokens: int, hidden: int) -> torch.Tensor:
    """[rows, cols] per-group values → [T, H], each group's value over its elements."""
    bm, bn = block
    rows, cols = groups.shape
    expanded = groups[:, None, :, None].expand(rows, bm, cols, bn)
    return ungrouped(expanded, tokens, hidden)


def power_of_two_exponent(scale: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(s))`` from the bits of fp32 ``s`` ≥ 0: ``((bits(s) - 1) >> 23) + 1 - 127``.

    Non-finite ``s`` gets :data:`NONFINITE_EXPONENT`.
    """
    bits = scale.contiguous().view(torch.int32)
    exponent = ((bits - 1) >> 23) + 1 - 127
    return torch.where(torch.isfinite(scale), exponent, torch.full_like(exponent, NONFINITE_EXPONENT))


def exp2_int(exponent: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2^e`` of int32 exponents (``e = 128`` gives +inf)."""
    one = torch.ones(exponent.shape, dtype=torch.float32, device=exponent.device)
    return torch.ldexp(one, exponent.to(torch.float32))


def compute_scales(
    amax: torch.Tensor, fmt: QuantFormat, clamp_min: float, round_sf: bool, use_e4m3_sf: bool
) -> GroupScales:
    """Scales and inverse scales of fp32 group maxima ``amax`` [rows, cols] (SPEC §2)."""
    fmt_max = torch.tensor(fmt.max_value, dtype=torch.float32, device=amax.device)
    clamped = torch.maximum(amax, torch.tensor(clamp_min, dtype=torch.float32, device=amax.device))
    if round_sf:
        reciprocal = torch.tensor(1.0, dtype=torch.float32, device=amax.device) / fmt_max
        exponent = power_of_two_exponent(clamped * reciprocal)
        finite = exponent != NONFINITE_EXPONENT
        inverse = torch.where(finite, exp2_int(-exponent), torch.zeros_like(clamped))
        return GroupScales(exp2_int(exponent), inverse, exponent=exponent)
    if use_e4m3_sf:
        ratio = clamped / fmt_max
        # A non-finite scale is stored as e4m3 NaN (e4m3fn has no inf), so the group shows it.
        stored = saturate_e4m3(torch.where(torch.isfinite(ratio), ratio, torch.full_like(ratio, float("nan"))))
        value = stored.float()
        return GroupScales(value, torch.ones_like(value) / value, e4m3=stored)
    return GroupScales(clamped / fmt_max, fmt_max / clamped)


def inverse_of_given(scale_values: torch.Tensor) -> torch.Tensor:
    """Cast-only mode: ``inv = 1 / sf`` in fp32."""
    return torch.ones_like(scale_values) / scale_values


def given_scale_exponent(scale: torch.Tensor) -> torch.Tensor:
    """The power-of-two exponent of caller-given fp32 scales (SPEC §11): ``ceil(log2 s)`` —
    ``log2 s`` exactly for a power of two, subnormals included — clamped below at -127
    (UE8M0's smallest, 2^-127; zero of either sign gets -127 too), and
    :data:`NONFINITE_EXPONENT` for a scale that is NaN, infinite, negative or above 2^127.
    ``e + 127`` is then the UE8M0 byte of the scale rounded up to a power of two (0xFF: none)."""
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa · 2^exponent, |mantissa| in [0.5, 1)
    exponent = exponent.to(torch.int32) - (mantissa == 0.5).to(torch.int32)
    exponent = torch.where(scale == 0, torch.full_like(exponent, -127), torch.clamp(exponent, min=-127))
    invalid = ~torch.isfinite(scale) | (scale < 0) | (exponent > 127)
    return torch.where(invalid, torch.full_like(exponent, NONFINITE_EXPONENT), exponent)


LOSSLESS_HEADROOM = 6
"""log2 of the factor an e2m1 value may grow by in a lossless e4m3 re-blocking: 6 · 2^6 = 384
fits under e4m3's 448, 4 · 2^7 = 512 does not (SPEC §11)."""

LOSSLESS_FOOTROOM = 8
"""log2 of the factor an e2m1 value may shrink by and stay exact in e4m3: 0.5 · 2^-8 = 2^-9 is
e4m3's smallest subnormal, and 1.5 · 2^-8 = 3 · 2^-9 its third (SPEC §11)."""

SMALLEST_UE8M0_EXPONENT = -127
"""UE8M0 byte 0 is 2^-127."""


def lossless_scales(element_exponent: torch.Tensor, block: tuple[int, int]) -> GroupScales:
    """Output scales of a lossless re-blocking (SPEC §11): int32 ``element_exponent`` [T, H]
    holds the exponent of each element's input scale (:func:`given_scale_exponent`); each
    ``bm × bn`` output group gets ``e = max(largest − 6, −127)``, or
    :data:`NONFINITE_EXPONENT` when one of its input scales is not finite (inv = 0).
    Groups are ``[ceil(T/bm), ceil(H/bn)]``."""
    # Shifted by 127 every exponent is >= 0, so the zero padding of a partial group
    # (exponent -127) never rises above a real one.
    shifted = grouped_view(element_exponent + 127, block)
    largest = shifted.amax(dim=(1, 3)) - 127
    exponent = torch.clamp(largest - LOSSLESS_HEADROOM, min=SMALLEST_UE8M0_EXPONENT)
    nonfinite = largest == NONFINITE_EXPONENT
    exponent = torch.where(nonfinite, torch.full_like(exponent, NONFINITE_EXPONENT), exponent)
    inverse = torch.where(nonfinite, torch.zeros(exponent.shape, device=exponent.device), exp2_int(-exponent))
    return GroupScales(exp2_int(exponent), inverse, exponent=exponent)
