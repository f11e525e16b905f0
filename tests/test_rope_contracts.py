"""Bad inputs of the RoPE family: each a ContractError (a ValueError) naming the argument,
with what was expected and what was passed; nothing is written before the check fails."""

from __future__ import annotations

import pytest
import torch

from tileplug import core
from tileplug.core.ops.rope import make_cos_sin_cache

T, N, D = 4, 2, 64


def query(tokens: int = T, heads: int = N, width: int = D, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(tokens, heads, width).to(dtype)


CACHE = make_cos_sin_cache(16, D)
BUFFER = torch.randn(T, 4 * D).to(torch.bfloat16)


def rotary_arguments(**changes):
    arguments = {"query": query(), "cos_sin_cache": CACHE}
    arguments.update(changes)
    return arguments


ROTARY_CASES = {
    "query not a tensor": ({"query": [[1.0]]}, "query", "a torch.Tensor"),
    "query 2-D": ({"query": torch.randn(T, D)}, "query", r"\[T, N, D\] or \[B, S, N, D\]"),
    "query 5-D": ({"query": torch.randn(1, 1, T, N, D)}, "query", r"\[T, N, D\]"),
    "query int8": ({"query": torch.zeros(T, N, D, dtype=torch.int8)}, "query", "dtype in"),
    "query float64": ({"query": torch.zeros(T, N, D, dtype=torch.float64)}, "query", "dtype in"),
    "query non-unit last stride": ({"query": query(width=2 * D)[..., ::2]}, "query", "unit stride on the last dim"),
    "query overlapping itself": ({"query": query(tokens=1).expand(T, N, D)}, "query", "do not overlap"),
    "key dtype": ({"key": query(dtype=torch.float16)}, "key", "dtype torch.bfloat16"),
    "key tokens": ({"key": query(tokens=T + 1)}, "key", "leading dims"),
    "key head width": ({"key": query(width=2 * D)}, "key", "D = 64"),
    "key rank": ({"key": query().unsqueeze(0)}, "key", r"\[T, N, D\] tensor"),
    "key on another device": ({"key": query().to("meta")}, "key", "a tensor on cpu"),
    "key overlapping query": ({"query": BUFFER[:, :2 * D].view(T, 2, D), "key": BUFFER[:, D:2 * D].view(T, 1, D)},
                              "key", "sharing no memory with query"),
    "cache fp16": ({"cos_sin_cache": CACHE.half()}, "cos_sin_cache", "dtype float32"),
    "cache 1-D": ({"cos_sin_cache": CACHE[0]}, "cos_sin_cache", r"a 2-D \[L, R\] tensor"),
    "cache odd width": ({"cos_sin_cache": CACHE[:, :63]}, "cos_sin_cache", "an even rotary width"),
    "cache wider than a head": ({"cos_sin_cache": make_cos_sin_cache(16, 2 * D)}, "cos_sin_cache", "R <= D = 64"),
    "cache non-unit last stride": ({"cos_sin_cache": make_cos_sin_cache(16, 2 * D)[:, ::2]}, "cos_sin_cache",
                                   "unit stride"),
    "cache on another device": ({"cos_sin_cache": CACHE.to("meta")}, "cos_sin_cache", "a tensor on cpu"),
    "cache not a tensor": ({"cos_sin_cache": 1.0}, "cos_sin_cache", "a torch.Tensor"),
    "positions float": ({"positions": torch.zeros(T)}, "positions", "dtype in"),
    "positions int16": ({"positions": torch.zeros(T, dtype=torch.int16)}, "positions", "dtype in"),
    "positions too many": ({"positions": torch.zeros(T + 1, dtype=torch.int64)}, "positions", r"shape \[T\]"),
    "positions [T] for a 4-D query": ({"query": query().unsqueeze(0), "positions": torch.zeros(T, dtype=torch.int64)},
                                      "positions", r"shape \[B, S\]"),
    "positions on another device": ({"positions": torch.zeros(T, dtype=torch.int64, device="meta")}, "positions",
                                    "a tensor on cpu"),
    "interleaved not a bool": ({"interleaved": 1}, "interleaved", "a bool"),
    "conjugate not a bool": ({"conjugate": "yes"}, "conjugate", "a bool"),
    "offset float": ({"seqlen_offset": 1.0}, "seqlen_offset", "an int"),
    "offset bool": ({"seqlen_offset": True}, "seqlen_offset", "an int"),
    "offset huge": ({"seqlen_offset": 2**63}, "seqlen_offset", r"< 2\*\*62"),
}


@pytest.mark.parametrize("case", ROTARY_CASES, ids=list(ROTARY_CASES))
def test_apply_rotary_bad_input_names_the_argument(case):
    changes, argument, says = ROTARY_CASES[case]
    arguments = rotary_arguments(**changes)
    tensors = {name: value.clone() for name, value in arguments.items()
               if isinstance(value, torch.Tensor) and value.device.type == "cpu" and name in ("query", "key")}
    with pytest.raises(core.ContractError, match=f"apply_rotary: argument '{argument}': expected .*{says}") as caught:
        core.ops.apply_rotary(**arguments)
    assert caught.value.argument == argument and isinstance(caught.value, ValueError)
    for name, before in tensors.items():
        assert torch.equal(arguments[name], before), f"{name} written before the check failed"
    with pytest.raises(core.ContractError, match=f"'{argument}'"):  # the declared contract says the same
        core.describe_call("apply_rotary", **arguments)


def test_the_memo_does_not_let_a_bad_call_through():
    """A call memoised as good, then the same metadata with a bad scalar: still refused."""
    q = query()
    core.ops.apply_rotary(q, CACHE)
    core.ops.apply_rotary(q, CACHE)
    with pytest.raises(core.ContractError, match="'interleaved'"):
        core.ops.apply_rotary(q, CACHE, interleaved=0)
    with pytest.raises(core.ContractError, match="'conjugate'"):
        core.ops.apply_rotary(q, CACHE, conjugate=None)


X = torch.randn(T, N, D).to(torch.bfloat16)
WEIGHT = torch.ones(D, dtype=torch.bfloat16)

FUSED_CASES = {
    "x 4-D": ({"x": X.unsqueeze(0)}, "x", r"3-D \[T, N, D\]"),
    "x 2-D": ({"x": X[:, 0]}, "x", r"3-D \[T, N, D\]"),
    "x int": ({"x": torch.zeros(T, N, D, dtype=torch.int32)}, "x", "dtype in"),
    "x non-unit last stride": ({"x": torch.randn(T, N, 2 * D).to(torch.bfloat16)[..., ::2]}, "x", "unit stride"),
    "weight shape": ({"weight": torch.ones(D + 1)}, "weight", r"\[D\] = \[64\]"),
    "weight int": ({"weight": torch.ones(D, dtype=torch.int32)}, "weight", "bf16, fp16, fp32 or fp64"),
    "weight on another device": ({"weight": WEIGHT.to("meta")}, "weight", "a tensor on cpu"),
    "weight missing": ({"weight": None}, "weight", "a torch.Tensor"),
    "cache wider than a head": ({"cos_sin_cache": make_cos_sin_cache(4, 2 * D)}, "cos_sin_cache", "R <= D"),
    "positions [T, 1]": ({"positions": torch.zeros(T, 1, dtype=torch.int64)}, "positions", r"shape \[T\]"),
    "eps zero": ({"eps": 0.0}, "eps", "> 0"),
    "eps nan": ({"eps": float("nan")}, "eps", "finite"),
    "weight_offset str": ({"weight_offset": "1"}, "weight_offset", "a finite float"),
    "interleaved int": ({"interleaved": 0}, "interleaved", "a bool"),
    "offset float": ({"seqlen_offset": 0.5}, "seqlen_offset", "an int"),
}

CAST_CASES = {
    "x fp16 (per_token_cast takes bf16 / fp32)": ({"x": X.half()}, "x", "dtype in"),
    "groups wider than a head": ({"num_per_channels": 128}, "num_per_channels", "at most the head width D = 64"),
    "groups of 48": ({"num_per_channels": 48}, "num_per_channels", "one of"),
    "fmt e5m2": ({"fmt": "e5m2"}, "fmt", "one of"),
    "packed without round_sf": ({"use_packed_ue8m0": True}, "use_packed_ue8m0", "unless round_sf"),
    "round_sf not a bool": ({"round_sf": 1}, "round_sf", "a bool"),
    "col-major not a bool": ({"use_tma_aligned_col_major_sf": "no"}, "use_tma_aligned_col_major_sf", "a bool"),
    "return_unquantized not a bool": ({"return_unquantized": 1}, "return_unquantized", "a bool"),
    "e2m1 with odd N·D": ({"x": torch.randn(T, 1, 17).to(torch.bfloat16), "weight": torch.ones(17),
                           "cos_sin_cache": make_cos_sin_cache(8, 16), "fmt": "e2m1", "num_per_channels": 16},
                          "x", "an even N·D"),
}


def _fused_arguments(changes):
    arguments = {"x": X, "weight": WEIGHT, "cos_sin_cache": CACHE}
    arguments.update(changes)
    return arguments


@pytest.mark.parametrize("case", FUSED_CASES, ids=list(FUSED_CASES))
@pytest.mark.parametrize("op", ["rms_norm_rope", "rms_norm_rope_per_token_cast"])
def test_fused_bad_input_names_the_argument(op, case):
    changes, argument, says = FUSED_CASES[case]
    arguments = _fused_arguments(changes)
    if op.endswith("cast"):
        arguments["num_per_channels"] = 64
    with pytest.raises(core.ContractError, match=f"{op}: argument '{argument}': expected .*{says}") as caught:
        getattr(core.ops, op)(**arguments)
    assert caught.value.argument == argument


@pytest.mark.parametrize("case", CAST_CASES, ids=list(CAST_CASES))
def test_fused_cast_bad_input_names_the_argument(case):
    changes, argument, says = CAST_CASES[case]
    arguments = {"num_per_channels": 64, **_fused_arguments(changes)}
    with pytest.raises(core.ContractError, match=f"argument '{argument}': expected .*{says}") as caught:
        core.ops.rms_norm_rope_per_token_cast(**arguments)
    assert caught.value.argument == argument
