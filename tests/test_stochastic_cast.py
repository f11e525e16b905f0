"""``cast`` and ``stochastic_cast`` on the reference (docs/spec.md §10.2): the stochastic
result against an independent model on Python fractions (its own Philox, its own tables of
every bf16 and e4m3 value), unbiasedness within the statistical bound, the generator's
offset, the specials as the deterministic cast, the deterministic cast of every pair, and the
refusals."""

from __future__ import annotations

import bisect
import math
import struct
from fractions import Fraction

import pytest
import torch

from tileplug import core
from tileplug.core import ContractError
from tileplug.core.ops import cast, nearest_cast, stochastic_cast
from tileplug.core.random import Generator
from tileplug.core.testing import philox4x32_10_words

MASK = 0xFFFFFFFF
E4M3 = torch.float8_e4m3fn


def _bf16_value(bits: int) -> Fraction:
    """A positive finite bf16 pattern's value from its fields (1 sign, 8 exponent, 7 mantissa bits)."""
    exponent, mantissa = bits >> 7, bits & 0x7F
    if exponent == 0:
        return Fraction(mantissa, 2**7) * Fraction(2) ** -126
    return (1 + Fraction(mantissa, 2**7)) * Fraction(2) ** (exponent - 127)


def _e4m3_value(bits: int) -> Fraction:
    """A non-negative finite e4m3 pattern's value from its fields (4 exponent bits, bias 7, 3 mantissa bits)."""
    exponent, mantissa = bits >> 3, bits & 0x7
    if exponent == 0:
        return Fraction(mantissa, 8) * Fraction(2) ** -6
    return (1 + Fraction(mantissa, 8)) * Fraction(2) ** (exponent - 7)


BF16_VALUES = [_bf16_value(bits) for bits in range(0x7F80)]  # 0 … the largest finite, ascending
E4M3_VALUES = [_e4m3_value(bits) for bits in range(0x7F)]  # 0 … 448


def _model_words(seed: int, offset: int, count: int) -> list[int]:
    """Words 0 … count−1 of the draw under ``(seed, offset)``, from the pure-Python Philox."""
    key = (seed & MASK, seed >> 32)
    out: list[int] = []
    for block in range((count + 3) // 4):
        out += philox4x32_10_words((block & MASK, block >> 32, offset & MASK, offset >> 32), key)
    return out[:count]


FIELD_BITS = {(torch.float32, torch.bfloat16): 16, (torch.float32, E4M3): 8, (torch.bfloat16, E4M3): 8}
"""The random bits an element takes, by pair (the spec's table, written out here)."""


def _model_fields(seed: int, offset: int, count: int, width: int) -> list[int]:
    """Each element's ``width``-bit field: ``32 // width`` fields a word, the first at its top."""
    per_word = 32 // width
    fields = []
    for word in _model_words(seed, offset, -(-count // per_word)):
        for index in range(per_word):
            fields.append((word >> (32 - width * (index + 1))) & ((1 << width) - 1))
    return fields[:count]


def _model_round(value: float, field: int, width: int, target: torch.dtype) -> float:
    """The spec's rule on exact fractions: ``hi`` iff ``floor(p·2^w) + f ≥ 2^w``."""
    if math.isnan(value):
        return math.nan
    table = BF16_VALUES if target == torch.bfloat16 else E4M3_VALUES
    sign = -1.0 if math.copysign(1.0, value) < 0 else 1.0
    if math.isinf(value) and target == torch.bfloat16:
        return value
    magnitude = Fraction(abs(value)) if math.isfinite(value) else Fraction(448)
    if target == E4M3:
        magnitude = min(magnitude, Fraction(448))
    index = bisect.bisect_right(table, magnitude) - 1
    low = table[index]
    high = table[index + 1] if index + 1 < len(table) else (
        Fraction(2) ** 128 if target == torch.bfloat16 else low)  # bf16: the step to inf
    if high == low:
        return sign * float(low)
    fraction_bits = math.floor((magnitude - low) / (high - low) * 2**width)
    if fraction_bits + field >= 2**width:
        return sign * (math.inf if high == Fraction(2) ** 128 else float(high))
    return sign * float(low)


def _edge_values(dtype: torch.dtype) -> torch.Tensor:
    """Values near every rounding decision: a normal spread, outliers, the targets' ranges'
    ends, subnormals of both, just below and above 448, the largest finite fp32, specials."""
    generator = torch.Generator().manual_seed(3)
    spread = torch.randn(300, generator=generator) * torch.logspace(-12, 3, 300)
    fixed = torch.tensor([0.0, -0.0, 1.0, -1.0, 448.0, 449.0, 464.0, 480.0, -447.9, 2.0**-9, 2.0**-10, 3 * 2.0**-11,
                          2.0**-6 * 0.999, 1e-40, -1e-39, 3.3895313892515355e38, 3.4028234663852886e38,
                          math.inf, -math.inf, math.nan, 0.3, 1 + 2.0**-10, 1 + 2.0**-20])
    return torch.cat([spread, fixed]).to(dtype)


PAIRS = [(torch.float32, torch.bfloat16), (torch.float32, E4M3), (torch.bfloat16, E4M3)]
PAIR_IDS = ["fp32-bf16", "fp32-e4m3", "bf16-e4m3"]


@pytest.mark.parametrize("source, target", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("seed", [0, 2**64 - 1, 0x243F6A8885A308D3])
def test_equals_an_independent_model(source, target, seed) -> None:
    x = _edge_values(source)
    generator = Generator("cpu", seed)
    generator.offset = 5
    result = cast(x, target, stochastic_rounding=True, generator=generator)
    assert generator.offset == 6
    width = FIELD_BITS[source, target]
    bits = _model_fields(seed, 5, x.numel(), width)
    expected = [_model_round(float(v), r, width, target) for v, r in zip(x.tolist(), bits)]
    got = result.float().tolist()
    for index, (have, want) in enumerate(zip(got, expected)):
        if math.isnan(want):
            assert math.isnan(have), f"element {index} ({x[index].item()!r}): {have} is not NaN"
        else:
            assert have == want and math.copysign(1, have) == math.copysign(1, want), (
                f"element {index} ({x[index].item()!r}, r={bits[index]}): {have} != {want}")


def test_fp32_to_bf16_takes_the_two_halves_of_each_word() -> None:
    """``1 + d · 2^-23`` drops ``d`` below bf16's last place of 1: with ``d = 2^16 − f`` for each
    element's field ``f`` (word ``i // 2``'s top half for an even ``i``, its bottom half for an
    odd one) every element rounds up to ``1 + 2^-7``, with one less every one rounds down to 1."""
    seed, count = 21, 514
    fields = _model_fields(seed, 0, count, 16)
    assert fields[:2] == [_model_words(seed, 0, 1)[0] >> 16, _model_words(seed, 0, 1)[0] & 0xFFFF]
    at = torch.tensor([1 + (2**16 - f) * 2.0**-23 for f in fields])
    below = torch.tensor([1 + (2**16 - f - 1) * 2.0**-23 for f in fields])
    assert cast(at, torch.bfloat16, True, Generator("cpu", seed)).float().tolist() == [1 + 2.0**-7] * count
    assert cast(below, torch.bfloat16, True, Generator("cpu", seed)).float().tolist() == [1.0] * count


def test_bf16_to_e4m3_takes_the_four_bytes_of_each_word() -> None:
    """``a = k · 2^-17`` (exact in bf16 for ``k < 256``) is ``k / 256`` of e4m3's subnormal step
    2^-9: with ``k = 256 − f`` for each element's byte ``f`` (byte ``i mod 4`` of word ``i // 4``,
    from the top) every element rounds up to 2^-9, with one less every one rounds down to 0."""
    seed, count = 23, 1030
    fields = _model_fields(seed, 0, count, 8)
    word = _model_words(seed, 0, 1)[0]
    assert fields[:4] == [word >> 24, (word >> 16) & 0xFF, (word >> 8) & 0xFF, word & 0xFF]
    at = torch.tensor([(256 - f) * 2.0**-17 for f in fields], dtype=torch.bfloat16)
    below = torch.tensor([(255 - f) * 2.0**-17 for f in fields], dtype=torch.bfloat16)
    assert cast(at, E4M3, True, Generator("cpu", seed)).float().tolist() == [2.0**-9] * count
    assert cast(below, E4M3, True, Generator("cpu", seed)).float().tolist() == [0.0] * count


def test_the_threshold_is_inclusive_on_e4m3_subnormals() -> None:
    """Below 2^-6 an e4m3 step is 2^-9 and ``a = k · 2^-17`` (exact in fp32) has
    ``floor(p · 2^8) = k``: with ``k = 2^8 − f`` for each element's 8-bit field (byte ``i mod 4`` of
    word ``i // 4``, from the top) the sum meets 2^8 and rounds up, one less and it rounds down —
    even with the 12 bits below ``k`` all set (``+ (2^12 − 1) · 2^-29``: fp32 → e4m3 takes the top 8
    of the 20 bits below the step, the rest are truncated)."""
    seed, count = 11, 514
    fields = _model_fields(seed, 0, count, 8)
    word = _model_words(seed, 0, 1)[0]
    assert fields[:4] == [word >> 24, (word >> 16) & 0xFF, (word >> 8) & 0xFF, word & 0xFF]
    at = torch.tensor([(2**8 - f) * 2.0**-17 for f in fields])
    below = torch.tensor([(2**8 - f - 1) * 2.0**-17 + (2**12 - 1) * 2.0**-29 for f in fields])
    assert cast(at, E4M3, True, Generator("cpu", seed)).float().tolist() == [2.0**-9] * count
    assert cast(below, E4M3, True, Generator("cpu", seed)).float().tolist() == [0.0] * count


def test_fp32_to_e4m3_takes_the_top_8_of_the_20_bits_below_a_normal_step() -> None:
    """At 1 an e4m3 step is 2^-3 and ``1 + k · 2^-11`` has ``floor(p · 2^8) = k``: with
    ``k = 2^8 − f`` every element rounds up to 1.125; with one less, and the 12 lowest bits of the
    step all set (``+ (2^12 − 1) · 2^-23``), every one rounds down to 1."""
    seed, count = 13, 514
    fields = _model_fields(seed, 0, count, 8)
    at = torch.tensor([1 + (2**8 - f) * 2.0**-11 for f in fields])
    below = torch.tensor([1 + (2**8 - f - 1) * 2.0**-11 + (2**12 - 1) * 2.0**-23 for f in fields])
    assert cast(at, E4M3, True, Generator("cpu", seed)).float().tolist() == [1.125] * count
    assert cast(below, E4M3, True, Generator("cpu", seed)).float().tolist() == [1.0] * count


@pytest.mark.parametrize("source, target, constant", [
    (torch.float32, torch.bfloat16, 1 + 2.0**-10),
    (torch.float32, torch.bfloat16, -3.14159),
    (torch.float32, E4M3, 0.3),
    (torch.float32, E4M3, -0.0012345),  # e4m3 subnormal steps
    (torch.float32, E4M3, 300.0),
    (torch.bfloat16, E4M3, 3.3),
    (torch.bfloat16, E4M3, -0.003),  # e4m3 subnormal steps, exact on 8 bits from bf16 above 2^-10
], ids=["bf16-near-1", "bf16-pi", "e4m3-0.3", "e4m3-subnormal", "e4m3-300", "bf16-source", "bf16-subnormal"])
def test_unbiased_within_the_statistical_bound(source, target, constant) -> None:
    count = 100_000
    x = torch.full((count,), constant, dtype=source)
    exact = float(x[0].float())
    result = cast(x, target, stochastic_rounding=True, generator=Generator("cpu", 1234)).double()
    low, high = result.min().item(), result.max().item()
    assert set(result.unique().tolist()) <= {low, high} and low <= exact <= high
    share = (exact - low) / (high - low) if high > low else 0.0
    assert 0 < share < 1, "the constant must lie strictly between two targets"
    sigma = (high - low) * math.sqrt(share * (1 - share) / count)
    assert abs(result.mean().item() - exact) <= 5 * sigma
    # the deterministic cast of the same constant is biased by far more than that bound
    nearest = cast(x[:1], target).double().item()
    assert abs(nearest - exact) > 5 * sigma


def test_the_offset_advances_and_selects_the_bits() -> None:
    x = torch.full((4096,), 0.3)
    generator = Generator("cpu", 9)
    first = cast(x, torch.bfloat16, True, generator)
    second = cast(x, torch.bfloat16, True, generator)
    assert generator.offset == 2
    assert not torch.equal(first.view(torch.int16), second.view(torch.int16))
    generator.manual_seed(9)
    assert torch.equal(cast(x, torch.bfloat16, True, generator).view(torch.int16), first.view(torch.int16))
    empty = cast(torch.empty(0, 3), torch.bfloat16, True, generator)
    assert empty.shape == (0, 3) and generator.offset == 1


def test_shape_and_row_major_order_take_words_in_order() -> None:
    x = _edge_values(torch.float32)[:300]
    flat = cast(x, E4M3, True, Generator("cpu", 77))
    shaped = cast(x.reshape(20, 15), E4M3, True, Generator("cpu", 77))
    transposed = cast(x.reshape(15, 20).t(), E4M3, True, Generator("cpu", 77))  # read through a copy
    assert torch.equal(shaped.view(torch.uint8).reshape(-1), flat.view(torch.uint8))
    assert torch.equal(transposed.view(torch.uint8),
                       cast(x.reshape(15, 20).t().contiguous(), E4M3, True, Generator("cpu", 77)).view(torch.uint8))


@pytest.mark.parametrize("source, target", PAIRS, ids=PAIR_IDS)
def test_specials_and_representable_values_as_the_deterministic_cast(source, target) -> None:
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, 448.0, -448.0, 1e6, -1e6, 0.5, -2.0**-9, 1.5],
                            dtype=source)
    if target == torch.bfloat16:
        specials = specials[(specials.abs() != 1e6)]
    for seed in range(8):
        stochastic = cast(specials, target, True, Generator("cpu", seed))
        assert torch.equal(stochastic.view(torch.uint8), cast(specials, target).view(torch.uint8))
    nan = cast(torch.tensor([math.nan, -math.nan], dtype=source), target, True, Generator("cpu", 0))
    assert torch.isnan(nan.float()).all()


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16, E4M3])
@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16, E4M3])
def test_deterministic_cast_of_every_pair(source, target) -> None:
    values = torch.tensor([0.0, -0.0, 1.0, -3.0, 0.3, 448.0, -448.0, 2.0**-9, math.nan, 1000.0, -1e30, math.inf])
    x = values.clamp(-448, 448).to(source) if source == E4M3 else values.to(source)
    result = cast(x, target)
    assert result.dtype == target and result.shape == x.shape and result.is_contiguous()
    assert result.data_ptr() != x.data_ptr()  # a fresh tensor, for an identity cast too
    assert cast(x.reshape(3, 4).t(), target).is_contiguous()
    wide = x.double()
    if target == E4M3:
        wide = wide.clamp(-448, 448)  # saturating; NaN stays NaN
    expected = wide.to(torch.float32).to(target).double() if target != torch.float32 else wide.float().double()
    assert torch.equal(torch.isnan(result.double()), torch.isnan(expected))
    assert torch.equal(result.double().nan_to_num(7.0), expected.nan_to_num(7.0))


def test_deterministic_e4m3_saturates_where_torch_gives_nan() -> None:
    x = torch.tensor([1000.0, -math.inf, 464.0])
    assert cast(x, E4M3).float().tolist() == [448.0, -448.0, 448.0]


def test_the_default_generator_of_the_device() -> None:
    core.random.manual_seed(31, device="cpu")
    x = torch.full((256,), 0.3)
    first = cast(x, E4M3, stochastic_rounding=True)
    assert core.random.default_generator("cpu").offset == 1
    assert torch.equal(first.view(torch.uint8), cast(x, E4M3, True, Generator("cpu", 31)).view(torch.uint8))


def test_compiled_cast_equals_eager() -> None:
    x = _edge_values(torch.float32)
    eager = cast(x, E4M3, True, Generator("cpu", 4))
    generator = Generator("cpu", 4)
    compiled = torch.compile(lambda value: stochastic_cast_into(value, generator), fullgraph=True)
    assert torch.equal(compiled(x).view(torch.uint8), eager.view(torch.uint8))
    assert generator.offset == 1


def stochastic_cast_into(x: torch.Tensor, generator: Generator) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=E4M3)
    stochastic_cast(out, x, generator.seed_state, generator.offset_state)
    return out


def _state() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64)


REFUSALS = [
    ("cast", lambda: cast([1.0], torch.bfloat16), "x"),
    ("cast", lambda: cast(torch.ones(2), torch.float16), "dtype"),
    ("cast", lambda: cast(torch.ones(2, dtype=torch.int32), torch.bfloat16), "x"),
    ("cast", lambda: cast(torch.ones(2), torch.bfloat16, stochastic_rounding=1), "stochastic_rounding"),
    ("cast", lambda: cast(torch.ones(2), torch.bfloat16, generator=Generator("cpu")), "generator"),
    ("cast", lambda: cast(torch.ones(2, dtype=torch.bfloat16), torch.float32, True), "dtype"),
    ("cast", lambda: cast(torch.ones(2), torch.float32, True), "dtype"),
    ("cast", lambda: cast(torch.ones(2).to(E4M3), torch.bfloat16, True), "dtype"),
    ("cast", lambda: cast(torch.ones(2), torch.bfloat16, True, generator=object()), "generator"),
    ("cast", lambda: cast(torch.ones(2), torch.bfloat16, True, generator=Generator("meta")), "generator"),
    ("stochastic_cast", lambda: stochastic_cast(torch.empty(2, dtype=E4M3), torch.ones(2, dtype=torch.float16),
                                                _state(), _state()), "x"),
    ("stochastic_cast", lambda: stochastic_cast(torch.empty(4, dtype=E4M3), torch.ones(4, 2).t(),
                                                _state(), _state()), "x"),
    ("stochastic_cast", lambda: stochastic_cast(torch.empty(2, dtype=torch.bfloat16),
                                                torch.ones(2, dtype=torch.bfloat16), _state(), _state()), "result"),
    ("stochastic_cast", lambda: stochastic_cast(torch.empty(3, dtype=E4M3), torch.ones(2), _state(), _state()), "result"),
    ("stochastic_cast", lambda: stochastic_cast(torch.empty(4, 2, dtype=E4M3).t(), torch.ones(2, 4),
                                                _state(), _state()), "result"),
    ("stochastic_cast", lambda: stochastic_cast(torch.empty(2, dtype=E4M3), torch.ones(2),
                                                torch.zeros(1, dtype=torch.int32), _state()), "seed"),
    ("stochastic_cast", lambda: stochastic_cast(torch.empty(2, dtype=E4M3), torch.ones(2), _state(),
                                                torch.zeros(2, dtype=torch.int64)), "offset"),
    ("stochastic_cast", lambda: stochastic_cast(torch.empty(2, dtype=E4M3), torch.ones(2), _state(),
                                                torch.zeros(1, dtype=torch.int64, device="meta")), "offset"),
]


def _shared_state() -> None:
    state = _state()
    stochastic_cast(torch.empty(2, dtype=E4M3), torch.ones(2), state, state)


def _overlapping_out() -> None:
    x = torch.ones(4)
    stochastic_cast(x.view(torch.int32).view(torch.float32)[:2].view(torch.uint8)[:2].view(E4M3), x[:2],
                    _state(), _state())


REFUSALS += [
    ("stochastic_cast", _shared_state, "offset"),
    ("stochastic_cast", _overlapping_out, "result"),
    ("nearest_cast", lambda: nearest_cast(torch.empty(2), [1.0, 2.0]), "x"),
    ("nearest_cast", lambda: nearest_cast(torch.empty(2), torch.ones(2, dtype=torch.float16)), "x"),
    ("nearest_cast", lambda: nearest_cast(torch.empty(2, dtype=torch.int32), torch.ones(2)), "result"),
    ("nearest_cast", lambda: nearest_cast(torch.empty(3, dtype=E4M3), torch.ones(2)), "result"),
    ("nearest_cast", lambda: nearest_cast(torch.empty(4, dtype=E4M3), torch.ones(4, 2).t()), "x"),
    ("nearest_cast", lambda: nearest_cast(torch.empty(2, 4, dtype=E4M3).t(), torch.ones(4, 2)), "result"),
    ("nearest_cast", lambda: (lambda x: nearest_cast(x[1:], x[:-1]))(torch.ones(5)), "result"),
]


@pytest.mark.parametrize("op, call, argument", REFUSALS, ids=[f"{i}-{a}" for i, (_, _, a) in enumerate(REFUSALS)])
def test_refusals_name_the_argument(op, call, argument) -> None:
    with pytest.raises(ContractError) as raised:
        call()
    assert raised.value.op == op and raised.value.argument == argument, str(raised.value)
