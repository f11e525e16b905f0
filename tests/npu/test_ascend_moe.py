"""Ascend MoE routing kernels (``topk_gate``, ``moe_topk_gate``, ``moe_topk_gate_backward``,
``normalize_weight``, ``moe_expert_counts``, ``moe_permute``, ``moe_unpermute``) on an NPU
against the reference (marker ``npu``).

Skipped everywhere without an Ascend NPU (tests/conftest.py gives the reason). On an Ascend
950 host with torch_npu they run unchanged. Indices are compared byte for byte (ties to the
smaller index, non-finite rows −1 in every slot), weights and scores within 2 ulp fp32 (SPEC
§7, the op table's ``compare``); ``normalize_weight``, the counts / ends and everything
``moe_permute`` writes bytewise, ``moe_unpermute`` within 1 ulp, the backward within a
relative 1e-5 (norm-wise). Until these pass there, the Ascend MoE kernels are "lowered",
never "verified".
"""

from __future__ import annotations

import pytest
import torch

from tileplug import core
from tileplug.core.testing import assert_bytes_equal, assert_within_ulps, cpu_copy
from tileplug.reference.conformance import CaseDeclined, check_case

pytestmark = pytest.mark.npu

TOKENS = (0, 1, 3, 129, 4001)
MOE_OPS = ("topk_gate", "moe_topk_gate", "moe_topk_gate_backward", "normalize_weight", "moe_expert_counts",
           "moe_permute", "moe_unpermute")


def _cases() -> list:
    return [(case, tokens) for name in MOE_OPS for case in core.opdefs.get(name).cases() for tokens in TOKENS]


@pytest.mark.parametrize("case,tokens", _cases(), ids=lambda v: v.id if hasattr(v, "id") else f"T={v}")
def test_matches_reference(case, tokens):
    """Every op-table case of the routing ops with an Ascend kernel against the reference on
    the CPU: indices bytewise, weights / scores within the op's SPEC tolerance (its ``compare``)."""
    try:
        check_case(case, tokens, "ascend", "npu")
    except CaseDeclined as declined:
        pytest.skip(str(declined))


def _reference_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    with core.use_backend("reference"):
        return core.ops.topk_gate(scores, k)


@pytest.mark.parametrize("experts,k", [(8, 8), (72, 6), (100, 32), (1000, 8), (1024, 32)])
def test_topk_gate_ties_to_the_smaller_index(experts, k):
    """Rows of coarse quarter-step values (many ties at every place, the k-th included), all-equal
    rows, and rows holding −0.0 and +0.0: indices bytewise equal to the reference's stable sort."""
    generator = torch.Generator().manual_seed(experts)
    coarse = torch.randint(-4, 4, (257, experts), generator=generator).float() / 4
    coarse[0] = 1.5
    coarse[1, ::2], coarse[1, 1::2] = -0.0, 0.0
    with core.use_backend("ascend"):
        got = cpu_copy(core.ops.topk_gate(coarse.to("npu"), k))
    assert_bytes_equal(got, _reference_topk(coarse, k), "topk_idx")
    assert got[0].tolist() == list(range(k))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_topk_gate_non_finite_rows_give_minus_one(bad):
    """A row holding a non-finite score (first column, last column, the padded tail's edge) gives
    −1 in every slot; every other row is exactly what it is without it. No abort."""
    scores = torch.randn(64, 100, generator=torch.Generator().manual_seed(1))
    scores[3, 0] = bad
    scores[10, 99] = bad
    scores[20, 63] = bad
    with core.use_backend("ascend"):
        got = cpu_copy(core.ops.topk_gate(scores.to("npu"), 8))
    expected = _reference_topk(scores, 8)
    assert_bytes_equal(got, expected, "topk_idx")
    assert (got[[3, 10, 20]] == -1).all()


def test_topk_gate_batch_invariant_and_strided():
    """A row's indices do not depend on the batch it sits in; a padded row stride reads the same."""
    scores = torch.randn(4001, 256, generator=torch.Generator().manual_seed(2))
    padded = torch.zeros(4001, 259)
    padded[:, :256] = scores
    with core.use_backend("ascend"):
        full = cpu_copy(core.ops.topk_gate(scores.to("npu"), 8))
        strided = cpu_copy(core.ops.topk_gate(padded.to("npu")[:, :256], 8))
        part = cpu_copy(core.ops.topk_gate(scores[2000:2007].to("npu"), 8))
    assert_bytes_equal(strided, full, "strided")
    assert_bytes_equal(part, full[2000:2007], "rows 2000:2007")


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_moe_topk_gate_non_finite_rows_and_shared_slots(scoring, dtype):
    """Non-finite logits give −1 / 0 in every slot, shared ones included; other rows keep the
    reference's indices bytewise and weights within 2 ulp; shared slots are E, E+1 with weight 1."""
    logits = (torch.randn(129, 160, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    logits[5, 7] = float("nan")
    logits[9, 159] = float("inf")
    bias = torch.randn(160, generator=torch.Generator().manual_seed(4)) * 0.1
    kwargs = dict(scoring=scoring, num_shared_experts=2, routed_scaling_factor=2.5, return_scores=True)
    with core.use_backend("ascend"):
        idx, w, _ = (cpu_copy(t) for t in core.ops.moe_topk_gate(logits.to("npu"), 6, bias=bias.to("npu"),
                                                                     **kwargs))
    with core.use_backend("reference"):
        ref_idx, ref_w, _ = core.ops.moe_topk_gate(logits, 6, bias=bias, **kwargs)
    assert_bytes_equal(idx, ref_idx, "topk_idx")
    assert_within_ulps(w, ref_w, 2, "topk_weights")
    assert (idx[[5, 9]] == -1).all() and (w[[5, 9]] == 0).all()
    assert idx[0, 6:].tolist() == [160, 161] and w[0, 6:].tolist() == [1.0, 1.0]


def test_normalize_weight_bytewise_edge_rows():
    """Rows whose left-to-right sum differs from a pairwise one, a single slot, −0.0 and a zero
    sum (NaN), inf and NaN weights: denominators and quotients bytewise the reference's."""
    generator = torch.Generator().manual_seed(5)
    for slots in (1, 6, 9, 64, 65, 130):
        weights = torch.rand(257, slots, generator=generator) * torch.logspace(-8, 8, slots)
        weights[0] = -0.0
        weights[1] = 0.0
        weights[2, 0] = float("inf")
        weights[3, -1] = float("nan")
        with core.use_backend("ascend"):
            denominator, normalized = (cpu_copy(t) for t in core.ops.normalize_weight(weights.to("npu")))
        with core.use_backend("reference"):
            want_denominator, want_normalized = core.ops.normalize_weight(weights)
        assert_bytes_equal(denominator, want_denominator, f"denominator K={slots}")
        assert_bytes_equal(normalized, want_normalized, f"normalized K={slots}")


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("experts,alignment", [(1, 1), (9, 3), (72, 16), (256, 128), (8192, 1)])
def test_moe_expert_counts_bytewise_and_deterministic(index_dtype, experts, alignment):
    """Counts and ends bytewise the reference's for routings with −1, shared experts past E,
    int64 values past 2**32 (not routed), and empty experts; the same bytes on a second run;
    T below, at and above the 64 blocks of the count kernel."""
    generator = torch.Generator().manual_seed(experts)
    for tokens in (1, 63, 64, 4001):
        topk_idx = torch.randint(-1, experts + 3, (tokens, 8), generator=generator).to(index_dtype)
        if index_dtype == torch.int64:
            topk_idx[::7, 0] = 2**32 + 1  # low word 1, high word 1: not routed
        with core.use_backend("ascend"):
            first = [cpu_copy(t) for t in core.ops.moe_expert_counts(topk_idx.to("npu"), experts, alignment)]
            second = [cpu_copy(t) for t in core.ops.moe_expert_counts(topk_idx.to("npu"), experts, alignment)]
        with core.use_backend("reference"):
            want = core.ops.moe_expert_counts(topk_idx, experts, alignment)
        for name, have, again, expected in zip(("counts", "expert_ends"), first, second, want):
            assert_bytes_equal(have, expected, f"{name} T={tokens}")
            assert_bytes_equal(again, have, f"{name} T={tokens} (second run)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_moe_unpermute_round_trip_and_skipped_slots(dtype, index_dtype):
    """Unit weights give ``x · K`` back exactly (moe_permute on the reference, then the Ascend
    unpermute); slots of row −1 are skipped; H = 7168 runs in two column tiles. Within 1 ulp
    of the reference in every case."""
    generator = torch.Generator().manual_seed(6)
    x = (torch.randint(-8, 8, (129, 7168), generator=generator) / 4).to(dtype)
    topk_idx = torch.randint(-1, 16, (129, 4), generator=generator)
    with core.use_backend("reference"):
        x_expanded, _, permutation, _ = core.ops.moe_permute(x, topk_idx, 16, 16)
    weights = torch.ones(129, 4)
    permutation = permutation.to(index_dtype)
    with core.use_backend("ascend"):
        y = cpu_copy(core.ops.moe_unpermute(x_expanded.to("npu"), permutation.to("npu"), weights.to("npu"), 129))
    with core.use_backend("reference"):
        want = core.ops.moe_unpermute(x_expanded, permutation, weights, 129)
    assert_within_ulps(y, want, 1, "y")
    routed = (topk_idx >= 0).sum(dim=1, keepdim=True).to(torch.float32)
    assert_bytes_equal(y, (x.float() * routed).to(dtype), "x · routed slots")


def _permute_both(x, topk_idx, experts, alignment, x_sf=None):
    """``moe_permute`` on the NPU (Ascend) and on the CPU (reference)."""
    with core.use_backend("ascend"):
        got = core.ops.moe_permute(x.to("npu"), topk_idx.to("npu"), experts, alignment,
                                   x_sf=None if x_sf is None else x_sf.to("npu"))
        got = [None if t is None else cpu_copy(t) for t in got]
    with core.use_backend("reference"):
        want = core.ops.moe_permute(x, topk_idx, experts, alignment, x_sf=x_sf)
    return got, want


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("experts,alignment", [(1, 1), (9, 3), (72, 16), (256, 128)])
def test_moe_permute_bytewise_token_order_and_padding(index_dtype, experts, alignment):
    """Rows, permutation and ends bytewise the reference's for routings with −1, shared experts
    past E, int64 values past 2**32 (not routed) and empty experts: token order within an
    expert, padding rows zero (the outputs start as garbage on the device), the same bytes on a
    second run; a padded row stride reads the same; H = 16384 fp32 runs in column tiles."""
    generator = torch.Generator().manual_seed(experts)
    for tokens, hidden in ((1, 576), (129, 576), (4001, 64), (65, 16384)):
        topk_idx = torch.randint(-1, experts + 3, (tokens, 8), generator=generator).to(index_dtype)
        if index_dtype == torch.int64:
            topk_idx[::7, 0] = 2**32 + 1  # low word 1, high word 1: not routed
        wide = torch.randn(tokens, hidden + 8, generator=generator)
        x = wide[:, :hidden] if hidden == 16384 else wide[:, :hidden].to(torch.bfloat16)
        first, want = _permute_both(x, topk_idx, experts, alignment)
        second, _ = _permute_both(x, topk_idx, experts, alignment)
        for name, have, again, expected in zip(("x_expanded", "x_sf_expanded", "permutation", "expert_ends"),
                                               first, second, want):
            if expected is None:
                assert have is None, name
                continue
            assert_bytes_equal(have, expected, f"{name} T={tokens} H={hidden}")
            assert_bytes_equal(again, have, f"{name} T={tokens} H={hidden} (second run)")


@pytest.mark.parametrize("sf_dtype", [torch.float32, torch.float8_e4m3fn, torch.int32, torch.int16],
                         ids=["fp32", "e4m3", "ue8m0-int32", "ue8m0-int16"])
def test_moe_permute_quantized_rows_travel_with_their_scales(sf_dtype):
    """e4m3 rows and e2m1 rows (packed in int8) with their scale rows: both copied bytewise to
    every routed pair's row; the padding rows of both are zero bytes."""
    generator = torch.Generator().manual_seed(7)
    topk_idx = torch.randint(-1, 20, (129, 6), generator=generator)
    widths = {torch.float32: 4, torch.float8_e4m3fn: 36, torch.int32: 14, torch.int16: 4}
    x_sf = torch.randint(-100, 100, (129, widths[sf_dtype]), generator=generator, dtype=torch.int8)
    x_sf = x_sf.to(torch.float32).to(sf_dtype) if sf_dtype.is_floating_point else x_sf.to(sf_dtype)
    for x in (torch.randn(129, 512, generator=generator).to(torch.float8_e4m3fn),
              torch.randint(-128, 127, (129, 288), generator=generator, dtype=torch.int8)):
        got, want = _permute_both(x, topk_idx, 16, 16, x_sf=x_sf)
        for name, have, expected in zip(("x_expanded", "x_sf_expanded", "permutation", "expert_ends"), got, want):
            assert_bytes_equal(have, expected, f"{name} {x.dtype}")


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalize", "plain"])
def test_moe_topk_gate_backward_slots_mask_and_empty_rows(scoring, renormalize):
    """An expert named in two slots receives both, shared / −1 slots carry nothing, masked rows
    and rows without a routed slot are zero (exactly); the rest within a relative 1e-5 (norm-wise)
    of the reference, row by row. Scores from the forward, so sqrtsoftplus meets small ``u``."""
    generator = torch.Generator().manual_seed(8)
    logits = torch.randn(129, 160, generator=generator) * 4
    with core.use_backend("reference"):
        topk_idx, weights, scores = core.ops.moe_topk_gate(logits, 6, scoring=scoring, num_shared_experts=1,
                                                           return_scores=True)
    topk_idx = topk_idx.clone()
    topk_idx[3, 2] = topk_idx[3, 1]
    topk_idx[4, :] = -1
    grads = torch.randn(129, 7, generator=generator)
    mask = torch.rand(129, generator=generator) > 0.2
    kwargs = dict(renormalize=renormalize, routed_scaling_factor=2.5, mask=mask)
    with core.use_backend("ascend"):
        got = cpu_copy(core.ops.moe_topk_gate_backward(scores.to("npu"), topk_idx.to("npu"), weights.to("npu"),
                                                       grads.to("npu"), scoring,
                                                       **{**kwargs, "mask": mask.to("npu")}))
    with core.use_backend("reference"):
        want = core.ops.moe_topk_gate_backward(scores, topk_idx, weights, grads, scoring, **kwargs)
    zero_rows = (~mask).nonzero().flatten().tolist() + [4]
    assert (got[zero_rows] == 0).all()
    error = (got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30)
    assert (error[want.norm(dim=1) > 0] <= 1e-5).all(), error.max()


@pytest.mark.parametrize("ties", ["random", "coarse"])
@pytest.mark.parametrize("experts,groups,chosen", [(256, 8, 4), (160, 10, 3), (64, 32, 5)])
def test_moe_topk_gate_group_limited(ties, experts, groups, chosen):
    """Group-limited routing: indices bytewise the reference's (groups by their top-two sum, ties
    to the smaller group, experts outside the chosen groups never taken), weights within 2 ulp;
    coarse rows tie groups and experts alike."""
    generator = torch.Generator().manual_seed(experts + groups)
    logits = torch.randn(257, experts, generator=generator)
    if ties == "coarse":
        logits = torch.randint(-2, 2, (257, experts), generator=generator).float()
    bias = torch.randn(experts, generator=generator) * 0.01 if ties == "random" else None
    kwargs = dict(scoring="sigmoid", bias=bias, num_groups=groups, topk_groups=chosen)
    with core.use_backend("ascend"):
        idx, w = (cpu_copy(t) for t in core.ops.moe_topk_gate(
            logits.to("npu"), 6, **{**kwargs, "bias": None if bias is None else bias.to("npu")}))
    with core.use_backend("reference"):
        ref_idx, ref_w = core.ops.moe_topk_gate(logits, 6, **kwargs)
    assert_bytes_equal(idx, ref_idx, "topk_idx")
    assert_within_ulps(w, ref_w, 2, "topk_weights")
