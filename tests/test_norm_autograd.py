"""Training with the norms: ``tileplug.core.nn`` modules against ``torch.nn``'s, autograd
through the op table (``rms_norm_backward`` / ``layer_norm_backward``), eager and under
``torch.compile(fullgraph=True)``, and the in-place serving form under compile."""

from __future__ import annotations

import pytest
import torch

from tileplug import core
from tileplug.core import nn
from tileplug.core.testing import activation, assert_bytes_equal, assert_within_ulps

ops = core.ops
F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _pair(kind: str, dtype: torch.dtype, **options):
    theirs = getattr(torch.nn, kind)(64, dtype=dtype, **options)
    ours = getattr(nn, kind)(64, dtype=dtype, **options)
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.normal_(generator=torch.Generator().manual_seed(1))
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


@pytest.mark.parametrize("kind,options", [("RMSNorm", {}), ("RMSNorm", {"eps": 1e-5}),
                                          ("RMSNorm", {"elementwise_affine": False}), ("LayerNorm", {}),
                                          ("LayerNorm", {"bias": False}), ("LayerNorm", {"elementwise_affine": False})])
def test_modules_match_torch_nn_forward_and_backward(kind, options):
    theirs, ours = _pair(kind, F32, **options)
    assert [name for name, _ in theirs.named_parameters()] == [name for name, _ in ours.named_parameters()]
    assert ours.eps == theirs.eps
    x = activation(2 * 5, 64, F32, seed=2).view(2, 5, 64)  # leading dims: any
    grad = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3))
    outputs, gradients = [], []
    for module in (theirs, ours):
        leaf = x.clone().requires_grad_()
        y = module(leaf)
        y.backward(grad)
        outputs.append(y.detach())
        gradients.append([leaf.grad] + [p.grad for p in module.parameters()])
    assert outputs[1].shape == x.shape and outputs[1].dtype == F32
    torch.testing.assert_close(outputs[1], outputs[0], rtol=2e-6, atol=2e-6)
    for mine, reference in zip(gradients[1], gradients[0]):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_modules_in_bf16_are_within_two_ulp_of_torch_nn(kind):
    theirs, ours = _pair(kind, BF16)
    x = activation(9, 64, BF16, seed=4)
    # torch rounds its bf16 intermediates where tileplug keeps fp32: one more rounding at most
    assert_within_ulps(ours(x).detach(), theirs(x).detach(), 2)


def test_module_with_default_eps_uses_the_dtype_epsilon():
    module = nn.RMSNorm(4, elementwise_affine=False)
    x = torch.zeros(1, 4, dtype=BF16)
    assert module.eps is None and torch.equal(module(x), x)  # 0 · rsqrt(0 + eps) = 0
    assert "eps=None" in repr(module)


def test_normalized_shape_of_several_dims():
    theirs, ours = torch.nn.LayerNorm((4, 16)), nn.LayerNorm((4, 16))
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 4, 16)
    torch.testing.assert_close(ours(x), theirs(x), rtol=2e-6, atol=2e-6)


def _training_step(module: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> list[torch.Tensor]:
    module.zero_grad()
    leaf = x.clone().requires_grad_()
    loss = ((module(leaf) - target) ** 2).mean()
    loss.backward()
    return [loss.detach(), leaf.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_training_step_compiled_fullgraph_equals_eager(kind):
    module = getattr(nn, kind)(576)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(5)))
    x, target = activation(7, 576, F32, seed=6), torch.randn(7, 576)
    eager = _training_step(module, x, target)
    explanation = torch._dynamo.explain(module)(x.clone().requires_grad_())
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled_module = torch.compile(module, fullgraph=True)
    compiled = _training_step(compiled_module, x, target)
    for have, want in zip(compiled, eager):
        torch.testing.assert_close(have, want, rtol=1e-6, atol=1e-7)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    before = [p.detach().clone() for p in module.parameters()]
    optimizer.step()
    assert all(not torch.equal(p, b) for p, b in zip(module.parameters(), before))


def test_compiled_backward_equals_eager_and_eager_is_the_backward_op():
    x = activation(5, 64, F32, seed=7).requires_grad_()
    weight = torch.randn(64, requires_grad=True)

    def loss(x, weight):
        y, residual_out = ops.rms_norm(x, weight, residual=x * 2, weight_offset=1.0, out_scale=0.5)
        return (y * y).sum() + residual_out.sum()

    torch.compile(loss, fullgraph=True)(x, weight).backward()
    compiled_grads = (x.grad.clone(), weight.grad.clone())
    x.grad = weight.grad = None
    loss(x, weight).backward()
    torch.testing.assert_close(compiled_grads[0], x.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(compiled_grads[1], weight.grad, rtol=1e-6, atol=1e-6)
    # the eager gradient is the backward op's own output
    s = (x * 3).detach()
    _, rstd = ops.rms_norm(s, weight.detach(), return_rstd=True)
    y = ops.rms_norm(s, weight.detach(), weight_offset=1.0, out_scale=0.5)
    grad_x, grad_weight = ops.rms_norm_backward(2 * y, s, weight.detach(), rstd, 1.0, 0.5, torch.ones_like(s))
    torch.testing.assert_close(x.grad, 3 * grad_x, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weight.grad, grad_weight, rtol=0, atol=0)


def test_outputs_of_differentiable_ops_have_history_and_statistics_do_not():
    x = torch.randn(3, 16, requires_grad=True)
    y, rstd = ops.rms_norm(x, return_rstd=True)
    assert y.grad_fn is not None and not rstd.requires_grad
    y, mean, rstd = ops.layer_norm(x, return_stats=True)
    assert y.requires_grad and not mean.requires_grad and not rstd.requires_grad
    with torch.no_grad():
        assert ops.rms_norm(x).grad_fn is None
    q, sf = ops.rms_norm_per_token_cast(x)
    assert not q.requires_grad and not sf.requires_grad  # a cast is not differentiable


def test_in_place_form_under_compile_writes_the_given_tensors():
    weight = torch.randn(576).to(BF16)

    def step(x, r):
        return ops.rms_norm(x, weight, residual=r, out=x, residual_out=r)

    x, r = activation(9, 576, BF16, seed=8), activation(9, 576, BF16, seed=9)
    expected_y, expected_residual = ops.rms_norm(x, weight, residual=r)
    compiled = torch.compile(step, fullgraph=True)
    y, residual_out = compiled(x, r)
    assert_bytes_equal(x, expected_y) and assert_bytes_equal(r, expected_residual)
    assert_bytes_equal(y, expected_y) and assert_bytes_equal(residual_out, expected_residual)


def test_out_is_refused_under_compile_for_a_non_written_op():
    x = torch.randn(4, 128).to(BF16)
    out = core.ops.per_token_cast(x)
    with pytest.raises(Exception, match="out"):
        torch.compile(lambda x: core.ops.per_token_cast(x, out=out), fullgraph=True)(x)


def test_compiled_token_count_is_dynamic():
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounter()
    weight = torch.randn(576).to(BF16)

    def norms(x, r):
        return (*ops.rms_norm(x, weight, residual=r, return_rstd=True), *ops.rms_norm_per_token_cast(x, weight),
                ops.layer_norm(x, weight))

    compiled = torch.compile(norms, fullgraph=True, dynamic=True, backend=counter)
    for tokens in (5, 17, 130):
        x, r = activation(tokens, 576, BF16, seed=tokens), activation(tokens, 576, BF16, seed=tokens + 1)
        for have, want in zip(compiled(x, r), norms(x, r)):
            assert_bytes_equal(have, want, strides=True)
    assert counter.frame_count == 1


def test_the_custom_op_called_directly_without_statistics_still_differentiates():
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(16, dtype=torch.float64, requires_grad=True)
    rms = torch.ops.tileplug.rms_norm
    assert torch.autograd.gradcheck(lambda x, w: rms(x, w, 1e-6, None, 0.0, 1.0, False)[0], (x, weight))
    layer = torch.ops.tileplug.layer_norm
    assert torch.autograd.gradcheck(lambda x, w: layer(x, w, None, 1e-5, None, False)[0], (x, weight))
