"""The CUDA layout kernels' batched form (``TILEPLUG_CUDA_MOE_BATCHED_LAYOUT=1``, the default since an H100
compared its bytes and timed it on 2026-12-06), without a GPU: the warp-match ranking's steps (``routing._match_ranks``) emulated in Python
— batches of 256 pairs, ``__match_any_sync`` within each warp of 32, the counts of the earlier warps and
batches — against the default form's walk (thread ``e`` counts the chunk's pairs routed to ``e`` in
order), on routing with skew, unrouted pairs (−1, ids past E) and a ragged last chunk, for slot counts
whose chunks do not fill the last batch; which specs the variable picks; and the compiled kernels (the
expert scan's batched loads among them)."""

from __future__ import annotations

import random

import pytest
import torch

from tileplug.backend_cuda.moe.spec import BATCHED_LAYOUT_VARIABLE, WARP, chunk_tokens

THREADS = 256


def walk_rows(ids: list[int], experts: int, base: list[int]) -> tuple[list[int], list[int]]:
    """The default form: each pair's row (−1: not routed) and the chunk's counts, pair by pair."""
    running = list(base)
    rows = []
    for expert in ids:
        if 0 <= expert < experts:
            rows.append(running[expert])
            running[expert] += 1
        else:
            rows.append(-1)
    return rows, [running[e] - base[e] for e in range(experts)]


def match_rows(ids: list[int], experts: int, base: list[int]) -> tuple[list[int], list[int]]:
    """The match form as the kernel runs it: batch by batch, warp by warp, lane by lane."""
    running = list(base)
    rows = []
    for start in range(0, len(ids), THREADS):
        batch = ids[start:start + THREADS] + [-1] * (THREADS - len(ids[start:start + THREADS]))
        batch = [e if 0 <= e < experts else -1 for e in batch]
        warp_counts = [[0] * experts for _ in range(THREADS // WARP)]
        places = []
        for warp in range(THREADS // WARP):
            lanes = batch[warp * WARP:(warp + 1) * WARP]
            for lane, expert in enumerate(lanes):
                same = [other for other in range(WARP) if lanes[other] == expert]  # __match_any_sync
                place = sum(1 for other in same if other < lane)  # __popc(same & lanes below)
                places.append(place)
                if expert >= 0 and place == 0:
                    warp_counts[warp][expert] = len(same)
        for thread, expert in enumerate(batch):
            if start + thread >= len(ids):
                continue
            if expert < 0:
                rows.append(-1)
                continue
            warp = thread // WARP
            rows.append(running[expert] + places[thread] + sum(warp_counts[w][expert] for w in range(warp)))
        for expert in range(experts):
            running[expert] += sum(warp_counts[w][expert] for w in range(THREADS // WARP))
    return rows, [running[e] - base[e] for e in range(experts)]


def _routing(tokens: int, slots: int, experts: int, seed: int) -> list[int]:
    """Chunk-order expert ids: skewed (a few hot experts), with unrouted slots and ids past E."""
    rng = random.Random(seed)
    hot = [rng.randrange(experts) for _ in range(3)]
    ids = []
    for _ in range(tokens * slots):
        draw = rng.random()
        ids.append(rng.choice(hot) if draw < 0.4 else -1 if draw < 0.45 else experts + 3 if draw < 0.47
                   else rng.randrange(experts))
    return ids


@pytest.mark.parametrize("experts, slots, tokens", [(256, 8, 600), (8, 2, 1500), (1024, 6, 700), (33, 9, 250),
                                                     (256, 1, 2048), (64, 2048, 2), (512, 1500, 3)])
def test_warp_match_ranks_give_the_walks_rows_and_counts(experts, slots, tokens) -> None:
    per_chunk = chunk_tokens(slots)
    ids = _routing(tokens, slots, experts, seed=experts + slots)
    rng = random.Random(7)
    for chunk_start in range(0, tokens, per_chunk):
        chunk = ids[chunk_start * slots:(chunk_start + per_chunk) * slots]
        base = [rng.randrange(1 << 20) for _ in range(experts)]
        assert match_rows(chunk, experts, base) == walk_rows(chunk, experts, base), (chunk_start, len(chunk))


def test_a_batch_of_one_expert_and_of_all_different_experts() -> None:
    same = [5] * THREADS
    assert match_rows(same, 8, [10] * 8)[0] == list(range(10, 10 + THREADS))
    distinct = list(range(THREADS))
    assert match_rows(distinct, THREADS, [0] * THREADS)[0] == [0] * THREADS


def _ends(counts: list[int], alignment: int) -> list[int]:
    """``expert_ends`` as the scan writes them: each expert starts at the aligned end of the one before."""
    ends, start = [], 0
    for count in counts:
        ends.append(start + count)
        start += -(-count // alignment) * alignment
    return ends


def searched_padding(ends: list[int], alignment: int, rows: int) -> set[int]:
    """The searched padding (the walk form of ``permute_rows``' padding job): row ``r`` is padding when no
    expert's ``[start, end)`` holds it."""
    padding = set()
    for r in range(rows):
        expert = next((e for e, end in enumerate(ends) if end > r), len(ends))  # the lower bound it searches
        start = 0 if expert == 0 else -(-ends[expert - 1] // alignment) * alignment
        if expert >= len(ends) or r < start:
            padding.add(r)
    return padding


def batched_padding(ends: list[int], alignment: int, rows: int) -> set[int]:
    """The batched form: ``[end, align(end))`` after each expert but the last, then ``[ends[-1], R)``."""
    padding = set(range(ends[-1], rows))
    if alignment > 1:
        for end in ends[:-1]:
            padding.update(range(end, -(-end // alignment) * alignment))
    return padding


@pytest.mark.parametrize("experts, alignment", [(8, 1), (8, 16), (33, 128), (1, 4), (256, 128)])
def test_batched_padding_zeroes_the_searched_rows(experts, alignment) -> None:
    from tileplug.core.contracts.moe import expanded_rows

    rng = random.Random(experts * alignment)
    for tokens, slots in ((1, 1), (37, 3), (300, 8)):
        for routed_share in (1.0, 0.7, 0.0):
            pairs = tokens * slots
            counts = [0] * experts
            for _ in range(int(pairs * routed_share)):
                counts[rng.randrange(experts) if rng.random() < 0.8 else 0] += 1
            rows = expanded_rows(tokens, slots, experts, alignment)
            ends = _ends(counts, alignment)
            assert ends[-1] <= rows
            assert batched_padding(ends, alignment, rows) == searched_padding(ends, alignment, rows)


def test_the_variable_picks_the_batched_kernels(monkeypatch) -> None:
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core import ops
    from tileplug.core.lowering import describe_call

    topk_idx = torch.zeros(4, 8, dtype=torch.int64)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    counts_call = describe_call(ops.moe_expert_counts, topk_idx, 256)[0]
    permute_call = describe_call(ops.moe_permute, x, topk_idx, 256)[0]
    monkeypatch.setenv(BATCHED_LAYOUT_VARIABLE, "0")
    assert not any(getattr(spec, "batched", False) for spec in _KERNELS["moe_permute"].specs(permute_call))
    assert not any(spec.batched for spec in _KERNELS["moe_expert_counts"].specs(counts_call))
    monkeypatch.delenv(BATCHED_LAYOUT_VARIABLE)  # the default: batched
    assert all(spec.batched for spec in _KERNELS["moe_expert_counts"].specs(counts_call))
    monkeypatch.setenv(BATCHED_LAYOUT_VARIABLE, "1")
    chosen = {spec.kernel: spec for spec in _KERNELS["moe_permute"].specs(permute_call) if hasattr(spec, "batched")}
    assert chosen["chunk_counts"].batched and chosen["permute_index"].batched and chosen["expert_scan"].batched
    rows = [spec for spec in _KERNELS["moe_permute"].specs(permute_call) if spec.kernel == "permute_rows"]
    assert rows[0].batched and rows[0].name.endswith("_batched")  # its padding job
    assert chosen["permute_index"].name.endswith("_batched")
    assert all(spec.batched for spec in _KERNELS["moe_expert_counts"].specs(counts_call))
    monkeypatch.setenv(BATCHED_LAYOUT_VARIABLE, "on")
    with pytest.raises(ValueError, match=f"{BATCHED_LAYOUT_VARIABLE}='on': expected one of 0, 1"):
        _KERNELS["moe_permute"].specs(permute_call)


@pytest.mark.nvcc
def test_the_row_copy_with_the_batched_padding_compiles_without_spills() -> None:
    """``permute_rows`` holds the padding job (its CTAs after the T copying ones): it compiles without spills, and a
    copying thread loads its group of slots' rows before its first store (one load latency a group)."""
    pytest.importorskip("tilelang")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_compile import nvcc, spill_bytes

    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.moe.spec import RowCopySpec

    for dtype, width, vec, alignment, sf in (("bfloat16", 7168, 8, 1, None), ("float8_e4m3fn", 7168, 16, 128, "int32"),
                                               ("float32", 100, 1, 16, None)):
        spec = RowCopySpec("permute_rows", dtype, width, vec, slots=6, experts=33, alignment=alignment, sf_dtype=sf,
                           sf_width=56 if sf else 0, batched=True)
        source = jit.lower_source(spec)
        assert "expert_ends[32]" in source, spec.name  # the tail starts at the last expert's end
        body = source[source.index("__launch_bounds__"):]
        body = body[body.index("{"):]  # past the signature
        assert body.count("permutation[") == 1 and "for (int j = 0; j < 6; ++j)" in body, spec.name
        assert body.index("permutation[") < body.index("x_expanded"), spec.name
        error, _, report = nvcc(source)
        assert error is None, error
        assert spill_bytes(report) == {spec.name + "_kernel": 0}, report[-2000:]


@pytest.mark.nvcc
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "walk"])
@pytest.mark.parametrize("kernel", ["chunk_counts", "permute_index", "expert_scan"])
def test_the_layout_kernels_compile_without_spills(kernel, batched) -> None:
    """Both forms compile (the compile grid takes the default, batched, one): the batched one at three layouts,
    the walk (``TILEPLUG_CUDA_MOE_BATCHED_LAYOUT=0``) at E = 256, k = 8."""
    pytest.importorskip("tilelang")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_compile import nvcc, spill_bytes

    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.moe.spec import LayoutSpec

    layouts = ((256, 8, "int64"), (1024, 6, "int32"), (33, 9, "int64")) if batched else ((256, 8, "int64"),)
    for experts, slots, index in layouts:
        spec = (LayoutSpec(kernel, experts, alignment=slots, bases=index == "int64", batched=batched)
                if kernel == "expert_scan" else LayoutSpec(kernel, experts, slots, index, batched=batched))
        source = jit.lower_source(spec)
        if kernel == "expert_scan":
            assert ("int counts_in[8]" in source) == batched, spec.name
        else:
            assert ("__match_any_sync" in source and "__popc" in source) == batched, spec.name
        error, _, report = nvcc(source)
        assert error is None, error
        assert spill_bytes(report) == {spec.name + "_kernel": 0}, report[-2000:]
