"""Training with SwiGLU: ``tileplug.core.nn.functional.swiglu`` / ``nn.SwiGLU`` differentiate
through the op table (``swiglu_backward``), checked by ``gradcheck`` in fp64 on the reference,
eager and under ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

import pytest
import torch

from tileplug.core import nn, ops
from tileplug.core.nn import functional

FP64, FP32, BF16 = torch.float64, torch.float32, torch.bfloat16


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _away_from_the_clamp(values: torch.Tensor, clamp: float) -> torch.Tensor:
    """Values whose distance to ±clamp is at least 0.1 (gradcheck's finite differences must not straddle a cut)."""
    near = (values.abs() - clamp).abs() < 0.1
    return torch.where(near, values + 0.3, values)


@pytest.mark.parametrize("clamp", [None, 1.5])
@pytest.mark.parametrize("weighted", [False, True])
def test_gradcheck_in_fp64(clamp, weighted) -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(7, 2 * 5, generator=generator, dtype=FP64) * 2
    if clamp is not None:
        x = _away_from_the_clamp(x, clamp)
    x.requires_grad_(True)
    inputs = [x]
    if weighted:
        inputs.append(torch.rand(7, generator=generator, dtype=FP64).requires_grad_(True))

    def function(x, weights=None):
        return functional.swiglu(x, weights, routed_scaling_factor=1.5, clamp_value=clamp)

    assert torch.autograd.gradcheck(function, tuple(inputs))


def test_gradcheck_with_padding_rows_in_fp64() -> None:
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(12, 8, generator=generator, dtype=FP64).requires_grad_(True)
    weights = torch.rand(12, generator=generator, dtype=FP64).requires_grad_(True)
    ends = torch.tensor([3, 5, 9], dtype=torch.int32)  # alignment 4: rows 3, 9, 10, 11 are padding
    y = functional.swiglu(x, weights, expert_ends=ends, expert_alignment=4)
    assert not bool(y[[3, 9, 10, 11]].any()) and bool(y[[0, 4, 8]].ne(0).all())
    assert torch.autograd.gradcheck(lambda x, w: functional.swiglu(x, w, expert_ends=ends, expert_alignment=4),
                                    (x, weights))
    y.sum().backward()
    assert not bool(x.grad[[3, 9, 10, 11]].any()) and not bool(weights.grad[[3, 9, 10, 11]].any())


def test_autograd_gives_the_backward_ops_gradients() -> None:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 2 * 64, generator=generator).to(BF16).requires_grad_(True)
    weights = torch.rand(6, generator=generator).requires_grad_(True)
    y = functional.swiglu(x, weights, clamp_value=2.0)
    assert y.shape == (2, 3, 64) and y.dtype == BF16 and y.grad_fn is not None
    grad = torch.randn(2, 3, 64, generator=generator).to(BF16)
    y.backward(grad)
    grad_x, grad_w = ops.swiglu_backward(x.detach().reshape(6, 128), grad.reshape(6, 64), weights.detach(),
                                         clamp_value=2.0)
    assert torch.equal(x.grad.reshape(6, 128), grad_x) and torch.equal(weights.grad, grad_w)
    with torch.no_grad():
        assert functional.swiglu(x, weights).grad_fn is None


def test_module_trains_under_torch_compile() -> None:
    generator = torch.Generator().manual_seed(6)
    layer = nn.SwiGLU(clamp_value=3.0, routed_scaling_factor=2.0)
    x = torch.randn(9, 2 * 16, generator=generator).requires_grad_(True)
    compiled = torch.compile(lambda x: (layer(x) ** 2).sum(), fullgraph=True)
    compiled(x).backward()
    eager_x = x.detach().clone().requires_grad_(True)
    (layer(eager_x) ** 2).sum().backward()
    assert torch.allclose(x.grad, eager_x.grad, rtol=1e-6, atol=0)
    assert x.grad.abs().sum() > 0 and "clamp_value=3.0" in repr(layer)
