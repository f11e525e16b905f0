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
