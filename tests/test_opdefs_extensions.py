"""The op table's generic extensions, on a toy op declared here (no family names them):
``written`` output arguments (aliasing an input, copied into under ``torch.compile``),
a result whose length depends on the arguments (schema ``Tensor[]``), an optional member of a
fixed result (``Tensor?``), and a backward registered through ``autograd=``."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch

from tileplug import core
from tileplug.core import opdefs
from tileplug.core.call import call_type
from tileplug.core.errors import ContractError
from tileplug.core.registry import registry

OP, BACKWARD = "toy_double", "toy_double_backward"


@call_type
class DoubleCall(core.Call):
    hidden: int
    dtype: torch.dtype
    with_sum: bool = False


class DoubleOutputs(NamedTuple):
    y: torch.Tensor
    total: torch.Tensor | None


class DoublePlan:
    def __init__(self, call: DoubleCall) -> None:
        self.call = call

    def allocate(self, tokens: int, device: Any, given: Any = None) -> DoubleOutputs:
        y = given if given is not None else torch.empty(tokens, self.call.hidden, dtype=self.call.dtype, device=device)
        total = torch.empty(tokens, dtype=self.call.dtype, device=device) if self.call.with_sum else None
        return DoubleOutputs(y, total)


def _call(op: str, x: Any, with_sum: bool = False) -> DoubleCall:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ContractError(op, "x", "a 2-D tensor", type(x).__name__)
    return DoubleCall(op, x.device.type, op, x.shape[1], x.dtype, with_sum, tokens=x.shape[0], device=x.device,
                      empty=x.numel() == 0)


def double_contract(x: Any, with_sum: bool = False, out: Any = None) -> tuple[DoubleCall, tuple]:
    return _call(OP, x, with_sum), (x.detach() if x.requires_grad else x,)


def toy_double(x: torch.Tensor, with_sum: bool = False, out: torch.Tensor | None = None
               ) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """y = 2 x [T, H] (``out`` may be ``x`` itself), and the row sums of y with ``with_sum``."""
    if opdefs.wants_grad(x) or torch.compiler.is_compiling():
        return DOUBLE.traced(x, with_sum, out=out)
    call, inputs = double_contract(x, with_sum)
    return opdefs.run(call, inputs, given=out)


def toy_double_backward(grad_y: torch.Tensor, weight: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(2 · grad_y, None): the toy's backward; the optional second result is always absent."""
    if torch.compiler.is_compiling():
        return DOUBLE_BACKWARD.traced(grad_y, weight)
    call, inputs = _call(BACKWARD, grad_y), (grad_y,)
    return opdefs.run(call, inputs)


def _setup(ctx: Any, inputs: tuple, output: list) -> None:
    if len(output) == 2:
        ctx.mark_non_differentiable(output[1])


def _backward(ctx: Any, grads: list) -> tuple:
    return toy_double_backward(grads[0])[0], None


class Kernel:
    def supports(self, call: DoubleCall) -> str | None:
        return None

    def __call__(self, call: DoubleCall, inputs: Any, outputs: Any) -> None:
        doubled = inputs[0] * 2
        if call.op == BACKWARD:
            outputs.y.copy_(doubled)
            return
        if outputs.total is not None:
            outputs.total.copy_(doubled.sum(-1))
        outputs.y.copy_(doubled)


def _declare(name: str, function: Any, contract: Any, result: Any, **extra: Any) -> opdefs.OpDef:
    return core.declare(core.OpDef(
        name=name, function=function, contract=contract, outputs=lambda call, traits: DoublePlan(call),
        result=result, ledger=lambda call, traits: core.Ledger(0, 0, 0), cases=lambda: [core.Case.of(name, 8)],
        bench=lambda: [], arguments=lambda *args: ((torch.ones(2, 8),), {}), family="toy", **extra))


DOUBLE = DOUBLE_BACKWARD = None


@pytest.fixture(scope="module", autouse=True)
def declared():
    global DOUBLE, DOUBLE_BACKWARD
    DOUBLE = _declare(OP, toy_double, double_contract,
                      lambda call, outputs: outputs.y if outputs.total is None else (outputs.y, outputs.total),
                      written={"out": 0}, autograd=(_setup, _backward))
    DOUBLE_BACKWARD = _declare(BACKWARD, toy_double_backward,
                               lambda grad_y, weight=None: (_call(BACKWARD, grad_y), (grad_y,)),
                               lambda call, outputs: (outputs.y, None))
    backend = core.Backend(name="toy-double", device_types=("cpu",), priority=60, traits=core.CUDA_LAYOUT,
                           kernels={OP: Kernel(), BACKWARD: Kernel()})
    registry.register(backend)
    try:
        yield
    finally:
        registry.unregister("toy-double")
        opdefs.undeclare(OP)
        opdefs.undeclare(BACKWARD)
        torch._dynamo.reset()


def test_schemas():
    assert DOUBLE.schema == "(Tensor x, bool with_sum) -> Tensor[]"  # out: written, not in the schema
    assert DOUBLE_BACKWARD.schema == "(Tensor grad_y, Tensor? weight) -> (Tensor, Tensor?)"


def test_variable_result_length_through_the_custom_op():
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(DOUBLE.traced(x), 2 * x)  # one element: the tensor itself
    y, total = DOUBLE.traced(x, True)
    assert torch.equal(total, torch.tensor([6.0, 24.0]))
    grad, absent = DOUBLE_BACKWARD.traced(x)
    assert absent is None and torch.equal(grad, 2 * x)


def test_written_argument_aliases_eager_and_is_copied_into_under_compile():
    x = torch.arange(6.0).reshape(2, 3)
    assert toy_double(x, out=x) is x and torch.equal(x, 2 * torch.arange(6.0).reshape(2, 3))
    compiled = torch.compile(lambda x: toy_double(x, out=x), fullgraph=True)
    z = torch.ones(2, 3)
    result = compiled(z)
    assert torch.equal(z, torch.full((2, 3), 2.0)) and torch.equal(result, z)
    with pytest.raises(ContractError, match="'out'.*does not require grad"):
        DOUBLE.traced(torch.ones(2, 3), out=torch.ones(2, 3, requires_grad=True))


def test_backward_registered_through_the_table_eager_and_compiled():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: toy_double(x), (x,))
    assert torch.autograd.gradcheck(lambda x: toy_double(x, True)[0], (x,))
    loss = torch.compile(lambda x: (toy_double(x) ** 2).sum(), fullgraph=True)
    loss(x).backward()
    assert torch.allclose(x.grad, 8 * x.detach())
    with torch.no_grad():
        assert toy_double(x).grad_fn is None


@pytest.mark.parametrize("op,hidden,inputs,argument", [
    ("apply_rotary", 256, {"bogus": 1}, "inputs.bogus"),
    ("apply_rotary", 256, {"head_dim": 0}, "inputs.head_dim"),
    ("apply_rotary", 256, {"positions": "int8"}, "inputs.positions"),
    ("apply_rotary", 256, {"row_stride_pad": -1}, "inputs.row_stride_pad"),
    ("moe_topk_gate", 64, {"topk": 0}, "inputs.topk"),
    ("moe_topk_gate", 64, {"shared": -1}, "inputs.shared"),
    ("moe_topk_gate", 64, {"ties": "random"}, "inputs.ties"),
])
def test_case_inputs_are_checked_by_name(op: str, hidden: int, inputs: dict, argument: str) -> None:
    """A case's ``inputs`` (how the family makes its tensors) are checked like arguments: a
    ContractError naming ``inputs.<name>``."""
    from tileplug.core import opdefs
    from tileplug.core.errors import ContractError
    from tileplug.core.opdefs import Case

    case = Case.of(op, hidden, torch.float32, inputs=inputs)
    with pytest.raises(ContractError, match=argument.replace(".", r"\.")):
        case.arguments(3, "cpu")
    assert opdefs.get(op).family in ("rope", "moe")
