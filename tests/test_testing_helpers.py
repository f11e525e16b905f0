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

    one = torch.tensor([1.0, -2.0, 0.0], dtype=torch.bfloat16)
    two_ulp = (one.view(torch.int16) + torch.tensor([0, 2, 0], dtype=torch.int16)).view(torch.bfloat16)
    raises(testing.assert_within_ulps, two_ulp, one, 1)                       # 2 ulp
    raises(testing.assert_within_ulps, one, one.float(), 1)                   # dtype
    raises(testing.assert_within_ulps, torch.tensor([float("nan")]), torch.tensor([1.0]), 4)  # NaN vs number
    testing.assert_within_ulps(two_ulp, one, 2)
    q = torch.tensor([[1.0, 2.0]]).to(torch.float8_e4m3fn)
    raises(testing.assert_quantized_close, (q.float() * 4).to(torch.float8_e4m3fn), torch.ones(1, 1), q,
           torch.ones(1, 1), "e4m3", 128, torch.bfloat16)                     # values 4x apart

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


def test_ulp_distance_counts_representable_values() -> None:
    bf16 = torch.bfloat16
    largest = torch.finfo(torch.float32).max
    values = torch.tensor([1.0, 1.0, -0.0, 0.0, largest, -1.0], dtype=torch.float32)
    others = torch.tensor([1.0, 1.0 + 2.0 ** -23, 0.0, -1.4e-45, float("inf"), 1.0], dtype=torch.float32)
    # equal; neighbours; ±0 equal; 0 and the smallest negative subnormal; the largest finite and
    # inf; -1 and 1 are 2 · 0x3F800000 apart (bits of 1.0)
    assert testing.ulp_distance(values, others).tolist() == [0, 1, 0, 1, 1, 2 * 0x3F800000]
    steps = torch.tensor([1.0, 1.0078125, 1.015625], dtype=bf16)  # neighbouring bf16 values
    assert testing.ulp_distance(steps[1:], steps[:-1]).tolist() == [1, 1]
    e4m3 = torch.tensor([448.0, 416.0, -0.0, 0.001953125], dtype=torch.float32).to(torch.float8_e4m3fn)
    assert testing.ulp_distance(e4m3[[0, 2]], e4m3[[1, 3]]).tolist() == [1, 1]  # 448/416; -0 and 2^-9
    assert testing.ulp_distance(e4m3[:1], e4m3[2:3]).tolist() == [0x7E]  # 448 is code 0x7E


def test_assert_within_ulps_semantics() -> None:
    base = torch.tensor([1.0, -1.0, 0.0, float("nan")])
    up = torch.tensor([1.0 + 2.0 ** -23, -1.0 - 2.0 ** -23, -0.0, float("nan")])
    testing.assert_within_ulps(up, base, 1)
    with pytest.raises(AssertionError, match="2 element"):
        testing.assert_within_ulps(up[:3], base[:3], 0)  # ±0 are 0 apart, the others 1
    with pytest.raises(AssertionError, match="NaN encodings"):
        testing.assert_within_ulps(-base, base.abs() * torch.tensor([1.0, 1.0, 1.0, 1.0]), 10 ** 9, nan_equal=False)
    testing.assert_within_ulps(torch.tensor([5], dtype=torch.int32), torch.tensor([5], dtype=torch.int32), 0)
    with pytest.raises(AssertionError):
        testing.assert_within_ulps(torch.tensor([5]), torch.tensor([6]), 3)  # integers: exact


def test_assert_quantized_close_accepts_an_ulp_of_the_source_and_refuses_more() -> None:
    x = testing.activation(4, 256, torch.bfloat16, seed=1)
    q, sf = core.ops.per_token_cast(x)
    nudged = x.clone()
    nudged[:, 0] = (nudged[:, 0].view(torch.int16) + 1).view(torch.bfloat16)  # one bf16 ulp
    nudged_q, nudged_sf = core.ops.per_token_cast(nudged)
    testing.assert_quantized_close(nudged_q, nudged_sf, q, sf, "e4m3", 128, torch.bfloat16)
    for mode in ({"round_sf": True}, {"round_sf": True, "use_packed_ue8m0": True}, {"use_e4m3_sf": True}):
        testing.assert_quantized_close(*core.ops.per_token_cast(nudged, **mode), *core.ops.per_token_cast(x, **mode),
                                       "e4m3", 128, torch.bfloat16)
    far_q, far_sf = core.ops.per_token_cast(x * 1.5)
    with pytest.raises(AssertionError, match="factor"):
        testing.assert_quantized_close(far_q, far_sf, q, sf, "e4m3", 128, torch.bfloat16)


def test_value_spacing_is_the_distance_to_the_next_value() -> None:
    views = {2: torch.int16, 4: torch.int32}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        values = torch.tensor([1.0, 1.5, -3.0, 1e-3, 0.0, 1e-7], dtype=dtype)
        following = (values.abs().view(views[values.element_size()]) + 1).view(dtype)
        expected = following.double() - values.abs().double()
        assert torch.equal(testing.value_spacing(values, dtype), expected), dtype


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotated_chain_bound_allows_carried_ulps_and_refuses_more(interleaved: bool) -> None:
    """[1 token, 1 head, D = 6], R = 4: pairs (0, 2), (1, 3) for NeoX, (0, 1), (2, 3) for GPT-J.
    One pair cancels: its small value may be off by two spacings of the pair's magnitude; an
    element of a balanced pair off by four of its own spacings is refused, as is a channel past
    R off by two ulp."""
    dtype = torch.float16
    one = 1.0
    small = 2.0 ** -9
    values = [small, one, one, one, 0.5, 0.25]  # element 0's partner is 1 (GPT-J) or 2 (NeoX): both 1
    expected = torch.tensor(values, dtype=dtype).view(1, 1, 6)
    spacing_one = 2.0 ** -10
    carried = expected.clone()
    carried[0, 0, 0] += 2 * spacing_one  # 2 spacings of hypot(small, 1) ≈ 1: many ulp of `small`
    assert testing.ulp_distance(carried, expected).max() > 2
    testing.assert_rotated_within_chain_bound(carried, expected, 4, interleaved)
    beyond = expected.clone()
    beyond[0, 0, 0] += 4 * spacing_one
    with pytest.raises(AssertionError, match="outside the chain's bound"):
        testing.assert_rotated_within_chain_bound(beyond, expected, 4, interleaved)
    balanced = expected.clone()
    balanced[0, 0, 3] += 3 * spacing_one  # its partner is 1: bound spacing(1) + 2·spacing(√2) = 3 spacings of 1
    testing.assert_rotated_within_chain_bound(balanced, expected, 4, interleaved)
    balanced[0, 0, 3] += spacing_one
    with pytest.raises(AssertionError, match="outside the chain's bound"):
        testing.assert_rotated_within_chain_bound(balanced, expected, 4, interleaved)
    tail = expected.clone()
    tail[0, 0, 5] = torch.tensor(0.25 + 2 * 2.0 ** -12, dtype=dtype)
    with pytest.raises(AssertionError, match="channels past R"):
        testing.assert_rotated_within_chain_bound(tail, expected, 4, interleaved)
    nan = expected.clone()
    nan[0, 0, 1] = float("nan")
    with pytest.raises(AssertionError, match="NaN mismatch"):
        testing.assert_rotated_within_chain_bound(nan, expected, 4, interleaved)
