"""CUDA re-blocking ops (docs/spec.md §11) against the reference, bytewise, on inputs the
op-table grid (powers of two only) does not hold.

``transpose_weight_sf``: every class of scale the byte rule distinguishes, shapes whose R or C
is not a multiple of the pack factor, stacked groups, several weights in one call,
``transpose_sf1`` and ``out=`` reuse. ``per_block_cast_lossless``: every op-table case with its
input scales replaced by those same special values (fp32: zeros of both signs, subnormals,
non-powers of two, infinities, NaN, negatives; packed UE8M0: every byte, 0xFF included) and
every e2m1 code in the data.

    . .gpu-bundle/prelude.sh && python3 -m pytest tests/gpu/test_cuda_reblock.py -m gpu
"""

from __future__ import annotations

import pytest
import torch

from tileplug import core
from tileplug.core.registry import use_backend
from tileplug.core.testing import assert_bytes_equal

pytestmark = pytest.mark.gpu

BLOCKS = (16, 32, 64, 128)


def special_scales() -> torch.Tensor:
    """fp32 values covering each branch of the UE8M0 byte: zero of both signs, subnormals on both
    sides of 2^-127, the smallest normal, powers of two and their neighbours, 2^127 and above,
    infinities, NaN, negative values."""
    tiny = torch.finfo(torch.float32).tiny
    values = [0.0, -0.0, 2.0 ** -149, 2.0 ** -128, 2.0 ** -127, 2.0 ** -127 * (1 + 2 ** -22), 2.0 ** -126 * 0.75,
              tiny, tiny * (1 + 2 ** -23), 1.0, 1.0 + 2 ** -23, 1.5, 2.0 - 2 ** -23, 0.5, 3.0, 448.0,
              2.0 ** 127, 2.0 ** 127 * (1 + 2 ** -23), torch.finfo(torch.float32).max, float("inf"), float("-inf"),
              float("nan"), -1.0, -2.0 ** -140, 2.0 ** -30, 2.0 ** 10]
    return torch.tensor(values, dtype=torch.float32)


def scales_of(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random picks among the special scales and random fp32 values of any magnitude."""
    generator = torch.Generator().manual_seed(seed)
    specials = special_scales()
    picks = specials[torch.randint(0, specials.numel(), shape, generator=generator)]
    exponents = torch.randint(-140, 128, shape, generator=generator).float()
    random = torch.ldexp(torch.rand(shape, generator=generator) + 0.5, exponents)
    return torch.where(torch.rand(shape, generator=generator) < 0.5, picks, random)


def both(sf, block: int, transpose_sf1: bool = False):
    """(cuda outputs, reference outputs) of the same call."""
    on_gpu = tuple(s.cuda() for s in sf) if isinstance(sf, tuple) else sf.cuda()
    with use_backend("cuda"):
        have = core.ops.transpose_weight_sf(on_gpu, block, transpose_sf1)
    with use_backend("reference"):
        want = core.ops.transpose_weight_sf(sf, block, transpose_sf1)
    return have, want


def test_the_cuda_backend_serves_it() -> None:
    call, _ = core.describe_call("transpose_weight_sf", torch.ones(3, 5, device="cuda"), 128)
    assert core.registry.route(call).backend.name == "cuda"


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (4, 4), (7, 9), (56, 56), (57, 13), (2, 5, 6), (3, 9, 4)],
                         ids=str)
@pytest.mark.parametrize("transpose_sf1", [False, True])
def test_special_scales_bytewise(block: int, shape: tuple[int, ...], transpose_sf1: bool) -> None:
    sf = scales_of(shape, seed=block * 131 + shape[-1] * 7 + len(shape))
    have, want = both(sf, block, transpose_sf1)
    assert len(have) == len(want) == 2
    for h, w in zip(have, want):
        assert_bytes_equal(h.cpu(), w, strides=True)


def test_every_special_value_in_every_byte_position() -> None:
    """Each special value at each of the four byte positions of an integer, in sf0 and sf1."""
    specials = special_scales()
    count = specials.numel()
    sf = torch.stack([specials.roll(shift) for shift in range(8)])  # [8, count]: every (row, column) mix
    for block in BLOCKS:
        have, want = both(sf, block)
        for h, w in zip(have, want):
            assert_bytes_equal(h.cpu(), w, strides=True)
    assert count > 20


def test_several_weights_one_call_and_out_reuse() -> None:
    weights = (scales_of((5, 7), 1), scales_of((2, 3, 9), 2), scales_of((0, 4), 3), scales_of((8, 8), 4))
    have, want = both(weights, 32)
    assert len(have) == 8
    for h, w in zip(have, want):
        assert_bytes_equal(h.cpu(), w, strides=True)
    on_gpu = tuple(s.cuda() for s in weights)
    out = tuple(torch.full_like(t, -1) for t in have)
    with use_backend("cuda"):
        again = core.ops.transpose_weight_sf(on_gpu, 32, out=out)
    for given, returned, w in zip(out, again, want):
        assert returned.data_ptr() == given.data_ptr()
        assert_bytes_equal(returned.cpu(), w, strides=True)


def test_large_stacked_weights_bytewise() -> None:
    """A DeepSeek-size expert stack: 64 experts of [2048, 7168] weights at bs 128 (sf [64, 16, 56])."""
    sf = scales_of((64, 16, 56), 5)
    have, want = both(sf, 128)
    for h, w in zip(have, want):
        assert_bytes_equal(h.cpu(), w, strides=True)


def test_graph_capture_replays() -> None:
    sf = scales_of((9, 11), 6).cuda()
    with use_backend("cuda"):
        sf0, sf1 = core.ops.transpose_weight_sf(sf, 64)
        out = (torch.empty_like(sf0), torch.empty_like(sf1))
        core.ops.transpose_weight_sf(sf, 64, out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            core.ops.transpose_weight_sf(sf, 64, out=out)
        sf.copy_(scales_of((9, 11), 7).cuda())
        graph.replay()
        torch.cuda.synchronize()
    with use_backend("reference"):
        want = core.ops.transpose_weight_sf(sf.cpu(), 64)
    for h, w in zip(out, want):
        assert_bytes_equal(h.cpu(), w, strides=True)


# ---------------------------------------------------------------------- per_block_cast_lossless


def _lossless_cases() -> list:
    from tileplug.core import opdefs

    return opdefs.get("per_block_cast_lossless").cases()


def _special_lossless_arguments(case, tokens: int, seed: int):
    """The case's arguments at ``tokens`` rows (made by the CPU reference in the CUDA sf layout),
    the data bytes replaced by random ones (every e2m1 code) and the input scales spread over
    the binades: fp32 scales times random powers of two, a fifth of them off the powers of two,
    5% special values (:func:`special_scales`) in the first third of the scale rows; UE8M0 bytes
    around 127 with 0x00 sprinkled in, and any byte (0xFF too) in that first third. Strides kept: the
    groups below the first third stay finite."""
    from tileplug.core import config

    with use_backend("reference"), config.host_layout("cuda"):
        args, kwargs = case.arguments(tokens, "cpu")
    (xq, sf), = args
    generator = torch.Generator().manual_seed(seed)
    xq.copy_(torch.randint(-128, 128, xq.shape, generator=generator, dtype=torch.int8))
    draw = lambda: torch.rand(sf.shape, generator=generator)  # noqa: E731
    top = (torch.arange(sf.shape[0]) < max(1, sf.shape[0] // 3)).reshape(-1, 1)  # where non-finite may go
    if sf.dtype == torch.float32:
        specials = special_scales()
        picks = specials[torch.randint(0, specials.numel(), sf.shape, generator=generator)]
        spread = sf * torch.ldexp(torch.ones(sf.shape), torch.randint(-12, 13, sf.shape, generator=generator).float())
        spread = torch.where(draw() < 0.2, spread * (1 + draw()), spread)
        sf.copy_(torch.where((draw() < 0.05) & top, picks, spread))
    else:
        raw = torch.randint(110, 145, (*sf.shape, 4), generator=generator, dtype=torch.int32)
        choice = torch.rand(raw.shape, generator=generator)
        anything = torch.randint(0, 256, raw.shape, generator=generator, dtype=torch.int32)
        top_bytes = top.unsqueeze(-1)
        raw = torch.where(choice < 0.02, 0, torch.where((choice < 0.04) & top_bytes, 255,
                                                         torch.where((choice < 0.1) & top_bytes, anything, raw)))
        packed = raw[..., 0] | (raw[..., 1] << 8) | (raw[..., 2] << 16) | (raw[..., 3] << 24)
        sf.copy_(packed.to(torch.int32))
    return (xq, sf), kwargs


def test_the_cuda_backend_serves_lossless_reblocking() -> None:
    for case in _lossless_cases():
        pair, kwargs = _special_lossless_arguments(case, 3, seed=0)
        call, _ = core.describe_call("per_block_cast_lossless", tuple(t.cuda() for t in pair), **kwargs)
        assert core.registry.route(call).backend.name == "cuda", case.id


@pytest.mark.parametrize("tokens", [1, 259])
@pytest.mark.parametrize("index", range(len(_lossless_cases())), ids=lambda i: _lossless_cases()[i].id)
def test_lossless_special_input_scales_bytewise(index: int, tokens: int) -> None:
    """Against the reference on the GPU (the same NaN encodings) bytewise, q and every sf byte
    that holds a group; against the CPU reference up to NaN encodings (``value · (NaN · 0)``)."""
    from tileplug.core import config
    from tileplug.core.testing import assert_sf_equal, cpu_copy

    case = _lossless_cases()[index]
    pair, kwargs = _special_lossless_arguments(case, tokens, seed=index * 17 + tokens)
    on_gpu = tuple(t.cuda() for t in pair)
    with use_backend("cuda"):
        q, sf = core.ops.per_block_cast_lossless(on_gpu, **kwargs)
    with use_backend("reference"):
        q_ref, sf_ref = core.ops.per_block_cast_lossless(on_gpu, **kwargs)
    block, hidden = tuple(kwargs["out_block_size"]), pair[0].shape[1] * 2
    assert_bytes_equal(cpu_copy(q), cpu_copy(q_ref), f"{case.id} q", strides=True)
    assert_sf_equal(cpu_copy(sf), cpu_copy(sf_ref), block, tokens, hidden, f"{case.id} sf")
    with use_backend("reference"), config.host_layout("cuda"):
        q_cpu, sf_cpu = core.ops.per_block_cast_lossless(pair, **kwargs)
    assert_bytes_equal(cpu_copy(q), q_cpu, f"{case.id} q vs CPU", nan_equal=True)
    assert_sf_equal(cpu_copy(sf), sf_cpu, block, tokens, hidden, f"{case.id} sf vs CPU")  # a scale is never NaN
