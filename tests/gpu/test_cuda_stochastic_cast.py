"""CUDA ``stochastic_cast`` and ``nearest_cast`` on a GPU (docs/spec.md §10.2) against the
reference backend, bytewise.

    hatch run python -m pytest tests/gpu/test_cuda_stochastic_cast.py -m gpu -q

The op-table cases run in tests/gpu/test_cuda_quant.py's grid; here: both load/store forms
(aligned and misaligned views of x and of result) at element counts that end inside a
thread's run, every non-finite and boundary input, graph replays drawing fresh bits (the
offset advanced on the device), the stochastic per-token / per-block casts' advance in their own
launch (eager and replayed), ``cast`` with a generator, and the mean of a constant's
stochastic casts on the GPU; for ``nearest_cast`` every pair in both forms.
"""

from __future__ import annotations

import pytest
import torch

from tileplug.core import ops
from tileplug.core.random import Generator
from tileplug.core.registry import use_backend
from tileplug.core.testing import assert_bytes_equal, assert_sf_equal, cpu_copy

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
PAIRS = [(torch.float32, torch.bfloat16), (torch.float32, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e4m3fn)]
PAIR_IDS = ["fp32-bf16", "fp32-e4m3", "bf16-e4m3"]


@pytest.fixture(scope="module", autouse=True)
def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


def _inputs(count: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values over many binades (both targets' subnormals, past 448, past bf16's largest) with
    the non-finite and boundary values first."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(count, generator=generator) * torch.exp2(
        torch.randint(-40, 40, (count,), generator=generator).float())
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 448.0, -448.0, 449.0, 480.0,
                            2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-6, 1e-45, -1e-45, 3.4028235e38, -3.4028235e38,
                            3.3895314e38, 1.0 + 2.0**-8, 1.0 - 2.0**-25])
    values[: min(count, special.numel())] = special[:count]
    return values.to(dtype).to(DEVICE)


def _run(backend: str, result: torch.Tensor, x: torch.Tensor, seed: int, offset: int) -> tuple:
    seed_state = torch.tensor([seed], dtype=torch.int64, device=DEVICE)
    offset_state = torch.tensor([offset], dtype=torch.int64, device=DEVICE)
    with use_backend(backend):
        ops.stochastic_cast(result, x, seed_state, offset_state)
    return result, offset_state


@pytest.mark.parametrize("source, target", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("count", [1, 15, 16, 17, 4097, 1 << 20, 3 * (1 << 20) + 5])
@pytest.mark.parametrize("x_shift, result_shift", [(0, 0), (1, 0), (0, 1)], ids=["aligned", "x-off", "result-off"])
def test_bytes_equal_the_reference(source, target, count, x_shift, result_shift) -> None:
    x = _inputs(count + x_shift, source, seed=count)[x_shift:]
    results = []
    for backend in ("cuda", "reference"):
        storage = torch.full((count + result_shift,), float("nan"), device=DEVICE).to(target)
        results.append(_run(backend, storage[result_shift:], x, seed=-0x5DEECE66D, offset=2**40 + 7))
    (result, offset), (want, want_offset) = results
    assert_bytes_equal(cpu_copy(result), cpu_copy(want), what=f"{count} values", nan_equal=True)
    assert_bytes_equal(cpu_copy(offset), cpu_copy(want_offset), what="offset")


@pytest.mark.parametrize("source, target", PAIRS, ids=PAIR_IDS)
def test_graph_replays_draw_fresh_bits(source, target) -> None:
    """A captured cast reads the offset at replay: replay k rounds with offset k."""
    x = _inputs(5000, source, seed=3)
    generator = Generator(DEVICE, 99)
    result = torch.empty(5000, dtype=target, device=DEVICE)
    with use_backend("cuda"):
        ops.stochastic_cast(result, x, generator.seed_state, generator.offset_state)  # compiled and loaded
        generator.offset_state.zero_()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ops.stochastic_cast(result, x, generator.seed_state, generator.offset_state)
    generator.offset_state.zero_()
    replays = []
    for _ in range(3):
        graph.replay()
        replays.append(cpu_copy(result))
    assert int(generator.offset_state.item()) == 3
    for offset, replayed in enumerate(replays):
        want, _ = _run("reference", torch.empty_like(result), x, seed=99, offset=offset)
        assert_bytes_equal(replayed, cpu_copy(want), what=f"replay {offset}", nan_equal=True)
    assert not torch.equal(replays[0].view(torch.uint8), replays[1].view(torch.uint8))


QUANT_CASTS = [(ops.per_token_cast, {}), (ops.per_token_cast, {"fmt": "e2m1", "num_per_channels": 16}),
               (ops.per_block_cast, {})]


@pytest.mark.parametrize("op, kwargs", QUANT_CASTS, ids=["per_token", "per_token-e2m1", "per_block"])
@pytest.mark.parametrize("tokens", [1, 128, 4099])
def test_a_stochastic_quant_cast_advances_in_its_own_launch(op, kwargs, tokens) -> None:
    """A stochastic per-token / per-block cast is one launch whose last CTA advances the offset:
    eager calls leave it at 2 after two calls, and a captured call's replays round with offsets
    0, 1, 2 (each replay's bytes the reference's at that offset) and leave it at 3."""
    x = _inputs(tokens * 7168, torch.bfloat16, seed=tokens).view(tokens, 7168)
    block = (1, kwargs.get("num_per_channels", 128)) if op is ops.per_token_cast else (128, 128)
    generator = Generator(DEVICE, 2**63 + 5)
    with use_backend("cuda"):
        op(x, stochastic_rounding=True, generator=generator, **kwargs)
        op(x, stochastic_rounding=True, generator=generator, **kwargs)
        assert int(generator.offset_state.item()) == 2
        generator.offset_state.zero_()
        q, sf = op(x, stochastic_rounding=True, generator=generator, **kwargs)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            op(x, stochastic_rounding=True, generator=generator, out=(q, sf), **kwargs)
    generator.offset_state.zero_()
    replays = []
    for _ in range(3):
        graph.replay()
        replays.append((cpu_copy(q), cpu_copy(sf)))
    assert int(generator.offset_state.item()) == 3
    for offset, (replayed, replayed_sf) in enumerate(replays):
        reference = Generator(DEVICE, 2**63 + 5)
        reference.offset_state.fill_(offset)
        with use_backend("reference"):
            want, want_sf = op(x, stochastic_rounding=True, generator=reference, **kwargs)
        assert int(reference.offset_state.item()) == offset + 1
        assert_bytes_equal(replayed, cpu_copy(want), what=f"replay {offset} q", nan_equal=True)
        assert_sf_equal(replayed_sf, cpu_copy(want_sf), block, tokens, 7168, what=f"replay {offset} sf",
                        nan_equal=True)
    assert not torch.equal(replays[0][0].view(torch.uint8), replays[1][0].view(torch.uint8))


def test_cast_with_a_generator_matches_the_reference_and_advances_it() -> None:
    x = _inputs(7 * 7168, torch.float32, seed=5).view(7, 7168)
    outputs = []
    for backend in ("cuda", "reference"):
        generator = Generator(DEVICE, 2**63 + 11)
        with use_backend(backend):
            first = ops.cast(x, torch.float8_e4m3fn, stochastic_rounding=True, generator=generator)
            second = ops.cast(x, torch.bfloat16, stochastic_rounding=True, generator=generator)
        assert int(generator.offset_state.item()) == 2
        outputs.append((cpu_copy(first), cpu_copy(second)))
    for have, want in zip(*outputs):
        assert_bytes_equal(have, want, what="cast", nan_equal=True)


@pytest.mark.parametrize("source, target", PAIRS, ids=PAIR_IDS)
def test_the_mean_of_a_constants_casts_is_the_constant(source, target) -> None:
    """10^5 stochastic casts of a value between two targets average to it within 5 standard
    deviations of a Bernoulli mean (p·(1 − p)·step² / n)."""
    value = 1.0 + 2.0**-7 + 2.0**-9 if target == torch.bfloat16 else 3.3
    constant = torch.tensor(value, dtype=source).item()
    count = 100_000
    x = torch.full((count,), constant, dtype=source, device=DEVICE)
    result = torch.empty(count, dtype=target, device=DEVICE)
    _run("cuda", result, x, seed=7, offset=0)
    rounded = result.to(torch.float64)
    low, high = rounded.min().item(), rounded.max().item()
    assert low <= constant <= high and high > low
    p = (constant - low) / (high - low)
    bound = 5 * (p * (1 - p)) ** 0.5 * (high - low) / count**0.5
    assert abs(rounded.mean().item() - constant) <= bound


DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)


@pytest.mark.parametrize("source", DTYPES, ids=["fp32", "bf16", "e4m3"])
@pytest.mark.parametrize("target", DTYPES, ids=["fp32", "bf16", "e4m3"])
@pytest.mark.parametrize("count", [1, 17, 4097, 3 * (1 << 20) + 5])
@pytest.mark.parametrize("x_shift, result_shift", [(0, 0), (1, 0), (0, 1)], ids=["aligned", "x-off", "result-off"])
def test_nearest_cast_bytes_equal_the_reference(source, target, count, x_shift, result_shift) -> None:
    values = _inputs(count + x_shift, torch.float32, seed=count)
    if source == torch.float8_e4m3fn:
        values = values.clamp(-448, 448)  # (NaN passes): e4m3 values of every binade
    x = values.to(source)[x_shift:]
    results = []
    for backend in ("cuda", "reference"):
        storage = torch.full((count + result_shift,), float("nan"), device=DEVICE).to(target)
        with use_backend(backend):
            ops.nearest_cast(storage[result_shift:], x)
        results.append(storage[result_shift:])
    assert_bytes_equal(cpu_copy(results[0]), cpu_copy(results[1]), what=f"{count} values", nan_equal=True)


@pytest.mark.parametrize("shape", [(), (3, 7), (2, 3, 5), (2, 1, 3, 7), (4097, 3), (3, 4097, 1)],
                         ids=lambda shape: "x".join(map(str, shape)) or "0-d")
def test_every_rank_casts_as_the_reference(shape) -> None:
    """Tensors of every rank (the launcher views them flat): the same bytes as the reference for
    both ops (element i of the row-major order takes word i)."""
    count = 1
    for size in shape:
        count *= size
    for source, target in PAIRS:
        x = _inputs(count, source, seed=count + len(shape)).view(shape)
        have, want = torch.empty(shape, dtype=target, device=DEVICE), torch.empty(shape, dtype=target, device=DEVICE)
        _run("cuda", have, x, seed=5, offset=3)
        _run("reference", want, x, seed=5, offset=3)
        assert_bytes_equal(cpu_copy(have), cpu_copy(want), what=f"stochastic {shape}", nan_equal=True)
        with use_backend("cuda"):
            ops.nearest_cast(have, x)
        with use_backend("reference"):
            ops.nearest_cast(want, x)
        assert_bytes_equal(cpu_copy(have), cpu_copy(want), what=f"nearest {shape}", nan_equal=True)
