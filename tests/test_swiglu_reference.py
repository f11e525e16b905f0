"""The reference SwiGLU ops (SPEC §8) against an independent fp64 model written here: values
within 2 ulp, the fused cast bytewise the composition, padding rows zero and never read, the
clamp, routed weights, the backward against fp64 autograd of the formula."""

from __future__ import annotations

import pytest
import torch

from tileplug.core import ops, opdefs
from tileplug.core.testing import assert_bytes_equal, assert_within_ulps, relative_error

BF16, FP32, FP64 = torch.bfloat16, torch.float32, torch.float64


# ---------------------------------------------------------------------- the independent model


def padding_mask(rows: int, expert_ends: torch.Tensor | None, alignment: int) -> torch.Tensor:
    """bool [rows]: True for padding rows, walking the experts one by one (SPEC §7)."""
    padding = torch.ones(rows, dtype=torch.bool)
    if expert_ends is None:
        return torch.zeros(rows, dtype=torch.bool)
    start = 0
    for end in expert_ends.tolist():
        padding[start:min(end, rows)] = False
        start = -(-end // alignment) * alignment
    return padding


def swiglu_fp64(x: torch.Tensor, topk_weights=None, routed_scaling_factor=1.0, clamp_value=None,
                padding: torch.Tensor | None = None, rounded_to: torch.dtype | None = None) -> torch.Tensor:
    """SPEC §8's value computed in fp64 (with autograd: x may require grad); padding rows give 0.

    ``rounded_to=torch.float32``: each step SPEC §8 rounds (the sigmoid, each product, the row's
    scale ``w · routed_scaling_factor``) is rounded to fp32 — so results the fp32 math underflows
    to 0 (a gate near −100 after the outliers' ×50) are 0 here too, and what remains is the
    sigmoid's own last bit."""
    def rounded(values: torch.Tensor) -> torch.Tensor:
        return values if rounded_to is None else values.to(rounded_to).to(FP64)

    width = x.shape[1] // 2
    keep = torch.ones(x.shape[0], 1, dtype=torch.bool) if padding is None else ~padding.unsqueeze(1)
    gate = torch.where(keep, x[:, :width].to(FP64), 0.0)
    up = torch.where(keep, x[:, width:].to(FP64), 0.0)
    if clamp_value is not None:
        gate = torch.clamp(gate, max=clamp_value)
        up = torch.clamp(up, -clamp_value, clamp_value)
    weight = torch.ones(x.shape[0], 1, dtype=FP64) if topk_weights is None else topk_weights.to(FP64).unsqueeze(1)
    weight = torch.where(keep, weight, 0.0)
    sigmoid = rounded(1.0 / (1.0 + torch.exp(-gate)))
    y = rounded(rounded(rounded(gate * sigmoid) * up) * rounded(weight * routed_scaling_factor))
    return torch.where(keep, y, 0.0)


def assert_within_ulps_above_underflow(actual: torch.Tensor, expected: torch.Tensor, ulps: int, what: str) -> None:
    """Within ``ulps`` of ``expected`` (fp64, rounded to actual's dtype), except where the exact
    value is below 2^-100: there fp32 intermediates underflow (SPEC's math is fp32) and the
    result must only be that small too."""
    tiny = expected.abs() < 2.0**-100
    assert bool(((actual.double() - expected).abs()[tiny] < 2.0**-100).all()), what
    assert_within_ulps(torch.where(tiny, 0, actual), torch.where(tiny, 0, expected).to(actual.dtype), ulps,
                       what=what)


def _case_arguments(case, tokens=129):
    args, kwargs = case.arguments(tokens, "cpu")
    return args, kwargs


FORWARD_CASES = opdefs.get("swiglu").cases()
CAST_CASES = opdefs.get("swiglu_per_token_cast").cases()
BACKWARD_CASES = opdefs.get("swiglu_backward").cases()


@pytest.mark.parametrize("case", FORWARD_CASES, ids=lambda c: c.id)
def test_forward_is_within_2_ulp_of_fp64(case) -> None:
    (x,), kwargs = _case_arguments(case)
    y = ops.swiglu(x, **kwargs)
    out_dtype = kwargs.get("out_dtype") or x.dtype
    assert y.shape == (x.shape[0], x.shape[1] // 2) and y.dtype == out_dtype
    padding = padding_mask(x.shape[0], kwargs.get("expert_ends"), kwargs.get("expert_alignment", 128))
    expected = swiglu_fp64(x, kwargs.get("topk_weights"), kwargs.get("routed_scaling_factor", 1.0),
                           kwargs.get("clamp_value"), padding, rounded_to=FP32)
    assert_within_ulps(y, expected.to(out_dtype), 2, what=case.id)
    assert bool(torch.isfinite(y).all()), case.id  # NaN in padding rows (nan_padding) reaches nothing
    assert not bool(y[padding].any()), case.id


def test_weights_and_scaling_multiply_each_row() -> None:
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5], [2.0, 0.25, -1.0, 4.0]])
    weights = torch.tensor([0.5, 2.0])
    y = ops.swiglu(x, topk_weights=weights, routed_scaling_factor=3.0)
    silu = torch.tensor([[1.0, -2.0], [2.0, 0.25]], dtype=FP64)
    silu = silu / (1 + torch.exp(-silu))
    expected = silu * torch.tensor([[3.0, 0.5], [-1.0, 4.0]], dtype=FP64) * torch.tensor([[1.5], [6.0]], dtype=FP64)
    assert_within_ulps(y, expected.float(), 2)
    unweighted = ops.swiglu(x, routed_scaling_factor=3.0)
    assert_within_ulps(unweighted, (silu * torch.tensor([[3.0, 0.5], [-1.0, 4.0]], dtype=FP64) * 3.0).float(), 2)


def test_clamp_cuts_the_gate_from_above_and_up_both_ways() -> None:
    # gate = [10, -10, 3], up = [10, -10, 0.5], c = 5 → g = [5, -10, 3], u = [5, -5, 0.5]
    x = torch.tensor([[10.0, -10.0, 3.0, 10.0, -10.0, 0.5]])
    y = ops.swiglu(x, clamp_value=5.0)
    g = torch.tensor([5.0, -10.0, 3.0], dtype=FP64)
    u = torch.tensor([5.0, -5.0, 0.5], dtype=FP64)
    assert_within_ulps(y, (g / (1 + torch.exp(-g)) * u).float().unsqueeze(0), 2)
    assert y[0, 0].item() == pytest.approx(5.0 * 5.0 / (1 + torch.exp(torch.tensor(-5.0)).item()), rel=1e-6)
    unclamped = ops.swiglu(x)
    assert unclamped[0, 0].item() == pytest.approx(100.0, rel=1e-3)  # silu(10)·10 without the clamp
    grad_x, _ = ops.swiglu_backward(x, torch.ones(1, 3), clamp_value=5.0)
    assert grad_x[0, 0].item() == 0.0  # gate 10 > 5: cut
    assert grad_x[0, 1].item() != 0.0  # gate -10 < 5: passes (the gate is cut from above only)
    assert grad_x[0, 3].item() == 0.0 and grad_x[0, 4].item() == 0.0  # |up| = 10 > 5: cut
    assert grad_x[0, 5].item() == pytest.approx(3.0 / (1 + torch.exp(torch.tensor(-3.0)).item()), rel=1e-6)


def test_nan_in_a_valid_row_stays_in_that_row() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    x[2, 3] = float("nan")
    y = ops.swiglu(x)
    assert bool(torch.isnan(y[2, 3])) and bool(torch.isfinite(y[[0, 1, 3]]).all())


@pytest.mark.parametrize("alignment", [1, 4, 16])
def test_padding_rows_are_zero_and_never_read(alignment) -> None:
    torch.manual_seed(alignment)
    rows, width = 40, 24
    ends = torch.tensor([3, 3, 9, 21], dtype=torch.int32)  # expert 1 is empty; rows >= 21 are padding
    padding = padding_mask(rows, ends, alignment)
    assert bool(padding[21:].all()) and int(padding.sum()) > rows - 21 - 1
    x = torch.randn(rows, 2 * width)
    x[padding] = float("nan")
    weights = torch.rand(rows)
    weights[padding] = float("nan")
    y = ops.swiglu(x, topk_weights=weights, expert_ends=ends, expert_alignment=alignment)
    assert bool(torch.isfinite(y).all()) and not bool(y[padding].any())
    assert_within_ulps(y, swiglu_fp64(x, weights, padding=padding, rounded_to=FP32).float(), 2)
    q, sf = ops.swiglu_per_token_cast(x, num_per_channels=16, topk_weights=weights, expert_ends=ends,
                                      expert_alignment=alignment)
    assert not bool(q[padding].view(torch.uint8).any()) and not bool(sf[padding].any())
    assert bool(torch.isfinite(sf).all()) and bool((sf[~padding] > 0).all())
    grad_x, grad_w = ops.swiglu_backward(x, torch.randn(rows, width), topk_weights=weights, expert_ends=ends,
                                         expert_alignment=alignment)
    assert bool(torch.isfinite(grad_x).all()) and not bool(grad_x[padding].any()) and not bool(grad_w[padding].any())
    assert bool(torch.isfinite(grad_w).all())


def _cast_flags(kwargs: dict) -> dict:
    names = ("fmt", "num_per_channels", "round_sf", "use_packed_ue8m0", "use_tma_aligned_col_major_sf", "use_e4m3_sf")
    return {name: kwargs[name] for name in names if name in kwargs}


@pytest.mark.parametrize("tokens", [1, 129])
@pytest.mark.parametrize("case", CAST_CASES, ids=lambda c: c.id)
def test_fused_cast_is_bytewise_the_composition(case, tokens) -> None:
    (x,), kwargs = _case_arguments(case, tokens)
    q, sf = ops.swiglu_per_token_cast(x, **kwargs)
    forward = {k: v for k, v in kwargs.items() if k not in _cast_flags(kwargs)}
    y = ops.swiglu(x, out_dtype=FP32, **forward)
    flags = _cast_flags(kwargs)
    expected_q, expected_sf = ops.per_token_cast(y, flags.pop("fmt", "e4m3"), flags.pop("num_per_channels", 128),
                                                 **flags)
    assert q.stride() == expected_q.stride() and sf.stride() == expected_sf.stride() and sf.dtype == expected_sf.dtype
    assert_bytes_equal(q, expected_q, what=case.id)
    padding = padding_mask(x.shape[0], kwargs.get("expert_ends"), kwargs.get("expert_alignment", 128))
    if not bool(padding.any()):
        assert_bytes_equal(sf, expected_sf, what=case.id)
        return
    assert_bytes_equal(sf[~padding], expected_sf[~padding], what=case.id)
    assert not bool(sf[padding].view(torch.uint8).any()), case.id  # padding rows: zero scale bytes
    assert not bool(q[padding].view(torch.uint8).any()), case.id


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=lambda c: c.id)
def test_backward_matches_fp64_autograd_of_the_formula(case) -> None:
    (x, grad_y), kwargs = _case_arguments(case)
    grad_x, grad_w = ops.swiglu_backward(x, grad_y, **kwargs)
    padding = padding_mask(x.shape[0], kwargs.get("expert_ends"), kwargs.get("expert_alignment", 128))
    x64 = torch.where(padding.unsqueeze(1), 0.0, x.to(FP64)).requires_grad_(True)
    weights = kwargs.get("topk_weights")
    w64 = None if weights is None else weights.to(FP64).requires_grad_(True)
    y64 = swiglu_fp64(x64, w64, kwargs.get("routed_scaling_factor", 1.0), kwargs.get("clamp_value"), padding)
    grad64 = torch.where(padding.unsqueeze(1), 0.0, grad_y.to(FP64))
    wanted = torch.autograd.grad(y64, [x64] + ([w64] if w64 is not None else []), grad64)
    assert grad_x.dtype == x.dtype and grad_x.shape == x.shape
    assert bool(torch.isfinite(grad_x).all()) and not bool(grad_x[padding].any()), case.id
    if x.dtype == BF16:
        assert_within_ulps_above_underflow(grad_x, wanted[0], 2, what=case.id)
    else:  # fp32: 1 + g·(1 − s) cancels near g ≈ −1.28, so compare to the fp64 gradient's scale
        scale = wanted[0].abs().max().item()
        assert torch.allclose(grad_x.double(), wanted[0], rtol=1e-5, atol=1e-6 * scale), case.id
    if weights is None:
        assert grad_w is None
    else:
        assert grad_w.dtype == FP32 and relative_error(grad_w, wanted[1]) <= 1e-5, case.id


def test_rows_are_batch_invariant() -> None:
    torch.manual_seed(0)
    x = torch.randn(300, 2 * 72, dtype=BF16)
    weights = torch.rand(300)
    full = ops.swiglu(x, topk_weights=weights, clamp_value=3.0)
    part = ops.swiglu(x[100:107], topk_weights=weights[100:107], clamp_value=3.0)
    assert_bytes_equal(full[100:107], part)
    q, sf = ops.swiglu_per_token_cast(x, topk_weights=weights, num_per_channels=32)
    q_part, sf_part = ops.swiglu_per_token_cast(x[5:6], topk_weights=weights[5:6], num_per_channels=32)
    assert_bytes_equal(q[5:6], q_part) and assert_bytes_equal(sf[5:6], sf_part)


def test_fp64_is_computed_in_fp64() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 8, dtype=FP64)
    y = ops.swiglu(x)
    assert y.dtype == FP64
    assert torch.allclose(y, swiglu_fp64(x), rtol=1e-14, atol=0)
    grad_x, grad_w = ops.swiglu_backward(x, torch.ones(5, 4, dtype=FP64), topk_weights=torch.rand(5, dtype=FP64))
    assert grad_x.dtype == FP64 and grad_w.dtype == FP64


def test_fp32_output_of_bf16_input_is_not_rounded_to_bf16() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 2 * 64, dtype=BF16)
    y32 = ops.swiglu(x, out_dtype=FP32)
    y16 = ops.swiglu(x)
    assert y32.dtype == FP32 and torch.equal(y32.to(BF16), y16)
    assert not torch.equal(y32, y16.float())  # the fp32 result keeps bits bf16 drops


def test_the_clamp_edge_passes_the_gradient() -> None:
    x = torch.tensor([[2.0, -2.0, 2.0, 2.0]])  # gate = [2, -2], up = [2, 2]; c = 2: nothing is cut
    grad_x, _ = ops.swiglu_backward(x, torch.ones(1, 2), clamp_value=2.0)
    unclamped, _ = ops.swiglu_backward(x, torch.ones(1, 2))
    assert torch.equal(grad_x, unclamped) and bool(grad_x.ne(0).all())


def test_backward_rows_are_batch_invariant() -> None:
    torch.manual_seed(1)
    x = torch.randn(260, 2 * 704)
    grad = torch.randn(260, 704)
    weights = torch.rand(260)
    grad_x, grad_w = ops.swiglu_backward(x, grad, weights, routed_scaling_factor=2.5)
    part_x, part_w = ops.swiglu_backward(x[3:4], grad[3:4], weights[3:4], routed_scaling_factor=2.5)
    assert_bytes_equal(grad_x[3:4], part_x) and assert_bytes_equal(grad_w[3:4], part_w)


@pytest.mark.parametrize("layout", ["cuda", "ascend"])
def test_every_case_passes_the_conformance_check_on_the_reference(layout) -> None:
    from tileplug import core
    from tileplug.reference import conformance

    with core.config.host_layout(layout):
        for case in FORWARD_CASES + CAST_CASES + BACKWARD_CASES:
            conformance.check_case(case, 129, "reference", "cpu")


def test_the_comparison_catches_a_wrong_result() -> None:
    compare = opdefs.get("swiglu").compare
    case = FORWARD_CASES[2]  # fp32, weighted
    (x,), kwargs = case.arguments(9, "cpu")
    y = ops.swiglu(x, **kwargs)
    compare(case, 9, [y], [y.clone()])
    off = y.clone()
    off[4, 5] = torch.nextafter(torch.nextafter(torch.nextafter(off[4, 5], torch.tensor(2.0)), torch.tensor(2.0)),
                                torch.tensor(2.0))  # 3 ulp away
    with pytest.raises(AssertionError, match="more than 2 ulp"):
        compare(case, 9, [off], [y])
    backward = BACKWARD_CASES[1]  # weighted
    (x, grad), kwargs = backward.arguments(9, "cpu")
    grad_x, grad_w = ops.swiglu_backward(x, grad, **kwargs)
    with pytest.raises(AssertionError, match="relative error"):
        opdefs.get("swiglu_backward").compare(backward, 9, [grad_x, grad_w * 1.001], [grad_x, grad_w])
    cast = CAST_CASES[0]
    (x,), kwargs = cast.arguments(9, "cpu")
    q, sf = ops.swiglu_per_token_cast(x, **kwargs)
    with pytest.raises(AssertionError):
        opdefs.get("swiglu_per_token_cast").compare(cast, 9, [q, sf * 4], [q, sf])
