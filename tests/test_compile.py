"""torch.compile and autograd readiness of every op in the op table (CPU, reference backend).

- ``torch.compile(fullgraph=True)`` over a function calling every declared op: no graph
  break, the eager bytes, dynamic token counts without recompiling per size.
- ``torch.ops.tileplug.<name>`` propagates shapes, dtypes and strides on meta and fake tensors.
- ``torch.library.opcheck`` on a sample of every op's cases.
- Outputs carry no autograd history, eager and compiled.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tileplug import core
from tileplug.core import opdefs
from tileplug.core.testing import assert_bytes_equal, moved

ALL_OPS = opdefs.all_ops()


def _outputs(result) -> list[torch.Tensor]:
    """The returned tensors (a list from a custom op returning Tensor[]; an absent optional output, such as
    grad_weight without a weight, is None: left out)."""
    return [t for t in result if t is not None] if isinstance(result, (tuple, list)) else [result]


def _first_cases(tokens: int) -> list[tuple[opdefs.OpDef, tuple, dict]]:
    """Each op with the arguments of its first, second and last case at ``tokens``."""
    calls = []
    for opdef in ALL_OPS:
        cases = opdef.cases()
        for case in dict.fromkeys((cases[0], cases[1 % len(cases)], cases[-1])):
            args, kwargs = case.arguments(tokens, "cpu")
            calls.append((opdef, args, kwargs))
    return calls


def _every_op(calls):
    """A function calling every op of ``calls`` on its own copies of their inputs (an in-place
    op writes them), returning what each produced (for an in-place op, its written inputs)."""
    calls = [(opdef, moved(args, "cpu", fresh=True), moved(kwargs, "cpu", fresh=True)) for opdef, args, kwargs in calls]

    def run():
        results = []
        for opdef, args, kwargs in calls:
            results.extend(_outputs(opdef.produced(opdef.function(*args, **kwargs), *args, **kwargs)))
        return results

    return run


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_fullgraph_compile_of_every_op_has_no_graph_break_and_gives_the_eager_bytes():
    calls = _first_cases(37)
    eager = _every_op(calls)()
    explanation = torch._dynamo.explain(_every_op(calls))()
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(_every_op(calls), fullgraph=True)()
    assert len(compiled) == len(eager)
    for index, (have, want) in enumerate(zip(compiled, eager)):
        assert_bytes_equal(have, want, what=f"output {index}", strides=True, nan_equal=True)


def test_compiled_token_count_is_dynamic():
    opdef = opdefs.get("per_token_cast")

    def quantize(x):
        return opdef.function(x, round_sf=True, use_packed_ue8m0=True, use_tma_aligned_col_major_sf=True)

    compiled = torch.compile(quantize, fullgraph=True, dynamic=True)
    for tokens in (5, 17, 130):
        x = torch.randn(tokens, 576).to(torch.bfloat16)
        for have, want in zip(compiled(x), quantize(x)):
            assert_bytes_equal(have, want, strides=True)


@pytest.mark.parametrize("opdef", ALL_OPS, ids=lambda d: d.name)
def test_shapes_propagate_on_meta_and_fake_tensors(opdef):
    for case in opdef.cases()[::7]:
        real_args, real_kwargs = case.arguments(9, "cpu")
        expected = _outputs(opdef.function(*real_args, **real_kwargs))
        meta_args, meta_kwargs = case.arguments(9, "meta")
        flat = opdef._flatten(*meta_args, **meta_kwargs)
        on_meta = _outputs(opdef.library_op()(*flat))
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_flat = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                         for t in opdef._flatten(*real_args, **real_kwargs)]
            on_fake = _outputs(opdef.library_op()(*fake_flat))
        if opdef.mutates:  # in place: the contract ran on meta and fake inputs, nothing is returned
            assert on_meta == on_fake == expected == [None], case.id
            continue
        for traced in (on_meta, on_fake):
            assert [(t.shape, t.dtype, t.stride()) for t in traced] == \
                [(t.shape, t.dtype, t.stride()) for t in expected], case.id


def _involves_fp8(tensors) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn for t in tensors)


@pytest.mark.parametrize("opdef", ALL_OPS, ids=lambda d: d.name)
def test_opcheck(opdef):
    """``torch.library.opcheck`` on every third case of the op. ``test_schema`` runs where no
    float8 tensor is involved: its SchemaCheckMode compares every aten op's arguments with
    ``torch.allclose``, which has no float8 CPU kernel in torch 2.13 (the other three
    checks run on every case). ``test_aot_dispatch_dynamic`` compares outputs with
    ``assert_close`` without ``equal_nan``: a case whose outputs hold a NaN (a router's scores
    of a non-finite row) runs the other checks only."""
    checked_schema = 0
    for case in opdef.cases()[::3]:
        args, kwargs = case.arguments(5, "cpu")
        flat = tuple(opdef._flatten(*args, **kwargs))
        produced = _outputs(opdef.produced(opdef.function(*args, **kwargs), *args, **kwargs))
        utils = ["test_autograd_registration", "test_faketensor"]
        if not any(t.dtype.is_floating_point and t.dtype.itemsize > 1 and torch.isnan(t).any() for t in produced):
            utils.append("test_aot_dispatch_dynamic")
        if not _involves_fp8(list(flat) + produced):
            utils.append("test_schema")
            checked_schema += 1
        torch.library.opcheck(opdef.library_op(), flat, test_utils=utils)
    every_case_involves_fp8 = True
    for case in opdef.cases():
        args, kwargs = case.arguments(5, "cpu")
        flat = tuple(opdef._flatten(*args, **kwargs))
        written = _outputs(opdef.produced(opdef.function(*args, **kwargs), *args, **kwargs))
        if not _involves_fp8(list(flat) + written):
            every_case_involves_fp8 = False
            if checked_schema == 0:
                torch.library.opcheck(opdef.library_op(), flat, test_utils=("test_schema",))
                checked_schema += 1
    # An op whose every call reads or writes float8 (its output format is e4m3 by definition)
    # cannot be schema-checked on this torch; every other op must have been.
    assert checked_schema > 0 or every_case_involves_fp8, f"{opdef.name}: no float8-free case to run test_schema on"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_outputs_carry_no_autograd_history(compiled):
    x = torch.randn(6, 256, requires_grad=True)

    def quantize(x):
        q, sf = core.ops.per_token_cast(x)
        return q, sf, core.ops.per_block_cast_with_sf_only(x), core.ops.cast_back((q, sf), "fp32",
                                                                                   x_block_size=(1, 128))

    run = torch.compile(quantize, fullgraph=True) if compiled else quantize
    for output in run(x):
        assert not output.requires_grad and output.grad_fn is None
    assert x.grad is None


def test_out_is_refused_under_compile():
    x = torch.randn(4, 128).to(torch.bfloat16)
    out = core.ops.per_token_cast(x)

    def quantize(x):
        return core.ops.per_token_cast(x, out=out)

    with pytest.raises(Exception, match="out"):
        torch.compile(quantize, fullgraph=True)(x)


def test_schemas_are_derived_from_the_signatures():
    schema = opdefs.get("per_token_cast").schema
    assert schema.startswith("(Tensor x, Tensor? x_scales, str fmt, int num_per_channels, int[]? x_block_size")
    assert schema.endswith("-> (Tensor, Tensor)")
    assert opdefs.get("cast_back").schema == "(Tensor x, Tensor x_scales, str fmt, int[]? x_block_size) -> Tensor"
    for opdef in ALL_OPS:
        assert getattr(torch.ops.tileplug, opdef.name).default is not None
