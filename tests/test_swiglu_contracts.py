"""Contracts of the SwiGLU ops (SPEC §0, §8): every bad argument is a ContractError naming it;
the call, the allocation on meta, the ledgers (fused vs unfused) and the custom ops' schemas."""

from __future__ import annotations

import pytest
import torch

from tileplug import core
from tileplug.core import CUDA_LAYOUT, ContractError, ops, opdefs
from tileplug.core.opdefs import describe_call

BF16, FP32 = torch.bfloat16, torch.float32
X = torch.zeros(6, 16, dtype=BF16)  # N = 6, H = 8
X32 = torch.zeros(6, 16)
W = torch.ones(6)
ENDS = torch.tensor([2, 5], dtype=torch.int32)
GRAD = torch.zeros(6, 8, dtype=BF16)

BAD_INPUTS = [
    # (id, call, argument, words in the message)
    ("x not a tensor", lambda: ops.swiglu([[1.0, 2.0]]), "x", "torch.Tensor"),
    ("x 1-D", lambda: ops.swiglu(torch.zeros(16)), "x", "2-D"),
    ("x 3-D", lambda: ops.swiglu(torch.zeros(2, 3, 16)), "x", "2-D"),
    ("x int", lambda: ops.swiglu(torch.zeros(6, 16, dtype=torch.int32)), "x", "dtype"),
    ("x fp16", lambda: ops.swiglu(torch.zeros(6, 16, dtype=torch.float16)), "x", "dtype"),
    ("x odd width", lambda: ops.swiglu(torch.zeros(6, 15)), "x", "even last dim"),
    ("x last stride", lambda: ops.swiglu(torch.zeros(16, 6).t()), "x", "unit stride"),
    ("out_dtype int", lambda: ops.swiglu(X, out_dtype=torch.int8), "out_dtype", "torch.bfloat16"),
    ("out_dtype string", lambda: ops.swiglu(X, out_dtype="fp32"), "out_dtype", "torch.float32"),
    ("out_dtype fp32 of fp64 x", lambda: ops.swiglu(X.double(), out_dtype=FP32), "out_dtype", "fp64"),
    ("weights 2-D", lambda: ops.swiglu(X, topk_weights=torch.ones(6, 1)), "topk_weights", "[6]"),
    ("weights length", lambda: ops.swiglu(X, topk_weights=torch.ones(5)), "topk_weights", "[6]"),
    ("weights bf16", lambda: ops.swiglu(X, topk_weights=torch.ones(6, dtype=BF16)), "topk_weights", "float32"),
    ("weights strided", lambda: ops.swiglu(X, topk_weights=torch.ones(12)[::2]), "topk_weights", "unit stride"),
    ("weights device", lambda: ops.swiglu(X, topk_weights=torch.ones(6, device="meta")), "topk_weights", "cpu"),
    ("scaling zero", lambda: ops.swiglu(X, routed_scaling_factor=0.0), "routed_scaling_factor", "> 0"),
    ("scaling inf", lambda: ops.swiglu(X, routed_scaling_factor=float("inf")), "routed_scaling_factor", "finite"),
    ("scaling bool", lambda: ops.swiglu(X, routed_scaling_factor=True), "routed_scaling_factor", "float"),
    ("clamp zero", lambda: ops.swiglu(X, clamp_value=0.0), "clamp_value", "> 0"),
    ("clamp negative", lambda: ops.swiglu(X, clamp_value=-1.0), "clamp_value", "> 0"),
    ("clamp nan", lambda: ops.swiglu(X, clamp_value=float("nan")), "clamp_value", "finite"),
    ("clamp string", lambda: ops.swiglu(X, clamp_value="7"), "clamp_value", "float"),
    ("ends int64", lambda: ops.swiglu(X, expert_ends=ENDS.long()), "expert_ends", "int32"),
    ("ends 2-D", lambda: ops.swiglu(X, expert_ends=ENDS.view(1, 2)), "expert_ends", "1-D"),
    ("ends empty", lambda: ops.swiglu(X, expert_ends=torch.zeros(0, dtype=torch.int32)), "expert_ends", "E >= 1"),
    ("ends strided", lambda: ops.swiglu(X, expert_ends=torch.zeros(8, dtype=torch.int32)[::2]), "expert_ends",
     "unit stride"),
    ("ends device", lambda: ops.swiglu(X, expert_ends=ENDS.to("meta")), "expert_ends", "cpu"),
    ("alignment zero", lambda: ops.swiglu(X, expert_ends=ENDS, expert_alignment=0), "expert_alignment", ">= 1"),
    ("alignment float", lambda: ops.swiglu(X, expert_alignment=16.0), "expert_alignment", "an int"),
    ("cast x fp64", lambda: ops.swiglu_per_token_cast(X.double()), "x", "dtype"),
    ("cast fmt", lambda: ops.swiglu_per_token_cast(X, fmt="e5m2"), "fmt", "e4m3"),
    ("cast group", lambda: ops.swiglu_per_token_cast(X, num_per_channels=8), "num_per_channels", "16"),
    ("cast group bool", lambda: ops.swiglu_per_token_cast(X, num_per_channels=True), "num_per_channels", "128"),
    ("cast e2m1 odd H", lambda: ops.swiglu_per_token_cast(torch.zeros(6, 6, dtype=BF16), fmt="e2m1",
                                                          num_per_channels=16), "x", "even H"),
    ("cast round and e4m3 sf", lambda: ops.swiglu_per_token_cast(X, round_sf=True, use_e4m3_sf=True), "use_e4m3_sf",
     "round_sf"),
    ("cast ue8m0 without round", lambda: ops.swiglu_per_token_cast(X, use_packed_ue8m0=True), "use_packed_ue8m0",
     "round_sf"),
    ("cast col-major flag", lambda: ops.swiglu_per_token_cast(X, use_tma_aligned_col_major_sf=1),
     "use_tma_aligned_col_major_sf", "bool"),
    ("cast weights", lambda: ops.swiglu_per_token_cast(X, topk_weights=torch.ones(7)), "topk_weights", "[6]"),
    ("cast clamp", lambda: ops.swiglu_per_token_cast(X, clamp_value=0), "clamp_value", "> 0"),
    ("backward grad shape", lambda: ops.swiglu_backward(X, torch.zeros(6, 16, dtype=BF16)), "grad_y", "[6, 8]"),
    ("backward grad rows", lambda: ops.swiglu_backward(X, torch.zeros(5, 8, dtype=BF16)), "grad_y", "[6, 8]"),
    ("backward grad dtype", lambda: ops.swiglu_backward(X, torch.zeros(6, 8, dtype=torch.float16)), "grad_y",
     "dtype"),
    ("backward grad 1-D", lambda: ops.swiglu_backward(X, torch.zeros(48, dtype=BF16)), "grad_y", "2-D"),
    ("backward grad device", lambda: ops.swiglu_backward(X, GRAD.to("meta")), "grad_y", "cpu"),
    ("backward grad stride", lambda: ops.swiglu_backward(X, torch.zeros(8, 6, dtype=BF16).t()), "grad_y",
     "unit stride"),
    ("backward x", lambda: ops.swiglu_backward(torch.zeros(6, 7), GRAD), "x", "even last dim"),
    ("backward weights", lambda: ops.swiglu_backward(X, GRAD, topk_weights=W.double()), "topk_weights", "float32"),
    ("backward ends", lambda: ops.swiglu_backward(X, GRAD, expert_ends=ENDS.float()), "expert_ends", "int32"),
    ("backward clamp", lambda: ops.swiglu_backward(X, GRAD, clamp_value=float("inf")), "clamp_value", "finite"),
]


def test_there_are_at_least_25_bad_inputs() -> None:
    assert len(BAD_INPUTS) >= 25
    assert {argument for _, _, argument, _ in BAD_INPUTS} >= {
        "x", "out_dtype", "topk_weights", "routed_scaling_factor", "clamp_value", "expert_ends", "expert_alignment",
        "fmt", "num_per_channels", "use_e4m3_sf", "use_packed_ue8m0", "use_tma_aligned_col_major_sf", "grad_y"}


@pytest.mark.parametrize("call, argument, words", [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_a_contract_error_naming_the_argument(call, argument, words) -> None:
    with pytest.raises(ContractError) as caught:
        call()
    assert caught.value.argument == argument
    assert f"'{argument}'" in str(caught.value) and words in str(caught.value), str(caught.value)


def test_a_bad_call_is_refused_again_after_a_good_one_of_the_same_signature() -> None:
    ops.swiglu(X, clamp_value=7.0)  # memoized
    with pytest.raises(ContractError, match="clamp_value"):
        ops.swiglu(X, clamp_value=-7.0)
    with pytest.raises(ContractError, match="expert_alignment"):
        ops.swiglu(X, expert_ends=ENDS, expert_alignment=0)


def test_the_call_holds_what_a_kernel_specialises_on_but_not_the_rows() -> None:
    meta = torch.empty(37, 2 * 704, dtype=BF16, device="meta")
    call, inputs = describe_call("swiglu", meta, out_dtype=FP32, topk_weights=torch.empty(37, device="meta"),
                                 routed_scaling_factor=2.5, clamp_value=7.0,
                                 expert_ends=torch.empty(8, dtype=torch.int32, device="meta"), expert_alignment=16)
    assert (call.hidden, call.input_dtype, call.output_dtype, call.weighted) == (704, BF16, FP32, True)
    assert (call.routed_scaling_factor, call.clamp_value, call.num_experts, call.expert_alignment) == (2.5, 7.0, 8, 16)
    assert call.tokens == 37 and inputs.x is meta
    other, _ = describe_call("swiglu", torch.empty(5, 2 * 704, dtype=BF16, device="meta"), out_dtype=FP32,
                             topk_weights=torch.empty(5, device="meta"), routed_scaling_factor=2.5, clamp_value=7.0,
                             expert_ends=torch.empty(8, dtype=torch.int32, device="meta"), expert_alignment=16)
    assert other == call and hash(other) == hash(call)
    plain, _ = describe_call("swiglu", meta)
    assert plain != call and plain.output_dtype == BF16 and not plain.weighted and plain.clamp_value is None


def test_meta_calls_allocate_the_outputs() -> None:
    x = torch.empty(9, 2 * 72, dtype=BF16, device="meta")
    y = torch.ops.tileplug.swiglu(x, FP32, None, 1.0, None, None, 128)
    assert y.shape == (9, 72) and y.dtype == FP32 and y.device.type == "meta"
    q, sf = opdefs.allocate_without_backend("swiglu_per_token_cast", CUDA_LAYOUT, x, "e2m1", 32,
                                          use_tma_aligned_col_major_sf=True)
    assert q.shape == (9, 36) and q.dtype == torch.int8 and sf.shape == (9, 3) and sf.stride()[0] == 1
    grad_x, grad_w = opdefs.allocate_without_backend("swiglu_backward", CUDA_LAYOUT, x,
                                                   torch.empty(9, 72, dtype=BF16, device="meta"),
                                                   topk_weights=torch.empty(9, device="meta"))
    assert grad_x.shape == (9, 144) and grad_x.dtype == BF16 and grad_w.shape == (9,) and grad_w.dtype == FP32


def test_schemas_take_out_dtype_as_a_scalar_type() -> None:
    assert opdefs.get("swiglu").schema.startswith("(Tensor x, ScalarType? out_dtype, Tensor? topk_weights, "
                                                  "float routed_scaling_factor, float? clamp_value, "
                                                  "Tensor? expert_ends, int expert_alignment)")
    assert opdefs.get("swiglu_backward").schema.endswith("-> (Tensor, Tensor?)")
    assert opdefs.get("swiglu_per_token_cast").schema.endswith("-> (Tensor, Tensor)")


def _ledger(name: str, *args, **kwargs):
    call, _ = describe_call(name, *args, **kwargs)
    return call, opdefs.get(name).ledger(call, CUDA_LAYOUT)


def test_ledgers_count_the_bytes_and_the_fused_cast_saves_the_activation_round_trip() -> None:
    rows, width = 4096, 1024
    x = torch.empty(rows, 2 * width, dtype=BF16, device="meta")
    weights = torch.empty(rows, device="meta")
    ends = torch.empty(32, dtype=torch.int32, device="meta")
    _, forward = _ledger("swiglu", x, topk_weights=weights, expert_ends=ends)
    assert forward.bytes_read == rows * 2 * width * 2 + rows * 4 + 32 * 4
    assert forward.bytes_written == rows * width * 2
    call, fused = _ledger("swiglu_per_token_cast", x, topk_weights=weights, expert_ends=ends)
    assert fused.bytes_read == forward.bytes_read
    assert fused.bytes_written == rows * width + rows * (width // 128) * 4  # e4m3 q + fp32 sf
    steps = opdefs.get("swiglu_per_token_cast").unfused(call, CUDA_LAYOUT)
    assert [name for name, _ in steps] == ["swiglu", "per_token_cast"]
    _, fp32_forward = _ledger("swiglu", x, out_dtype=FP32, topk_weights=weights, expert_ends=ends)
    _, cast = _ledger("per_token_cast", torch.empty(rows, width, device="meta"))
    assert steps[0][1] == fp32_forward and steps[1][1] == cast
    unfused_total = sum(ledger.bytes_total for _, ledger in steps)
    assert unfused_total - fused.bytes_total == 2 * rows * width * 4  # the fp32 y written, then read back
    _, backward = _ledger("swiglu_backward", x, torch.empty(rows, width, dtype=BF16, device="meta"),
                          topk_weights=weights)
    assert backward.bytes_read == rows * 2 * width * 2 + rows * width * 2 + rows * 4
    assert backward.bytes_written == rows * 2 * width * 2 + rows * 4


def test_swiglu_ops_have_bench_cases_and_a_grid_of_every_option() -> None:
    for name in ("swiglu", "swiglu_per_token_cast", "swiglu_backward"):
        assert opdefs.get(name).bench(), name
        assert opdefs.get(name).family == "swiglu"
    cast_cases = opdefs.get("swiglu_per_token_cast").cases()
    pairs = {(dict(c.kwargs).get("fmt", "e4m3"), dict(c.kwargs).get("num_per_channels", 128)) for c in cast_cases}
    assert pairs >= {(fmt, group) for fmt in ("e4m3", "e2m1") for group in (16, 32, 64, 128)}
    flags = {flag for c in cast_cases for flag, value in c.kwargs if value is True}
    assert flags == {"round_sf", "use_packed_ue8m0", "use_tma_aligned_col_major_sf", "use_e4m3_sf"}
    every = [c for name in ("swiglu", "swiglu_per_token_cast", "swiglu_backward") for c in opdefs.get(name).cases()]
    assert {c.hidden for c in every} == {3, 72, 704, 3584} and {c.dtype for c in every} == {BF16, FP32}
    assert any(dict(c.kwargs).get("clamp_value") for c in every)
    assert any(dict(c.inputs).get("nan_padding") for c in every)
    assert any(dict(c.kwargs).get("routed_scaling_factor", 1.0) != 1.0 and dict(c.inputs).get("weighted")
               for c in every)


def test_cuda_and_ascend_calls_fall_to_the_reference() -> None:
    import dataclasses

    for name in ("swiglu", "swiglu_per_token_cast", "swiglu_backward"):
        case = opdefs.get(name).cases()[0]
        args, kwargs = case.arguments(4, "meta")
        call, _ = describe_call(name, *args, **kwargs)
        for device_type in ("cuda", "npu"):
            route = core.registry.route(dataclasses.replace(call, device_type=device_type))
            assert route.backend.name == "reference", (name, device_type)


def test_case_inputs_are_checked_by_name() -> None:
    case = opdefs.get("swiglu").cases()[0]
    with pytest.raises(ContractError, match="inputs.experts"):
        opdefs.get("swiglu").arguments(4, 8, BF16, {}, {"experts": 0}, torch.device("cpu"), 0)
    with pytest.raises(ContractError, match="inputs.heads"):
        opdefs.get("swiglu").arguments(4, 8, BF16, {}, {"heads": 2}, torch.device("cpu"), 0)
    assert case.arguments(4, "cpu")[0][0].shape == (4, 6)


def test_torch_compile_sees_one_node() -> None:
    x = torch.randn(5, 16)

    @torch.compile(fullgraph=True, backend="eager")
    def compiled(values):
        return ops.swiglu(values, clamp_value=3.0)

    assert torch.equal(compiled(x), ops.swiglu(x, clamp_value=3.0))
