"""The CUDA ``fill_randn`` kernel's reduced Box–Muller (the default; ``TILEPLUG_CUDA_RANDN_BOX_MULLER=library`` is the other),
without a GPU: its arithmetic emulated in PyTorch fp64 with the kernel's constants (products and
sums rounded one by one where the kernel fuses them: the same values to within a few fp64 ulps)
against the reference's Box–Muller over every radius input, every angle and a 2^24-value draw;
which kernels take it; and that it compiles to fp64 arithmetic without library calls or spills."""

from __future__ import annotations

import pytest
import torch

from tileplug.backend_cuda import jit
from tileplug.backend_cuda.random import fill_randn as kernel_module
from tileplug.backend_cuda.random.spec import BOX_MULLER_VARIABLE, RandomKernelSpec
from tileplug.reference.random.draw import MANTISSA_SHIFT, UNIT, cos_sin_of_turns, normal_from_block_words
from tileplug.reference.random.philox import block_words

F64 = torch.float64
STEPS = 1 << 24
QUADRANT = 1 << kernel_module.QUADRANT_BITS


def _horner(z: torch.Tensor, terms) -> torch.Tensor:
    value = torch.full_like(z, terms[-1])
    for term in reversed(terms[:-1]):
        value = value * z + term
    return value


def _parts(m: torch.Tensor):
    """``(exponent, f, rcp seed)`` of int64 ``m`` in ``[1, 2^24]``: ``m = 2^e · f``, ``f`` in ``[√½, √2)``."""
    bits = m.to(torch.float32).view(torch.int32)
    exponent = (bits - kernel_module.SQRT_HALF_BITS) >> 23
    f = (bits - (exponent << 23)).view(torch.float32)
    return exponent, f, (1.0 / (f + 1.0)).to(F64)


def _unscaled_square(m: torch.Tensor) -> torch.Tensor:
    """``−2 ln a`` the unscaled way (``s = (f − 1) / (f + 1)``, ``−4s`` and ``s³ · P(s²)``), rounded step by step."""
    exponent, f, seed = _parts(m)
    numerator = (f - 1.0).to(F64)
    denominator = numerator + 2.0
    quotient = numerator * seed
    s = (numerator - denominator * quotient) * seed + quotient
    z = s * s
    return (exponent - 24).to(F64) * (-2.0 * kernel_module.LN2) + (
        (s * z) * _horner(z, kernel_module.NEGATED_ATANH_TERMS) + s * -4.0)


def _square(m: torch.Tensor, atanh_terms=kernel_module.SCALED_ATANH_TERMS) -> torch.Tensor:
    """The kernel's ``−2 ln a`` (``u = 4s`` and the polynomial in ``u²``), rounded step by step."""
    exponent, f, seed = _parts(m)
    numerator = (f * 4.0 - 4.0).to(F64)
    denominator = numerator * 0.25 + 2.0
    quotient = numerator * seed
    u = (numerator - denominator * quotient) * seed + quotient
    w = u * u
    return (exponent - 24).to(F64) * (-2.0 * kernel_module.LN2) + ((u * w) * _horner(w, atanh_terms) - u)


def _radius(m: torch.Tensor, atanh_terms=kernel_module.SCALED_ATANH_TERMS) -> torch.Tensor:
    """The kernel's ``sqrt(−2 ln(m · 2^-24))`` for int64 ``m`` in ``[1, 2^24]``."""
    square = _square(m, atanh_terms)
    rsqrt_seed = torch.rsqrt(square.to(torch.float32).clamp_min(kernel_module.RSQRT_FLOOR)).to(F64)
    root = square * rsqrt_seed
    return (square - root * root) * (0.5 * rsqrt_seed) + root


def _reduced_turn(rest: torch.Tensor, sin_terms=kernel_module.SIN_TERMS) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's ``(cos, sin)`` of ``rest · ANGLE_STEP`` for int64 ``rest`` in ``[0, 2^22)`` (quadrant 0)."""
    upper = rest > QUADRANT // 2
    x = torch.where(upper, QUADRANT - rest, rest).to(F64) * kernel_module.ANGLE_STEP
    square = x * x
    sine = (x * square) * _horner(square, sin_terms) + x
    cosine = square * _horner(square, kernel_module.COS_TERMS) + 1.0
    return torch.where(upper, sine, cosine), torch.where(upper, cosine, sine)


def _reduced_draw(block: torch.Tensor) -> torch.Tensor:
    """The kernel's fp32 values of int64 block words ``[B, 4]`` (element order)."""
    m = (block[:, 0::2] >> MANTISSA_SHIFT) + 1
    steps = block[:, 1::2] >> MANTISSA_SHIFT
    quadrant = steps >> kernel_module.QUADRANT_BITS
    cosine, sine = _reduced_turn(steps & (QUADRANT - 1))
    swap = (quadrant & 1) == 1
    radius = _radius(m)
    first = (radius * torch.where(swap, sine, cosine)).to(torch.float32)
    second = (radius * torch.where(swap, cosine, sine)).to(torch.float32)
    first = torch.where((quadrant == 1) | (quadrant == 2), 0.0 - first, first)
    second = torch.where(quadrant >= 2, 0.0 - second, second)
    return torch.stack((first, second), dim=2).reshape(-1)


def _relative(have: torch.Tensor, want: torch.Tensor) -> float:
    return float(((have - want).abs() / want.abs()).max())


def test_the_radius_is_within_2_to_the_minus_44_of_the_reference_for_every_input() -> None:
    """Every ``a = m · 2^-24`` (``m`` from 1 to 2^24): the radius within 2^-44 of the reference's
    fp64 ``sqrt(−2 log a)`` (relatively, near ``a = 1`` too) and exactly 0 at ``a = 1``; the
    series one term shorter is not."""
    m = torch.arange(1, STEPS + 1, dtype=torch.int64)
    want = torch.sqrt(-2.0 * torch.log(m.to(F64) * UNIT))
    have = _radius(m)
    assert float(have[-1]) == 0.0 and float(want[-1]) == 0.0
    assert _relative(have[:-1], want[:-1]) < 2.0**-44
    shorter = tuple(kernel_module.SCALED_ATANH_TERMS[:-1])
    assert _relative(_radius(m[:-1], shorter), want[:-1]) > 2.0**-40


def test_the_scaled_logarithm_has_the_unscaled_bits_for_every_input() -> None:
    """``u = 4s`` and the polynomial in ``u²`` (one multiply fewer) give the bits of the unscaled form,
    the zero at ``a = 1`` included (−0): every step is the unscaled step's value times a power of two."""
    m = torch.arange(1, STEPS + 1, dtype=torch.int64)
    assert torch.equal(_square(m).view(torch.int64), _unscaled_square(m).view(torch.int64))
    for k, (scaled, term) in enumerate(zip(kernel_module.SCALED_ATANH_TERMS, kernel_module.NEGATED_ATANH_TERMS)):
        assert scaled * 2.0 ** (6 + 4 * k) == term


def test_the_angle_is_within_2_to_the_minus_43_of_the_reference_but_near_the_zeros_of_cos() -> None:
    """Every angle inside a quadrant: ``cos`` and ``sin`` within 2^-43 of the reference's fp64 ones
    (absolutely, and relatively but where ``cos`` nears 0: the reference rounds ``r · ANGLE_STEP``
    before its ``cos``, a relative 2^-33 there), the zeros exactly +0; the sine one term shorter
    is off by more than 2^-40."""
    rest = torch.arange(QUADRANT, dtype=torch.int64)
    cos_want, sin_want = cos_sin_of_turns(rest)
    cos_have, sin_have = _reduced_turn(rest)
    for have, want in ((cos_have, cos_want), (sin_have, sin_want)):
        assert float((have - want).abs().max()) < 2.0**-43
        zero = want == 0
        assert torch.equal(have[zero].view(torch.int64), want[zero].view(torch.int64))  # +0.0, bit for bit
    assert _relative(sin_have[1:], sin_want[1:]) < 2.0**-43
    assert _relative(cos_have[: QUADRANT // 2], cos_want[: QUADRANT // 2]) < 2.0**-43
    assert _relative(cos_have, cos_want) < 2.0**-32
    shorter = tuple(kernel_module.SIN_TERMS[:-1])
    assert float((_reduced_turn(rest, shorter)[1] - sin_want).abs().max()) > 2.0**-40


def test_a_draw_equals_the_reference_but_for_a_few_values_one_ulp_away() -> None:
    """2^24 values of one draw: every value within 1 ulp of the reference's (SPEC allows 2), at most
    16 not equal, signs and zeros alike."""
    seed, offset = torch.tensor([0x1234ABCD5678], dtype=torch.int64), torch.tensor([7], dtype=torch.int64)
    block = block_words(seed, offset, STEPS // 4)
    want = normal_from_block_words(block)
    have = _reduced_draw(block)
    distance = (have.view(torch.int32).long() - want.view(torch.int32).long()).abs()
    assert int(distance.max()) <= 1 and int((distance != 0).sum()) <= 16
    assert bool(((have < 0) == (want < 0)).all())


def test_the_reduced_box_muller_is_the_default_and_named(monkeypatch) -> None:
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core.lowering import describe_call
    from tileplug.core.ops import fill_rand, fill_randn

    values, seed, offset = torch.empty(8), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    normal = describe_call(fill_randn, values, seed, offset)[0]
    uniform = describe_call(fill_rand, values, seed, offset)[0]
    monkeypatch.delenv(BOX_MULLER_VARIABLE, raising=False)
    spec = _KERNELS["fill_randn"].spec(normal)
    assert spec.box_muller == "reduced" and spec.name.endswith("_reduced")
    assert not _KERNELS["fill_rand"].spec(uniform).name.endswith("_reduced")
    monkeypatch.setenv(BOX_MULLER_VARIABLE, "library")
    library = _KERNELS["fill_randn"].spec(normal)
    assert library.box_muller == "library" and library.name == spec.name[: -len("_reduced")]
    monkeypatch.setenv(BOX_MULLER_VARIABLE, "fast")
    with pytest.raises(ValueError, match=f"{BOX_MULLER_VARIABLE}='fast': expected one of library, reduced"):
        _KERNELS["fill_randn"].spec(normal)


@pytest.mark.nvcc
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_reduced_kernel_calls_no_library_function_and_does_not_spill(dtype: str) -> None:
    pytest.importorskip("tilelang")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_compile import nvcc, spill_bytes

    spec = RandomKernelSpec("fill_randn", dtype, True, "reduced")
    source = jit.lower_source(spec)
    for name in ("log1p(", "cospi(", "sinpi(", "sqrt("):
        assert name not in source, name
    assert source.count("__fma_rn(") >= 20
    error, _, report = nvcc(source)
    assert error is None, error
    assert spill_bytes(report) == {spec.name + "_kernel": 0}, report[-2000:]
