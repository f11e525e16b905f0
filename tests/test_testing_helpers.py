"""Every asserting helper raises AssertionError on a mismatch, also under ``python -O``
(which strips plain ``assert`` statements): ``tileplug.core.testing`` and the conformance
suite raise explicitly."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tileplug import core
from tileplug.core import testing
from tileplug.reference import conformance

CHECKS = textwrap.dedent('''
    import torch
    from tileplug import core
    from tileplug.core import opdefs, testing
    from tileplug.reference import conformance

    def raises(function, *args, **kwargs):
        try:
            function(*args, **kwargs)
        except AssertionError as error:
            return str(error)
        raise SystemExit(f"{getattr(function, '__name__', function)} did not raise AssertionError")

    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = a.clone()
    b[1, 2] = -1.0
    raises(testing.assert_bytes_equal, a, b)                                   # a byte
    raises(testing.assert_bytes_equal, a, a.to(torch.bfloat16))                # dtype
    raises(testing.assert_bytes_equal, a, a.reshape(4, 3))                     # shape
    raises(testing.assert_bytes_equal, a, a.t().contiguous().t(), strides=True)  # strides
    raises(testing.assert_bytes_equal, torch.tensor([float("nan")]), torch.tensor([1.0]), nan_equal=True)
    testing.assert_bytes_equal(a, a.clone(), strides=True)

    sf = torch.ones(3, 5)
    other = sf.clone()
    other[2, 4] = 2.0
    raises(testing.assert_sf_equal, sf, other, (1, 128), 3, 576)              # a group
    raises(testing.assert_sf_equal, sf, sf.t().contiguous().t(), (1, 128), 3, 576)  # strides
    raises(testing.assert_sf_equal, sf, sf.to(torch.float8_e4m3fn), (1, 128), 3, 576)  # dtype
    testing.assert_sf_equal(sf, sf.clone(), (1, 128), 3, 576)
    raises(testing.require, False, "no")

    class FlipsAByte:
        def __init__(self, inner):
            self.inner = inner

        def supports(self, call):
            return None

        def __call__(self, call, inputs, outputs):
            self.inner(call, inputs, outputs)
            outputs.q.view(-1).view(torch.uint8)[0] ^= 1

    reference = core.registry.get("reference")
    core.registry.register(core.Backend(
        name="flips-a-byte", device_types=("cpu",), priority=-2000, traits=core.CUDA_LAYOUT,
        kernels={k: FlipsAByte(v) for k, v in reference.kernels.items()}))
    case = next(c for c in opdefs.get("per_token_cast").cases() if c.hidden == 576)
    try:
        message = raises(conformance.check_case, case, 3, "flips-a-byte", "cpu")
    finally:
        core.registry.unregister("flips-a-byte")  # the in-process run must leave no backend behind
    assert_message = "differing byte" in message
    if not assert_message:
        raise SystemExit(f"unexpected message: {message}")
    raises(conformance.check_case, case, 3, "not-installed", "cpu")
    print("ALL RAISED")
''')


def test_helpers_raise_assertion_error() -> None:
    namespace: dict = {}
    exec(compile(CHECKS, "<checks>", "exec"), namespace)


def test_helpers_raise_under_python_O() -> None:
    result = subprocess.run([sys.executable, "-O", "-c", CHECKS], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ALL RAISED" in result.stdout


def test_python_O_strips_plain_assert() -> None:
    """The premise: under -O a plain assert is gone (so the helpers must not use one)."""
    result = subprocess.run([sys.executable, "-O", "-c", "assert False, 'kept'"], capture_output=True, text=True)
    assert result.returncode == 0


@pytest.mark.parametrize("module", [testing, conformance], ids=lambda m: m.__name__)
def test_no_plain_assert_statements(module) -> None:
    tree = ast.parse(Path(module.__file__).read_text())
    found = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
    assert found == [], f"{module.__name__}: plain assert at lines {found}"


def test_check_case_with_a_wrong_sf_fails() -> None:
    """A backend that writes the right q but a wrong scale byte fails on sf (compare_quant)."""

    class WrongScale:
        def __init__(self, inner):
            self.inner = inner

        def supports(self, call):
            return None

        def __call__(self, call, inputs, outputs):
            self.inner(call, inputs, outputs)
            outputs.sf[0, 0] = outputs.sf[0, 0] * 2

    reference = core.registry.get("reference")
    core.registry.register(core.Backend(name="wrong-scale", device_types=("cpu",), priority=-2000,
                                        traits=core.CUDA_LAYOUT,
                                        kernels={k: WrongScale(v) for k, v in reference.kernels.items()}))
    try:
        case = core.Case.of("per_token_cast", 576, num_per_channels=128)
        with pytest.raises(AssertionError, match="sf"):
            conformance.check_case(case, 3, "wrong-scale", "cpu")
    finally:
        core.registry.unregister("wrong-scale")


def test_moved_keeps_strides_and_moves_keyword_tensors() -> None:
    """``moved`` (how conformance and the GPU tests put inputs on a device) keeps a padded
    row stride and a column-major sf as they are, and moves tensors inside tuples and dicts."""
    padded = torch.randn(3, 600)[:, :576]
    column_major = torch.randn(5, 3).t()
    args, kwargs = testing.moved(((padded, column_major),), "meta"), testing.moved({"sf": column_major, "n": 1}, "meta")
    (moved_x, moved_sf), = args
    assert moved_x.device.type == "meta" and moved_x.stride() == padded.stride()
    assert moved_sf.stride() == column_major.stride() and kwargs["sf"].device.type == "meta" and kwargs["n"] == 1
    assert testing.moved(padded, "cpu") is padded and testing.cpu_copy(padded) is padded
