"""The CUDA ``moe_topk_gate``'s lane-by-lane group scores (the default; ``TILEPLUG_CUDA_MOE_LANE_GROUPS=0`` the masked rounds),
without a GPU: the kernel's arithmetic on the warp layout (``warp_topk.WarpRow``: lane ``l`` holds
the ``VEC`` columns ``(j·32 + l)·VEC …`` of each chunk ``j``) emulated lane by lane in Python — each
lane's two largest keys of a chunk, the xor-shuffle merges, the move to lane ``g`` — against the
default form's two masked argmax rounds a group, on keys with ties, for every layout it serves;
which layouts and calls take it; and its compiled kernel."""

from __future__ import annotations

import random

import pytest
import torch

from tileplug.backend_cuda.moe.spec import LANE_GROUPS_VARIABLE, lane_groups_fit

WARP = 32
NONE = -(2**31)


def _key_value(key: int) -> float:
    """``warp_topk.value_of`` of an int32 key, as a Python float (fp32 exact)."""
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32).item()


def _score(first: int, second: int) -> float:
    return (torch.tensor([_key_value(first)], dtype=torch.float32)
            + torch.tensor([_key_value(second)], dtype=torch.float32)).item()


def _columns(experts: int, vec: int) -> tuple[int, list[list[int]]]:
    chunks = -(-experts // (WARP * vec))
    return chunks, [[(j * WARP + lane) * vec + c for j in range(chunks) for c in range(vec)] for lane in range(WARP)]


def masked_argmax_scores(keys: list[int], experts: int, groups: int) -> list[float | None]:
    """The default form: lane ``g``'s group score (None past the groups) from the row's keys."""
    size = experts // groups
    scores = []
    for g in range(groups):
        members = sorted(keys[g * size:(g + 1) * size], reverse=True)
        scores.append(_score(members[0], members[1]))
    return scores + [None] * (WARP - groups)


def lane_scores(keys: list[int], experts: int, groups: int, vec: int) -> list[float | None]:
    """The lane form, lane by lane as the kernel runs it."""
    chunks, columns = _columns(experts, vec)
    held = [[keys[c] if c < experts else NONE for c in columns[lane]] for lane in range(WARP)]
    lanes_per_group = experts // groups // vec
    groups_per_chunk = WARP // lanes_per_group
    masks = [1 << b for b in range(lanes_per_group.bit_length() - 1)]
    group_key: list[float | None] = [None] * WARP
    for j in range(chunks):
        pair = []
        for lane in range(WARP):
            top, second = NONE, NONE
            for c in range(vec):
                key = held[lane][j * vec + c]
                second = max(second, min(top, key))
                top = max(top, key)
            pair.append((top, second))
        for mask in masks:
            pair = [(max(pair[lane][0], pair[lane ^ mask][0]),
                     max(min(pair[lane][0], pair[lane ^ mask][0]), max(pair[lane][1], pair[lane ^ mask][1])))
                    for lane in range(WARP)]
        for lane in range(WARP):
            if j * groups_per_chunk <= lane < min((j + 1) * groups_per_chunk, groups):
                source = ((lane - j * groups_per_chunk) * lanes_per_group) % WARP
                group_key[lane] = _score(*pair[source])
    return group_key


def _keys(experts: int, generator: random.Random, ties: bool) -> list[int]:
    values = [generator.choice([0.25, 0.5, 1.0, -0.5]) if ties else generator.gauss(0, 1) for _ in range(experts)]
    bits = torch.tensor(values, dtype=torch.float32).view(torch.int32).tolist()
    return [b ^ ((b >> 31) & 0x7FFFFFFF) for b in bits]


LAYOUTS = [(256, 8, 8), (256, 8, 4), (256, 16, 8), (64, 4, 8), (64, 2, 4), (96, 3, 4), (384, 12, 8), (256, 8, 1),
           (512, 32, 8), (160, 5, 1)]


@pytest.mark.parametrize(("experts", "groups", "vec"), LAYOUTS)
def test_the_lane_group_scores_are_the_masked_argmax_ones(experts: int, groups: int, vec: int) -> None:
    """Random rows and rows of ties: every lane's group score is the default form's (None past the
    groups), lane for lane."""
    assert lane_groups_fit(experts, groups, vec)
    generator = random.Random(experts * 31 + groups * 7 + vec)
    for ties in (False, True):
        for _ in range(20):
            keys = _keys(experts, generator, ties)
            assert lane_scores(keys, experts, groups, vec) == masked_argmax_scores(keys, experts, groups)


def test_a_merge_without_the_second_largest_fails() -> None:
    """The emulation can fail: a merge keeping only each side's largest key loses a group's second."""
    keys = _keys(256, random.Random(3), ties=False)
    chunks, columns = _columns(256, 8)
    wrong = [max(keys[c] for c in columns[lane]) for lane in range(WARP)]
    assert [_score(wrong[4 * g], wrong[4 * g + 1]) for g in range(8)] != masked_argmax_scores(keys, 256, 8)[:8]


@pytest.mark.parametrize(("experts", "groups", "vec", "fits"), [
    (256, 8, 8, True), (256, 1, 8, False), (256, 128, 8, False), (192, 3, 8, True), (72, 3, 8, False),
    (256, 4, 1, False), (100, 3, 4, False),
])
def test_which_layouts_take_it(experts: int, groups: int, vec: int, fits: bool) -> None:
    """A chunk's values of a lane in one group, a power of two of lanes a group, at most a warp, two
    or more experts a group."""
    assert lane_groups_fit(experts, groups, vec) is fits


def test_the_variable_picks_it_where_it_fits(monkeypatch) -> None:
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core import ops
    from tileplug.core.lowering import describe_call

    logits, bias = torch.randn(4, 256, dtype=torch.bfloat16), torch.randn(256)
    grouped = describe_call(ops.moe_topk_gate, logits, 8, "sigmoid", bias=bias, num_groups=8, topk_groups=4)[0]
    plain = describe_call(ops.moe_topk_gate, logits, 8, "sigmoid", bias=bias)[0]
    monkeypatch.delenv(LANE_GROUPS_VARIABLE, raising=False)
    spec = _KERNELS["moe_topk_gate"].spec(grouped)  # the default since it ran on a GPU
    assert spec.lane_groups and "_w4_lanegroups" in spec.name
    assert not _KERNELS["moe_topk_gate"].spec(plain).lane_groups
    monkeypatch.setenv(LANE_GROUPS_VARIABLE, "0")
    masked = _KERNELS["moe_topk_gate"].spec(grouped)
    assert not masked.lane_groups and masked.name == spec.name.replace("_lanegroups", "")
    monkeypatch.setenv(LANE_GROUPS_VARIABLE, "yes")
    with pytest.raises(ValueError, match=f"{LANE_GROUPS_VARIABLE}='yes': expected one of 0, 1"):
        _KERNELS["moe_topk_gate"].spec(grouped)


@pytest.mark.nvcc
def test_the_lane_group_kernel_compiles_without_spills(monkeypatch) -> None:
    """The grouped gates of the layouts above that the op serves (bf16 and fp32 logits) compile
    without spills, their group scores by xor shuffles and no masked argmax."""
    pytest.importorskip("tilelang")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_compile import nvcc, spill_bytes

    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core import ops
    from tileplug.core.lowering import describe_call

    monkeypatch.setenv(LANE_GROUPS_VARIABLE, "1")
    for dtype, experts, groups in ((torch.bfloat16, 256, 8), (torch.float32, 256, 8), (torch.float32, 96, 3)):
        logits = torch.empty(2, experts, dtype=dtype, device="meta")
        call = describe_call(ops.moe_topk_gate, logits, 4, "sigmoid", bias=torch.empty(experts, device="meta"),
                             num_groups=groups, topk_groups=2)[0]
        spec = _KERNELS["moe_topk_gate"].spec(call)
        assert spec.lane_groups, spec.name
        source = jit.lower_source(spec)
        assert "__shfl_xor_sync" in source, spec.name
        error, _, report = nvcc(source)
        assert error is None, error
        spills = spill_bytes(report)  # the kernel and the out-of-line fp32_math library calls
        assert spills.get(spec.name + "_kernel") == 0 and not any(spills.values()), report[-2000:]
