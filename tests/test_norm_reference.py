"""The norm family on the reference backend (SPEC §5, docs/spec.md "Norms"): hand-worked
values, every rounding point, the residual and in-place forms, Gemma offset, out_scale,
3-D per-head rows, strided views, dtypes, batch invariance, the fused cast ≡ the unfused
chain bytewise, and the backward against autograd of a plain fp64 formula."""

from __future__ import annotations

import itertools

import pytest
import torch

from tileplug import core
from tileplug.core.norm import formulas
from tileplug.core.ops.quant import SF_MODES
from tileplug.core.testing import activation, assert_bytes_equal, assert_within_ulps, relative_error

ops = core.ops
F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64


def _t(values, dtype=F32):
    return torch.tensor(values, dtype=dtype)


# ---------------------------------------------------------------------- hand-worked values


def test_rms_norm_hand_worked_values():
    # mean(2²) = 4, rstd = 1/sqrt(4) = 0.5 exactly, x̂ = 1; y = x̂ · w
    x = _t([[2.0, 2.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    y, rstd = ops.rms_norm(x, _t([1.0, 2.0, -3.0, 0.5]), eps=0.0, return_rstd=True)
    assert torch.equal(y, _t([[1.0, 2.0, -3.0, 0.5], [1.0, 2.0, -3.0, 0.5]]))
    assert torch.equal(rstd, _t([0.5, 1.0]))
    # eps enters the root: mean 1 + eps 3 = 4 -> rstd 0.5
    assert torch.equal(ops.rms_norm(_t([[1.0, -1.0, 1.0, -1.0]]), eps=3.0), _t([[0.5, -0.5, 0.5, -0.5]]))
    # [3, 4, 0, 0]: mean square 6.25, sqrt 2.5, rstd = fp32(0.4); y = 3·0.4, 4·0.4 rounded once
    y = ops.rms_norm(_t([[3.0, 4.0, 0.0, 0.0]]), eps=0.0)
    assert_within_ulps(y, _t([[1.2, 1.6, 0.0, 0.0]]), 1)


def test_rms_norm_residual_gemma_offset_and_out_scale_hand_worked():
    x, r = _t([[1.0, 1.0, 1.0, 1.0]]), _t([[1.0, 1.0, 1.0, 1.0]])
    y, residual_out, rstd = ops.rms_norm(x, _t([0.0, 1.0, -0.5, 2.0]), eps=0.0, residual=r, weight_offset=1.0,
                                         out_scale=2.0, return_rstd=True)
    assert torch.equal(residual_out, _t([[2.0, 2.0, 2.0, 2.0]]))  # s = x + r
    assert torch.equal(rstd, _t([0.5]))  # of s
    assert torch.equal(y, _t([[2.0, 4.0, 1.0, 6.0]]))  # x̂ = 1; (w + 1) · 2


def test_gemma_offset_is_added_in_fp32_not_in_the_weight_dtype():
    # bf16 weight 2^-9: 1 + 2^-9 is exact in fp32 and rounds to 1 in bf16
    weight = torch.full((4,), 2.0 ** -9, dtype=BF16)
    y = ops.rms_norm(torch.ones(1, 4), weight, eps=0.0, weight_offset=1.0)
    assert torch.equal(y, torch.full((1, 4), 1.0 + 2.0 ** -9))
    assert not torch.equal(y, (torch.ones(1, 4) * (weight + 1).float()))  # what bf16 w + 1 would give


def test_layer_norm_hand_worked_values_and_two_pass_variance():
    x = _t([[0.0, 0.0, 2.0, 2.0]])  # mean 1, centered ±1, var 1
    y, mean, rstd = ops.layer_norm(x, _t([1.0, 2.0, 3.0, 4.0]), _t([0.5, 0.0, 0.0, -1.0]), eps=0.0,
                                   return_stats=True)
    assert torch.equal(y, _t([[-0.5, -2.0, 3.0, 3.0]]))
    assert torch.equal(mean, _t([1.0])) and torch.equal(rstd, _t([1.0]))
    assert torch.equal(ops.layer_norm(x, eps=3.0), _t([[-0.5, -0.5, 0.5, 0.5]]))  # var 1 + 3 -> rstd 0.5
    # far from 0, E[x²] − E[x]² cancels catastrophically in fp32; the two passes are exact
    far = x + 4096.0
    y, mean, rstd = ops.layer_norm(far, eps=0.0, return_stats=True)
    assert torch.equal(y, _t([[-1.0, -1.0, 1.0, 1.0]])) and torch.equal(mean, _t([4097.0]))
    one_pass = (far * far).mean(-1) - far.mean(-1) ** 2
    assert one_pass.item() != 1.0  # what the forbidden formula gives


def test_reciprocal_sqrt_is_correctly_rounded_on_every_fp32_in_one_binade_pair():
    """The statistics' ``1 / sqrt(v)`` is the correctly rounded root, then the correctly
    rounded reciprocal (docs/spec.md "Norms"; a kernel's ``__fdiv_rn(1, __fsqrt_rn(v))``).
    ``torch.sqrt`` on fp32 is only faithful on some CPUs (AVX-512 PyTorch builds: one ulp off
    for about 0.6 % of the inputs), which made the CUDA kernels' correctly rounded rstd look
    wrong on the H200 run. Every fp32 in [1, 4) is checked against numpy's hardware root
    (IEEE, correctly rounded); a root's correct rounding depends only on the mantissa and the
    exponent's parity, so these two binades stand for every normal fp32."""
    import numpy as np

    bits = torch.arange(127 << 23, 129 << 23, dtype=torch.int64).to(torch.int32)
    values = bits.view(torch.float32)
    root = torch.from_numpy(np.sqrt(values.numpy()))
    expected = torch.from_numpy(np.float32(1.0) / root.numpy())
    assert_bytes_equal(formulas.reciprocal_sqrt(values), expected, what="1 / sqrt over [1, 4)")
    # a few binades further out, and subnormals, by sampling
    generator = torch.Generator().manual_seed(0)
    sample = torch.randint(1, 0x7F800000, (1 << 20,), generator=generator, dtype=torch.int32).view(torch.float32)
    sample = torch.cat((sample, torch.arange(1, 1 << 23, 4099, dtype=torch.int32).view(torch.float32)))
    expected = torch.from_numpy(np.float32(1.0) / np.sqrt(sample.numpy()))
    assert_bytes_equal(formulas.reciprocal_sqrt(sample), expected, what="1 / sqrt, sampled")


def test_statistics_use_the_correctly_rounded_root():
    """rms_norm / layer_norm rstd = fp32 1 / sqrt(mean + eps) with IEEE ops, on a value where
    torch's CPU root (AVX-512) is one ulp off: 32.32936, the mean square of row 112 of the GPU
    grid's rms_norm[H=64, fp32] at T=129 (where the H200 run first showed the difference)."""
    value = torch.tensor([1107382596], dtype=torch.int32).view(torch.float32)  # 32.32936
    correct = torch.tensor([1043601482], dtype=torch.int32).view(torch.float32)  # fp32(1 / fp32(sqrt(value)))
    assert torch.equal(formulas.reciprocal_sqrt(value), correct)
    # a zero row: rstd = 1 / sqrt(0 + eps) with eps = that value (exact in fp32), through both ops
    _, rstd = ops.rms_norm(torch.zeros(1, 4), eps=value.item(), return_rstd=True)
    assert torch.equal(rstd, correct)
    _, _, rstd = ops.layer_norm(torch.zeros(1, 4), eps=value.item(), return_stats=True)
    assert torch.equal(rstd, correct)


def test_layer_norm_without_bias_adds_nothing_so_negative_zero_stays():
    x = _t([[-1.0, 1.0, -0.0]])  # mean +0, the centered -0 − (+0) = -0, times rstd: -0
    y = ops.layer_norm(x, eps=1.0)
    assert y[0, 2].item() == 0.0 and torch.signbit(y[0, 2])
    with_zero_bias = ops.layer_norm(x, bias=torch.zeros(3), eps=1.0)
    assert not torch.signbit(with_zero_bias[0, 2])  # -0 + 0 = +0: a bias is an addition


def test_backward_hand_worked_values():
    x = _t([[2.0, 2.0, 2.0, 2.0]])  # rstd 0.5, x̂ = 1
    grad_y = _t([[1.0, 0.0, 0.0, 0.0]])
    weight = torch.ones(4)
    rstd = _t([0.5])
    grad_x, grad_weight = ops.rms_norm_backward(grad_y, x, weight, rstd)
    # g = grad_y; mean(g·x̂) = 0.25; grad_x = 0.5 · (g − 0.25)
    assert torch.equal(grad_x, _t([[0.375, -0.125, -0.125, -0.125]]))
    assert torch.equal(grad_weight, _t([1.0, 0.0, 0.0, 0.0]))
    grad_x, grad_weight = ops.rms_norm_backward(grad_y, x, None, rstd, out_scale=2.0,
                                                grad_residual_out=_t([[1.0, 1.0, 1.0, 1.0]]))
    assert grad_weight is None
    assert torch.equal(grad_x, _t([[1.75, 0.75, 0.75, 0.75]]))  # 2 · [0.375, -0.125, ...] + 1
    # LayerNorm: x = [0, 0, 2, 2] (mean 1, rstd 1, x̂ = [-1, -1, 1, 1]), grad_y = [1, 0, 0, 0]:
    # mean(g) = 0.25, mean(g·x̂) = -0.25; grad_x = (g − 0.25) − x̂ · (−0.25)
    grad_x, grad_weight, grad_bias = ops.layer_norm_backward(grad_y, _t([[0.0, 0.0, 2.0, 2.0]]), None, _t([1.0]),
                                                             _t([1.0]))
    assert torch.equal(grad_x, _t([[0.5, -0.5, 0.0, 0.0]]))
    assert grad_weight is None and torch.equal(grad_bias, _t([1.0, 0.0, 0.0, 0.0]))


def test_row_sum_is_the_documented_pairwise_tree():
    values = _t([[1.0, 2.0 ** 24, 1.0, -(2.0 ** 24), 3.0]])
    # width 5: [1 + 1, 2^24 - 2^24] + carried 3 -> [2, 0, 3] -> [2 + 0] + carried 3 -> [2, 3] -> 5
    assert formulas.row_sum(values).item() == 5.0
    assert (values[0, 0] + values[0, 1] + values[0, 2] + values[0, 3] + values[0, 4]).item() != 5.0
    assert formulas.row_sum(torch.empty(3, 0)).tolist() == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------------- forms and layouts


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
def test_rms_norm_matches_the_formula_in_fp64_within_an_ulp(dtype):
    x = activation(9, 576, dtype, seed=1)
    weight = (1 + 0.1 * torch.randn(576, generator=torch.Generator().manual_seed(2))).to(dtype)
    y = ops.rms_norm(x, weight, eps=1e-6)
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    # bf16 / fp16: the fp32 intermediates leave one rounding that counts; fp32 keeps a few
    assert_within_ulps(y, exact.to(dtype), 1 if dtype != F32 else 4)


LAYER_NORM_SEED = 5


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
def test_layer_norm_matches_the_formula_in_fp64_within_an_ulp(dtype):
    x = activation(9, 1536, dtype, seed=3)
    generator = torch.Generator().manual_seed(LAYER_NORM_SEED)  # the global stream depends on the tests before
    weight, bias = torch.randn(1536, generator=generator).to(dtype), torch.randn(1536, generator=generator).to(dtype)
    y = ops.layer_norm(x, weight, bias)
    s = x.double()
    exact = (s - s.mean(-1, keepdim=True)) * torch.rsqrt(s.var(-1, unbiased=False, keepdim=True) + 1e-5)
    expected = exact * weight.double() + bias.double()
    if dtype != F32:
        # where + bias cancels to near 0 the fp32 roundings of its terms (|x̂·w| + |b|, 2^-24 each)
        # can pass an ulp of the output (an fp16 subnormal ulp is 2^-24): those elements are held to
        # an ulp plus the terms' fp32 error; every other element to one ulp of the output dtype
        terms = (exact * weight.double()).abs() + bias.double().abs()
        cancelled = expected.abs() < terms * 2.0**-10
        assert cancelled.sum() <= y.numel() // 100, int(cancelled.sum())
        assert_within_ulps(y[~cancelled], expected.to(dtype)[~cancelled], 1)
        info = torch.finfo(dtype)  # an ulp of the output: at most eps·|y|, or eps·smallest_normal below it
        bound = expected.abs() * info.eps + info.smallest_normal * info.eps + terms * 2.0**-21
        assert ((y.double() - expected).abs() <= bound)[cancelled].all()
    else:  # fp32 output: the few fp32 roundings count, and + bias cancels near 0 (ulps are meaningless there)
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


def test_in_place_residual_form_equals_the_out_of_place_one():
    x, r = activation(7, 576, BF16, seed=4), activation(7, 576, BF16, seed=5)
    weight = torch.randn(576).to(BF16)
    y, residual_out = ops.rms_norm(x, weight, residual=r)
    x_buffer, r_buffer = x.clone(), r.clone()
    returned = ops.rms_norm(x_buffer, weight, residual=r_buffer, out=x_buffer, residual_out=r_buffer)
    assert returned[0] is x_buffer and returned[1] is r_buffer
    assert_bytes_equal(x_buffer, y) and assert_bytes_equal(r_buffer, residual_out)
    # LayerNorm and the fused cast take the same form
    ly, lres = ops.layer_norm(x, weight, residual=r)
    x_buffer, r_buffer = x.clone(), r.clone()
    ops.layer_norm(x_buffer, weight, residual=r_buffer, out=x_buffer, residual_out=r_buffer)
    assert_bytes_equal(x_buffer, ly) and assert_bytes_equal(r_buffer, lres)
    r_buffer = r.clone()
    q, sf, res = ops.rms_norm_per_token_cast(x, weight, residual=r_buffer, residual_out=r_buffer)
    assert res is r_buffer and torch.equal(r_buffer, residual_out)


def test_in_place_form_on_strided_views_and_3d():
    buffer = activation(6, 4 * 80, BF16, seed=6)
    x = buffer.view(6, 4, 80)[..., :64]  # [T, N, D] heads of a padded buffer
    residual_buffer = activation(6, 4 * 80, BF16, seed=7)
    r = residual_buffer.view(6, 4, 80)[..., :64]
    weight = torch.randn(64).to(BF16)
    y, residual_out = ops.rms_norm(x.contiguous(), weight, residual=r.contiguous())
    padding, residual_padding = buffer.view(6, 4, 80)[..., 64:].clone(), residual_buffer.view(6, 4, 80)[..., 64:].clone()
    ops.rms_norm(x, weight, residual=r, out=x, residual_out=r)
    assert_bytes_equal(x.contiguous(), y) and assert_bytes_equal(r.contiguous(), residual_out)
    assert torch.equal(buffer.view(6, 4, 80)[..., 64:], padding)  # the padding is not touched
    assert torch.equal(residual_buffer.view(6, 4, 80)[..., 64:], residual_padding)


def test_three_d_is_a_norm_per_head():
    x = activation(5, 8 * 128, F32, seed=8).view(5, 8, 128)
    weight = torch.randn(128)
    y, rstd = ops.rms_norm(x, weight, return_rstd=True)
    flat, flat_rstd = ops.rms_norm(x.reshape(40, 128), weight, return_rstd=True)
    assert y.shape == (5, 8, 128) and rstd.shape == (5, 8)
    assert_bytes_equal(y.reshape(40, 128), flat) and assert_bytes_equal(rstd.reshape(40), flat_rstd)
    ly, mean, lrstd = ops.layer_norm(x, weight, return_stats=True)
    assert ly.shape == (5, 8, 128) and mean.shape == (5, 8) and lrstd.shape == (5, 8)


def test_strided_rows_give_the_contiguous_bytes():
    buffer = activation(9, 1600, F16, seed=9)
    x = buffer[:, :1536]
    weight = torch.randn(1536).to(F32)
    assert_bytes_equal(ops.rms_norm(x, weight), ops.rms_norm(x.contiguous(), weight))
    assert_bytes_equal(ops.layer_norm(x, weight, weight), ops.layer_norm(x.contiguous(), weight, weight))


def test_rows_of_single_element_and_seven():
    assert torch.equal(ops.rms_norm(_t([[3.0], [-2.0]]), eps=0.0), _t([[1.0], [-1.0]]))
    assert torch.equal(ops.layer_norm(_t([[3.0], [-2.0]]), eps=1.0), _t([[0.0], [0.0]]))
    x = activation(3, 7, BF16, seed=10)
    assert ops.rms_norm(x).shape == (3, 7) and ops.layer_norm(x).dtype == BF16


def test_non_finite_inputs_stay_in_their_row():
    x = activation(4, 576, BF16, seed=11)
    x[1, 5] = float("inf")
    x[2, 7] = float("nan")
    clean = ops.rms_norm(x[[0, 3]])
    y = ops.rms_norm(x)
    assert_bytes_equal(y[[0, 3]], clean)
    assert not torch.isfinite(y[1]).all() and torch.isnan(y[2]).any()
    ly = ops.layer_norm(x)
    assert torch.isfinite(ly[[0, 3]]).all() and not torch.isfinite(ly[1]).all() and torch.isnan(ly[2]).all()


# ---------------------------------------------------------------------- batch invariance, determinism


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "rms_norm_per_token_cast"])
def test_batch_invariance_same_row_same_bytes_at_any_batch_and_position(op):
    hidden = 1536
    batch = activation(4001, hidden, BF16, seed=12)
    weight = torch.randn(hidden).to(BF16)
    function = getattr(ops, op)

    def rows_of(x):
        result = function(x, weight)
        return result if isinstance(result, torch.Tensor) else result[0]

    full = rows_of(batch)
    for row in (0, 1, 2000, 4000):
        alone = rows_of(batch[row:row + 1])
        assert_bytes_equal(alone, full[row:row + 1], what=f"row {row} alone")
        for size in (7, 129):
            for start in (max(0, row - size + 1), max(0, row - size // 2)):
                window = batch[start:start + size]
                if not start <= row < start + window.shape[0]:
                    continue
                assert_bytes_equal(rows_of(window)[row - start], full[row], what=f"row {row} in [{start}, +{size})")
    again = rows_of(batch)
    assert_bytes_equal(again, full, what="a second run")


def test_weight_gradient_is_deterministic_and_fixed_order():
    x = activation(257, 576, BF16, seed=13)
    grad_y = activation(257, 576, BF16, seed=14) * 0.1
    weight = torch.randn(576).to(BF16)
    _, rstd = ops.rms_norm(x, weight, return_rstd=True)
    first = ops.rms_norm_backward(grad_y, x, weight, rstd)[1]
    second = ops.rms_norm_backward(grad_y.clone(), x.clone(), weight, rstd.clone())[1]
    assert_bytes_equal(first, second)
    normalized = x.float() * rstd[:, None]
    assert torch.equal(first, formulas.column_sum(grad_y.float() * normalized))  # out_scale 1: the same products


# ---------------------------------------------------------------------- fused ≡ unfused


def _sf_options():
    for fmt, group, mode, col_major in itertools.product(("e4m3", "e2m1"), (32, 128), SF_MODES, (False, True)):
        yield {"fmt": fmt, "num_per_channels": group, "use_tma_aligned_col_major_sf": col_major, **SF_MODES[mode]}


@pytest.mark.parametrize("options", list(_sf_options()), ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("layout", ["cuda", "ascend"])
def test_rms_norm_per_token_cast_is_the_composition_bytewise(options, layout):
    x, r = activation(5, 576, BF16, seed=15), activation(5, 576, BF16, seed=16)
    weight = torch.randn(576).to(BF16)
    with core.config.host_layout(layout):
        q, sf, residual_out, y = ops.rms_norm_per_token_cast(x, weight, residual=r, weight_offset=1.0, out_scale=0.5,
                                                             return_unquantized=True, **options)
        expected_y, expected_residual = ops.rms_norm(x, weight, residual=r, weight_offset=1.0, out_scale=0.5)
        expected_q, expected_sf = ops.per_token_cast(expected_y, **options)
    assert_bytes_equal(y, expected_y) and assert_bytes_equal(residual_out, expected_residual)
    assert_bytes_equal(q, expected_q, strides=True)
    assert_bytes_equal(sf, expected_sf, strides=True)


def test_rms_norm_per_token_cast_of_3d_quantizes_the_flattened_rows():
    x = activation(3, 4 * 64, F32, seed=17).view(3, 4, 64)
    q, sf = ops.rms_norm_per_token_cast(x, torch.ones(64), num_per_channels=32)
    expected = ops.per_token_cast(ops.rms_norm(x, torch.ones(64)).reshape(3, 256), num_per_channels=32)
    assert q.shape == (3, 256) and sf.shape == (3, 8)
    assert_bytes_equal(q, expected[0]) and assert_bytes_equal(sf, expected[1])


# ---------------------------------------------------------------------- backward


def _rms_formula(x, weight, residual, offset, scale, eps):
    s = x + residual if residual is not None else x
    factor = ((weight + offset) if weight is not None else 1.0) * scale
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * factor


def _layer_formula(x, weight, bias, residual, eps):
    s = x + residual if residual is not None else x
    y = (s - s.mean(-1, keepdim=True)) * torch.rsqrt(s.var(-1, unbiased=False, keepdim=True) + eps)
    return y * (weight if weight is not None else 1.0) + (bias if bias is not None else 0.0)


@pytest.mark.parametrize("offset,scale,residual", [(0.0, 1.0, False), (1.0, 0.5, True)], ids=["plain", "gemma"])
def test_rms_norm_backward_equals_autograd_of_the_fp64_formula(offset, scale, residual):
    x = activation(33, 576, F32, seed=18)
    r = activation(33, 576, F32, seed=19) if residual else None
    weight = torch.randn(576)
    grad_y, grad_res = torch.randn(33, 576), torch.randn(33, 576) if residual else None
    s = x + r if residual else x
    _, rstd = ops.rms_norm(s, weight, return_rstd=True)
    grad_x, grad_weight = ops.rms_norm_backward(grad_y, s, weight, rstd, offset, scale, grad_res)
    leaves = [t.double().requires_grad_() for t in (x, weight)]
    r64 = r.double().requires_grad_() if residual else None
    y = _rms_formula(leaves[0], leaves[1], r64, offset, scale, 1e-6)
    outputs, grads = [y], [grad_y.double()]
    if residual:
        outputs.append(leaves[0] + r64)
        grads.append(grad_res.double())
    torch.autograd.backward(outputs, grads)
    assert relative_error(grad_x, leaves[0].grad) < 2e-6
    assert relative_error(grad_weight, leaves[1].grad) < 1e-5
    if residual:
        assert torch.equal(leaves[0].grad, r64.grad)


def test_layer_norm_backward_equals_autograd_of_the_fp64_formula():
    x, weight, bias = activation(33, 1536, F32, seed=20), torch.randn(1536), torch.randn(1536)
    grad_y, grad_res = torch.randn(33, 1536), torch.randn(33, 1536)
    _, mean, rstd = ops.layer_norm(x, weight, bias, return_stats=True)
    grad_x, grad_weight, grad_bias = ops.layer_norm_backward(grad_y, x, weight, mean, rstd, grad_res)
    leaves = [t.double().requires_grad_() for t in (x, weight, bias)]
    torch.autograd.backward([_layer_formula(*leaves, None, 1e-5), leaves[0] * 1.0], [grad_y.double(), grad_res.double()])
    assert relative_error(grad_x, leaves[0].grad) < 2e-6
    assert relative_error(grad_weight, leaves[1].grad) < 1e-5
    assert relative_error(grad_bias, leaves[2].grad) < 1e-6


def test_gradcheck_in_fp64_on_the_reference():
    generator = torch.Generator().manual_seed(21)

    def leaf(*shape):
        return torch.randn(*shape, dtype=F64, generator=generator).requires_grad_()

    x, r, w, b = leaf(3, 2, 9), leaf(3, 2, 9), leaf(9), leaf(9)
    assert torch.autograd.gradcheck(lambda x, w, r: ops.rms_norm(x, w, residual=r, weight_offset=1.0, out_scale=0.7),
                                    (x, w, r))
    assert torch.autograd.gradcheck(lambda x, w: ops.rms_norm(x, w, return_rstd=True), (x, w))  # rstd: no gradient
    assert torch.autograd.gradcheck(lambda x, w, b, r: ops.layer_norm(x, w, b, residual=r), (x, w, b, r))
    assert torch.autograd.gradcheck(lambda x: ops.layer_norm(x, return_stats=True), (x,))
    assert torch.autograd.gradcheck(lambda x: ops.rms_norm(x), (x,))


# ---------------------------------------------------------------------- the op table's comparison


def _nudged(tensor: torch.Tensor, steps: int) -> torch.Tensor:
    """``tensor`` moved ``steps`` representable values up (positive elements) / down (negative)."""
    view = {2: torch.int16, 4: torch.int32}[tensor.element_size()]
    return (tensor.view(view) + steps).view(tensor.dtype)


def test_compare_allows_the_spec_tolerances_and_no_more():
    from tileplug.core import opdefs

    opdef = opdefs.get("rms_norm")
    case = core.Case.of("rms_norm", 64, BF16, inputs={"residual": True}, return_rstd=True)
    args, kwargs = case.arguments(3, "cpu")
    y, residual_out, rstd = opdef.function(*args, **kwargs)
    opdef.compare(case, 3, [_nudged(y, 1), _nudged(residual_out, 1), _nudged(rstd, 4)], [y, residual_out, rstd])
    with pytest.raises(AssertionError, match="more than 1 ulp"):
        opdef.compare(case, 3, [_nudged(y, 2), residual_out, rstd], [y, residual_out, rstd])
    with pytest.raises(AssertionError, match="more than 4 ulp"):
        opdef.compare(case, 3, [y, residual_out, _nudged(rstd, 5)], [y, residual_out, rstd])
    fp32_case = core.Case.of("rms_norm", 64, F32, return_rstd=True)  # rstd has x's dtype: still a statistic
    y, rstd = opdefs.get("rms_norm").function(*fp32_case.arguments(3, "cpu")[0], **fp32_case.arguments(3, "cpu")[1])
    opdef.compare(fp32_case, 3, [y, _nudged(rstd, 3)], [y, rstd])
    backward = opdefs.get("rms_norm_backward")
    back_case = core.Case.of("rms_norm_backward", 64, F32)
    grad_x, grad_weight = backward.function(*back_case.arguments(3, "cpu")[0])
    backward.compare(back_case, 3, [grad_x, grad_weight * (1 + 5e-6)], [grad_x, grad_weight])
    with pytest.raises(AssertionError, match="relative error"):
        backward.compare(back_case, 3, [grad_x, grad_weight * (1 + 5e-5)], [grad_x, grad_weight])
