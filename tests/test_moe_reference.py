"""The reference MoE routing ops (SPEC §7) against independent implementations written here:
a naive Python top-k loop with explicit tie handling, float64 scoring functions, a naive
group router, a naive expert layout built token by token, and gradcheck in fp64."""

from __future__ import annotations

import math

import pytest
import torch

from tileplug import core
from tileplug.core.testing import assert_within_ulps

ops = core.ops
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


@pytest.fixture(autouse=True)
def _reference():
    with core.use_backend("reference"):
        yield


# ---------------------------------------------------------------------- independent implementations


def naive_topk(row: list[float], count: int, allowed: list[bool] | None = None) -> list[int]:
    """Repeatedly take the largest remaining value; on equal values keep the smaller index
    (a strict ``>`` scanning upwards)."""
    taken: set[int] = set()
    picked = []
    for _ in range(count):
        best = None
        for index, value in enumerate(row):
            if index in taken or (allowed is not None and not allowed[index]):
                continue
            if best is None or value > row[best]:
                best = index
        picked.append(best)
        taken.add(best)
    return picked


def score64(value: float, scoring: str) -> float:
    if scoring == "sigmoid":
        return 1.0 / (1.0 + math.exp(-value))
    if scoring == "sqrtsoftplus":
        return math.sqrt(math.log1p(math.exp(value)) if value < 30 else value + math.log1p(math.exp(-value)))
    raise ValueError(scoring)


def softmax64(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(v - top) for v in row]
    total = math.fsum(exps)
    return [e / total for e in exps]


def naive_gate(scores: torch.Tensor, num_topk: int, bias=None, num_groups=1, topk_groups=1, renormalize=True,
               scaling=1.0, shared=0, mask=None) -> tuple[list[list[int]], list[list[float]]]:
    """Per row, in Python: biased values, group scores (two largest), best groups (ties to
    the smaller group), top-k among their experts, weights in float64."""
    tokens, experts = scores.shape
    size = experts // num_groups
    all_idx, all_w = [], []
    for t in range(tokens):
        u = [float(v) for v in scores[t].tolist()]
        if (mask is not None and not bool(mask[t])) or not all(math.isfinite(v) for v in u):
            all_idx.append([-1] * (num_topk + shared))
            all_w.append([0.0] * (num_topk + shared))
            continue
        biased = [float(torch.tensor(u[e], dtype=F32) + (0 if bias is None else bias[e])) for e in range(experts)]
        allowed = None
        if num_groups > 1:
            group_scores = []
            for g in range(num_groups):
                members = sorted(biased[g * size:(g + 1) * size], reverse=True)
                group_scores.append(float(torch.tensor(members[0], dtype=F32) + torch.tensor(members[1], dtype=F32)))
            best = set(naive_topk(group_scores, topk_groups))
            allowed = [e // size in best for e in range(experts)]
        idx = naive_topk(biased, num_topk, allowed)
        weights = [u[e] for e in idx]
        if renormalize:
            total = math.fsum(weights) + 1e-20
            weights = [w / total for w in weights]
        weights = [w * scaling for w in weights]
        all_idx.append(idx + list(range(experts, experts + shared)))
        all_w.append(weights + [1.0] * shared)
    return all_idx, all_w


def naive_layout(topk_idx: torch.Tensor, experts: int, alignment: int):
    """(counts, ends, permutation as {(t, slot): row}) built expert by expert, token by token."""
    rows = topk_idx.tolist()
    counts, ends, permutation = [], [], {}
    start = 0
    for e in range(experts):
        if e:
            start = -(-ends[-1] // alignment) * alignment
        row = start
        for t, slots in enumerate(rows):
            for s, value in enumerate(slots):
                if value == e:
                    permutation[(t, s)] = row
                    row += 1
        counts.append(row - start)
        ends.append(row)
    return counts, ends, permutation


# ---------------------------------------------------------------------- topk_gate


def _tie_rows(experts: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(experts)
    coarse = torch.round(torch.randn(6, experts, generator=generator).clamp(-1, 1) * 2) / 2
    rows = [coarse, torch.full((1, experts), 0.25), torch.randn(1, experts, generator=generator)]
    kth = torch.arange(experts, dtype=F32).flip(0).unsqueeze(0) / experts
    kth[0, experts // 2:] = kth[0, experts // 2]  # every value from the middle on is equal: ties at the k-th place
    signed_zero = torch.zeros(1, experts)
    signed_zero[0, ::2] = -0.0  # -0.0 and +0.0 are equal: ties to the smaller index
    return torch.cat(rows + [kth, signed_zero]).to(F32)


@pytest.mark.parametrize("experts,count", [(8, 1), (8, 8), (72, 6), (100, 32), (1000, 8), (1024, 32)])
def test_topk_gate_matches_the_naive_loop_with_ties(experts, count):
    scores = _tie_rows(experts)
    got = ops.topk_gate(scores, count)
    assert got.dtype == torch.int64 and got.shape == (scores.shape[0], count) and got.is_contiguous()
    assert got.tolist() == [naive_topk(row, count) for row in scores.tolist()]


def test_topk_gate_hand_worked_ties():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, -0.0, 0.0, -1.0, 5.0]])
    assert ops.topk_gate(scores, 4).tolist() == [[1, 2, 4, 3], [4, 0, 1, 2]]


def test_topk_gate_non_finite_rows_get_minus_one_and_leave_others_untouched():
    scores = torch.randn(7, 40)
    clean = ops.topk_gate(scores, 5)
    scores[1, 3], scores[4, 39], scores[5, 0] = float("nan"), float("inf"), float("-inf")
    got = ops.topk_gate(scores, 5)
    for row in (1, 4, 5):
        assert got[row].tolist() == [-1] * 5
    others = [0, 2, 3, 6]
    assert torch.equal(got[others], clean[others])


# ---------------------------------------------------------------------- moe_topk_gate


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_scores_match_float64(scoring):
    logits = torch.randn(9, 37, dtype=torch.float64).mul(3).to(F32)
    logits[0, :3] = torch.tensor([40.0, -40.0, 0.0])
    _, _, scores = ops.moe_topk_gate(logits, 3, scoring, return_scores=True)
    assert scores.dtype == F32
    rows = logits.double().tolist()
    expected = [softmax64(row) if scoring == "softmax" else [score64(v, scoring) for v in row] for row in rows]
    expected = torch.tensor(expected, dtype=F64)
    if scoring == "softmax":  # the fp32 difference x - max is rounded: exp magnifies it by |x - max|
        spread = (logits.double() - logits.double().amax(dim=1, keepdim=True)).abs()
        relative = (scores.double() - expected).abs() / expected
        assert (relative <= 2.0**-23 * (4 + spread)).all()
    else:
        assert_within_ulps(scores, expected.to(F32), 2, what=scoring)


CONFIGS = [
    dict(scoring="softmax"),
    dict(scoring="softmax", renormalize=False, scaling=1.5),
    dict(scoring="sigmoid", bias=True, num_groups=8, topk_groups=4, scaling=2.5),
    dict(scoring="sigmoid", bias=True, num_groups=4, topk_groups=1, shared=2),
    dict(scoring="sqrtsoftplus", bias=True, shared=1),
    dict(scoring="sqrtsoftplus", num_groups=16, topk_groups=3, mask=True, renormalize=False),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("ties", [False, True])
def test_moe_topk_gate_matches_the_naive_router(config, ties):
    experts, num_topk, tokens = 64, 6, 23
    generator = torch.Generator().manual_seed(len(str(config)) + ties)
    logits = torch.randn(tokens, experts, generator=generator)
    if ties:  # repeated maxima inside and across groups, ties at the k-th place
        logits = torch.round(logits.clamp(-1, 1) * 2) / 2
    bias = torch.round(torch.randn(experts, generator=generator) * 4) / 16 if config.get("bias") else None
    mask = torch.arange(tokens) % 4 != 1 if config.get("mask") else None
    kwargs = dict(bias=bias, num_groups=config.get("num_groups", 1), topk_groups=config.get("topk_groups", 1),
                  renormalize=config.get("renormalize", True), routed_scaling_factor=config.get("scaling", 1.0),
                  num_shared_experts=config.get("shared", 0), mask=mask)
    idx, weights, scores = ops.moe_topk_gate(logits, num_topk, config["scoring"], return_scores=True, **kwargs)
    want_idx, want_w = naive_gate(scores, num_topk, bias, kwargs["num_groups"], kwargs["topk_groups"],
                                  kwargs["renormalize"], kwargs["routed_scaling_factor"], kwargs["num_shared_experts"],
                                  mask)
    assert idx.tolist() == want_idx
    assert_within_ulps(weights, torch.tensor(want_w, dtype=F64).to(F32), 2, what="weights")
    assert idx.shape == weights.shape == (tokens, num_topk + kwargs["num_shared_experts"])


def test_groups_hand_worked():
    # 4 groups of 2: group sums 1.0+0.9, 1.0+0.9 (tie: group 0 first), 0.5+0.5, 2.0+0.0
    logits = torch.tensor([[1.0, 0.9, 0.9, 1.0, 0.5, 0.5, 2.0, 0.0]])
    scoring = "sigmoid"
    idx, weights = ops.moe_topk_gate(torch.logit(torch.sigmoid(logits)), 3, scoring, num_groups=4, topk_groups=2,
                                     renormalize=False)
    # best groups by two-largest sum: group 3 (2.0+0.0 → sigmoid sum ≈ 1.38) vs group 0 and 1 (≈ 1.44 each)
    # → groups 0 and 1 (tie → both, as they are the two best); experts 0 and 3 (equal, 0 first), then 1 vs 2 (tie → 1)
    assert idx.tolist() == [[0, 3, 1]]
    assert torch.equal(weights, torch.sigmoid(logits)[:, [0, 3, 1]])


def test_shared_experts_mask_and_scaling_hand_worked():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([True, False, True])
    idx, weights = ops.moe_topk_gate(logits, 2, "softmax", num_shared_experts=2, mask=mask,
                                     routed_scaling_factor=2.0)
    assert idx.tolist() == [[1, 2, 4, 5], [-1, -1, -1, -1], [0, 1, 4, 5]]
    e = torch.exp(torch.tensor([2.0, 1.0]) - 2.0)
    assert torch.allclose(weights[0, :2], 2 * e / e.sum(), rtol=0, atol=3e-7)
    assert weights[0, 2:].tolist() == [1.0, 1.0] and weights[1].tolist() == [0.0] * 4
    assert weights[2].tolist() == [1.0, 1.0, 1.0, 1.0]  # 0.25 / 0.5 · 2, then the shared slots


def test_non_finite_logits_and_bias():
    logits = torch.randn(6, 32)
    clean_idx, clean_w = ops.moe_topk_gate(logits, 4, "sigmoid")
    logits[2, 5] = float("nan")
    logits[3, 0] = float("inf")
    idx, weights = ops.moe_topk_gate(logits, 4, "sigmoid", num_shared_experts=1)
    for row in (2, 3):
        assert idx[row].tolist() == [-1] * 5 and weights[row].tolist() == [0.0] * 5
    others = [0, 1, 4, 5]
    assert torch.equal(idx[others, :4], clean_idx[others]) and torch.equal(weights[others, :4], clean_w[others])
    bias = torch.zeros(32)
    bias[7] = float("nan")
    idx, weights = ops.moe_topk_gate(torch.randn(3, 32), 4, "sigmoid", bias=bias)
    assert (idx == -1).all() and (weights == 0).all()


def test_check_finite_raises_naming_the_rows_and_costs_nothing_when_off():
    logits = torch.randn(10, 16, dtype=BF16)
    logits[3, 1], logits[7, 2] = float("nan"), float("-inf")
    ops.moe_topk_gate(logits, 2)  # off: no error
    with core.config.check_finite(True):
        with pytest.raises(core.ContractError) as error:
            ops.moe_topk_gate(logits, 2)
        assert error.value.argument == "logits" and "row(s) 3, 7" in str(error.value)
        with pytest.raises(core.ContractError, match=r"row\(s\) 3"):
            ops.topk_gate(logits.float()[:5], 2)
        mask = torch.ones(10, dtype=torch.bool)
        mask[[3, 7]] = False
        ops.moe_topk_gate(logits, 2, mask=mask)  # the masked rows are padding: not checked
        bias = torch.zeros(16)
        bias[0] = float("inf")
        with pytest.raises(core.ContractError, match="bias"):
            ops.moe_topk_gate(logits[:2], 2, bias=bias)
    ops.topk_gate(logits.float(), 2)  # off again outside the block
    core.config.set(check_finite=True)
    try:
        with pytest.raises(core.ContractError):
            ops.topk_gate(logits.float(), 2)
    finally:
        core.config.reset()
    with pytest.raises(core.ContractError, match="bool"):
        core.config.set(check_finite=1)


def test_normalize_weight_sums_left_to_right():
    weights = torch.tensor([[1e8, 1.0, -1e8, 1.0], [0.5, 0.25, 0.125, 0.125], [0.0, 0.0, 0.0, 0.0]])
    denominator, normalized = ops.normalize_weight(weights)
    # fp32 left to right: (1e8 + 1) = 1e8, - 1e8 = 0, + 1 = 1
    assert denominator.tolist()[:2] == [1.0, 1.0]
    assert torch.equal(normalized[:2], weights[:2] / denominator[:2, None])
    assert torch.isnan(normalized[2]).all()  # 0 / 0


def test_batch_invariance_of_the_gates():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(300, 256, generator=generator, dtype=torch.float64).to(BF16)
    bias = torch.randn(256, generator=generator) * 0.1
    kwargs = dict(bias=bias, num_groups=8, topk_groups=4, routed_scaling_factor=2.5, return_scores=True)
    full = ops.moe_topk_gate(logits, 8, "sigmoid", **kwargs)
    for row in (0, 137, 299):
        for window in (logits[row:row + 1], logits[max(0, row - 2):row + 3]):
            part = ops.moe_topk_gate(window, 8, "sigmoid", **kwargs)
            offset = row - max(0, row - 2) if window.shape[0] > 1 else 0
            for have, want in zip(part, full):
                assert have[offset].view(torch.uint8).tolist() == want[row].view(torch.uint8).tolist()
    scores = torch.randn(64, 1000, generator=generator)
    assert torch.equal(ops.topk_gate(scores, 8)[17], ops.topk_gate(scores[17:18], 8)[0])


# ---------------------------------------------------------------------- backward


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_gradcheck_fp64(scoring):
    logits = torch.randn(5, 16, dtype=F64, requires_grad=True)
    mask = torch.tensor([True, True, False, True, True])

    def routed(renormalize, groups, shared, with_mask):
        return lambda x: ops.moe_topk_gate(x, 4, scoring, num_groups=groups, topk_groups=2 if groups > 1 else 1,
                                           renormalize=renormalize, routed_scaling_factor=1.5,
                                           num_shared_experts=shared, mask=mask if with_mask else None)[1]

    for options in ((True, 1, 0, False), (False, 4, 1, True)):
        assert torch.autograd.gradcheck(routed(*options), (logits,))


def test_fp32_backward_within_1e_5_of_fp64_and_repeated_experts_accumulate():
    from tileplug.core.testing import relative_error

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(40, 72, generator=generator, dtype=F64)
    grad = torch.randn(40, 7, generator=generator, dtype=F64)
    for scoring in ("softmax", "sigmoid", "sqrtsoftplus"):
        idx, weights, scores = ops.moe_topk_gate(logits, 6, scoring, num_shared_experts=1, return_scores=True)
        want = ops.moe_topk_gate_backward(scores, idx, weights, grad, scoring)
        idx32, w32, s32 = ops.moe_topk_gate(logits.float(), 6, scoring, num_shared_experts=1, return_scores=True)
        assert torch.equal(idx32, idx)
        have = ops.moe_topk_gate_backward(s32, idx32, w32, grad.float(), scoring)
        assert have.dtype == F32 and relative_error(have.double(), want) <= 1e-5
    # an expert named in two slots gets both slots' gradient (no renormalization: c·g each)
    scores = torch.tensor([[0.2, 0.5, 0.3]], dtype=F64)
    twice = ops.moe_topk_gate_backward(scores, torch.tensor([[1, 1, -1]]), scores[:, [1, 1, 0]],
                                       torch.tensor([[1.0, 2.0, 5.0]], dtype=F64), "sigmoid", renormalize=False)
    assert torch.allclose(twice, torch.tensor([[0.0, 3.0 * 0.5 * 0.5, 0.0]], dtype=F64))


def test_autograd_eager_and_compiled_fullgraph():
    torch._dynamo.reset()
    logits = torch.randn(12, 64, dtype=BF16)
    bias = torch.randn(64) * 0.1

    def loss(x):
        idx, weights = ops.moe_topk_gate(x, 6, "sqrtsoftplus", bias=bias, num_groups=8, topk_groups=3,
                                         num_shared_experts=1)
        counts, ends = ops.moe_expert_counts(idx, 65)
        return (weights * torch.arange(7.0)).sum(), weights, idx, counts, ends

    eager_x = logits.clone().requires_grad_(True)
    eager = loss(eager_x)
    eager[0].backward()
    compiled_x = logits.clone().requires_grad_(True)
    compiled = torch.compile(loss, fullgraph=True)(compiled_x)
    compiled[0].backward()
    # the op's outputs bytewise; the loss is inductor's own sum (its reduction order may differ)
    assert all(torch.equal(a, b) for a, b in zip(eager[1:], compiled[1:]))
    assert torch.allclose(eager[0], compiled[0], rtol=1e-6, atol=0)
    assert compiled_x.grad.dtype == BF16 and torch.equal(eager_x.grad, compiled_x.grad)
    assert eager_x.grad.abs().sum() > 0
    assert not ops.moe_topk_gate(eager_x, 6)[0].requires_grad  # indices carry no gradient


# ---------------------------------------------------------------------- counting and permutation


@pytest.mark.parametrize("experts,slots,alignment", [(9, 3, 3), (72, 6, 1), (16, 9, 16), (256, 8, 128)])
def test_counts_and_permute_match_the_naive_layout(experts, slots, alignment):
    tokens = 37
    generator = torch.Generator().manual_seed(experts)
    topk_idx = torch.randint(-1, experts + 2, (tokens, slots), generator=generator)  # -1 and past-E: not routed
    counts, ends = ops.moe_expert_counts(topk_idx.to(torch.int32), experts, alignment)
    want_counts, want_ends, want_rows = naive_layout(topk_idx, experts, alignment)
    assert counts.dtype == ends.dtype == torch.int32
    assert counts.tolist() == want_counts and ends.tolist() == want_ends
    x = torch.randn(tokens, 33, dtype=torch.float64).to(BF16)
    x_expanded, no_sf, permutation, permute_ends = ops.moe_permute(x, topk_idx, experts, alignment)
    assert no_sf is None and torch.equal(permute_ends, ends)
    rows = tokens * slots + min(tokens * slots, experts - 1) * (alignment - 1)
    assert x_expanded.shape == (rows, 33) and permutation.dtype == torch.int32
    filled = torch.zeros(rows, dtype=torch.bool)
    for t in range(tokens):
        for s in range(slots):
            row = want_rows.get((t, s), -1)
            assert permutation[t, s] == row
            if row >= 0:
                assert torch.equal(x_expanded[row], x[t])
                filled[row] = True
    assert (x_expanded[~filled].view(torch.int16) == 0).all()  # padding: zero bytes


def test_round_trip_returns_x_times_k_exactly():
    x = torch.randint(-64, 64, (50, 96)).to(BF16) / 8  # sums of k copies stay bf16-representable
    topk_idx, weights = ops.moe_topk_gate(torch.randn(50, 32), 4, "sigmoid")
    x_expanded, _, permutation, _ = ops.moe_permute(x, topk_idx, 32, alignment=16)
    y = ops.moe_unpermute(x_expanded, permutation, torch.ones_like(weights), 50)
    assert y.dtype == BF16 and torch.equal(y, x * 4)
    y_weighted = ops.moe_unpermute(x_expanded.float(), permutation, weights, 50)
    want = sum(weights[:, s:s + 1] * x.float() for s in range(4))
    assert_within_ulps(y_weighted, want, 1, what="weighted")


def test_unpermute_skips_unrouted_slots_and_accumulates_in_slot_order():
    y_expanded = torch.tensor([[1e8], [1.0], [-1e8], [float("nan")]])
    permutation = torch.tensor([[0, 1, 2, -1]], dtype=torch.int32)
    y = ops.moe_unpermute(y_expanded, permutation, torch.ones(1, 4), 1)
    assert y.tolist() == [[0.0]]  # (1e8 + 1) - 1e8 in fp32, slot order; the NaN row is never read


@pytest.mark.parametrize("data_dtype,sf_dtype,width,sf_width", [
    (torch.float8_e4m3fn, torch.float32, 512, 4), (torch.float8_e4m3fn, torch.int32, 7168, 14),
    (torch.int8, torch.float8_e4m3fn, 288, 36), (torch.float8_e4m3fn, torch.int16, 1024, 4)])
def test_permute_quantized_rows_with_their_sf_rows(data_dtype, sf_dtype, width, sf_width):
    tokens, experts = 11, 8
    generator = torch.Generator().manual_seed(width)
    x = torch.randint(0, 126, (tokens, width), generator=generator, dtype=torch.uint8).view(
        torch.int8 if data_dtype == torch.int8 else data_dtype)
    sf = torch.randint(0, 256, (tokens, sf_width * sf_dtype.itemsize), generator=generator,
                       dtype=torch.uint8).view(sf_dtype)
    topk_idx = torch.stack([torch.randperm(experts, generator=generator)[:3] for _ in range(tokens)])
    x_expanded, sf_expanded, permutation, _ = ops.moe_permute(x, topk_idx, experts, 4, x_sf=sf)
    assert x_expanded.dtype == data_dtype and sf_expanded.dtype == sf_dtype and sf_expanded.shape[1] == sf_width
    for t in range(tokens):
        for s in range(3):
            row = int(permutation[t, s])
            assert torch.equal(x_expanded[row].view(torch.uint8), x[t].view(torch.uint8))
            assert torch.equal(sf_expanded[row].view(torch.uint8), sf[t].view(torch.uint8))
    used = permutation.flatten().long()
    unused = torch.ones(x_expanded.shape[0], dtype=torch.bool)
    unused[used] = False
    assert (x_expanded[unused].view(torch.uint8) == 0).all() and (sf_expanded[unused].view(torch.uint8) == 0).all()


def test_empty_routing_gives_zero_counts_and_ends():
    counts, ends = ops.moe_expert_counts(torch.empty(0, 8, dtype=torch.int64), 16, 128)
    assert counts.tolist() == [0] * 16 and ends.tolist() == [0] * 16
    x_expanded, _, permutation, ends = ops.moe_permute(torch.empty(0, 64, dtype=BF16), torch.empty(0, 8,
                                                       dtype=torch.int64), 16, 128)
    assert x_expanded.shape == (0, 64) and permutation.shape == (0, 8) and ends.tolist() == [0] * 16
    assert ops.topk_gate(torch.empty(0, 40), 3).shape == (0, 3)
    idx, weights, scores = ops.moe_topk_gate(torch.empty(0, 40), 3, num_shared_experts=1, return_scores=True)
    assert idx.shape == weights.shape == (0, 4) and scores.shape == (0, 40)


def test_permutation_is_deterministic_and_in_token_order():
    topk_idx = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 2]])  # token 3 routes to expert 2 twice
    _, _, permutation, ends = ops.moe_permute(torch.arange(8.0).view(4, 2), topk_idx, 3)
    assert ends.tolist() == [2, 3, 8]
    assert permutation.tolist() == [[3, 0], [4, 2], [1, 5], [6, 7]]
