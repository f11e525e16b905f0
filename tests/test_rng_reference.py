"""Random numbers on the reference (SPEC §9): Philox4x32-10 against the Random123 known-answer
vectors and an independent pure-Python implementation, the counter layout, the offset's
advance, the uniform and Box–Muller transforms, their distributions, and the contracts."""

from __future__ import annotations

import math
import random as python_random

import pytest
import torch

from tileplug import core
from tileplug.core import ContractError
from tileplug.core.ops import fill_rand, fill_randn
from tileplug.core.random import Generator, manual_seed, rand, rand_like, randn, randn_like
from tileplug.core.testing import PHILOX_KNOWN_ANSWERS, philox4x32_10_words
from tileplug.reference.random import philox

MASK = 0xFFFFFFFF


philox_in_python = philox4x32_10_words
"""The independent Philox on Python ints (``tileplug.core.testing``)."""


def philox_in_torch(counter: tuple[int, ...], key: tuple[int, ...]) -> tuple[int, ...]:
    as_tensor = lambda value: torch.tensor([value], dtype=torch.int64)  # noqa: E731
    words = philox.philox4x32_10(tuple(map(as_tensor, counter)), tuple(map(as_tensor, key)))
    return tuple(int(word) for word in words)


KNOWN_ANSWERS = PHILOX_KNOWN_ANSWERS


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS, ids=["zeros", "ones", "pi"])
def test_known_answer_vectors(counter, key, expected) -> None:
    assert philox_in_python(counter, key) == expected
    assert philox_in_torch(counter, key) == expected


def test_torch_philox_equals_the_python_one_on_random_blocks() -> None:
    """Vectorised over 512 blocks of random counters and keys (every word up to 2^32 − 1: the
    int64 products of 16-bit halves never overflow)."""
    chooser = python_random.Random(12)
    counters = [tuple(chooser.getrandbits(32) for _ in range(4)) for _ in range(512)]
    keys = [tuple(chooser.getrandbits(32) for _ in range(2)) for _ in range(512)]
    counters[0], keys[0] = (MASK,) * 4, (MASK, MASK)
    columns = [torch.tensor([c[i] for c in counters], dtype=torch.int64) for i in range(4)]
    key_columns = [torch.tensor([k[i] for k in keys], dtype=torch.int64) for i in range(2)]
    got = torch.stack(philox.philox4x32_10(tuple(columns), tuple(key_columns)), dim=1).tolist()
    assert got == [list(philox_in_python(c, k)) for c, k in zip(counters, keys)]
    assert min(min(row) for row in got) >= 0 and max(max(row) for row in got) <= MASK


def expected_words(seed: int, offset: int, count: int) -> list[int]:
    """SPEC §9's layout in Python: element 4b + i is word i of block b under key (seed lo, seed hi)
    and counter (b lo, b hi, offset lo, offset hi); the last block's tail is dropped."""
    flat: list[int] = []
    for block in range((count + 3) // 4):
        flat += philox_in_python((block & MASK, block >> 32, offset & MASK, offset >> 32), (seed & MASK, seed >> 32))
    return flat[:count]


SEEDS_AND_OFFSETS = [(0, 0), (1234, 1), (2**64 - 1, 2**64 - 1), (0x0123456789ABCDEF, 2**32 + 5),
                     (2**63, 2**63 - 1)]


@pytest.mark.parametrize("seed, offset", SEEDS_AND_OFFSETS)
@pytest.mark.parametrize("count", [1, 4, 23, 4001])
def test_counter_layout_and_uniform_values(seed, offset, count) -> None:
    """``rand`` element i = (r_i >> 8)·2^-24 of the words of the layout, bit for bit; the
    offset then advances by one (mod 2^64)."""
    generator = Generator("cpu", seed)
    generator.offset = offset
    words = expected_words(seed, offset, count)
    values = rand(count, generator=generator)
    assert values.dtype == torch.float32 and values.shape == (count,)
    assert values.tolist() == [(word >> 8) * 2.0**-24 for word in words]
    assert generator.offset == (offset + 1) % 2**64 and generator.seed == seed
    generator.offset = offset
    assert philox.words(generator.seed_state, generator.offset_state, count).tolist() == words


def test_uniform_extremes_are_exact() -> None:
    """The transform maps the smallest and largest 24-bit codes to 0 and 1 − 2^-24."""
    from tileplug.reference.random.draw import uniform_from_words

    codes = torch.tensor([0, 255, 256, MASK, MASK - 255], dtype=torch.int64)
    assert uniform_from_words(codes).tolist() == [0.0, 0.0, 2.0**-24, 1 - 2.0**-24, 1 - 2.0**-24]


def test_same_seed_offset_and_shape_give_the_same_bytes_and_the_shape_only_counts_elements() -> None:
    first, second = Generator("cpu", 99), Generator("cpu", 99)
    a = randn(3, 7, generator=first)
    b = randn((3, 7), generator=second)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    third = Generator("cpu", 99)
    assert torch.equal(randn(21, generator=third).view(3, 7), a)  # row-major: element i is draw element i
    assert not torch.equal(randn(3, 7, generator=first), a)  # offset 1: fresh numbers
    assert not torch.equal(randn(3, 7, generator=Generator("cpu", 100)), a)


def test_offset_advances_by_one_per_call_and_manual_seed_resets() -> None:
    generator = Generator("cpu", 7)
    draws = [rand(5, generator=generator) for _ in range(3)]
    assert generator.offset == 3
    for offset, values in enumerate(draws):
        assert values.tolist() == [(w >> 8) * 2.0**-24 for w in expected_words(7, offset, 5)]
    state = generator.offset_state
    generator.manual_seed(7)
    assert generator.offset == 0 and generator.offset_state is state  # the same device tensor, refilled
    assert torch.equal(rand(5, generator=generator), draws[0])
    randn(2, 2, generator=generator)
    assert generator.offset == 2  # rand and randn share the counter
    generator.manual_seed(8)
    assert generator.seed == 8 and generator.offset == 0
    assert rand(5, generator=generator).tolist() == [(w >> 8) * 2.0**-24 for w in expected_words(8, 0, 5)]


def test_an_empty_draw_launches_nothing_and_keeps_the_offset() -> None:
    generator = Generator("cpu", 3)
    assert rand(0, 4, generator=generator).shape == (0, 4)
    assert randn(0, generator=generator).shape == (0,)
    assert generator.offset == 0


def test_default_generators_and_manual_seed() -> None:
    manual_seed(2024)
    default = core.random.default_generator("cpu")
    assert default.seed == 2024 and default.offset == 0
    first = rand(6)
    assert first.tolist() == [(w >> 8) * 2.0**-24 for w in expected_words(2024, 0, 6)]
    assert default.offset == 1
    assert manual_seed(2024, device="cpu") is default and default.offset == 0
    assert torch.equal(rand(6, device="cpu"), first)
    manual_seed(2024)
    assert torch.equal(rand_like(torch.zeros(2, 3)), first.view(2, 3))
    manual_seed(0)


def test_a_cuda_generator_is_refused_during_a_graph_capture(monkeypatch) -> None:
    """Its state's fills would be nodes of the captured graph, unset until the first replay: a generator (the
    default one too, made by a first draw) is made before the capture; outside one it is made as before."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before capturing a CUDA graph"):
        Generator("cuda:0", 5)
    monkeypatch.setattr(core.random, "_defaults", {})
    with pytest.raises(RuntimeError, match="make the generator .the default one: by a first draw."):
        core.random.default_generator(torch.device("cuda", 0))
    assert core.random._defaults == {}
    assert Generator("cpu", 5).seed == 5  # the check reads the capture state of CUDA devices only


def test_like_draws_take_shape_device_and_dtype() -> None:
    generator = Generator("cpu", 5)
    template = torch.zeros(4, 3, dtype=torch.float16)
    values = randn_like(template, generator=generator)
    assert values.shape == (4, 3) and values.dtype == torch.float16
    generator.manual_seed(5)
    assert torch.equal(values, randn(4, 3, dtype=torch.float16, generator=generator))
    assert rand_like(template, dtype=torch.float32, generator=generator).dtype == torch.float32


def _ulp_distance_bound(z32: torch.Tensor, z64: torch.Tensor, ulps: int) -> torch.Tensor:
    """Elements of fp32 ``z32`` within ``ulps`` fp32 ulp of fp64 ``z64`` (ulp at |z64|)."""
    exponent = torch.floor(torch.log2(z64.abs().clamp_min(2.0**-126)))
    ulp = torch.pow(2.0, exponent - 23)
    return (z32.double() - z64).abs() <= ulps * ulp


@pytest.mark.parametrize("seed, offset", [(0, 0), (0xDEADBEEFCAFEF00D, 2**40 + 3)])
def test_randn_is_box_muller_of_the_words_within_2_ulp_of_fp64(seed, offset) -> None:
    """Each block's pairs (r0, r1), (r2, r3): a = ((r_even >> 8) + 1)·2^-24, t = (r_odd >> 8)·2^-24,
    z_even = sqrt(−2 ln a)·cos(2πt), z_odd = sqrt(−2 ln a)·sin(2πt), against the same formula in
    fp64 (where the fp64 formula gives a value below 1e-12 — its own error at an exact zero of
    cos or sin, where 2π is rounded — the reference must be within 1e-12 too)."""
    count = 200_003
    generator = Generator("cpu", seed)
    generator.offset = offset
    z32 = randn(count, generator=generator)
    generator.offset = offset
    words = philox.words(generator.seed_state, generator.offset_state, count + 1)  # whole pairs
    even, odd = words[0::2] >> 8, words[1::2] >> 8
    radius = torch.sqrt(-2.0 * torch.log((even + 1).double() * 2.0**-24))
    angle = 2 * math.pi * (odd.double() * 2.0**-24)
    z64 = torch.stack((radius * torch.cos(angle), radius * torch.sin(angle)), dim=1).reshape(-1)[:count]
    tiny = z64.abs() < 1e-12
    assert bool((z32.double() - z64).abs()[tiny].le(1e-12).all())
    close = _ulp_distance_bound(z32, z64, 2) | tiny
    assert bool(close.all()), f"{int((~close).sum())} elements beyond 2 ulp, first at {int((~close).nonzero()[0])}"
    assert bool(torch.isfinite(z32).all())


def test_randn_hits_the_exact_zeros_of_cos_and_sin() -> None:
    """t = 1/4 (r_odd >> 8 = 2^22) makes cos(2πt) exactly 0 (+0.0), t = 0 makes sin exactly 0."""
    from tileplug.reference.random.draw import normal_from_block_words

    block = torch.tensor([[0, (1 << 22) << 8, 5 << 8, 0]], dtype=torch.int64)
    z = normal_from_block_words(block)
    radius0 = math.sqrt(-2 * math.log(2.0**-24))
    assert z[0].item() == 0.0 and math.copysign(1.0, z[0].item()) == 1.0
    assert z[1].item() == pytest.approx(radius0, rel=1e-7)
    assert z[3].item() == 0.0 and z[2].item() == pytest.approx(math.sqrt(-2 * math.log(6 * 2.0**-24)), rel=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("draw", [rand, randn], ids=["rand", "randn"])
def test_16_bit_draws_are_the_fp32_draw_rounded_once(draw, dtype) -> None:
    fp32 = draw(3, 1001, generator=Generator("cpu", 31))
    narrow = draw(3, 1001, dtype=dtype, generator=Generator("cpu", 31))
    assert narrow.dtype == dtype
    assert torch.equal(narrow.view(torch.int16), fp32.to(dtype).view(torch.int16))


def _ks_statistic(samples: torch.Tensor, cdf) -> float:
    """Kolmogorov–Smirnov distance between the samples' empirical CDF and ``cdf`` (fp64)."""
    ordered = torch.sort(samples.double()).values
    n = ordered.numel()
    model = cdf(ordered)
    steps = torch.arange(1, n + 1, dtype=torch.float64) / n
    return max(float((steps - model).max()), float((model - (steps - 1.0 / n)).max()))


SAMPLES = 1_000_000
KS_LIMIT = 1.95 / math.sqrt(SAMPLES)  # the 0.1 % critical value of the KS distance
_uniform_cdf = lambda x: x.clamp(0, 1)  # noqa: E731
_normal_cdf = torch.special.ndtr


@pytest.mark.parametrize("seed", [1, 0xFEEDFACE12345678])
def test_uniform_distribution(seed) -> None:
    u = rand(SAMPLES, generator=Generator("cpu", seed))
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.double().mean()) - 0.5) < 5 * math.sqrt(1 / 12 / SAMPLES)
    assert abs(float(u.double().var()) - 1 / 12) < 5 * math.sqrt(1 / 180 / SAMPLES)
    assert _ks_statistic(u, _uniform_cdf) < KS_LIMIT


@pytest.mark.parametrize("seed", [2, 0x0BADC0FFEE0DDF00])
def test_normal_distribution_and_its_thresholds_reject_wrong_transforms(seed) -> None:
    z = randn(SAMPLES, generator=Generator("cpu", seed))
    assert abs(float(z.double().mean())) < 5 / math.sqrt(SAMPLES)
    assert abs(float(z.double().var()) - 1.0) < 5 * math.sqrt(2 / SAMPLES)
    assert _ks_statistic(z, _normal_cdf) < KS_LIMIT
    for half in (z[0::2], z[1::2]):  # the cos and the sin halves each normal
        assert _ks_statistic(half, _normal_cdf) < 1.95 / math.sqrt(half.numel())
    # the same words through wrong transforms: the thresholds above reject them
    words = philox.words(torch.tensor([seed - 2**64 if seed >= 2**63 else seed]), torch.zeros(1, dtype=torch.int64),
                         SAMPLES)
    a = ((words[0::2] >> 8) + 1).double() * 2.0**-24
    t = (words[1::2] >> 8).double() * 2.0**-24
    no_two = torch.sqrt(-torch.log(a)) * torch.cos(2 * math.pi * t)  # sqrt(−ln a): variance 1/2
    assert abs(float(no_two.var()) - 1.0) > 5 * math.sqrt(2 / SAMPLES)
    # mean 0 and variance 1 but uniform: only the KS distance tells it from a normal
    unit_variance_uniform = ((words >> 8).double() * 2.0**-24 * 2 - 1) * math.sqrt(3)
    assert abs(float(unit_variance_uniform.mean())) < 5 / math.sqrt(SAMPLES)
    assert abs(float(unit_variance_uniform.var()) - 1.0) < 5 * math.sqrt(2 / SAMPLES)
    assert _ks_statistic(unit_variance_uniform, _normal_cdf) > KS_LIMIT
    as_uniform = (words >> 8).double() * 2.0**-24 * 2 - 1  # no transform at all
    assert _ks_statistic(as_uniform, _normal_cdf) > KS_LIMIT


def test_draws_go_through_the_op_table_and_the_compiled_graph_advances_the_offset() -> None:
    """``fill_rand`` / ``fill_randn`` are table ops (``torch.ops.tileplug.*``, mutating the
    values and the offset); a ``torch.compile(fullgraph=True)`` draw reads the offset tensor on
    every call, so each call gives the next draw, as eager does."""
    assert core.opdefs.get("fill_rand").mutates == ("values", "offset")
    assert core.registry.route(core.describe_call("fill_randn", torch.empty(4), torch.zeros(1, dtype=torch.int64),
                                                  torch.zeros(1, dtype=torch.int64))[0]).backend.name == "reference"
    generator = Generator("cpu", 77)
    compiled = torch.compile(lambda: randn(9, generator=generator), fullgraph=True)
    first, second = compiled(), compiled()
    assert generator.offset == 2
    eager = Generator("cpu", 77)
    assert torch.equal(first, randn(9, generator=eager)) and torch.equal(second, randn(9, generator=eager))


def test_fill_writes_in_place_and_keeps_a_grad_leaf_a_leaf() -> None:
    values = torch.zeros(2, 6, requires_grad=True)
    seed, offset = torch.tensor([11], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    assert fill_rand(values, seed, offset) is None
    assert values.is_leaf and values.grad_fn is None and int(offset) == 1
    assert values.detach().reshape(-1).tolist() == [(w >> 8) * 2.0**-24 for w in expected_words(11, 0, 12)]


def _bad_calls():
    cpu, state = torch.empty(4), torch.zeros(1, dtype=torch.int64)
    return [
        ("size", lambda: rand(-1)),
        ("size", lambda: randn(2, -3)),
        ("size", lambda: rand(2.0)),
        ("size", lambda: rand((2, "a"))),
        ("dtype", lambda: rand(3, dtype=torch.float64)),
        ("dtype", lambda: randn(3, dtype=torch.int32)),
        ("dtype", lambda: randn(3, dtype=torch.float8_e4m3fn)),
        ("generator", lambda: randn(3, device="meta", generator=Generator("cpu"))),
        ("generator", lambda: rand(3, generator="not a generator")),
        ("seed", lambda: manual_seed(-1)),
        ("seed", lambda: manual_seed(2**64)),
        ("seed", lambda: manual_seed(1.5)),
        ("seed", lambda: manual_seed(True)),
        ("seed", lambda: Generator("cpu", seed=-5)),
        ("seed", lambda: Generator("cpu", seed=2**64)),
        ("seed", lambda: Generator("cpu").manual_seed("7")),
        ("offset", lambda: setattr(Generator("cpu"), "offset", -1)),
        ("device", lambda: Generator("no-such-device")),
        ("tensor", lambda: rand_like(torch.zeros(3, dtype=torch.int64))),
        ("tensor", lambda: randn_like([1.0, 2.0])),
        ("values", lambda: fill_rand(torch.empty(4, dtype=torch.float64), state.clone(), state.clone())),
        ("values", lambda: fill_randn(torch.empty(4, 4).t(), state.clone(), state.clone())),
        ("seed", lambda: fill_rand(cpu, torch.zeros(1, dtype=torch.int32), state.clone())),
        ("seed", lambda: fill_rand(cpu, torch.zeros(1, dtype=torch.int64, device="meta"), state.clone())),
        ("offset", lambda: fill_rand(cpu, state.clone(), torch.zeros(2, dtype=torch.int64))),
        ("offset", lambda: fill_randn(cpu, state, state)),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_inputs_raise_contract_errors_naming_the_argument(index) -> None:
    name, call = _bad_calls()[index]
    with pytest.raises(ContractError) as caught:
        call()
    assert caught.value.argument == name
    assert f"argument '{name}'" in str(caught.value)
