"""Ascend random-number kernels (``fill_rand``, ``fill_randn``) on an NPU against the
reference (marker ``npu``).

Skipped everywhere without an Ascend NPU (tests/conftest.py gives the reason). On an Ascend
950 host with torch_npu they run unchanged: Random123's known-answer vector that a draw can
reach (counter word 1 is ``b >> 32``, 0 below 2^32 blocks, so the "zeros" vector; the words
of the others are checked through the reference, which reproduces all three), ``rand``
bytewise and ``randn`` within 2 ulp of fp32 of the reference at counts around every tile and
group boundary, nothing written past the tensor, the offset advanced by one on the device
(wrapping at 2^64), a captured graph drawing new numbers on each replay, and the mean,
variance and Kolmogorov–Smirnov distance of 10^6 samples. Until these pass there, the Ascend
RNG kernels are "lowered", never "verified".
"""

from __future__ import annotations

import math

import pytest
import torch

from tileplug import core
from tileplug.core.random import Generator, rand, randn
from tileplug.core.testing import assert_bytes_equal, assert_within_ulps
from tileplug.reference.conformance import CaseDeclined, check_case

from test_rng_reference import KS_LIMIT, SAMPLES, _ks_statistic  # tests/: the reference's distribution checks

pytestmark = pytest.mark.npu

COUNTS = (1, 3, 4, 5, 255, 256, 257, 4095, 4096, 4097, 64 * 4096 + 13, 1_000_003)
SEEDS_AND_OFFSETS = ((0, 0), (2**64 - 1, 2**64 - 2), (0x243F6A8885A308D3, 2**32 + 5), (0xA4093822299F31D0, 7))
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _generator(device, seed, offset) -> Generator:
    generator = Generator(device, seed)
    generator.offset = offset
    return generator


def _draw(draw, count, dtype, seed, offset, backend):
    device = "npu" if backend == "ascend" else "cpu"
    generator = _generator(device, seed, offset)
    with core.use_backend(backend):
        values = draw(count, dtype=dtype, generator=generator)
    return values.cpu(), generator.offset


def _cases() -> list:
    return [(case, tokens) for name in ("fill_rand", "fill_randn") for case in core.opdefs.get(name).cases()
            for tokens in (0, 1, 3, 129, 4001)]


@pytest.mark.parametrize("case,tokens", _cases(), ids=lambda v: v.id if hasattr(v, "id") else f"T={v}")
def test_matches_reference(case, tokens):
    """Every op-table case against the reference (the op's ``compare``: rand bytewise, randn 2 ulp)."""
    try:
        check_case(case, tokens, "ascend", "npu")
    except CaseDeclined as declined:
        pytest.skip(str(declined))


def test_known_answer_vector_zeros():
    """Seed 0, offset 0: block 0's words are Random123's (0x6627E8D5, 0xE169C58D, 0xBC57AC4C,
    0x9B00DBD8); ``rand`` shows their top 24 bits exactly."""
    values, _ = _draw(rand, 4, torch.float32, 0, 0, "ascend")
    assert (values.double() * 2**24).long().tolist() == [w >> 8 for w in (0x6627E8D5, 0xE169C58D, 0xBC57AC4C,
                                                                          0x9B00DBD8)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed,offset", SEEDS_AND_OFFSETS)
@pytest.mark.parametrize("draw", [rand, randn], ids=["rand", "randn"])
def test_matches_the_reference_around_every_boundary(draw, seed, offset, dtype):
    """Counts around every group (256) and tile (4096) boundary: rand bytewise; randn within
    2 ulp of fp32 (the transcendentals), a 16-bit dtype within 1 ulp, never NaN; the offset
    advanced by one (mod 2^64) as the reference's."""
    for count in COUNTS:
        got, got_offset = _draw(draw, count, dtype, seed, offset, "ascend")
        want, want_offset = _draw(draw, count, dtype, seed, offset, "reference")
        assert got_offset == want_offset == (offset + 1) % 2**64
        if draw is rand:
            assert_bytes_equal(got, want, f"rand count={count}")
        else:
            assert not torch.isnan(got.float()).any()
            assert_within_ulps(got, want, 2 if dtype == torch.float32 else 1, what=f"randn count={count}",
                               nan_equal=False)


@pytest.mark.parametrize("draw", [core.ops.fill_rand, core.ops.fill_randn], ids=["rand", "randn"])
def test_nothing_is_written_past_the_tensor(draw):
    """A draw into a prefix of a larger buffer leaves the rest (NaN) untouched, at every tail length."""
    for count in (1, 5, 257, 4097, 8191):
        buffer = torch.full((count + 4096,), float("nan"), device="npu")
        generator = Generator("npu", 5)
        with core.use_backend("ascend"):
            draw(buffer[:count], generator.seed_state, generator.offset_state)
        host = buffer.cpu()
        assert not torch.isnan(host[:count]).any() and torch.isnan(host[count:]).all()


def test_offset_advances_on_the_device_and_a_graph_replay_draws_new_numbers():
    """The offset is read and advanced on the device (seed unchanged; empty draws leave it);
    a captured NPU graph, replayed, gives the next draws."""
    generator = Generator("npu", 11)
    with core.use_backend("ascend"):
        first = rand(1000, generator=generator)
        second = rand(1000, generator=generator)
        rand(0, generator=generator)
    assert generator.offset == 2 and generator.seed == 11 and not torch.equal(first, second)
    if not hasattr(torch.npu, "NPUGraph"):
        pytest.skip("torch_npu has no NPUGraph")
    out = torch.empty(1000, device="npu")
    graph = torch.npu.NPUGraph()
    with core.use_backend("ascend"), torch.npu.graph(graph):
        core.ops.fill_rand(out, generator.seed_state, generator.offset_state)
    start = generator.offset
    replays = []
    for _ in range(2):
        graph.replay()
        replays.append(out.cpu().clone())
    assert generator.offset == start + 2 and not torch.equal(replays[0], replays[1])
    with core.use_backend("reference"):
        expected = rand(1000, generator=_generator("cpu", 11, start + 1))
    assert_bytes_equal(replays[1], expected, "second replay")


@pytest.mark.parametrize("seed", [1, 0xFEEDFACE12345678])
def test_distributions(seed):
    u, _ = _draw(rand, SAMPLES, torch.float32, seed, 0, "ascend")
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.double().mean()) - 0.5) < 5 * math.sqrt(1 / 12 / SAMPLES)
    assert abs(float(u.double().var()) - 1 / 12) < 5 * math.sqrt(1 / 180 / SAMPLES)
    assert _ks_statistic(u, lambda x: x.clamp(0, 1)) < KS_LIMIT
    z, _ = _draw(randn, SAMPLES, torch.float32, seed, 0, "ascend")
    assert abs(float(z.double().mean())) < 5 / math.sqrt(SAMPLES)
    assert abs(float(z.double().var()) - 1.0) < 5 * math.sqrt(2 / SAMPLES)
    assert _ks_statistic(z, torch.special.ndtr) < KS_LIMIT
