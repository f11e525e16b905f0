"""CUDA MoE routing kernels on a GPU (topk_gate, normalize_weight, moe_topk_gate,
moe_topk_gate_backward, moe_expert_counts, moe_permute, moe_unpermute) against the reference.

Run on the GPU host (compute capability >= 9.0)::

    hatch run python -m pytest tests/gpu/test_cuda_moe.py -m gpu -q

Every specialisation the module launches is compiled up front by ``jit.precompile`` (the
``precompiled`` fixture walks every case of the module through the kernel objects' ``specs``).

What is checked, per SPEC §4 and §7:

- **vs the reference** (``test_matches_reference``): the op table's cases plus an E × k grid
  (E in {8, 60, 72, 100, 160, 256, 384, 1000, 1024}, non-multiples of 32 included; k up to 32)
  with ties (coarse, all equal) and non-finite rows, at T in {1, 3, 4001}, by the op table's
  ``compare_moe``: indices, counts, ends, permutations and permuted rows bytewise, gate weights
  and scores within 2 ulp fp32, the backward within relative 1e-5, unpermute within 1 ulp.
- **batch invariance and determinism** bytewise: rows alone vs inside a batch of 4001 at three
  positions, and two runs (gates, backward, unpermute; the layout ops are whole-batch outputs,
  checked run to run).
- **non-finite rows**: other rows keep their bytes; the row gets −1 / 0 in every slot, and a
  later CUDA call still works (no device assert).
- **large T**: topk_gate and moe_permute at T = 65536 once.
- **the lane group scores** (the default; ``TILEPLUG_CUDA_MOE_LANE_GROUPS=0`` the masked rounds): the
  grouped gates' bytes equal the masked rounds' kernel's; running the module with the variable at 0 puts
  every grouped case on the masked rounds.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tileplug.core import Case, config, opdefs, ops
from tileplug.core.registry import use_backend
from tileplug.core.testing import assert_bytes_equal, moved

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
TOKENS = (1, 3, 4001)
BATCH = 4001
FP32, BF16 = torch.float32, torch.bfloat16
GATE, FULL, BACK = "topk_gate", "moe_topk_gate", "moe_topk_gate_backward"
COUNTS, PERMUTE, UNPERMUTE, NORMALIZE = "moe_expert_counts", "moe_permute", "moe_unpermute", "normalize_weight"
MOE_OPS = (GATE, NORMALIZE, FULL, BACK, COUNTS, PERMUTE, UNPERMUTE)

# ---------------------------------------------------------------------- the grid

EXPERTS = (8, 60, 72, 100, 160, 256, 384, 1000, 1024)


def _grid() -> list[Case]:
    cases = [case for op in MOE_OPS for case in opdefs.get(op).cases()]
    for experts in EXPERTS:
        for k in sorted({1, 6, 8, 32} & set(range(1, experts + 1))):
            cases.append(Case.of(GATE, experts, FP32, num_topk=k))
        cases.append(Case.of(GATE, experts, FP32, inputs={"ties": "coarse", "non_finite": True},
                             num_topk=min(8, experts)))
        cases.append(Case.of(FULL, experts, BF16, inputs={"ties": "coarse"}, num_topk=min(8, experts)))
        cases.append(Case.of(FULL, experts, FP32, inputs={"bias": True, "non_finite": True}, num_topk=min(6, experts),
                             scoring="sqrtsoftplus", num_shared_experts=1, return_scores=True))
    cases += [
        Case.of(GATE, 100, FP32, inputs={"ties": "all_equal"}, num_topk=32),
        Case.of(FULL, 256, FP32, inputs={"bias": True, "ties": "coarse"}, num_topk=8, scoring="sigmoid", num_groups=8,
                topk_groups=4, routed_scaling_factor=2.5),  # DeepSeek-V3
        Case.of(FULL, 96, BF16, inputs={"ties": "all_equal", "mask": True}, num_topk=6, scoring="softmax",
                num_groups=4, topk_groups=2),
        Case.of(BACK, 384, FP32, inputs={"topk": 8, "mask": True}, scoring="sqrtsoftplus"),
        Case.of(COUNTS, 1, num_experts=100, inputs={"topk": 8, "unrouted": True}, alignment=128),
        Case.of(PERMUTE, 2048, BF16, num_experts=100, inputs={"topk": 8, "unrouted": True}, alignment=64),
        Case.of(UNPERMUTE, 2048, BF16, inputs={"experts": 100, "topk": 8, "alignment": 64}),
    ]
    return list(dict.fromkeys(cases))


GRID = _grid()
INVARIANCE = [case for case in GRID if case.op in (GATE, FULL, BACK, UNPERMUTE, NORMALIZE)][::3]
NONFINITE = [Case.of(GATE, 256, FP32, num_topk=8), Case.of(FULL, 256, BF16, inputs={"bias": True}, num_topk=8,
                                                          scoring="sqrtsoftplus", num_shared_experts=1)]
LARGE = [Case.of(GATE, 256, FP32, num_topk=8), Case.of(PERMUTE, 7168, BF16, num_experts=256, alignment=128)]


def _outputs(result) -> list:
    return list(result) if isinstance(result, tuple) else [result]


def _run(op: str, backend: str, args: tuple, kwargs: dict) -> list:
    with use_backend(backend), config.host_layout("cuda"):
        return _outputs(getattr(ops, op)(*args, **kwargs))


def _cuda(case: Case, args: tuple, kwargs: dict) -> list:
    outputs = _run(case.op, "cuda", moved(args, DEVICE, fresh=True), moved(kwargs, DEVICE, fresh=True))
    torch.cuda.synchronize()
    return outputs


def _cuda_under(variable: str, value: str, case: Case, args: tuple, kwargs: dict,
                monkeypatch: pytest.MonkeyPatch) -> list:
    """:func:`_cuda` with the tuning variable ``variable`` set to ``value`` (routes prepared before are
    dropped: they would hide it)."""
    from tileplug.core.registry import registry

    monkeypatch.setattr(registry, "_cache", {})
    monkeypatch.setenv(variable, value)
    return _cuda(case, args, kwargs)


def _specs(case: Case, tokens: int = 3) -> list:
    """Every CUDA specialisation ``case`` launches at ``tokens`` rows (asserts the kernel accepts it; one row may
    take another specialisation than several: its row stride is unused, so a padded stride no longer costs the
    16-byte loads)."""
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core.lowering import describe_call

    args, kwargs = case.arguments(tokens, "cpu")
    with config.host_layout("cuda"):
        call, _ = describe_call(getattr(ops, case.op), *args, **kwargs)
    kernel = _KERNELS[call.op]
    reason = kernel.supports(call)
    assert reason is None, f"{case.id}: the CUDA kernel declines it: {reason}"
    return kernel.specs(call)


@pytest.fixture(scope="module", autouse=True)
def gate_forced_on():
    """The CUDA ``moe_topk_gate`` declines every call until a GPU run verifies it
    (``moe.table.GATE_VERIFIED``): this module forces it on, so that its cases run the kernel
    (never the reference through the fallback) and one GPU run verifies it."""
    from tileplug.backend_cuda.moe import table

    saved = table.GATE_VERIFIED
    table.GATE_VERIFIED = True
    yield
    table.GATE_VERIFIED = saved


@pytest.fixture(scope="module", autouse=True)
def precompiled(gate_forced_on):
    """Compile every specialisation of the module up front, in parallel processes
    (``TILEPLUG_GPU_PRECOMPILE=0``: each kernel on its first call instead, for a run of a few tests)."""
    from tileplug.backend_cuda import jit

    if os.environ.get("TILEPLUG_GPU_PRECOMPILE") == "0":
        return

    specs = [spec for case in dict.fromkeys(GRID + INVARIANCE + NONFINITE + LARGE) for spec in _specs(case)]
    from tileplug.backend_cuda.moe.spec import lane_groups_fit

    both = [dataclasses.replace(spec, lane_groups=lanes) for case in GRID if case.op == FULL
            and dict(case.kwargs).get("num_groups", 1) > 1 for spec in _specs(case)
            if lane_groups_fit(spec.experts, spec.groups, spec.vec) for lanes in (False, True)]
    matched = [dataclasses.replace(spec, batched=batched) for case in GRID if case.op in (COUNTS, PERMUTE)
               for spec in _specs(case) if spec.kernel in ("chunk_counts", "expert_scan", "permute_index", "permute_rows")
               for batched in (False, True)]
    tables = [dataclasses.replace(spec, table_math=tables) for case in GRID if case.op == FULL for spec in _specs(case)
              for tables in (False, True)]
    heads = [dataclasses.replace(spec, lane_heads=headed) for case in GRID if case.op in (GATE, FULL)
             for spec in _specs(case) for headed in (False, True)]
    jit.precompile(list(dict.fromkeys(specs + both + matched + tables + heads)))


# ---------------------------------------------------------------------- vs the reference


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("case", GRID, ids=[case.id for case in GRID])
def test_matches_reference(case: Case, tokens: int) -> None:
    args, kwargs = case.arguments(tokens, "cpu")
    expected = _run(case.op, "reference", args, kwargs)
    actual = _cuda(case, args, kwargs)
    opdefs.get(case.op).compare(case, tokens, [moved(a, "cpu") for a in actual], [moved(e, "cpu") for e in expected])


@pytest.mark.parametrize("case", LARGE, ids=[case.id for case in LARGE])
def test_large_batch(case: Case) -> None:
    args, kwargs = case.arguments(65536, "cpu", seed=11)
    expected = _run(case.op, "reference", args, kwargs)
    actual = _cuda(case, args, kwargs)
    opdefs.get(case.op).compare(case, 65536, [moved(a, "cpu") for a in actual], [moved(e, "cpu") for e in expected])


# ---------------------------------------------------------------------- the lane group scores

GROUPED = [case for case in GRID if case.op == FULL and dict(case.kwargs).get("num_groups", 1) > 1]


@pytest.mark.parametrize("case", GROUPED, ids=[case.id for case in GROUPED])
def test_lane_group_scores_give_the_masked_rounds_bytes(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped gate with its group scores taken lane by lane (``TILEPLUG_CUDA_MOE_LANE_GROUPS=1``,
    the default) gives the masked rounds' kernel's (``=0``) indices, weights and scores, byte for byte,
    at 4001 rows (ties included), and the lane form's kernel ran."""
    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.moe.spec import LANE_GROUPS_VARIABLE

    args, kwargs = case.arguments(BATCH, "cpu", seed=23)
    masked = _cuda_under(LANE_GROUPS_VARIABLE, "0", case, args, kwargs, monkeypatch)
    lane = _cuda_under(LANE_GROUPS_VARIABLE, "1", case, args, kwargs, monkeypatch)
    (spec,) = _specs(case)
    if spec.lane_groups:  # (a layout it does not fit keeps the masked rounds: the same kernel twice)
        assert any(entry == spec for entry, _ in jit._entries), "the lane form did not run"
    for index, (have, want) in enumerate(zip(lane, masked)):
        assert_bytes_equal(moved(have, "cpu"), moved(want, "cpu"), what=f"{case.id} output {index} (lane groups)")


# ---------------------------------------------------------------------- the gate's score math

SCORED = [case for case in GRID if case.op == FULL]


@pytest.mark.parametrize("case", SCORED, ids=[case.id for case in SCORED])
def test_table_score_math_gives_the_library_bytes(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate with ``fp32_math``'s exp / log1p (``TILEPLUG_CUDA_MOE_SCORE_MATH=tables``) gives the bytes of
    CUDA's fp64 functions (the default) — indices, weights and scores — at 4001 rows, and both kernels ran."""
    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.moe.spec import SCORE_MATH_VARIABLE

    args, kwargs = case.arguments(BATCH, "cpu", seed=31)
    library = _cuda_under(SCORE_MATH_VARIABLE, "library", case, args, kwargs, monkeypatch)
    tables = _cuda_under(SCORE_MATH_VARIABLE, "tables", case, args, kwargs, monkeypatch)
    names = {entry.name for entry, _ in jit._entries if getattr(entry, "op", None) == FULL}
    (spec,) = _specs(case)  # the tables form: the variable is still set
    library_name = dataclasses.replace(spec, table_math=False).name
    assert spec.table_math and spec.name in names and library_name in names, sorted(names)[:5]
    for index, (have, want) in enumerate(zip(tables, library)):
        if want is not None:
            assert_bytes_equal(moved(have, "cpu"), moved(want, "cpu"), what=f"{case.id} output {index} (score math)",
                               nan_equal=True)


# ---------------------------------------------------------------------- the rounds over the lanes' heads

HEADED = [case for case in GRID if case.op in (GATE, FULL)]


@pytest.mark.parametrize("tokens", [1, BATCH])
@pytest.mark.parametrize("case", HEADED, ids=[case.id for case in HEADED])
def test_lane_heads_give_the_rounds_bytes(case: Case, tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``topk_gate`` / ``moe_topk_gate`` choosing from the lanes' two heads (``TILEPLUG_CUDA_MOE_LANE_HEADS=1``)
    give the default rounds' indices, weights and scores byte for byte (ties included), and the heads'
    kernel ran."""
    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.moe.spec import LANE_HEADS_VARIABLE

    args, kwargs = case.arguments(tokens, "cpu", seed=37)
    rounds = _cuda_under(LANE_HEADS_VARIABLE, "0", case, args, kwargs, monkeypatch)
    headed = _cuda_under(LANE_HEADS_VARIABLE, "1", case, args, kwargs, monkeypatch)
    (spec,) = _specs(case, tokens)  # the heads' form: the variable is still set
    assert spec.lane_heads and any(entry == spec for entry, _ in jit._entries), spec.name
    for index, (have, want) in enumerate(zip(headed, rounds)):
        if want is not None:
            assert_bytes_equal(moved(have, "cpu"), moved(want, "cpu"), what=f"{case.id} output {index} (lane heads)",
                               nan_equal=True)


# ---------------------------------------------------------------------- the gates' load width and unrolled rounds

GATE_FORMS = [("TILEPLUG_CUDA_MOE_GATE_FULL_WARP", "0", "1"), ("TILEPLUG_CUDA_MOE_GATE_UNROLLED", "0", "1"),
              ("TILEPLUG_CUDA_MOE_GATE_FIXED_HEADS", "0", "1")]
FORMED = [(case, *form) for case in HEADED for form in GATE_FORMS]


@pytest.mark.parametrize("tokens", [1, BATCH])
@pytest.mark.parametrize("entry", FORMED, ids=[f"{case.id}-{variable.split('_GATE_', 1)[1].lower()}"
                                               for case, variable, _, _ in FORMED])  # -full_warp, -unrolled, -fixed_heads
def test_gate_forms_give_the_same_bytes(entry: tuple, tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gates reading a short row at the width that spreads it over the whole warp
    (``TILEPLUG_CUDA_MOE_GATE_FULL_WARP=1``) give the 16-byte form's indices, weights and scores byte for byte
    (softmax denominators included); the gates with their selection rounds unrolled
    (``TILEPLUG_CUDA_MOE_GATE_UNROLLED=1``) the loop's; the lanes' heads kept in place
    (``TILEPLUG_CUDA_MOE_GATE_FIXED_HEADS=1``) the moving heads'; and the form's kernel ran."""
    from tileplug.backend_cuda import jit

    case, variable, one, other = entry
    args, kwargs = case.arguments(tokens, "cpu", seed=41)
    first = _cuda_under(variable, one, case, args, kwargs, monkeypatch)
    second = _cuda_under(variable, other, case, args, kwargs, monkeypatch)
    (spec,) = _specs(case, tokens)  # the second form: the variable is still set
    assert any(entry == spec for entry, _ in jit._entries), spec.name
    for index, (have, want) in enumerate(zip(second, first)):
        if want is not None:
            assert_bytes_equal(moved(have, "cpu"), moved(want, "cpu"),
                               what=f"{case.id} output {index} ({variable}={other})", nan_equal=True)


# ---------------------------------------------------------------------- the batched layout kernels

LAYOUT = [case for case in GRID if case.op in (COUNTS, PERMUTE)]


@pytest.mark.parametrize("tokens", [1, 300, BATCH])
@pytest.mark.parametrize("case", LAYOUT, ids=[case.id for case in LAYOUT])
def test_batched_layout_gives_the_walks_bytes(case: Case, tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting and permutation with the layout kernels' batched form (``TILEPLUG_CUDA_MOE_BATCHED_LAYOUT=1``:
    warp-match ranks, batched scan loads) give the default walk's outputs byte for byte, and the batched
    kernels ran."""
    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.moe.spec import BATCHED_LAYOUT_VARIABLE

    args, kwargs = case.arguments(tokens, "cpu", seed=29)
    walked = _cuda_under(BATCHED_LAYOUT_VARIABLE, "0", case, args, kwargs, monkeypatch)
    batched = _cuda_under(BATCHED_LAYOUT_VARIABLE, "1", case, args, kwargs, monkeypatch)
    ran = {entry.name for entry, _ in jit._entries if getattr(entry, "batched", False)}
    assert any(name.startswith("moe_chunk_counts") for name in ran), ran
    for index, (have, want) in enumerate(zip(batched, walked)):
        if want is not None:
            assert_bytes_equal(moved(have, "cpu"), moved(want, "cpu"), what=f"{case.id} output {index} (batched layout)")


# ---------------------------------------------------------------------- batch invariance


def _slice(value, start: int, count: int):
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == BATCH:
        return value[start:start + count]
    return value


@pytest.mark.parametrize("case", INVARIANCE, ids=[case.id for case in INVARIANCE])
def test_batch_invariance_and_determinism(case: Case) -> None:
    """A row's output bytes do not depend on the batch it is in, its position, or the run."""
    args, kwargs = case.arguments(BATCH, "cpu", seed=7)
    if case.op == UNPERMUTE:  # y_expanded is not a per-token input: keep it whole, slice the token tables
        sliced = lambda value, start, count: value if value is args[0] else _slice(value, start, count)  # noqa: E731
    else:
        sliced = _slice
    full = _cuda(case, args, kwargs)
    again = _cuda(case, args, kwargs)
    for index, (first, second) in enumerate(zip(full, again)):
        if first is not None:
            assert_bytes_equal(first.cpu(), second.cpu(), what=f"{case.id} run-to-run output {index}")
    for tokens in (1, 7):
        for position in (0, (BATCH - tokens) // 2, BATCH - tokens):
            part_args = tuple(sliced(a, position, tokens) for a in args)
            part_kwargs = {k: sliced(v, position, tokens) for k, v in kwargs.items()}
            if case.op == UNPERMUTE:  # (y_expanded, permutation, topk_weights, num_tokens): T is positional
                part_args = (*part_args[:3], tokens)
            part = _cuda(case, part_args, part_kwargs)
            for index, (whole, piece) in enumerate(zip(full, part)):
                if whole is not None:
                    assert_bytes_equal(piece.cpu(), whole[position:position + tokens].cpu(),
                                       what=f"{case.id} rows [{position}, {position + tokens}) output {index}")


@pytest.mark.parametrize("op", (COUNTS, PERMUTE))
def test_layout_is_deterministic(op: str) -> None:
    case = next(case for case in GRID if case.op == op)
    args, kwargs = case.arguments(BATCH, "cpu", seed=5)
    first, second = _cuda(case, args, kwargs), _cuda(case, args, kwargs)
    for index, (a, b) in enumerate(zip(first, second)):
        if a is not None:
            assert_bytes_equal(a.cpu(), b.cpu(), what=f"{op} run-to-run output {index}")


# ---------------------------------------------------------------------- non-finite rows


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("case", NONFINITE, ids=[case.id for case in NONFINITE])
def test_nonfinite_row_is_contained(case: Case, value: float) -> None:
    """One bad score in row 5: −1 (and weight 0) in every slot of row 5, other rows unchanged,
    and the CUDA context still works afterwards (no device-side assert)."""
    args, kwargs = case.arguments(129, "cpu", seed=3)
    clean = _cuda(case, args, kwargs)
    bad = args[0].clone()
    bad[5, bad.shape[1] // 3] = value
    damaged = _cuda(case, (bad, *args[1:]), kwargs)
    keep = torch.ones(129, dtype=torch.bool)
    keep[5] = False
    for index, (have, want) in enumerate(zip(damaged, clean)):
        if have is None or (case.op == FULL and index == 2):
            continue
        assert_bytes_equal(have.cpu()[keep], want.cpu()[keep], what=f"other rows, output {index}")
    assert bool((damaged[0].cpu()[5] == -1).all()), "the row's indices are -1"
    if case.op == FULL:
        assert bool((damaged[1].cpu()[5] == 0).all()), "the row's weights are 0"
    assert torch.ones(4, device=DEVICE).sum().item() == 4.0  # the context is intact
