"""The conformance suite runs end to end on the reference through the public dispatch path,
in both device families' sf layouts (the suite itself is what backends are held to)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tileplug import core
from tileplug.core import opdefs
from tileplug.reference import conformance

SUITE = conformance.cases(tokens=(0, 1, 3, 129))


@pytest.mark.parametrize("family", ["cuda", "ascend"])
@pytest.mark.parametrize("pair", SUITE[::7], ids=lambda p: f"{p[0].id}-T={p[1]}")
def test_reference_conforms(pair: tuple[core.Case, int], family: str) -> None:
    case, tokens = pair
    with core.config.host_layout(family):
        conformance.check_case(case, tokens, "reference", "cpu")


def test_suite_is_every_case_of_every_op_at_every_token_count() -> None:
    expected = [(case, t) for opdef in opdefs.all_ops() for case in opdef.cases() for t in (0, 1, 3, 129)]
    assert SUITE == expected
    assert {case.op for case, _ in SUITE} == set(opdefs.names())
    assert conformance.cases(tokens=(5,)) == [(case, 5) for opdef in opdefs.all_ops() for case in opdef.cases()]


def test_conformance_names_no_op() -> None:
    """Generic over the op table: no op name appears in the suite's source."""
    source = Path(conformance.__file__).read_text()
    strings = {node.value for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Constant)
               and isinstance(node.value, str)}
    for name in opdefs.names() + sorted(opdefs.kernel_names()):
        assert name not in source, name
        assert name not in strings, name


def test_parse_tokens() -> None:
    assert conformance.parse_tokens("1,3") == (1, 3)
    assert conformance.parse_tokens("0, 129") == (0, 129)
    for bad in ("", "x", "1,-2"):
        with pytest.raises(ValueError, match="--tileplug-tokens"):
            conformance.parse_tokens(bad)


class _Wrapped:
    """A kernel around the reference's: ``flip`` xors an exponent bit of the first element of
    its first output after it (of the first tensor it writes in place, for an in-place op: a
    change no ulp tolerance absorbs), ``decline`` is what supports() answers."""

    def __init__(self, inner, flip: bool = False, decline: str | None = None) -> None:
        self.inner, self.flip, self.decline = inner, flip, decline

    def supports(self, call):
        return self.decline

    def __call__(self, call, inputs, outputs):
        self.inner(call, inputs, outputs)
        if self.flip:
            written = [getattr(inputs, name) for name in opdefs.get(call.name).mutates] or list(outputs)
            first = next(t for t in written if t is not None)
            # an exponent bit of the first element (its most significant byte): beyond any
            # tolerance an op's compare allows (the ulp-compared families too)
            first.as_strided((1,), (1,)).view(torch.uint8)[-1] ^= 0x40


def _register(name: str, **options) -> None:
    reference = core.registry.get("reference")
    kernels = {key: _Wrapped(kernel, **options) for key, kernel in reference.kernels.items()}
    core.registry.register(core.Backend(name=name, device_types=("cpu",), priority=-2000, traits=core.CUDA_LAYOUT,
                                        kernels=kernels))


def test_check_case_catches_a_wrong_backend() -> None:
    """A backend whose bytes differ from the reference's beyond the op's tolerance fails, for
    every kernel-table key."""
    _register("off-by-one", flip=True)
    try:
        for key in sorted(opdefs.kernel_names()):
            grid = [c for opdef in opdefs.ops_of_kernel(key) for c in opdef.cases()]
            case = next((c for c in grid if c.hidden == 576), grid[0])  # (a gate's hidden is its expert count)
            with pytest.raises(AssertionError, match="differ|ulp apart|beyond one|outside the chain.s bound"):
                conformance.check_case(case, 3, "off-by-one", "cpu")
            conformance.check_case(case, 0, "off-by-one", "cpu")  # T = 0: no kernel launch, nothing to flip
    finally:
        core.registry.unregister("off-by-one")


def test_check_case_raises_case_declined() -> None:
    _register("declines-all", decline="not today")
    try:
        case = opdefs.all_ops()[0].cases()[0]
        with pytest.raises(conformance.CaseDeclined, match="not today"):
            conformance.check_case(case, 1, "declines-all", "cpu")
    finally:
        core.registry.unregister("declines-all")


def test_check_case_names_a_missing_backend() -> None:
    case = opdefs.all_ops()[0].cases()[0]
    with pytest.raises(AssertionError, match="'no-such-backend' is not installed"):
        conformance.check_case(case, 1, "no-such-backend", "cpu")
