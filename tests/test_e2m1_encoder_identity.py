"""The identity the CUDA e2m1 encoder rests on (``backend_cuda.quant.sf_math.e2m1_rounded``),
checked on the CPU against the reference encoding (``core.quant.formats.e2m1_codes``).

The device code takes ``a = fminf(|y|, 6)`` and the smallest of ``a·2 + 2^23``,
``a + (2^23 + 2)`` and ``a·0.5 + (2^23 + 4)`` (each one fp32 fused multiply-add, compared as
int32 bit patterns): its low three bits are the magnitude code. Here the same arithmetic runs
in fp64 (exact: the products are exact and one rounding to fp32 follows, as in the FMA) over
every fp32 within 2048 ulps of each rounding boundary and representable value of e2m1, a
stride through all 2^32 bit patterns, and the special values. (The whole 2^32 was checked
once, 2026-12-02: no difference.) The kernels' bytes are compared with the reference on a
GPU by tests/gpu/test_cuda_quant.py.
"""

from __future__ import annotations

import torch

from tileplug.core.quant.formats import E2M1_MAGNITUDES, e2m1_codes

TWO_POW_23 = 2.0**23


def device_codes(values: torch.Tensor) -> torch.Tensor:
    """fp32 values → e2m1 nibble codes, by the device encoder's arithmetic."""
    magnitude = torch.where(torch.isnan(values), torch.tensor(6.0), values.abs().clamp(max=6.0))  # fminf
    wide = magnitude.double()
    candidates = [(wide * scale + offset).float().view(torch.int32)
                  for scale, offset in ((2.0, TWO_POW_23), (1.0, TWO_POW_23 + 2), (0.5, TWO_POW_23 + 4))]
    smallest = torch.minimum(torch.minimum(candidates[0], candidates[1]), candidates[2])
    sign = (values.view(torch.int32) >> 28) & 8
    return ((smallest & 7) | sign).to(torch.uint8)


def _near(points: list[float], ulps: int = 2048) -> torch.Tensor:
    """Every fp32 within ``ulps`` of each point, both signs."""
    bits = torch.tensor(points, dtype=torch.float32).view(torch.int32)
    steps = torch.arange(-ulps, ulps + 1, dtype=torch.int32)
    around = (bits[:, None] + steps[None, :]).flatten().view(torch.float32)
    return torch.cat([around, -around])


def test_identity_near_every_boundary_and_value() -> None:
    midpoints = [(low + high) / 2 for low, high in zip(E2M1_MAGNITUDES, E2M1_MAGNITUDES[1:])]
    values = _near([m for m in E2M1_MAGNITUDES if m > 0] + midpoints + [8.0, 12.0, 2.0**-126, 2.0**-149])
    assert values.numel() > 60_000
    assert torch.equal(device_codes(values), e2m1_codes(values))


def test_identity_over_a_stride_of_all_bit_patterns() -> None:
    patterns = torch.arange(0, 2**32, 4099, dtype=torch.int64)
    values = (patterns - (patterns >= 2**31).long() * 2**32).to(torch.int32).view(torch.float32)
    assert values.numel() > 1_000_000 and bool(torch.isnan(values).any()) and bool((values < 0).any())
    assert torch.equal(device_codes(values), e2m1_codes(values))


def test_identity_on_special_values() -> None:
    values = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 6.0, -6.0, 6.0000005, 3.4e38,
                           1e-45, -1e-45, 0.25, 0.75, 5.0, -5.0])
    assert torch.equal(device_codes(values), e2m1_codes(values))
    # by hand: 6.0000005 clamps to 6 (code 7); 5.0 ties to 4.0 (code 6); -5.0 → 8 | 6
    assert device_codes(torch.tensor([6.0000005, 5.0, -5.0])).tolist() == [7, 6, 14]
