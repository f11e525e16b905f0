"""Contracts of the norm family: every bad argument is a ContractError naming it (SPEC §0, §5),
and the aliasing rules of ``out=`` / ``residual_out=``."""

from __future__ import annotations

import pytest
import torch

from tileplug import core
from tileplug.core import nn

ops = core.ops
BF16, F32 = torch.bfloat16, torch.float32


def _x(tokens=4, hidden=64, dtype=BF16):
    return torch.randn(tokens, hidden).to(dtype)


X = _x()
W = torch.ones(64, dtype=BF16)
R = _x()
META_X = torch.empty(4, 64, dtype=BF16, device="meta")
RSTD = torch.ones(4)
G = _x()

CASES = [
    # (id, call, argument named, words of the expectation)
    ("x not a tensor", lambda: ops.rms_norm([[1.0]]), "x", "torch.Tensor"),
    ("x 1-D", lambda: ops.rms_norm(torch.ones(8)), "x", "2-D"),
    ("x 4-D", lambda: ops.layer_norm(torch.ones(2, 2, 2, 8)), "x", "3-D"),
    ("x int dtype", lambda: ops.rms_norm(torch.ones(2, 8, dtype=torch.int32)), "x", "dtype"),
    ("x fp8 dtype", lambda: ops.layer_norm(torch.ones(2, 8).to(torch.float8_e4m3fn)), "x", "dtype"),
    ("x D = 0", lambda: ops.rms_norm(torch.ones(2, 0)), "x", "D >= 1"),
    ("x last stride", lambda: ops.rms_norm(torch.ones(8, 4).t()), "x", "unit stride"),
    ("weight wrong length", lambda: ops.rms_norm(X, torch.ones(63, dtype=BF16)), "weight", "[64]"),
    ("weight 2-D", lambda: ops.rms_norm(X, torch.ones(1, 64)), "weight", "1-D"),
    ("weight int", lambda: ops.layer_norm(X, torch.ones(64, dtype=torch.int64)), "weight", "float"),
    ("weight strided", lambda: ops.rms_norm(X, torch.ones(128)[::2]), "weight", "unit stride"),
    ("weight other device", lambda: ops.rms_norm(X, torch.ones(64, device="meta")), "weight", "cpu"),
    ("bias wrong length", lambda: ops.layer_norm(X, W, torch.ones(65)), "bias", "[64]"),
    ("residual shape", lambda: ops.rms_norm(X, W, residual=_x(4, 32)), "residual", "shape"),
    ("residual dtype", lambda: ops.rms_norm(X, W, residual=R.float()), "residual", "dtype"),
    ("residual device", lambda: ops.layer_norm(X, residual=torch.empty(4, 64, dtype=BF16, device="meta")),
     "residual", "cpu"),
    ("eps negative", lambda: ops.rms_norm(X, W, eps=-1e-6), "eps", ">= 0"),
    ("eps nan", lambda: ops.layer_norm(X, eps=float("nan")), "eps", "finite"),
    ("eps inf", lambda: ops.rms_norm(X, eps=float("inf")), "eps", "finite"),
    ("eps a string", lambda: ops.rms_norm(X, eps="1e-6"), "eps", "float"),
    ("eps a bool", lambda: ops.rms_norm(X, eps=True), "eps", "float"),
    ("weight_offset inf", lambda: ops.rms_norm(X, W, weight_offset=float("inf")), "weight_offset", "finite"),
    ("weight_offset without weight", lambda: ops.rms_norm(X, weight_offset=1.0), "weight_offset", "weight is None"),
    ("out_scale nan", lambda: ops.rms_norm(X, W, out_scale=float("nan")), "out_scale", "finite"),
    ("return_rstd not bool", lambda: ops.rms_norm(X, return_rstd=1), "return_rstd", "bool"),
    ("return_stats not bool", lambda: ops.layer_norm(X, return_stats="yes"), "return_stats", "bool"),
    ("out wrong shape", lambda: ops.rms_norm(X, W, out=_x(4, 32)), "out", "shape"),
    ("out wrong dtype", lambda: ops.layer_norm(X, W, out=torch.empty(4, 64)), "out", "dtype"),
    ("out overlaps x partly", lambda: _partial_overlap(), "out", "x itself"),
    ("out aliases the residual", lambda: _out_is_residual(), "out", "x itself"),
    ("out aliases the weight", lambda: _out_over_weight(), "out", "sharing no memory"),
    ("residual_out without residual", lambda: ops.rms_norm(X, W, residual_out=torch.empty_like(X)), "residual_out",
     "residual is None"),
    ("residual_out aliases x", lambda: _residual_out_is_x(), "residual_out", "residual itself"),
    ("residual_out overlaps out", lambda: _residual_out_is_out(), "residual_out", "no memory with out"),
    ("residual_out other device", lambda: ops.rms_norm(X, W, residual=R, residual_out=torch.empty(
        4, 64, dtype=BF16, device="meta")), "residual_out", "cpu"),
    ("out made in inference mode", lambda: _inference_out(), "out", "inference mode"),
    ("cast x fp16", lambda: ops.rms_norm_per_token_cast(X.half()), "x", "dtype"),
    ("cast fmt", lambda: ops.rms_norm_per_token_cast(X, fmt="e5m2"), "fmt", "e4m3"),
    ("cast group", lambda: ops.rms_norm_per_token_cast(X, num_per_channels=48), "num_per_channels", "128"),
    ("cast packed without round", lambda: ops.rms_norm_per_token_cast(X, use_packed_ue8m0=True), "use_packed_ue8m0",
     "round_sf"),
    ("cast round and e4m3 sf", lambda: ops.rms_norm_per_token_cast(X, round_sf=True, use_e4m3_sf=True), "use_e4m3_sf",
     "exclude"),
    ("cast e2m1 odd width", lambda: ops.rms_norm_per_token_cast(_x(2, 7), fmt="e2m1"), "x", "even"),
    ("cast col major not bool", lambda: ops.rms_norm_per_token_cast(X, use_tma_aligned_col_major_sf=None),
     "use_tma_aligned_col_major_sf", "bool"),
    ("cast return_unquantized", lambda: ops.rms_norm_per_token_cast(X, return_unquantized=0), "return_unquantized",
     "bool"),
    ("backward grad_y shape", lambda: ops.rms_norm_backward(_x(4, 32), X, W, RSTD), "grad_y", "shape"),
    ("backward grad_y dtype", lambda: ops.rms_norm_backward(G.float(), X, W, RSTD), "grad_y", "dtype"),
    ("backward rstd shape", lambda: ops.rms_norm_backward(G, X, W, torch.ones(5)), "rstd", "shape"),
    ("backward rstd dtype", lambda: ops.rms_norm_backward(G, X, W, torch.ones(4, dtype=BF16)), "rstd", "float32"),
    ("backward rstd strided", lambda: ops.rms_norm_backward(G, X, W, torch.ones(8)[::2]), "rstd", "contiguous"),
    ("backward grad_residual_out", lambda: ops.rms_norm_backward(G, X, W, RSTD, grad_residual_out=_x(3)),
     "grad_residual_out", "shape"),
    ("backward offset without weight", lambda: ops.rms_norm_backward(G, X, None, RSTD, weight_offset=1.0),
     "weight_offset", "weight is None"),
    ("layer backward mean", lambda: ops.layer_norm_backward(G, X, W, torch.ones(4, 1), RSTD), "mean", "shape"),
    ("layer backward x", lambda: ops.layer_norm_backward(G, torch.ones(4), W, RSTD, RSTD), "x", "2-D"),
    ("module normalized_shape", lambda: nn.RMSNorm(0), "normalized_shape", ">= 1"),
    ("functional input shape", lambda: nn.functional.layer_norm(X, (32,)), "input", "normalized_shape"),
]


def _partial_overlap():
    buffer = _x(5, 64)
    return ops.rms_norm(buffer[:4], W, out=buffer[1:])


def _out_is_residual():
    r = R.clone()
    return ops.rms_norm(X, W, residual=r, out=r)


def _out_over_weight():
    buffer = torch.ones(4, 64, dtype=BF16)
    return ops.rms_norm(X, buffer[0], out=buffer)


def _residual_out_is_x():
    x = X.clone()
    return ops.rms_norm(x, W, residual=R, residual_out=x)


def _residual_out_is_out():
    out = torch.empty_like(X)
    return ops.rms_norm(X, W, residual=R, out=out, residual_out=out)


def _inference_out():
    with torch.inference_mode():
        out = torch.empty_like(X)
    return ops.rms_norm(X, W, out=out)


def test_enough_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("call,argument,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_argument_is_a_contract_error_naming_it(call, argument, words):
    with pytest.raises(core.ContractError) as caught:
        call()
    assert caught.value.argument == argument, str(caught.value)
    assert f"argument '{argument}'" in str(caught.value)
    assert words in str(caught.value), str(caught.value)


def test_out_requiring_grad_is_refused():
    out = torch.empty(4, 64, dtype=BF16).requires_grad_()
    with pytest.raises(core.ContractError, match="'out'.*does not require grad"):
        ops.rms_norm(X, W, out=out)


def test_out_may_be_x_itself_and_residual_out_the_residual_itself():
    x, r = X.clone(), R.clone()
    expected = ops.rms_norm(X, W, residual=R)
    y, residual_out = ops.rms_norm(x, W, residual=r, out=x, residual_out=r)
    assert y is x and residual_out is r
    assert torch.equal(x, expected[0]) and torch.equal(r, expected[1])


def test_out_of_another_view_of_x_with_other_strides_is_refused():
    buffer = _x(4, 64)
    x = buffer[::2]  # rows 0 and 2
    out = torch.as_strided(buffer, (2, 64), (64, 1))  # rows 0 and 1: the same pointer, other strides
    assert out.data_ptr() == x.data_ptr()
    with pytest.raises(core.ContractError, match="'out'.*x itself"):
        ops.rms_norm(x, W, out=out)


def test_quant_contracts_unchanged_by_the_shared_cast_config():
    with pytest.raises(core.ContractError, match="'use_packed_ue8m0'"):
        ops.per_token_cast(X, use_packed_ue8m0=True)
    with pytest.raises(core.ContractError, match="'fmt'"):
        ops.per_block_cast(X.float(), fmt="int4")


def test_the_contract_memo_keeps_every_check():
    from tileplug.core.contracts import norm as contracts

    x = _x(3, 64)
    ops.rms_norm(x, W, eps=1)  # an int eps is a number: accepted and memoized
    size = len(contracts.recent_calls)
    ops.rms_norm(x, W, eps=1)
    assert len(contracts.recent_calls) == size  # the second call hit the memo
    with pytest.raises(core.ContractError, match="'eps'"):
        ops.rms_norm(x, W, eps=True)  # True == 1, but a bool is not a number here
    with pytest.raises(core.ContractError, match="'x'"):
        ops.rms_norm(x.t().contiguous().t(), W)  # other strides: another key, checked
    with core.config.host_layout("ascend"):  # another config in force: checked again, another call
        call, _, _ = contracts.rms_norm(x, W, 1, None, 0.0, 1.0, None, None, False)
    assert call.host_layout is not contracts.rms_norm(x, W, 1, None, 0.0, 1.0, None, None, False)[0].host_layout
