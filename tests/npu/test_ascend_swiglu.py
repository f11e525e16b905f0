"""Ascend SwiGLU kernels (``swiglu``, ``swiglu_per_token_cast``, ``swiglu_backward``) on an NPU
against the reference (marker ``npu``).

Skipped everywhere without an Ascend NPU (tests/conftest.py gives the reason). On an Ascend
950 host with torch_npu they run unchanged. Tolerances are SPEC §4 / §8's, as the op table's
``compare`` states them: ``y`` and ``grad_x`` ≤ 2 ulp of their dtype, ``grad_topk_weights``
within a relative 1e-5; the fused cast bytewise against the same backend's unfused twin
``per_token_cast(swiglu(x, out_dtype=fp32))``. Padding rows of an expert layout hold NaN and
must come out as zeros (``q`` and its scale bytes too). Until these pass there, the Ascend
SwiGLU kernels are "lowered", never "verified".

Expected risk (docs/ascend-backend.md): where x is fp32, the kernels' sigmoid runs on the vector
exp and is not correctly rounded; emulated on the CPU, fp32 ``y`` / ``grad_x`` then exceed 2 ulp
in a fraction of a percent of the elements, so the fp32-x cases may fail here where the bf16 ones
pass. (A bf16 x with an fp32 ``y`` and the fused cast read the reference's sigmoid from a table in
UB, gathered by the gate's bits.)
"""

from __future__ import annotations

import pytest
import torch

from tileplug import core
from tileplug.core.swiglu.layout import expert_ends_for, valid_rows_of
from tileplug.core.testing import assert_bytes_equal, assert_within_ulps, cpu_copy
from tileplug.reference.conformance import CaseDeclined, check_case

pytestmark = pytest.mark.npu

TOKENS = (0, 1, 3, 129, 4001)
SWIGLU_OPS = ("swiglu", "swiglu_per_token_cast", "swiglu_backward")


def _cases() -> list:
    return [(case, tokens) for name in SWIGLU_OPS for case in core.opdefs.get(name).cases() for tokens in TOKENS]


@pytest.mark.parametrize("case,tokens", _cases(), ids=lambda v: v.id if hasattr(v, "id") else f"T={v}")
def test_matches_reference_within_spec_tolerance(case, tokens):
    """Every op-table case against the reference on the CPU in the Ascend layout, within the
    op's SPEC tolerance (its ``compare``)."""
    try:
        check_case(case, tokens, "ascend", "npu")
    except CaseDeclined as declined:
        pytest.skip(str(declined))


def _rows(tokens: int, width: int, dtype: torch.dtype, seed: int, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, width, generator=generator) * scale).to(dtype)


def _moe_inputs(tokens: int, hidden: int, dtype: torch.dtype, experts: int, alignment: int, seed: int):
    """``x`` ``[T, 2H]`` whose padding rows hold NaN, ``grad_y`` likewise, the weights, the ends, the valid rows."""
    x, grad = _rows(tokens, 2 * hidden, dtype, seed), _rows(tokens, hidden, dtype, seed + 1, 0.1)
    ends = expert_ends_for(tokens, experts, alignment, seed + 2)
    valid = valid_rows_of(tokens, ends, alignment)
    x[~valid], grad[~valid] = float("nan"), float("nan")
    weights = torch.rand(tokens, generator=torch.Generator().manual_seed(seed + 3))
    return x, grad, weights, ends, valid


def _on_npu(*tensors):
    return [None if t is None else t.to("npu") for t in tensors]


@pytest.mark.parametrize("hidden,dtype", [(1408, torch.bfloat16), (7168, torch.bfloat16), (14336, torch.float32)],
                         ids=["h1408-bf16", "h7168-bf16", "h14336-fp32-tiled"])
def test_moe_widths_forward_and_backward_against_the_reference(hidden, dtype):
    """The MoE widths (H = 14336 fp32 runs in column tiles) with weights, a scaling factor, a
    clamp and an expert layout whose padding rows hold NaN: ``y`` / ``grad_x`` within 2 ulp,
    ``grad_topk_weights`` within a relative 1e-5, padding rows zero."""
    from tileplug.core.testing import relative_error

    x, grad, weights, ends, valid = _moe_inputs(1031, hidden, dtype, 16, 128, hidden)
    kwargs = dict(routed_scaling_factor=2.5, clamp_value=7.0, expert_alignment=128)
    with core.use_backend("reference"):
        y_ref = core.ops.swiglu(x, topk_weights=weights, expert_ends=ends, **kwargs)
        gx_ref, gw_ref = core.ops.swiglu_backward(x, grad, topk_weights=weights, expert_ends=ends, **kwargs)
    nx, ngrad, nweights, nends = _on_npu(x, grad, weights, ends)
    with core.use_backend("ascend"):
        y = cpu_copy(core.ops.swiglu(nx, topk_weights=nweights, expert_ends=nends, **kwargs))
        gx, gw = core.ops.swiglu_backward(nx, ngrad, topk_weights=nweights, expert_ends=nends, **kwargs)
    gx, gw = cpu_copy(gx), cpu_copy(gw)
    assert_within_ulps(y, y_ref, 2, "y")
    assert_within_ulps(gx, gx_ref, 2, "grad_x")
    assert relative_error(gw, gw_ref) <= 1e-5
    assert not y[~valid].float().abs().sum() and not gx[~valid].float().abs().sum() and not gw[~valid].abs().sum()


@pytest.mark.parametrize("fmt,group", [("e4m3", 16), ("e4m3", 32), ("e4m3", 64), ("e4m3", 128), ("e2m1", 16),
                                       ("e2m1", 32), ("e2m1", 64), ("e2m1", 128)])
@pytest.mark.parametrize("flags", [dict(), dict(round_sf=True), dict(round_sf=True, use_packed_ue8m0=True),
                                   dict(use_tma_aligned_col_major_sf=True),
                                   dict(round_sf=True, use_packed_ue8m0=True, use_tma_aligned_col_major_sf=True)],
                         ids=["plain", "round", "ue8m0", "col", "ue8m0-col"])
@pytest.mark.parametrize("hidden,dtype", [(1408, torch.bfloat16), (14336, torch.float32)], ids=["h1408-bf16",
                                                                                                "h14336-fp32-tiled"])
def test_cast_equals_the_ascend_chain_and_zeroes_padding(fmt, group, flags, hidden, dtype):
    """The fused cast equals, bytewise on the valid rows, the Ascend chain
    ``per_token_cast(swiglu(x, out_dtype=fp32))`` (SPEC §4 fusion rule); the padding rows' ``q``
    and scale bytes are zero (the chain gives them the clamp floor)."""
    x, _, weights, ends, valid = _moe_inputs(1031, hidden, dtype, 16, 128, hidden + group)
    options = dict(fmt=fmt, num_per_channels=group, **flags)
    moe = dict(routed_scaling_factor=2.5, clamp_value=7.0, expert_alignment=128)
    nx, nweights, nends = _on_npu(x, weights, ends)
    with core.use_backend("ascend"):
        q, sf = core.ops.swiglu_per_token_cast(nx, topk_weights=nweights, expert_ends=nends, **moe, **options)
        y = core.ops.swiglu(nx, out_dtype=torch.float32, topk_weights=nweights, expert_ends=nends, **moe)
        q_chain, sf_chain = core.ops.per_token_cast(y, **options)
    for name, have, want in (("q", q, q_chain), ("sf", sf, sf_chain)):  # sf compared row by row, any layout
        have, want = _bytes(cpu_copy(have)), _bytes(cpu_copy(want))
        assert_bytes_equal(have[valid], want[valid], f"{name} (valid rows)")
        assert not have[~valid].any(), f"{name} of padding rows is not zero"


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of each row of a 2-D tensor (``[N, columns · itemsize]`` uint8), whatever its strides."""
    return tensor.contiguous().view(torch.uint8)


@pytest.mark.parametrize("op", SWIGLU_OPS)
@pytest.mark.parametrize("hidden,dtype", [(576, torch.bfloat16), (14336, torch.float32)], ids=["h576-bf16",
                                                                                               "h14336-fp32-tiled"])
def test_batch_invariant_and_deterministic(op, hidden, dtype):
    """A row's bytes do not depend on the batch it sits in or its position (1, 7, 4001 rows),
    and repeated runs give the same bytes (``grad_topk_weights``' row sum included)."""
    x, grad = _rows(4001, 2 * hidden, dtype, 11), _rows(4001, hidden, dtype, 12, 0.1)
    weights = torch.rand(4001, generator=torch.Generator().manual_seed(13))

    def run(rows: slice):
        nx, ngrad, nweights = _on_npu(x[rows], grad[rows], weights[rows])
        with core.use_backend("ascend"):
            if op == "swiglu":
                out = (core.ops.swiglu(nx, topk_weights=nweights),)
            elif op == "swiglu_per_token_cast":
                out = core.ops.swiglu_per_token_cast(nx, topk_weights=nweights, num_per_channels=64)
            else:
                out = core.ops.swiglu_backward(nx, ngrad, topk_weights=nweights)
        return [cpu_copy(t) for t in out]

    full, again = run(slice(None)), run(slice(None))
    for have, want in zip(again, full):
        assert_bytes_equal(have, want, "second run")
    for start, count in ((0, 1), (5, 7), (3990, 1), (2000, 7)):
        for index, (have, want) in enumerate(zip(run(slice(start, start + count)), full)):
            assert_bytes_equal(have, want[start:start + count], f"output {index}, rows {start}:{start + count}")
