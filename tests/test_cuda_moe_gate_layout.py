"""The CUDA gates' row layouts, without a GPU: the width a lane loads at a time
(``TILEPLUG_CUDA_MOE_GATE_FULL_WARP``: 16 bytes by default, or the width that spreads a short row over
the whole warp) and the rows a ``topk_gate`` warp selects from (``TILEPLUG_CUDA_MOE_GATE_ROWS_PER_WARP``)
— which widths and specs the variables pick, the softmax denominator's order on every width (emulated
step by step against the reference's sum), and the compiled kernels."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tileplug.backend_cuda.moe.spec import (
    GATE_FULL_WARP_VARIABLE,
    GATE_ROWS_PER_WARP_VARIABLE,
    GateSpec,
    gate_vec,
    lane_chunks,
)

sys.path.insert(0, str(Path(__file__).parent))


@pytest.mark.parametrize(("experts", "dtype", "alignment", "default", "full_warp"), [
    (256, "float32", 16, 4, 4),  # 8 values a lane either way: the widest
    (256, "bfloat16", 16, 8, 8),
    (64, "float32", 16, 4, 2),  # 16 lanes of 4 -> 32 lanes of 2
    (64, "bfloat16", 16, 8, 2),  # 8 lanes of 8 -> 32 lanes of 2
    (128, "bfloat16", 16, 8, 4),
    (384, "bfloat16", 16, 8, 4),  # 16 values a lane -> 12
    (72, "bfloat16", 16, 8, 1),  # 8 -> 3 (scalar loads, coalesced)
    (64, "bfloat16", 4, 1, 2),  # rows 4-byte aligned: 16-byte loads refused, 4-byte ones not
    (60, "float32", 16, 4, 2),  # 15 lanes of 4 -> 30 lanes of 2
    (50, "float32", 16, 1, 2),  # 50 % 4: scalar by default; 25 lanes of 2 (a tie with scalar's 2: the wider)
    (45, "bfloat16", 16, 1, 1),  # E odd: scalar either way
])
def test_the_full_warp_width(experts: int, dtype: str, alignment: int, default: int, full_warp: int,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GATE_FULL_WARP_VARIABLE, raising=False)
    assert gate_vec(experts, dtype, alignment) == default
    monkeypatch.setenv(GATE_FULL_WARP_VARIABLE, "1")
    vec = gate_vec(experts, dtype, alignment)
    assert vec == full_warp
    assert lane_chunks(experts, vec) * vec <= lane_chunks(experts, default) * default


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


def test_the_variables_reach_the_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The widths and the rows a warp reach the specs and their names; ``moe_topk_gate`` keeps one row a
    warp; other values are refused, naming the variable."""
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core import ops
    from tileplug.core.lowering import describe_call

    plain = describe_call(ops.topk_gate, torch.randn(4, 64), 6)[0]
    full = describe_call(ops.moe_topk_gate, torch.randn(4, 64, dtype=torch.bfloat16), 6, "softmax")[0]
    wide = describe_call(ops.topk_gate, torch.randn(4, 256), 8)[0]
    monkeypatch.delenv(GATE_FULL_WARP_VARIABLE, raising=False)
    monkeypatch.delenv(GATE_ROWS_PER_WARP_VARIABLE, raising=False)
    assert "_v128_" in _KERNELS["topk_gate"].spec(plain).name and "_v128_" in _KERNELS["moe_topk_gate"].spec(full).name
    assert _KERNELS["topk_gate"].spec(wide).rows_per_warp == 1
    monkeypatch.setenv(GATE_FULL_WARP_VARIABLE, "1")
    narrow, narrow_full = _KERNELS["topk_gate"].spec(plain), _KERNELS["moe_topk_gate"].spec(full)
    assert (narrow.vec, narrow_full.vec) == (2, 2) and "_v64_" in narrow.name and "_v32_" in narrow_full.name
    assert narrow.vector_buffers == () and _KERNELS["topk_gate"].spec(wide).vector_buffers == ("scores",)
    monkeypatch.setenv(GATE_ROWS_PER_WARP_VARIABLE, "4")
    spec = _KERNELS["topk_gate"].spec(wide)
    assert spec.rows_per_warp == 4 and spec.name.endswith("_r4"), spec.name
    assert _KERNELS["moe_topk_gate"].spec(full).rows_per_warp == 1
    monkeypatch.setenv(GATE_ROWS_PER_WARP_VARIABLE, "3")
    with pytest.raises(ValueError, match=f"{GATE_ROWS_PER_WARP_VARIABLE}='3': expected one of 1, 2, 4"):
        _KERNELS["topk_gate"].spec(wide)
    monkeypatch.setenv(GATE_FULL_WARP_VARIABLE, "yes")
    with pytest.raises(ValueError, match=f"{GATE_FULL_WARP_VARIABLE}='yes': expected one of 0, 1"):
        _KERNELS["topk_gate"].spec(wide)


@pytest.mark.nvcc
@pytest.mark.parametrize("spec", [
    GateSpec("topk_gate", 256, 8, "float32", 4, lane_heads=True, ctas_per_sm=10, rows_per_warp=2),
    GateSpec("topk_gate", 384, 8, "float32", 4, lane_heads=True, rows_per_warp=4),
    GateSpec("topk_gate", 64, 6, "float32", 2, lane_heads=True, ctas_per_sm=10, rows_per_warp=4),
    GateSpec("moe_topk_gate", 64, 6, "bfloat16", 2, scoring="softmax", lane_heads=True, ctas_per_sm=10),
    GateSpec("moe_topk_gate", 384, 8, "bfloat16", 4, scoring="sigmoid", biased=True, renormalize=True,
             lane_heads=True),
], ids=lambda spec: spec.name)
def test_the_layouts_compile_without_spills(spec: GateSpec) -> None:
    """Each layout compiles without spills; several rows a warp load the next row inside the row loop (a
    second pair of loads of the row), one row a warp loads once."""
    pytest.importorskip("tilelang")
    from test_cuda_compile import nvcc, spill_bytes

    from tileplug.backend_cuda import jit

    source = jit.lower_source(spec)
    loads = source.count("scores + ") if spec.op == "topk_gate" else None
    if spec.rows_per_warp > 1:
        assert "for (int step = 0; step < %d; ++step)" % spec.rows_per_warp in source
        assert loads == 2 * lane_chunks(spec.experts, spec.vec), loads
    error, _, report = nvcc(source)
    assert error is None, error
    spills = spill_bytes(report)
    assert spills.get(spec.name + "_kernel") == 0 and not any(spills.values()), report[-2000:]
