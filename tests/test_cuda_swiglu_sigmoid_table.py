"""The CUDA SwiGLU kernels' sigmoid table (opt-in: ``TILEPLUG_CUDA_SWIGLU_SIGMOID_TABLE=1``), without
a GPU: what the table holds for every bf16 gate, which kernels read it, what their launchers hand
the compiled entry (``jit.entry`` replaced by a recorder), and that they compile without spills."""

from __future__ import annotations

import struct
from decimal import Decimal, getcontext

import pytest
import torch

from tileplug.backend_cuda import jit
from tileplug.backend_cuda.plugin import _KERNELS
from tileplug.core.swiglu import sigmoid_table as st
from tileplug.backend_cuda.swiglu.spec import ROW_STEPS, ROW_STEPS_CTAS, SIGMOID_TABLE_VARIABLE, row_steps
from tileplug.core import ops
from tileplug.core.lowering import describe_call
from tileplug.core.moe.formulas import correctly_rounded
from test_cuda_swiglu_random_host import Recorder  # tests/: jit.entry's stand-in

BF16, FP32 = torch.bfloat16, torch.float32
EVERY_GATE = torch.arange(65536, dtype=torch.int32)
"""The bits of every bf16 value."""


def _gates(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int16).view(BF16).to(FP32)


def _looked_up(low: int = st.LOW, high: int = st.HIGH) -> torch.Tensor:
    """The kernel's lookup over every bf16 gate, with the table's magnitude range ``[low, high]``."""
    gates = torch.cat((torch.arange(low, high + 1), torch.arange(low, high + 1) | 0x8000)).to(torch.int32)
    table = correctly_rounded(torch.sigmoid, _gates(gates))
    magnitude = torch.clamp(EVERY_GATE & 0x7FFF, low, high)
    return table[magnitude - low + ((EVERY_GATE >> 3) & (high - low + 1))]


def test_every_bf16_gate_reads_the_reference_sigmoid() -> None:
    """Through the kernel's index arithmetic (``table_index``), every finite or infinite bf16 gate
    reads the reference's fp32 sigmoid, bit for bit; a table one binade narrower at either end
    does not (the clamped magnitudes are exactly those whose sigmoid is 1/2, 1 or 0)."""
    gates = _gates(EVERY_GATE)
    want = correctly_rounded(torch.sigmoid, gates).view(torch.int32)
    number = ~torch.isnan(gates)
    table = st.sigmoid_table(torch.device("cpu"))
    assert table.shape == (st.ENTRIES,) and table.dtype == FP32
    have = table[st.table_index(EVERY_GATE)]
    assert int(st.table_index(EVERY_GATE).min()) == 0 and int(st.table_index(EVERY_GATE).max()) == st.ENTRIES - 1
    assert torch.equal(have.view(torch.int32)[number], want[number])
    assert torch.equal(_looked_up().view(torch.int32)[number], want[number])
    for low, high in ((st.LOW + 128, st.HIGH), (st.LOW, st.HIGH - 128)):
        assert not torch.equal(_looked_up(low, high).view(torch.int32)[number], want[number]), (low, high)
    assert bool(torch.isfinite(have[~number]).all())  # a NaN gate reads a number (y is NaN through g)


def _fp32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def test_the_entries_are_the_correctly_rounded_sigmoid_but_at_63_fp64_midpoints() -> None:
    """Against a 50-digit sigmoid: every entry is the nearest fp32 but 63, all of gates below 2^-16
    in magnitude, where ``1 / (1 + exp(-g))`` in fp64 lands exactly on an fp32 midpoint and rounds to
    even (the reference's double rounding, kept: the table holds the reference's values)."""
    getcontext().prec = 50
    gates = st.table_gates()
    table = st.sigmoid_table(torch.device("cpu"))
    wide = torch.sigmoid(gates.double())
    differ = []
    for gate, value, fp64 in zip(gates.tolist(), table.view(torch.int32).tolist(), wide.tolist()):
        exact = 1 / (1 + (-Decimal(gate)).exp())
        nearest = min((bits for bits in (value - 1, value, value + 1) if bits >= 0),
                      key=lambda bits: abs(Decimal(_fp32(bits)) - exact))
        if nearest != value:
            differ.append(gate)
            midpoint = (Decimal(_fp32(value)) + Decimal(_fp32(nearest))) / 2
            assert Decimal(fp64) == midpoint, gate
    assert len(differ) == 63 and max(abs(gate) for gate in differ) < 2.0**-16


@pytest.mark.parametrize("clamp", [7.0, 0.1, 1e-30, 100.0, 3.3])
def test_a_clamped_gate_takes_the_reference_sigmoid_of_the_clamp(clamp: float) -> None:
    value = torch.tensor([clamp], dtype=FP32)
    assert st.clamp_sigmoid(float(value)) == float(correctly_rounded(torch.sigmoid, value)[0])


def test_the_table_is_built_once_a_device_and_is_a_normal_tensor(monkeypatch) -> None:
    """One tensor per device (every kernel of the device binds it), made outside inference mode even
    when the first call runs inside it; a build during a CUDA-graph capture is refused by name."""
    monkeypatch.setattr(st, "_TABLES", {})
    with torch.inference_mode():
        table = st.sigmoid_table(torch.device("cpu"))
    assert not table.is_inference() and st.sigmoid_table(torch.device("cpu")) is table
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before capturing a CUDA graph"):
        st.sigmoid_table(torch.device("cuda", 0))


def test_row_steps_group_row_tiles_only_past_the_fewest_ctas() -> None:
    assert [row_steps(tiles) for tiles in (1, 128, 2 * ROW_STEPS_CTAS - 1)] == [1, 1, 1]
    assert row_steps(2 * ROW_STEPS_CTAS) == 2 and row_steps(4 * ROW_STEPS_CTAS + 5) == 4
    assert row_steps(ROW_STEPS * ROW_STEPS_CTAS) == ROW_STEPS == row_steps(10**7)


def _spec(op, *args, **kwargs):
    return _KERNELS[op.__name__].spec(describe_call(op, *args, **kwargs)[0])


def test_the_table_is_the_default_and_read_only_where_x_is_bf16(monkeypatch) -> None:
    """By default (and with the variable at 1) ``swiglu`` with an fp32 ``y``, the fused cast and the
    backward of a bf16 x read the table (their kernels named so); a bf16 ``y`` (the fast sigmoid is
    inside its ulp) and an fp32 x do not; at 0 none does."""
    x = torch.randn(2, 2 * 7168, dtype=BF16)
    grad = torch.randn(2, 7168, dtype=BF16)
    monkeypatch.setenv(SIGMOID_TABLE_VARIABLE, "0")
    assert _spec(ops.swiglu, x, out_dtype=FP32).sigmoid == "reduced"
    assert _spec(ops.swiglu_per_token_cast, x).sigmoid == "reduced"
    assert _spec(ops.swiglu_backward, x, grad).sigmoid == "accurate"
    for value in (None, "1"):
        if value is None:
            monkeypatch.delenv(SIGMOID_TABLE_VARIABLE)
        else:
            monkeypatch.setenv(SIGMOID_TABLE_VARIABLE, value)
        for spec in (_spec(ops.swiglu, x, out_dtype=FP32), _spec(ops.swiglu_per_token_cast, x),
                     _spec(ops.swiglu_per_token_cast, x, fmt="e2m1", num_per_channels=16),
                     _spec(ops.swiglu_backward, x, grad), _spec(ops.swiglu_backward, x, grad, topk_weights=torch.rand(2))):
            assert spec.sigmoid == "table" and spec.name.endswith("_table"), spec.name
        assert _spec(ops.swiglu, x).sigmoid == "branchless"
        assert _spec(ops.swiglu, x.float()).sigmoid == "reduced"
        assert _spec(ops.swiglu_per_token_cast, x.float()).sigmoid == "reduced"
        assert _spec(ops.swiglu_backward, x.float(), grad.float()).sigmoid == "reduced"


@pytest.mark.parametrize("rows", [1, 5, 3000])
def test_the_launchers_hand_the_table_and_the_row_steps(rows: int, monkeypatch) -> None:
    """A table kernel gets the device's table (one tensor for every call signature) and the row
    tiles a CTA runs, between the optional buffers and the outputs; one-row calls still get their
    strides fixed (the step count is an int, passed as is)."""
    recording = Recorder()
    monkeypatch.setattr(jit, "entry", recording.entry)
    monkeypatch.setenv(SIGMOID_TABLE_VARIABLE, "1")
    x = torch.randn(rows, 2 * 7168, dtype=BF16)
    weights = torch.rand(rows)
    table = st.sigmoid_table(torch.device("cpu"))
    for op, kwargs, outputs in (
        (ops.swiglu, {"out_dtype": FP32, "topk_weights": weights}, {"y": torch.empty(rows, 7168)}),
        (ops.swiglu_per_token_cast, {}, {"q": torch.empty(rows, 7168, dtype=torch.float8_e4m3fn),
                                         "sf": torch.empty(rows, 56)}),
    ):
        call, inputs = describe_call(op, x, **kwargs)
        kernel = _KERNELS[call.op]
        spec = kernel.spec(call)
        kernel.prepare(call)(inputs, type("Outputs", (), outputs)())
        name, arguments = recording.launches[-1]
        assert name == spec.name
        assert arguments[3] is table
        assert arguments[4] == row_steps(-(-rows // spec.tile.rows)) and type(arguments[4]) is int
        assert arguments[0].shape == (rows, 2, 7168) and arguments[0].data_ptr() == x.data_ptr()
        assert arguments[0].stride()[0] % 8 == 0  # a one-row call's stride fixed for the alignment assumption
    (first, second) = recording.launches
    assert first[1][1] is weights and second[1][1] is x  # absent weights stood in by x
    grad = torch.randn(rows, 7168, dtype=BF16)
    call, inputs = describe_call(ops.swiglu_backward, x, grad, topk_weights=weights)
    kernel = _KERNELS[call.op]
    spec = kernel.spec(call)
    grad_x, grad_weights = torch.empty_like(x), torch.empty(rows)
    kernel.prepare(call)(inputs, type("Outputs", (), {"grad_x": grad_x, "grad_topk_weights": grad_weights})())
    name, arguments = recording.launches[-1]
    assert name == spec.name and arguments[2] is weights and arguments[4] is table
    assert arguments[5] == row_steps(-(-rows // spec.tile.rows)) and arguments[7] is grad_weights
    assert arguments[6].shape == (rows, 2, 7168) and arguments[6].data_ptr() == grad_x.data_ptr()


@pytest.mark.nvcc
def test_the_table_kernels_compile_without_spills(monkeypatch) -> None:
    """The table kernels of the widths models use (several short rows a CTA, one long row, the
    scalar form of an unaligned width) with weights, an expert layout and a clamp, the cast's
    formats and scale layouts, and the backward: one barrier after the table's copy (the weighted
    backward's row sum has more), the row-step loop, no fp64, no spill."""
    pytest.importorskip("tilelang")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_compile import nvcc, spill_bytes

    monkeypatch.setenv(SIGMOID_TABLE_VARIABLE, "1")
    ends = torch.tensor([1, 2], dtype=torch.int32)
    cases = [
        (ops.swiglu, 64, {"out_dtype": FP32}),
        (ops.swiglu, 1408, {"out_dtype": FP32, "topk_weights": True, "expert_ends": ends, "clamp_value": 7.0}),
        (ops.swiglu, 100, {"out_dtype": FP32}),
        (ops.swiglu_per_token_cast, 7168, {}),
        (ops.swiglu_per_token_cast, 14336, {"topk_weights": True, "expert_ends": ends, "round_sf": True,
                                            "use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True}),
        (ops.swiglu_per_token_cast, 2048, {"fmt": "e2m1", "num_per_channels": 16, "clamp_value": 7.0}),
        (ops.swiglu_backward, 7168, {}),
        (ops.swiglu_backward, 1408, {"topk_weights": True, "expert_ends": ends, "clamp_value": 7.0}),
        (ops.swiglu_backward, 64, {"topk_weights": True}),
    ]
    for op, hidden, options in cases:
        x = torch.empty(2, 2 * hidden, dtype=BF16, device="meta")
        if op is ops.swiglu_backward:
            options = {**options, "grad_y": torch.empty(2, hidden, dtype=BF16, device="meta")}
        if options.get("topk_weights") is True:
            options = {**options, "topk_weights": torch.empty(2, device="meta")}
        if "expert_ends" in options:
            options = {**options, "expert_ends": options["expert_ends"].to("meta")}
        spec = _spec(op, x, **options)
        assert spec.sigmoid == "table", spec.name
        source = jit.lower_source(spec)
        if op is not ops.swiglu_backward or "topk_weights" not in options:  # (the weighted row sum has its own)
            assert source.count("__syncthreads()") == 1, spec.name
        assert "row_steps" in source and "double" not in source, spec.name
        error, _, report = nvcc(source)
        assert error is None, error
        assert spill_bytes(report) == {spec.name + "_kernel": 0}, report[-2000:]
