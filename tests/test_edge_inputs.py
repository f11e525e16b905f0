"""Edge inputs of every op in the op table: empty shapes, out= tensors that cannot be written
or overlap the inputs, inputs that require grad."""

from __future__ import annotations

import inspect

import pytest
import torch

from tileplug import core
from tileplug.core import opdefs

ALL_OPS = opdefs.all_ops()


def _outputs(result):
    """The returned tensors (a list from a custom op returning Tensor[]; an absent optional output, such as
    grad_weight without a weight, is None: left out)."""
    return [t for t in result if t is not None] if isinstance(result, (tuple, list)) else [result]


class RaisingKernel:
    """A kernel that must never run: empty calls launch nothing."""

    def supports(self, call):
        return None

    def __call__(self, call, inputs, outputs):
        raise AssertionError(f"kernel launched for an empty call: {call}")


@pytest.fixture
def no_launch_backend():
    backend = core.Backend(
        name="never-launches", device_types=("cpu",), priority=900, traits=core.CUDA_LAYOUT,
        kernels={name: RaisingKernel() for name in opdefs.kernel_names()},
    )
    core.registry.register(backend)
    yield
    core.registry.unregister("never-launches")


@pytest.mark.parametrize("tokens,hidden", [(0, None), (5, 0), (0, 0)], ids=["T=0", "H=0", "T=0,H=0"])
@pytest.mark.parametrize("opdef", ALL_OPS, ids=lambda d: d.name)
def test_empty_shapes_give_ordinary_empty_outputs_without_a_launch(opdef, tokens, hidden, no_launch_backend):
    for case in opdef.cases():
        size = case.hidden if hidden is None else hidden
        args, kwargs = opdef.arguments(tokens, size, case.dtype, dict(case.kwargs), dict(case.inputs),
                                       torch.device("cpu"), 0)
        try:
            if not opdefs.describe_call(opdef.name, *args, **kwargs)[0].empty:
                continue  # the case adds columns of its own (a shared-expert slot): not an empty call
            outputs = _outputs(opdef.produced(opdef.function(*args, **kwargs), *args, **kwargs))
        except core.ContractError as error:
            # an op reducing over the last dim needs one (the norms: SPEC §5, D >= 1; a router
            # needs an expert, a permutation a column): refused, naming one of its arguments
            assert size == 0 and error.argument in inspect.signature(opdef.function).parameters, (case.id, error)
            assert "D >= 1" in str(error) or "at least 1 column" in str(error), (case.id, error)
            continue
        meta_args, meta_kwargs = opdef.arguments(tokens, size, case.dtype, dict(case.kwargs), dict(case.inputs),
                                                 torch.device("meta"), 0)
        expected = _outputs(opdef.produced(opdef.library_op()(*opdef._flatten(*meta_args, **meta_kwargs)), *meta_args,
                                           **meta_kwargs))
        assert [(t.shape, t.dtype) for t in outputs] == [(t.shape, t.dtype) for t in expected], case.id
        for tensor in outputs:
            if tensor.dim() == 1 and tensor.numel() and (tokens == 0 or size == 0):
                # a reduction over what is empty: the sum over no rows ([H] weight gradients, [E] expert
                # counts and ends) or over no slots ([T] routing denominators) is 0
                assert torch.equal(tensor, torch.zeros_like(tensor)), case.id
                continue
            assert tensor.numel() == 0
            assert tensor.view(torch.uint8).numel() == 0, case.id  # viewable: ordinary strides
            assert tensor.clone().shape == tensor.shape and tensor.reshape(-1).numel() == 0


def test_hidden_zero_quantized_input_round_trips():
    q, sf = core.ops.per_token_cast(torch.empty(3, 0, dtype=torch.bfloat16))
    assert q.shape == (3, 0) and sf.shape == (3, 0)
    back = core.ops.cast_back((q, sf), "bf16", x_block_size=(1, 128))
    assert back.shape == (3, 0) and back.dtype == torch.bfloat16


def test_out_made_under_inference_mode_is_refused_outside_it():
    x = torch.randn(4, 256).to(torch.bfloat16)
    with torch.inference_mode():
        out = tuple(torch.empty_like(t) for t in core.ops.per_token_cast(x))
    with pytest.raises(core.ContractError, match="'out'.*inference mode") as caught:
        core.ops.per_token_cast(x, out=out)
    assert caught.value.argument == "out"
    with torch.inference_mode():  # inside inference mode it is an ordinary out=
        q, sf = core.ops.per_token_cast(x, out=out)
    assert q is out[0] and sf is out[1]


def test_out_overlapping_an_input_is_refused():
    x = torch.randn(4, 256)
    sf = core.ops.per_token_cast_with_sf_only(x)
    alias = torch.as_strided(x, sf.shape, sf.stride())  # the first bytes of x, in sf's layout
    with pytest.raises(core.ContractError, match="'out'.*sharing no memory with the inputs"):
        core.ops.per_token_cast_with_sf_only(x, out=alias)
    x16 = x.to(torch.bfloat16)
    q_over_x = torch.as_strided(x16.view(torch.uint8), (4, 256), (256, 1)).view(torch.float8_e4m3fn)
    with pytest.raises(core.ContractError, match="'out'.*sharing no memory with the inputs"):
        core.ops.per_token_cast(x16, out=(q_over_x, torch.empty(4, 2)))
    assert torch.equal(x16, x.to(torch.bfloat16))  # x untouched
    fresh = torch.empty(4, 256)
    assert core.ops.per_token_cast_with_sf_only(x, out=fresh[:, :2].contiguous()).shape == (4, 2)


def test_out_tensors_overlapping_each_other_are_refused():
    x = torch.randn(2, 128).to(torch.bfloat16)
    shared = torch.empty(256 + 16, dtype=torch.uint8)
    q_out = shared[:256].view(torch.float8_e4m3fn).view(2, 128)
    sf_shared = shared[:16].view(torch.float32)[:2].view(2, 1)
    with pytest.raises(core.ContractError, match="sharing no memory with each other"):
        core.ops.per_token_cast(x, out=(q_out, sf_shared))


def test_out_requiring_grad_is_refused():
    x = torch.randn(2, 128)
    sf = torch.empty(2, 1, requires_grad=True)
    with pytest.raises(core.ContractError, match="'out'.*require grad"):
        core.ops.per_token_cast_with_sf_only(x, out=sf)


@pytest.mark.parametrize("opdef", ALL_OPS, ids=lambda d: d.name)
def test_inputs_requiring_grad_give_history_only_to_differentiable_ops(opdef):
    case = opdef.cases()[0]
    args, kwargs = case.arguments(3, "cpu")

    def wanting_grad(value):
        if isinstance(value, tuple):
            return tuple(wanting_grad(item) for item in value)
        if isinstance(value, torch.Tensor):
            return value.detach().requires_grad_(value.is_floating_point() and value.dtype.itemsize > 1)
        return value

    args = tuple(wanting_grad(a) for a in args)
    result = opdef.function(*args, **kwargs)
    if opdef.mutates:  # in place: nothing returned, the written inputs stay leaves (no history recorded)
        assert result is None
        for written in _outputs(opdef.produced(result, *args, **kwargs)):
            assert written.grad_fn is None and written.is_leaf
        return
    outputs = _outputs(result)
    if opdef.autograd is not None:  # a differentiable op: its first floating output carries history
        floating = [output for output in outputs if output.is_floating_point()]
        assert floating and floating[0].grad_fn is not None and floating[0].requires_grad
        assert all(output.grad_fn is None for output in outputs if not output.is_floating_point())  # indices
        return
    for output in outputs:
        assert output.grad_fn is None and not output.requires_grad
