"""Ascend norm and RoPE kernels on an NPU against the reference (marker ``npu``).

Skipped everywhere without an Ascend NPU (tests/conftest.py gives the reason). On an Ascend
950 host with torch_npu they run unchanged. Tolerances are SPEC §4-6's, as each op's
``compare`` in the op table states them: outputs ≤ 1 ulp of the output dtype, ``rstd`` /
``mean`` ≤ 4 ulp fp32, ``apply_rotary`` ≤ 1 ulp. Batch invariance and determinism are
bytewise. Until these pass there, the Ascend norm and RoPE kernels are "lowered", never
"verified".
"""

from __future__ import annotations

import pytest
import torch

from tileplug import core
from tileplug.core.testing import assert_bytes_equal, assert_within_ulps, cpu_copy
from tileplug.reference.conformance import CaseDeclined, check_case

pytestmark = pytest.mark.npu

TOKENS = (0, 1, 3, 129, 4001)
ROW_OPS = ("rms_norm", "layer_norm", "rms_norm_per_token_cast", "apply_rotary", "rms_norm_rope",
           "rms_norm_rope_per_token_cast", "rms_norm_backward", "layer_norm_backward")


def _ascend_ops() -> list[str]:
    from tileplug.backend_ascend.plugin import kernel_table

    table = kernel_table()
    return [name for name in ROW_OPS if core.opdefs.get(name).kernel in table]


def _cases() -> list:
    return [(case, tokens) for name in _ascend_ops() for case in core.opdefs.get(name).cases() for tokens in TOKENS]


@pytest.mark.parametrize("case,tokens", _cases(), ids=lambda v: v.id if hasattr(v, "id") else f"T={v}")
def test_matches_reference_within_spec_tolerance(case, tokens):
    """Every op-table case of the norm / RoPE ops with an Ascend kernel, against the reference
    on the CPU in the Ascend layout, within the op's SPEC tolerance (its ``compare``)."""
    try:
        check_case(case, tokens, "ascend", "npu")
    except CaseDeclined as declined:
        pytest.skip(str(declined))


def _rows(tokens: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hidden, generator=generator) * 3).to(dtype)


@pytest.mark.parametrize("hidden", [64, 576, 4096, 7168])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_batch_invariant_and_deterministic(hidden, dtype):
    """A row's bytes do not depend on the batch it sits in or its position (1, 7, 4001 rows),
    and repeated runs give the same bytes."""
    x = _rows(4001, hidden, dtype, hidden)
    weight = _rows(1, hidden, torch.float32, 1)[0]
    with core.use_backend("ascend"):
        full = cpu_copy(core.ops.rms_norm(x.to("npu"), weight.to("npu")))
        again = cpu_copy(core.ops.rms_norm(x.to("npu"), weight.to("npu")))
        for start, count in ((0, 1), (5, 7), (3990, 1), (2000, 7)):
            part = cpu_copy(core.ops.rms_norm(x[start:start + count].to("npu"), weight.to("npu")))
            assert_bytes_equal(part, full[start:start + count], f"rows {start}:{start + count}")
    assert_bytes_equal(again, full, "second run")


def test_rms_norm_in_place_residual_form():
    """``rms_norm(x, w, residual=r, out=x, residual_out=r)`` writes both in place, as the
    out-of-place call computes them."""
    x, r = _rows(129, 2048, torch.bfloat16, 3), _rows(129, 2048, torch.bfloat16, 4)
    weight = _rows(1, 2048, torch.bfloat16, 5)[0]
    with core.use_backend("ascend"):
        y, s = core.ops.rms_norm(x.to("npu"), weight.to("npu"), residual=r.to("npu"))
        xi, ri = x.to("npu"), r.to("npu")
        core.ops.rms_norm(xi, weight.to("npu"), residual=ri, out=xi, residual_out=ri)
    assert_bytes_equal(cpu_copy(xi), cpu_copy(y), "y in place")
    assert_bytes_equal(cpu_copy(ri), cpu_copy(s), "residual_out in place")


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_identity_and_conjugate(interleaved):
    """cos = 1, sin = 0 returns x bitwise; the conjugate rotation undoes the rotation within
    2 ulp; an out-of-range position gives NaN rotated channels in its row only."""
    q = _rows(3 * 8, 128, torch.bfloat16, 6).view(3, 8, 128)
    identity = torch.cat((torch.ones(16, 64), torch.zeros(16, 64)), dim=1)
    angles = torch.rand(16, 64, generator=torch.Generator().manual_seed(7)) * 6.0
    cache = torch.cat((angles.cos(), angles.sin()), dim=1)
    with core.use_backend("ascend"):
        same = q.to("npu")
        core.ops.apply_rotary(same, identity.to("npu"), interleaved=interleaved)
        assert_bytes_equal(cpu_copy(same), q, "identity rotation")
        there = q.float().to("npu")
        core.ops.apply_rotary(there, cache.to("npu"), interleaved=interleaved)
        core.ops.apply_rotary(there, cache.to("npu"), interleaved=interleaved, conjugate=True)
        assert_within_ulps(cpu_copy(there), q.float(), 2, "conjugate undoes")
        bad = q.to("npu")
        positions = torch.tensor([0, 99, 1], dtype=torch.int64, device="npu")
        core.ops.apply_rotary(bad, cache.to("npu"), positions=positions, interleaved=interleaved)
    bad = cpu_copy(bad)
    assert torch.isnan(bad[1].float()).all() and not torch.isnan(bad[0].float()).any()
    assert not torch.isnan(bad[2].float()).any()


@pytest.mark.parametrize("group", [16, 32, 64, 128])
@pytest.mark.parametrize("flags", [dict(), dict(round_sf=True), dict(use_tma_aligned_col_major_sf=True)],
                         ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rms_norm_per_token_cast_equals_the_ascend_chain(group, flags, dtype):
    """The fused kernel equals, bytewise, the Ascend chain per_token_cast(rms_norm(x)) (SPEC §4
    fusion rule), with a residual, at a non-aligned T."""
    x, r = _rows(4001, 2048, dtype, 8), _rows(4001, 2048, dtype, 9)
    weight = _rows(1, 2048, torch.bfloat16, 10)[0]
    kwargs = dict(num_per_channels=group, **flags)
    with core.use_backend("ascend"):
        q, sf, s = core.ops.rms_norm_per_token_cast(x.to("npu"), weight.to("npu"), residual=r.to("npu"), **kwargs)
        y, s_chain = core.ops.rms_norm(x.to("npu"), weight.to("npu"), residual=r.to("npu"))
        q_chain, sf_chain = core.ops.per_token_cast(y, **kwargs)
    assert_bytes_equal(cpu_copy(q), cpu_copy(q_chain), "q")
    assert_bytes_equal(cpu_copy(sf), cpu_copy(sf_chain), "sf", strides=True)
    assert_bytes_equal(cpu_copy(s), cpu_copy(s_chain), "residual_out")


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rms_norm_rope_equals_the_ascend_chain(interleaved, dtype):
    """The fused QK-norm + RoPE equals, bytewise, the Ascend chain apply_rotary(rms_norm(x))
    per head (SPEC §4 fusion rule), out-of-range positions included."""
    x = _rows(129 * 8, 128, dtype, 11).view(129, 8, 128)
    weight = _rows(1, 128, torch.bfloat16, 12)[0]
    angles = torch.rand(64, 64, generator=torch.Generator().manual_seed(13)) * 6.0
    cache = torch.cat((angles.cos(), angles.sin()), dim=1)
    positions = torch.randint(-2, 70, (129,), generator=torch.Generator().manual_seed(14))
    with core.use_backend("ascend"):
        fused = core.ops.rms_norm_rope(x.to("npu"), weight.to("npu"), cache.to("npu"), positions=positions.to("npu"),
                                       interleaved=interleaved, weight_offset=1.0)
        chain = core.ops.rms_norm(x.to("npu"), weight.to("npu"), weight_offset=1.0)
        core.ops.apply_rotary(chain, cache.to("npu"), positions=positions.to("npu"), interleaved=interleaved)
    assert_bytes_equal(cpu_copy(fused), cpu_copy(chain), "y", nan_equal=True)


@pytest.mark.parametrize("group", [16, 32, 64, 128])
@pytest.mark.parametrize("flags", [dict(), dict(round_sf=True), dict(use_tma_aligned_col_major_sf=True)],
                         ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize("interleaved", [False, True])
def test_rms_norm_rope_per_token_cast_equals_the_ascend_chain(group, flags, interleaved):
    """The fused QK-norm + RoPE + cast equals, bytewise, the Ascend chain
    per_token_cast(rms_norm_rope(x).view(T, N·D)) (SPEC §4 fusion rule, §6), with y returned,
    out-of-range positions included (their NaN rows give NaN scales in both)."""
    x = _rows(129 * 8, 128, torch.bfloat16, 15).view(129, 8, 128)
    weight = _rows(1, 128, torch.bfloat16, 16)[0]
    angles = torch.rand(64, 64, generator=torch.Generator().manual_seed(17)) * 6.0
    cache = torch.cat((angles.cos(), angles.sin()), dim=1)
    positions = torch.randint(-2, 70, (129,), generator=torch.Generator().manual_seed(18)).to("npu")
    kwargs = dict(num_per_channels=group, **flags)
    with core.use_backend("ascend"):
        q, sf, y = core.ops.rms_norm_rope_per_token_cast(x.to("npu"), weight.to("npu"), cache.to("npu"),
                                                         positions=positions, interleaved=interleaved,
                                                         return_unquantized=True, **kwargs)
        chain = core.ops.rms_norm_rope(x.to("npu"), weight.to("npu"), cache.to("npu"), positions=positions,
                                       interleaved=interleaved)
        q_chain, sf_chain = core.ops.per_token_cast(chain.view(129, 8 * 128), **kwargs)
    assert_bytes_equal(cpu_copy(y), cpu_copy(chain), "y", nan_equal=True)
    assert_bytes_equal(cpu_copy(q), cpu_copy(q_chain), "q")
    assert_bytes_equal(cpu_copy(sf), cpu_copy(sf_chain), "sf", strides=True, nan_equal=True)


def _backward(op_name: str, x: torch.Tensor, grad_y: torch.Tensor, weight: torch.Tensor):
    """``core.ops.<op_name>`` on the NPU with the statistics of the reference forward; the
    results on the CPU."""
    with core.use_backend("reference"):
        if op_name == "rms_norm_backward":
            statistics = core.ops.rms_norm(x, weight, return_rstd=True)[1:]
        else:
            statistics = core.ops.layer_norm(x, weight, return_stats=True)[1:]
    op = getattr(core.ops, op_name)
    with core.use_backend("ascend"):
        result = op(grad_y.to("npu"), x.to("npu"), weight.to("npu"), *(s.to("npu") for s in statistics))
    return [cpu_copy(r) if r is not None else None for r in result]


@pytest.mark.parametrize("op_name", ["rms_norm_backward", "layer_norm_backward"])
@pytest.mark.parametrize("hidden", [7, 576, 7168])
def test_backward_weight_gradient_deterministic_and_rows_batch_invariant(op_name, hidden):
    """The weight (and bias) gradients are the same bytes on every run (no atomics, a split of
    the rows that is a constant); each row's grad_x does not depend on the batch it sits in
    (1, 7 rows at several positions of 4001)."""
    x = _rows(4001, hidden, torch.bfloat16, hidden)
    grad_y = _rows(4001, hidden, torch.bfloat16, hidden + 1)
    weight = _rows(1, hidden, torch.float32, hidden + 2)[0]
    full = _backward(op_name, x, grad_y, weight)
    again = _backward(op_name, x, grad_y, weight)
    for index, (first, second) in enumerate(zip(full, again)):
        if first is not None:
            assert_bytes_equal(second, first, f"output {index}, second run")
    for start, count in ((0, 1), (5, 7), (3990, 1)):
        part = _backward(op_name, x[start:start + count], grad_y[start:start + count], weight)
        assert_bytes_equal(part[0], full[0][start:start + count], f"grad_x of rows {start}:{start + count}")
