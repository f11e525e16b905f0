"""CUDA random numbers on a GPU (fill_rand, fill_randn: Philox4x32-10, SPEC §9) against the
reference and the Random123 known-answer vectors.

Run on the GPU host (compute capability >= 9.0)::

    hatch run python -m pytest tests/gpu/test_cuda_random.py -m gpu -q

What is checked:

- **known answers**: the kernels' shared Philox macro (``backend_cuda.random.philox``), run by
  a test kernel on arbitrary counters and keys, gives Random123's kat_vectors and the words of
  an independent Python Philox on 4096 random blocks; a draw with seed 0, offset 0 starts with
  the all-zero vector's words.
- **the same stream as the reference**: ``rand`` bytewise for fp32 / bf16 / fp16 at odd sizes
  (1, 3, 7, 4097, 2^20 + 3), a 64-bit seed, a large offset and a misaligned view (the scalar
  store form); ``randn`` within 2 ulp of the reference on 2^24 values (the largest distance
  is printed).
- **distributions** of the CUDA values (mean, variance, Kolmogorov–Smirnov on 10^6 draws).
- **the offset lives on the device**: each draw adds 1; a CUDA graph capturing a draw gives
  new values on every replay — those of offsets 0, 1, 2 — and leaves the offset at 3; a generator
  first drawn from during a capture counts from zero in an eager draw before the first replay; one
  made during a capture is refused (its state's fills would be graph nodes).
- **the library Box–Muller** (``TILEPLUG_CUDA_RANDN_BOX_MULLER=library``; the default is the reduced
  one) within 2 ulp of the reference; running the module with the variable set puts every ``randn``
  test on it.
"""

from __future__ import annotations

import math
import random as python_random

import pytest
import torch

from tileplug.core import config
from tileplug.core.ops import fill_rand, fill_randn
from tileplug.core.random import Generator, rand, randn
from tileplug.core.registry import use_backend
from tileplug.core.testing import PHILOX_KNOWN_ANSWERS, assert_bytes_equal, assert_within_ulps, philox4x32_10_words

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
MASK = 0xFFFFFFFF
KNOWN_ANSWERS = PHILOX_KNOWN_ANSWERS


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _philox_kernel():
    """A test kernel around the backend's Philox macro: block ``i`` gets counter
    ``(blocks[i], offsets[i])`` and key ``seeds[i]`` (int64 words), words into ``out[i, :]``."""
    import tilelang
    import tilelang.language as T

    from tileplug.backend_cuda.random.philox import DEVICE_HELPERS, philox_block

    N = T.dynamic("N")

    @T.prim_func
    def kernel(blocks: T.Tensor((N,), "int64"), seeds: T.Tensor((N,), "int64"), offsets: T.Tensor((N,), "int64"),
               out: T.Tensor((N, 4), "int32")):
        with T.Kernel(T.ceildiv(N, 128), threads=128, prelude=DEVICE_HELPERS) as bx:
            tx = T.get_thread_binding()
            words = T.alloc_local((4,), "uint32")
            i = bx * 128 + tx
            if i < N:
                philox_block(seeds[i], offsets[i], blocks[i], words)
                for j in T.unroll(4):
                    out[i, j] = T.reinterpret(words[j], "int32")

    return tilelang.compile(kernel, target="cuda")


def test_philox_macro_gives_the_known_answers_and_the_python_words() -> None:
    chooser = python_random.Random(5)
    random_words = lambda count: tuple(chooser.getrandbits(32) for _ in range(count))  # noqa: E731
    counters = [c for c, _, _ in KNOWN_ANSWERS] + [random_words(4) for _ in range(4096)]
    keys = [k for _, k, _ in KNOWN_ANSWERS] + [random_words(2) for _ in range(4096)]
    as_int64 = lambda pairs: torch.tensor([_signed(low | high << 32) for low, high in pairs], dtype=torch.int64,  # noqa: E731
                                          device=DEVICE)
    blocks = as_int64([(c[0], c[1]) for c in counters])
    offsets = as_int64([(c[2], c[3]) for c in counters])
    seeds = as_int64(keys)
    out = torch.empty(len(counters), 4, dtype=torch.int32, device=DEVICE)
    _philox_kernel()(blocks, seeds, offsets, out)
    words = [tuple(w & MASK for w in row) for row in out.cpu().tolist()]
    for index, (_, _, expected) in enumerate(KNOWN_ANSWERS):
        assert words[index] == expected, f"known answer {index}: {[hex(w) for w in words[index]]}"
    for index, (counter, key) in enumerate(zip(counters, keys)):
        assert words[index] == philox4x32_10_words(counter, key), f"block {index}"


def _fill(op, values, seed: int, offset: int, backend: str | tuple[str, ...]) -> torch.Tensor:
    seed_state = torch.tensor([_signed(seed)], dtype=torch.int64, device=values.device)
    offset_state = torch.tensor([_signed(offset)], dtype=torch.int64, device=values.device)
    backends = (backend,) if isinstance(backend, str) else backend
    with use_backend(*backends), config.host_layout("cuda"):
        op(values, seed_state, offset_state)
    assert int(offset_state.item()) == _signed(offset + 1)
    return values


def test_a_draw_from_zero_starts_with_the_zero_vector() -> None:
    values = _fill(fill_rand, torch.empty(4, device=DEVICE), 0, 0, "cuda")
    expected = torch.tensor([w >> 8 for w in KNOWN_ANSWERS[0][2]], dtype=torch.float64) * 2.0 ** -24
    assert_bytes_equal(values.cpu(), expected.float(), what="first block")


SIZES = (1, 3, 7, 4097, (1 << 20) + 3)
STATES = ((0, 0), (0xFEEDFACE12345678, 3), (12345, (1 << 40) + 7))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("count", SIZES)
@pytest.mark.parametrize("state", STATES, ids=["zero", "64-bit-seed", "large-offset"])
def test_rand_is_the_reference_stream_bytewise(dtype, count, state) -> None:
    seed, offset = state
    cuda = _fill(fill_rand, torch.empty(count, dtype=dtype, device=DEVICE), seed, offset, "cuda")
    reference = _fill(fill_rand, torch.empty(count, dtype=dtype, device=DEVICE), seed, offset, "reference")
    assert_bytes_equal(cuda.cpu(), reference.cpu(), what=f"rand {dtype} n={count}")


@pytest.mark.parametrize("op", (fill_rand, fill_randn), ids=["rand", "randn"])
def test_a_misaligned_view_is_filled_by_the_scalar_form(op) -> None:
    storage = torch.full((4099,), -7.0, device=DEVICE)
    view = storage[1:4098]
    assert view.data_ptr() % 16 != 0
    _fill(op, view, 99, 5, "cuda")
    reference = _fill(op, torch.empty(4097, device=DEVICE), 99, 5, "reference")
    assert float(storage[0]) == -7.0 and float(storage[-1]) == -7.0, "nothing written outside the view"
    if op is fill_rand:
        assert_bytes_equal(view.cpu(), reference.cpu(), what="misaligned rand")
    else:
        assert_within_ulps(view.cpu(), reference.cpu(), 2, what="misaligned randn")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("state", STATES, ids=["zero", "64-bit-seed", "large-offset"])
def test_randn_is_within_2_ulp_of_the_reference(dtype, state) -> None:
    seed, offset = state
    count = (1 << 24) + 5 if dtype == torch.float32 else (1 << 20) + 5
    cuda = _fill(fill_randn, torch.empty(count, dtype=dtype, device=DEVICE), seed, offset, "cuda")
    reference = _fill(fill_randn, torch.empty(count, dtype=dtype, device=DEVICE), seed, offset, "reference")
    if dtype == torch.float32:
        distance = (cuda.view(torch.int32).long() - reference.view(torch.int32).long()).abs()
        sign_flip = (cuda.view(torch.int32) < 0) != (reference.view(torch.int32) < 0)
        print(f"randn fp32 {state}: largest distance {int(distance[~sign_flip].max())} ulp, "
              f"{int((distance[~sign_flip] > 0).sum())} of {count} values differ")
    assert_within_ulps(cuda.cpu(), reference.cpu(), 2, what=f"randn {dtype} {state}")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_the_library_box_muller_is_within_2_ulp_of_the_reference(dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """``TILEPLUG_CUDA_RANDN_BOX_MULLER=library``: the library kernel (CUDA's fp64 functions) runs and
    its 2^24 values lie within 2 ulp of the reference's (the count of differing values is printed),
    a misaligned view too."""
    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.random.spec import BOX_MULLER_VARIABLE
    from tileplug.core.registry import registry

    monkeypatch.setattr(registry, "_cache", {})  # routes prepared before the variable was set would hide it

    monkeypatch.setenv(BOX_MULLER_VARIABLE, "library")
    count = (1 << 24) + 5
    for seed, offset in STATES:
        reference = _fill(fill_randn, torch.empty(count, dtype=dtype, device=DEVICE), seed, offset, "reference")
        # another forced-backend tuple is another route, prepared with the variable set
        cuda = _fill(fill_randn, torch.empty(count, dtype=dtype, device=DEVICE), seed, offset, ("cuda", "reference"))
        assert any(spec.name.startswith("fill_randn") and not spec.name.endswith("_reduced")
                   for spec, _ in jit._entries), "the library kernel did not run"
        differ = int((cuda.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
                      != reference.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)).sum())
        print(f"library randn {dtype} {(seed, offset)}: {differ} of {count} values differ")
        assert_within_ulps(cuda.cpu(), reference.cpu(), 2, what=f"library randn {dtype} {(seed, offset)}")
    storage = torch.empty(4099, dtype=dtype, device=DEVICE)
    view = _fill(fill_randn, storage[3:], 5, 9, ("cuda", "reference"))
    assert_within_ulps(view.cpu(), _fill(fill_randn, torch.empty(4096, dtype=dtype, device=DEVICE), 5, 9,
                                         "reference").cpu(), 2, what="misaligned library randn")


SAMPLES = 1_000_000
KS_LIMIT = 1.95 / math.sqrt(SAMPLES)


def _ks_statistic(values: torch.Tensor, cdf) -> float:
    ordered = values.double().sort().values
    n = ordered.numel()
    theoretical = cdf(ordered)
    ranks = torch.arange(1, n + 1, dtype=torch.float64, device=ordered.device)
    return float(torch.maximum(ranks / n - theoretical, theoretical - (ranks - 1) / n).max())


@pytest.mark.parametrize("seed", [1, 0xFEEDFACE12345678])
def test_distributions_of_the_cuda_draws(seed) -> None:
    generator = Generator(DEVICE, seed)
    with use_backend("cuda"):
        u = rand(SAMPLES, device=DEVICE, generator=generator)
        z = randn(SAMPLES, device=DEVICE, generator=generator)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.double().mean()) - 0.5) < 5 * math.sqrt(1 / 12 / SAMPLES)
    assert abs(float(u.double().var()) - 1 / 12) < 5 * math.sqrt(1 / 180 / SAMPLES)
    assert _ks_statistic(u, lambda x: x.clamp(0, 1)) < KS_LIMIT
    assert abs(float(z.double().mean())) < 5 / math.sqrt(SAMPLES)
    assert abs(float(z.double().var()) - 1.0) < 5 * math.sqrt(2 / SAMPLES)
    assert _ks_statistic(z, torch.special.ndtr) < KS_LIMIT
    assert generator.offset == 2


def test_graph_replay_draws_new_numbers_and_advances_the_offset() -> None:
    generator = Generator(DEVICE, 77)
    values = torch.empty(4097, device=DEVICE)
    with use_backend("cuda"):
        fill_randn(values, generator.seed_state, generator.offset_state)  # warm: compiled and loaded
        generator.offset = 0
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fill_randn(values, generator.seed_state, generator.offset_state)
    generator.offset = 0
    replays = []
    for _ in range(3):
        graph.replay()
        replays.append(values.clone())
    torch.cuda.synchronize()
    assert generator.offset == 3
    for offset, drawn in enumerate(replays):
        expected = _fill(fill_randn, torch.empty(4097, device=DEVICE), 77, offset, "reference")
        assert_within_ulps(drawn.cpu(), expected.cpu(), 2, what=f"replay {offset}")
    assert not torch.equal(replays[0], replays[1]) and not torch.equal(replays[1], replays[2])


def test_a_first_draw_captured_in_a_graph_counts_from_zero_and_a_generator_made_there_is_refused() -> None:
    """A generator whose first draw is captured takes a counter of the device's slab, zeroed before the
    capture: an eager draw before the first replay advances the offset once, and the replay draws the next
    offset's values. A generator made during a capture is refused (its state's fills would be graph nodes)."""
    values = torch.empty(4097, device=DEVICE)
    fresh = Generator(DEVICE, 91)
    with use_backend("cuda"):
        warm = Generator(DEVICE, 1)
        fill_rand(values, warm.seed_state, warm.offset_state)  # compiled, loaded, the device's counters made
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fill_rand(values, fresh.seed_state, fresh.offset_state)
        with pytest.raises(RuntimeError, match="make the generator"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                Generator(DEVICE, 2)
        eager = torch.empty(4097, device=DEVICE)
        fill_rand(eager, fresh.seed_state, fresh.offset_state)
    assert fresh.offset == 1
    assert_bytes_equal(eager, _fill(fill_rand, torch.empty(4097, device=DEVICE), 91, 0, "reference"),
                       what="an eager draw before the first replay")
    graph.replay()
    assert fresh.offset == 2
    assert_bytes_equal(values, _fill(fill_rand, torch.empty(4097, device=DEVICE), 91, 1, "reference"),
                       what="the first replay")
