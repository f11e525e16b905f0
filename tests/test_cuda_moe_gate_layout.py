"""The width a CUDA gate lane loads at a time and the unrolled selection rounds, without a GPU:
``TILEPLUG_CUDA_MOE_GATE_FULL_WARP`` (by default the width that spreads a short row over the whole warp,
``0``: 16 bytes wherever the row allows) and ``TILEPLUG_CUDA_MOE_GATE_UNROLLED`` (by default the ``k ≤ 8``
rounds unrolled, ``0``: one loop) and ``TILEPLUG_CUDA_MOE_GATE_FIXED_HEADS`` (by default the lanes' heads
kept in place through the rounds, ``0``: the second moves up) — which widths and specs the variables pick, the softmax denominator's
order on every width (emulated step by step against the reference's sum), and the compiled kernels."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tileplug.backend_cuda.moe.spec import (
    GATE_FIXED_HEADS_VARIABLE,
    GATE_FULL_WARP_VARIABLE,
    GATE_UNROLLED_VARIABLE,
    GateSpec,
    gate_vec,
    lane_chunks,
)

sys.path.insert(0, str(Path(__file__).parent))


@pytest.mark.parametrize(("experts", "dtype", "alignment", "sixteen", "full_warp"), [
    (256, "float32", 16, 4, 4),  # 8 values a lane either way: the widest
    (256, "bfloat16", 16, 8, 8),
    (64, "float32", 16, 4, 2),  # 16 lanes of 4 -> 32 lanes of 2
    (64, "bfloat16", 16, 8, 2),  # 8 lanes of 8 -> 32 lanes of 2
    (128, "bfloat16", 16, 8, 4),
    (384, "bfloat16", 16, 8, 8),  # a row of at least a warp of 16-byte pieces keeps them (16 values a lane)
    (1000, "float32", 16, 4, 4),
    (72, "bfloat16", 16, 8, 1),  # 8 -> 3 (scalar loads, coalesced)
    (64, "bfloat16", 4, 1, 2),  # rows 4-byte aligned: 16-byte loads refused, 4-byte ones not
    (60, "float32", 16, 4, 2),  # 15 lanes of 4 -> 30 lanes of 2
    (50, "float32", 16, 1, 2),  # 50 % 4: scalar by default; 25 lanes of 2 (a tie with scalar's 2: the wider)
    (45, "bfloat16", 16, 1, 1),  # E odd: scalar either way
])
def test_the_full_warp_width(experts: int, dtype: str, alignment: int, sixteen: int, full_warp: int,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GATE_FULL_WARP_VARIABLE, "0")
    assert gate_vec(experts, dtype, alignment) == sixteen
    monkeypatch.delenv(GATE_FULL_WARP_VARIABLE)  # the default: the full warp
    vec = gate_vec(experts, dtype, alignment)
    assert vec == full_warp
    assert lane_chunks(experts, vec) * vec <= lane_chunks(experts, sixteen) * sixteen


@pytest.mark.parametrize("experts", [8, 64, 72, 96, 128, 160, 256, 384, 1000, 1024])
def test_the_softmax_denominator_keeps_the_reference_order_on_every_width(experts: int) -> None:
    """``WarpRow.row_sum`` on a gate row (one warp, ``lane_chunks`` pieces a lane) adds the scores in
    ``row_sum``'s order, bit for bit, whichever width a lane loads."""
    from test_cuda_norm_host import emulate_row_sum

    from tileplug.backend_cuda.norm.spec import RowTile
    from tileplug.core.norm.formulas import row_sum

    generator = torch.Generator().manual_seed(experts)
    terms = torch.rand(experts, generator=generator) * torch.exp(6 * torch.randn(experts, generator=generator))
    expected = row_sum(terms.unsqueeze(0))[0]
    for vec in (1, 2, 4, 8):
        if experts % vec == 0 or vec == 1:
            actual = emulate_row_sum(terms, experts, RowTile(32, 1, lane_chunks(experts, vec)), vec)
            assert actual.view(torch.int32) == expected.view(torch.int32), (experts, vec, actual, expected)


def test_the_variable_reaches_the_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The width reaches the specs and their names (``_v32`` / ``_v64``: 4 / 8 bytes; no 128-bit load to
    check there); other values are refused, naming the variable."""
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core import ops
    from tileplug.core.lowering import describe_call

    plain = describe_call(ops.topk_gate, torch.randn(4, 64), 6)[0]
    full = describe_call(ops.moe_topk_gate, torch.randn(4, 64, dtype=torch.bfloat16), 6, "softmax")[0]
    wide = describe_call(ops.topk_gate, torch.randn(4, 256), 8)[0]
    monkeypatch.setenv(GATE_FULL_WARP_VARIABLE, "0")
    assert "_v128_" in _KERNELS["topk_gate"].spec(plain).name and "_v128_" in _KERNELS["moe_topk_gate"].spec(full).name
    monkeypatch.delenv(GATE_FULL_WARP_VARIABLE)
    narrow, narrow_full = _KERNELS["topk_gate"].spec(plain), _KERNELS["moe_topk_gate"].spec(full)
    assert (narrow.vec, narrow_full.vec) == (2, 2) and "_v64_" in narrow.name and "_v32_" in narrow_full.name
    assert narrow.vector_buffers == () and _KERNELS["topk_gate"].spec(wide).vector_buffers == ("scores",)
    assert "_v128_" in _KERNELS["topk_gate"].spec(wide).name
    assert all(_KERNELS[op].spec(call).unrolled and "unrolled" in _KERNELS[op].spec(call).name.split("_")
               for op, call in (("topk_gate", wide), ("moe_topk_gate", full)))  # the default: unrolled
    many = describe_call(ops.topk_gate, torch.randn(4, 256), 9)[0]
    assert not _KERNELS["topk_gate"].spec(many).unrolled  # past MAX_UNROLLED_ROUNDS: the loop
    monkeypatch.setenv(GATE_UNROLLED_VARIABLE, "0")
    assert not _KERNELS["topk_gate"].spec(wide).unrolled and not _KERNELS["moe_topk_gate"].spec(full).unrolled
    monkeypatch.setenv(GATE_UNROLLED_VARIABLE, "2")
    with pytest.raises(ValueError, match=f"{GATE_UNROLLED_VARIABLE}='2': expected one of 0, 1"):
        _KERNELS["topk_gate"].spec(wide)
    monkeypatch.delenv(GATE_UNROLLED_VARIABLE)
    assert all(_KERNELS[op].spec(call).fixed_heads and _KERNELS[op].spec(call).name.endswith("_unrolled_fixed")
               for op, call in (("topk_gate", wide), ("moe_topk_gate", full)))  # the default: the heads stay
    monkeypatch.setenv(GATE_FIXED_HEADS_VARIABLE, "0")
    assert not any(_KERNELS[op].spec(call).fixed_heads or "fixed" in _KERNELS[op].spec(call).name.split("_")
                   for op, call in (("topk_gate", wide), ("moe_topk_gate", full)))  # the heads move up
    monkeypatch.setenv(GATE_FIXED_HEADS_VARIABLE, "1")
    monkeypatch.setenv("TILEPLUG_CUDA_MOE_LANE_HEADS", "0")
    assert not _KERNELS["topk_gate"].spec(wide).fixed_heads  # no heads, nothing to keep in place
    monkeypatch.delenv("TILEPLUG_CUDA_MOE_LANE_HEADS")
    monkeypatch.setenv(GATE_FIXED_HEADS_VARIABLE, "on")
    with pytest.raises(ValueError, match=f"{GATE_FIXED_HEADS_VARIABLE}='on': expected one of 0, 1"):
        _KERNELS["topk_gate"].spec(wide)
    monkeypatch.delenv(GATE_FIXED_HEADS_VARIABLE)
    monkeypatch.setenv(GATE_FULL_WARP_VARIABLE, "yes")
    with pytest.raises(ValueError, match=f"{GATE_FULL_WARP_VARIABLE}='yes': expected one of 0, 1"):
        _KERNELS["topk_gate"].spec(wide)


@pytest.mark.nvcc
@pytest.mark.parametrize("spec", [
    GateSpec("topk_gate", 64, 6, "float32", 2, lane_heads=True, ctas_per_sm=10),
    GateSpec("topk_gate", 96, 8, "float32", 1, lane_heads=True, ctas_per_sm=10),
    GateSpec("topk_gate", 256, 8, "float32", 4, lane_heads=True, ctas_per_sm=10, unrolled=True),
    GateSpec("moe_topk_gate", 256, 8, "float32", 4, scoring="sqrtsoftplus", biased=True, renormalize=True, shared=1,
             table_math=True, lane_heads=True, ctas_per_sm=10, unrolled=True),
    GateSpec("topk_gate", 256, 8, "float32", 4, lane_heads=True, ctas_per_sm=10, unrolled=True, fixed_heads=True),
    GateSpec("topk_gate", 1000, 16, "float32", 4, lane_heads=True, fixed_heads=True),
    GateSpec("moe_topk_gate", 256, 8, "bfloat16", 8, scoring="sigmoid", biased=True, groups=8, topk_groups=4,
             renormalize=True, scaling=2.5, lane_groups=True, lane_heads=True, ctas_per_sm=10, unrolled=True,
             fixed_heads=True),
    GateSpec("moe_topk_gate", 64, 6, "bfloat16", 2, scoring="softmax", lane_heads=True, ctas_per_sm=10),
    GateSpec("moe_topk_gate", 128, 8, "bfloat16", 4, scoring="sigmoid", biased=True, renormalize=True,
             lane_heads=True, ctas_per_sm=10),
], ids=lambda spec: spec.name)
def test_the_forms_compile_without_spills(spec: GateSpec) -> None:
    """The full-warp widths compile without spills, loading ``vec`` values at a time (``float2`` / ``uint1``:
    two fp32 / two bf16); the unrolled rounds too, with one pair of warp reductions a round and no round loop;
    the fixed heads too, and none of their rounds moves a head."""
    pytest.importorskip("tilelang")
    from test_cuda_compile import nvcc, spill_bytes

    from tileplug.backend_cuda import jit

    source = jit.lower_source(spec)
    if 1 < spec.vec and spec.vec * spec.value_bytes < 16:
        vector = {(2, 4): "float2", (2, 2): "uint1", (4, 2): "uint2"}[spec.vec, spec.value_bytes]
        assert re.search(rf"\*\({vector}\*\)\((scores|logits) \+", source), vector
    if spec.unrolled and not spec.fixed_heads:
        assert source.count("tl::warp_reduce_max(head_key[0])") == spec.topk and "round_index" not in source
    if spec.fixed_heads:  # the heads never move: no round writes the first head from the second
        reductions = source.count("tl::warp_reduce_max(")
        assert "head_key[0] = head_key[1]" not in source and reductions >= (spec.topk if spec.unrolled else 1)
    error, _, report = nvcc(source)
    assert error is None, error
    spills = spill_bytes(report)
    assert spills.get(spec.name + "_kernel") == 0 and not any(spills.values()), report[-2000:]
