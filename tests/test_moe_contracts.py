"""Contracts of the MoE routing family: every bad argument is a ContractError naming it (SPEC §0, §7)."""

from __future__ import annotations

import pytest
import torch

from tileplug import core

ops = core.ops
BF16, F32 = torch.bfloat16, torch.float32

SCORES = torch.randn(4, 16)
LOGITS = torch.randn(4, 16, dtype=BF16)
IDX = torch.randint(0, 16, (4, 3))
W = torch.rand(4, 3)
X = torch.randn(4, 32, dtype=BF16)
Q = torch.zeros(4, 32, dtype=torch.float8_e4m3fn)
Y = torch.randn(12, 32, dtype=BF16)
PERM = torch.arange(12, dtype=torch.int32).view(4, 3)
META = torch.empty(4, 16, device="meta")


def _backward(**changes):
    arguments = dict(scores=SCORES, topk_idx=IDX, topk_weights=W, grad_topk_weights=W, scoring="softmax")
    arguments.update(changes)
    return ops.moe_topk_gate_backward(**arguments)


CASES = [
    # (id, call, argument named, words of the expectation)
    ("topk scores not a tensor", lambda: ops.topk_gate([[1.0]], 1), "scores", "torch.Tensor"),
    ("topk scores 1-D", lambda: ops.topk_gate(torch.ones(8), 1), "scores", "2-D"),
    ("topk scores bf16", lambda: ops.topk_gate(LOGITS, 2), "scores", "dtype"),
    ("topk scores last stride", lambda: ops.topk_gate(torch.ones(16, 4).t(), 2), "scores", "unit stride"),
    ("topk scores E = 0", lambda: ops.topk_gate(torch.ones(4, 0), 1), "scores", "at least 1"),
    ("topk k = 0", lambda: ops.topk_gate(SCORES, 0), "num_topk", "[1, 16]"),
    ("topk k > E", lambda: ops.topk_gate(SCORES, 17), "num_topk", "at most E"),
    ("topk k a bool", lambda: ops.topk_gate(SCORES, True), "num_topk", "int"),
    ("topk k a float", lambda: ops.topk_gate(SCORES, 2.0), "num_topk", "int"),
    ("normalize int weights", lambda: ops.normalize_weight(IDX), "topk_weights", "dtype"),
    ("normalize 3-D weights", lambda: ops.normalize_weight(torch.ones(2, 2, 2)), "topk_weights", "2-D"),
    ("gate logits fp16", lambda: ops.moe_topk_gate(LOGITS.half(), 2), "logits", "dtype"),
    ("gate logits 3-D", lambda: ops.moe_topk_gate(torch.ones(2, 2, 8), 2), "logits", "2-D"),
    ("gate scoring unknown", lambda: ops.moe_topk_gate(LOGITS, 2, "relu"), "scoring", "sqrtsoftplus"),
    ("gate scoring not a str", lambda: ops.moe_topk_gate(LOGITS, 2, 1), "scoring", "softmax"),
    ("gate k too large", lambda: ops.moe_topk_gate(LOGITS, 17), "num_topk", "at most E"),
    ("gate k past the chosen groups", lambda: ops.moe_topk_gate(LOGITS, 5, num_groups=4, topk_groups=1),
     "num_topk", "4 experts"),
    ("gate bias wrong length", lambda: ops.moe_topk_gate(LOGITS, 2, bias=torch.zeros(15)), "bias", "[16]"),
    ("gate bias bf16", lambda: ops.moe_topk_gate(LOGITS, 2, bias=torch.zeros(16, dtype=BF16)), "bias", "dtype"),
    ("gate bias strided", lambda: ops.moe_topk_gate(LOGITS, 2, bias=torch.zeros(32)[::2]), "bias", "unit stride"),
    ("gate bias other device", lambda: ops.moe_topk_gate(LOGITS, 2, bias=torch.zeros(16, device="meta")), "bias",
     "cpu"),
    ("gate groups not dividing E", lambda: ops.moe_topk_gate(LOGITS, 2, num_groups=3), "num_groups", "divisor"),
    ("gate groups of one expert", lambda: ops.moe_topk_gate(LOGITS, 2, num_groups=16, topk_groups=2), "num_groups",
     "two largest"),
    ("gate groups zero", lambda: ops.moe_topk_gate(LOGITS, 2, num_groups=0), "num_groups", "int"),
    ("gate topk_groups > groups", lambda: ops.moe_topk_gate(LOGITS, 2, num_groups=4, topk_groups=5), "topk_groups",
     "at most num_groups"),
    ("gate topk_groups zero", lambda: ops.moe_topk_gate(LOGITS, 2, topk_groups=0), "topk_groups", "int"),
    ("gate renormalize not bool", lambda: ops.moe_topk_gate(LOGITS, 2, renormalize=1), "renormalize", "bool"),
    ("gate scaling zero", lambda: ops.moe_topk_gate(LOGITS, 2, routed_scaling_factor=0.0), "routed_scaling_factor",
     "> 0"),
    ("gate scaling nan", lambda: ops.moe_topk_gate(LOGITS, 2, routed_scaling_factor=float("nan")),
     "routed_scaling_factor", "finite"),
    ("gate scaling a string", lambda: ops.moe_topk_gate(LOGITS, 2, routed_scaling_factor="2"),
     "routed_scaling_factor", "float"),
    ("gate shared negative", lambda: ops.moe_topk_gate(LOGITS, 2, num_shared_experts=-1), "num_shared_experts",
     ">= 0"),
    ("gate mask int", lambda: ops.moe_topk_gate(LOGITS, 2, mask=torch.ones(4, dtype=torch.int32)), "mask", "dtype"),
    ("gate mask wrong length", lambda: ops.moe_topk_gate(LOGITS, 2, mask=torch.ones(5, dtype=torch.bool)), "mask",
     "[4]"),
    ("gate return_scores not bool", lambda: ops.moe_topk_gate(LOGITS, 2, return_scores=None), "return_scores",
     "bool"),
    ("backward scores bf16", lambda: _backward(scores=LOGITS), "scores", "dtype"),
    ("backward idx float", lambda: _backward(topk_idx=W), "topk_idx", "dtype"),
    ("backward idx rows", lambda: _backward(topk_idx=IDX[:3]), "topk_idx", "one row per token"),
    ("backward weights width", lambda: _backward(topk_weights=torch.rand(4, 2)), "topk_weights", "[4, 3]"),
    ("backward grad dtype", lambda: _backward(scores=SCORES.double(), topk_weights=W.double()), "grad_topk_weights",
     "the scores'"),
    ("backward scoring", lambda: _backward(scoring="tanh"), "scoring", "softmax"),
    ("backward mask length", lambda: _backward(mask=torch.ones(3, dtype=torch.bool)), "mask", "[4]"),
    ("counts idx float", lambda: ops.moe_expert_counts(W, 16), "topk_idx", "dtype"),
    ("counts experts zero", lambda: ops.moe_expert_counts(IDX, 0), "num_experts", ">= 1"),
    ("counts alignment zero", lambda: ops.moe_expert_counts(IDX, 16, 0), "alignment", ">= 1"),
    ("counts alignment float", lambda: ops.moe_expert_counts(IDX, 16, 16.0), "alignment", "int"),
    ("permute x int64", lambda: ops.moe_permute(IDX, IDX, 16), "x", "dtype"),
    ("permute x last stride", lambda: ops.moe_permute(torch.ones(32, 4, dtype=BF16).t(), IDX, 16), "x",
     "unit stride"),
    ("permute idx rows", lambda: ops.moe_permute(X, IDX[:2], 16), "topk_idx", "one row per token"),
    ("permute idx device", lambda: ops.moe_permute(X, torch.zeros(4, 3, dtype=torch.int64, device="meta"), 16),
     "topk_idx", "cpu"),
    ("permute sf with bf16 rows", lambda: ops.moe_permute(X, IDX, 16, x_sf=torch.ones(4, 1)), "x_sf", "None"),
    ("permute quantized without sf", lambda: ops.moe_permute(Q, IDX, 16), "x_sf", "scale rows"),
    ("permute sf column-major", lambda: ops.moe_permute(Q, IDX, 16, x_sf=torch.ones(2, 4).t()), "x_sf",
     "row-major"),
    ("permute sf rows", lambda: ops.moe_permute(Q, IDX, 16, x_sf=torch.ones(3, 1)), "x_sf", "one row per token"),
    ("permute sf dtype", lambda: ops.moe_permute(Q, IDX, 16, x_sf=torch.ones(4, 1, dtype=BF16)), "x_sf", "dtype"),
    ("unpermute y int", lambda: ops.moe_unpermute(PERM, PERM, W, 4), "y_expanded", "dtype"),
    ("unpermute permutation float", lambda: ops.moe_unpermute(Y, W, W, 4), "permutation", "dtype"),
    ("unpermute weights shape", lambda: ops.moe_unpermute(Y, PERM, torch.rand(4, 2), 4), "topk_weights", "[4, 3]"),
    ("unpermute weights bf16", lambda: ops.moe_unpermute(Y, PERM, W.to(BF16), 4), "topk_weights", "dtype"),
    ("unpermute num_tokens", lambda: ops.moe_unpermute(Y, PERM, W, 5), "num_tokens", "T = 4"),
    ("unpermute permutation device", lambda: ops.moe_unpermute(Y, PERM.to("meta"), W, 4), "permutation", "cpu"),
]


@pytest.mark.parametrize("call,argument,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_argument_is_a_contract_error_naming_it(call, argument, words):
    with pytest.raises(core.ContractError) as raised:
        call()
    assert raised.value.argument == argument, str(raised.value)
    assert f"'{argument}'" in str(raised.value) and words in str(raised.value), str(raised.value)


def test_at_least_forty_cases():
    assert len(CASES) >= 40


def test_repeated_calls_hit_the_memo_and_keep_the_checks():
    from tileplug.core.contracts import moe as contracts

    first, _ = contracts.moe_topk_gate(LOGITS, 2, "sigmoid", None, 4, 2, True, 2.5, 1, None, False)
    again, _ = contracts.moe_topk_gate(LOGITS, 2, "sigmoid", None, 4, 2, True, 2.5, 1, None, False)
    assert again is first and first.num_slots == 3 and first.group_size == 4
    assert first.scoring is core.Scoring.SIGMOID
    with pytest.raises(core.ContractError):  # a bool where an int was memoised: checked again, refused
        contracts.moe_topk_gate(LOGITS, True, "sigmoid", None, 4, 2, True, 2.5, 1, None, False)


def test_meta_inputs_describe_the_outputs():
    call, _ = core.describe_call("moe_permute", torch.empty(5, 64, dtype=BF16, device="meta"),
                                 torch.empty(5, 8, dtype=torch.int64, device="meta"), 16, 128)
    assert call.expanded_rows(5) == 40 + 15 * 127
    outputs = call.allocation_plan(None).allocate(5, torch.device("meta"))
    assert outputs.x_expanded.shape == (40 + 15 * 127, 64) and outputs.expert_ends.dtype == torch.int32
    call, _ = core.describe_call("moe_topk_gate", META, 4, "sqrtsoftplus", num_shared_experts=2)
    assert call.num_slots == 6 and call.logits_dtype == F32
