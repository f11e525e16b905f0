"""``opdefs.argument_binder``: the per-op function that binds a public call's arguments for its
contract (made once from the public function's signature) gives what ``inspect``'s
``Signature.bind`` + ``apply_defaults`` gives, for every declared op on its cases and on
hand-made signatures of every parameter kind, and a wrong call is Python's ``TypeError``."""

from __future__ import annotations

import inspect

import pytest
import torch

from tileplug.core import opdefs
from tileplug.core.opdefs import argument_binder, bound_contract


def _inspected(signature: inspect.Signature, names, *args, **kwargs) -> tuple:
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments[name] for name in names)


def _same(have: tuple, want: tuple) -> bool:
    return len(have) == len(want) and all(a is b or (type(a) is type(b) and not isinstance(a, torch.Tensor) and a == b)
                                          for a, b in zip(have, want))


@pytest.mark.parametrize("opdef", opdefs.all_ops(), ids=lambda opdef: opdef.name)
def test_every_op_binds_its_cases_as_inspect_does(opdef) -> None:
    """Each case's arguments (meta tensors), as given and with every keyword moved to its position
    where it has one, bind to the same objects in the same order."""
    signature = inspect.signature(opdef.function)
    names = [name for name in signature.parameters if name != "out"]
    bind = argument_binder(signature, names, opdef.function.__name__)
    for case in opdef.cases()[:6]:
        args, kwargs = case.arguments(3, "meta")
        assert _same(bind(*args, **kwargs), _inspected(signature, names, *args, **kwargs)), case.id
        positional = list(args)
        rest = dict(kwargs)
        for parameter in list(signature.parameters.values())[len(args):]:
            if parameter.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD or parameter.name not in rest:
                break
            positional.append(rest.pop(parameter.name))
        assert _same(bind(*positional, **rest), _inspected(signature, names, *positional, **rest)), case.id


def _kinds(a, /, b, c=2, *, d, e=None, out=None):
    """Every kind a declared op may use: positional-only, positional-or-keyword, keyword-only."""


@pytest.mark.parametrize("args,kwargs", [
    ((1, 2), {"d": 4}),
    ((1,), {"b": 2, "d": 4, "e": 5}),
    ((1, 2, 3), {"d": 4, "out": 9}),
    ((1, 2), {"c": 3, "d": 4}),
])
def test_every_parameter_kind_binds_as_inspect_does(args, kwargs) -> None:
    signature = inspect.signature(_kinds)
    names = ["a", "b", "c", "d", "e"]
    assert argument_binder(signature, names, "_kinds")(*args, **kwargs) == _inspected(signature, names, *args, **kwargs)
    assert argument_binder(signature, ["e", "a"], "_kinds")(*args, **kwargs) == _inspected(
        signature, ["e", "a"], *args, **kwargs)


@pytest.mark.parametrize("args,kwargs,message", [
    ((), {"d": 4}, r"_kinds\(\) missing 2 required positional arguments: 'a' and 'b'"),
    ((1, 2), {}, "missing 1 required keyword-only argument: 'd'"),
    ((1, 2, 3, 4), {"d": 4}, "takes from 2 to 3 positional arguments but 4"),
    ((1, 2), {"d": 4, "f": 6}, "got an unexpected keyword argument 'f'"),
    ((), {"a": 1, "b": 2, "d": 4}, "positional-only"),
])
def test_a_wrong_call_is_pythons_type_error_naming_the_function(args, kwargs, message) -> None:
    signature = inspect.signature(_kinds)
    with pytest.raises(TypeError, match=message):
        argument_binder(signature, ["a"], "_kinds")(*args, **kwargs)
    with pytest.raises(TypeError):  # inspect refuses the same calls
        signature.bind(*args, **kwargs)


def test_a_default_object_is_passed_itself_and_out_is_dropped() -> None:
    """A mutable default reaches the builder as the signature's own object; ``out`` never reaches
    it, whether the function declares it or not."""
    marker = object()

    def with_default(x, options=marker):
        """A public function whose default is an object."""

    def without_out(x, y=1):
        """A public function without ``out``."""

    seen = []
    contract = bound_contract(with_default, lambda *values: seen.append(values))
    contract(5)
    contract(5, out=3)
    assert seen[0][1] is marker and len(seen[0]) == 2 and seen[1] == seen[0]
    contract = bound_contract(without_out, lambda *values: seen.append(values))
    contract(7, out=1)
    assert seen[-1] == (7, 1)


def test_a_signature_with_star_arguments_falls_back_to_inspect() -> None:
    def variadic(x, *rest, **options):
        """Not a shape a declared op uses, still bound right."""

    signature = inspect.signature(variadic)
    bind = argument_binder(signature, ["x", "rest", "options"], "variadic")
    assert bind(1, 2, 3, k=4) == (1, (2, 3), {"k": 4})
