"""Ascend backend on an NPU: bytewise against the reference (marker ``npu``).

Skipped everywhere without an Ascend NPU (tests/conftest.py gives the reason); on an Ascend 950
host with torch_npu these run unchanged: the kernel runs on ``npu``, the reference on the CPU
under ``core.config.host_layout("ascend")``, and q / sf / cast_back bytes must be equal
(pad bytes of packed UE8M0 are not compared). Until they pass there, the Ascend kernels are
"lowered", never "verified".
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tileplug import core
from tileplug.core.ops.quant_reblock import lossless_cases
from tileplug.core.testing import activation, assert_bytes_equal, assert_sf_equal

pytestmark = pytest.mark.npu

TOKENS = (0, 1, 3, 4001, 8001)
HIDDENS = (576, 2048, 7168)
PER_TOKEN_FLAGS = [
    dict(),
    dict(use_tma_aligned_col_major_sf=True),
    dict(round_sf=True),
    dict(round_sf=True, use_packed_ue8m0=True),
    dict(round_sf=True, use_packed_ue8m0=True, use_tma_aligned_col_major_sf=True),
]


def _npu(t):
    return t.to("npu")


def _reference(op, *args, **kwargs):
    with core.use_backend("reference"), core.config.host_layout("ascend"):
        return op(*args, **kwargs)


def _ascend(op, *args, **kwargs):
    with core.use_backend("ascend"):
        return op(*args, **kwargs)


def _cpu(value):
    return tuple(v.cpu() for v in value) if isinstance(value, tuple) else value.cpu()


@pytest.mark.parametrize("tokens,hidden", list(itertools.product(TOKENS, HIDDENS)))
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("group", [16, 32, 64, 128])
@pytest.mark.parametrize("flags", PER_TOKEN_FLAGS, ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_per_token_cast_matches_reference(tokens, hidden, fmt, group, flags, dtype):
    x = activation(tokens, hidden, dtype)
    kwargs = dict(fmt=fmt, num_per_channels=group, **flags)
    q, sf = _cpu(_ascend(core.ops.per_token_cast, _npu(x), **kwargs))
    q_ref, sf_ref = _reference(core.ops.per_token_cast, x, **kwargs)
    assert_bytes_equal(q, q_ref, "q")
    assert_sf_equal(sf, sf_ref, (1, group), tokens, hidden, "sf")
    sf_only = _ascend(core.ops.per_token_cast_with_sf_only, _npu(x), **kwargs).cpu()
    assert_sf_equal(sf_only, sf_ref, (1, group), tokens, hidden, "sf (sf only)")
    q_given = _ascend(core.ops.per_token_cast_with_precomputed_sf, _npu(x), fmt=fmt, num_per_channels=group,
                      sf=_npu(sf_ref) if not flags.get("use_tma_aligned_col_major_sf") else _npu(sf_ref.t().contiguous()).t()).cpu()
    assert_bytes_equal(q_given, q_ref, "q (precomputed sf)")


@pytest.mark.parametrize("tokens,hidden", list(itertools.product(TOKENS, HIDDENS)))
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("block", [(16, 16), (32, 32), (64, 128), (128, 128)])
@pytest.mark.parametrize("flags", PER_TOKEN_FLAGS[::2], ids=lambda f: "-".join(f) or "plain")
def test_per_block_cast_matches_reference(tokens, hidden, fmt, block, flags):
    x = activation(tokens, hidden)
    kwargs = dict(fmt=fmt, block_size=block, **flags)
    q, sf = _cpu(_ascend(core.ops.per_block_cast, _npu(x), **kwargs))
    q_ref, sf_ref = _reference(core.ops.per_block_cast, x, **kwargs)
    assert_bytes_equal(q, q_ref, "q")
    assert_sf_equal(sf, sf_ref, block, tokens, hidden, "sf")


@pytest.mark.parametrize("tokens,hidden", list(itertools.product(TOKENS, HIDDENS)))
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("packed", [False, True])
def test_per_channel_cast_matches_reference(tokens, hidden, fmt, group, packed):
    x = activation(tokens, hidden)
    kwargs = dict(fmt=fmt, num_per_tokens=group, round_sf=packed, use_packed_ue8m0=packed)
    q, sf = _cpu(_ascend(core.ops.per_channel_cast, _npu(x), **kwargs))
    q_ref, sf_ref = _reference(core.ops.per_channel_cast, x, **kwargs)
    assert_bytes_equal(q, q_ref, "q")
    assert_sf_equal(sf, sf_ref, (group, 1), tokens, hidden, "sf")


@pytest.mark.parametrize("tokens,hidden", list(itertools.product(TOKENS, HIDDENS)))
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("block,flags", [((1, 128), {}), ((1, 32), dict(round_sf=True, use_packed_ue8m0=True)),
                                         ((128, 128), dict(use_tma_aligned_col_major_sf=True))])
@pytest.mark.parametrize("out", ["bf16", "fp32"])
def test_cast_back_and_requantize_match_reference(tokens, hidden, fmt, block, flags, out):
    x = activation(tokens, hidden)
    op = core.ops.per_token_cast if block[0] == 1 else core.ops.per_block_cast
    size = dict(num_per_channels=block[1]) if block[0] == 1 else dict(block_size=block)
    pair = _reference(op, x, fmt=fmt, **size, **flags)
    npu_pair = tuple(_npu(t) if t.stride(0) != 1 or t.dim() != 2 or t.shape[0] <= 1 else _npu(t.t().contiguous()).t()
                     for t in pair)
    back = _ascend(core.ops.cast_back, npu_pair, fmt=out, x_block_size=block).cpu()
    assert_bytes_equal(back, _reference(core.ops.cast_back, pair, fmt=out, x_block_size=block), "cast_back")
    again = _cpu(_ascend(core.ops.per_token_cast, npu_pair, num_per_channels=64, x_block_size=block, round_sf=True))
    again_ref = _reference(core.ops.per_token_cast, pair, num_per_channels=64, x_block_size=block, round_sf=True)
    assert_bytes_equal(again[0], again_ref[0], "q (re-quantized)")
    assert_sf_equal(again[1], again_ref[1], (1, 64), tokens, hidden, "sf (re-quantized)")


@pytest.mark.parametrize("hidden", HIDDENS)
def test_strided_rows_and_nonfinite_groups(hidden):
    big = activation(4001, hidden + 64)
    big[:, hidden:] = float("inf")
    big[7, 5] = float("nan")
    big[9, 3] = float("inf")
    x = big[:, :hidden]
    for kwargs in (dict(), dict(round_sf=True, use_packed_ue8m0=True)):
        q, sf = _cpu(_ascend(core.ops.per_token_cast, _npu(big)[:, :hidden], **kwargs))
        q_ref, sf_ref = _reference(core.ops.per_token_cast, x, **kwargs)
        assert_bytes_equal(q, q_ref, "q")
        assert_sf_equal(sf, sf_ref, (1, 128), 4001, hidden, "sf")


def _npu_same_strides(t):
    """``t`` on the NPU with its strides (a column-major scale tensor stays column-major)."""
    return _npu(t) if t.stride(0) != 1 or t.dim() != 2 or t.shape[0] <= 1 else _npu(t.t().contiguous()).t()


@pytest.mark.parametrize("tokens", (1, 3, 4001))
@pytest.mark.parametrize("case", lossless_cases(), ids=lambda case: case.id)
def test_per_block_cast_lossless_matches_reference(tokens, case):
    """Every op-table case the Ascend kernel accepts: q and sf bytes as the reference's on the same
    e2m1 pair (made by the reference); a declined case is skipped with its reason."""
    from tileplug.backend_ascend.plugin import kernel_table

    with core.use_backend("reference"), core.config.host_layout("ascend"):
        (pair,), kwargs = case.arguments(tokens, "cpu")
        q_ref, sf_ref = core.ops.per_block_cast_lossless(pair, **kwargs)
    npu_pair = tuple(_npu_same_strides(t) for t in pair)
    call, _ = core.describe_call(core.ops.per_block_cast_lossless, npu_pair, **kwargs)
    why = kernel_table()["per_block_cast_lossless"].supports(call)
    if why is not None:
        pytest.skip(f"declined on Ascend (the reference serves it): {why}")
    q, sf = _cpu(_ascend(core.ops.per_block_cast_lossless, npu_pair, **kwargs))
    assert_bytes_equal(q, q_ref, "q")
    assert_sf_equal(sf, sf_ref, tuple(kwargs["out_block_size"]), tokens, case.hidden, "sf")


def test_declines_e4m3_sf_with_reason():
    x = _npu(activation(3, 576))
    call, _ = core.describe_call(core.ops.per_token_cast, x, use_e4m3_sf=True)
    assert "e4m3-stored" in core.registry.explain("per_token_cast", call)["ascend"]


@pytest.mark.parametrize("tokens,hidden", list(itertools.product(TOKENS, HIDDENS)))
@pytest.mark.parametrize("fmt,group", [("e4m3", 128), ("e4m3", 32), ("e2m1", 16), ("e2m1", 64)])
@pytest.mark.parametrize("flags", [dict(), dict(round_sf=True), dict(use_e4m3_sf=True)],
                         ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_per_token_cast_and_cast_back_matches_reference(tokens, hidden, fmt, group, flags, dtype):
    """Fake quant in place, on a row-padded x: the [T, H] bytes equal the reference's, the pad is untouched."""
    padded = activation(tokens, hidden + 16, dtype)
    padded_npu = _npu(padded)
    x_ref = padded.clone()[:, :hidden]
    kwargs = dict(fmt=fmt, num_per_channels=group, **flags)
    assert _ascend(core.ops.per_token_cast_and_cast_back, padded_npu[:, :hidden], **kwargs) is None
    _reference(core.ops.per_token_cast_and_cast_back, x_ref, **kwargs)
    result = padded_npu.cpu()
    assert_bytes_equal(result[:, :hidden], x_ref, "x (fake quant)")
    assert_bytes_equal(result[:, hidden:], padded[:, hidden:], "row pad")
