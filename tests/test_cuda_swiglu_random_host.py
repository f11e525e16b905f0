"""CUDA SwiGLU, random-number and stochastic_cast kernels, host side, without a GPU: what they decline, how
calls map onto specialisations, and what the launchers hand the compiled entry (views, the
stand-ins of absent buffers, the store form of a draw and the offset's advance launch),
with ``jit.entry`` replaced by a recorder."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tileplug.backend_cuda import jit
from tileplug.backend_cuda.plugin import _KERNELS
from tileplug.core import ops
from tileplug.core.lowering import describe_call
from tileplug.core.testing import assert_bytes_equal

BF16, FP32 = torch.bfloat16, torch.float32


class Recorder:
    """Stands in for ``jit.entry``: each spec's entry records the arguments of its launches."""

    def __init__(self) -> None:
        self.launches: list[tuple[str, tuple]] = []

    def entry(self, spec):
        def launch(*arguments):
            self.launches.append((spec.name, arguments))

        return launch


@pytest.fixture
def recorder(monkeypatch) -> Recorder:
    recording = Recorder()
    monkeypatch.setattr(jit, "entry", recording.entry)
    return recording


def _prepared(op, *args, **kwargs):
    call, inputs = describe_call(op, *args, **kwargs)
    kernel = _KERNELS[call.op]
    assert kernel.supports(call) is None, kernel.supports(call)
    return kernel, call, inputs


def test_swiglu_hands_x_as_two_halves_and_y_as_one_row(recorder) -> None:
    x = torch.randn(5, 2 * 64, dtype=BF16)
    weights = torch.rand(5)
    ends = torch.tensor([2, 5], dtype=torch.int32)
    kernel, call, inputs = _prepared(ops.swiglu, x, topk_weights=weights, expert_ends=ends, expert_alignment=4)
    y = torch.empty(5, 64, dtype=BF16)
    kernel.prepare(call)(inputs, type("Outputs", (), {"y": y})())
    ((name, (halves, w, e, y_view)),) = recorder.launches
    assert name.startswith("swiglu_bf16_bf16_h64_w_e2a4_v128")
    assert halves.shape == (5, 2, 64) and halves.stride() == (128, 64, 1) and halves.data_ptr() == x.data_ptr()
    assert w is weights and e is ends
    assert y_view.shape == (5, 1, 64) and y_view.data_ptr() == y.data_ptr()


def test_absent_weights_and_ends_are_stood_in_by_x(recorder) -> None:
    x = torch.randn(3, 2 * 72)
    kernel, call, inputs = _prepared(ops.swiglu, x, out_dtype=BF16)
    kernel.prepare(call)(inputs, type("Outputs", (), {"y": torch.empty(3, 72, dtype=BF16)})())
    ((name, (_, w, e, _)),) = recorder.launches
    assert w is x and e is x
    assert name.startswith("swiglu_fp32_bf16_h72_v128")


def test_one_row_calls_get_strides_the_alignment_assumptions_accept(recorder) -> None:
    storage = torch.randn(1, 2 * 64 + 3, dtype=BF16)
    x = storage[:, :128]  # one row: its stride (131) is never used
    kernel, call, inputs = _prepared(ops.swiglu, x)
    kernel.prepare(call)(inputs, type("Outputs", (), {"y": torch.empty(1, 64, dtype=BF16)})())
    ((_, (halves, _, _, y_view)),) = recorder.launches
    assert halves.stride()[0] % 8 == 0 and y_view.stride()[0] % 8 == 0


def test_the_cast_hands_packed_scales_as_core_allocated_them(recorder, monkeypatch) -> None:
    monkeypatch.setenv("TILEPLUG_CUDA_SWIGLU_SIGMOID_TABLE", "0")  # (the table's launcher: test_cuda_swiglu_sigmoid_table)
    x = torch.randn(4, 2 * 256, dtype=BF16)
    kernel, call, inputs = _prepared(ops.swiglu_per_token_cast, x, round_sf=True, use_packed_ue8m0=True)
    q = torch.empty(4, 256, dtype=torch.float8_e4m3fn)
    sf = torch.empty(4, 1, dtype=torch.int32)
    kernel.prepare(call)(inputs, type("Outputs", (), {"q": q, "sf": sf})())
    ((name, (_, _, _, q_arg, sf_arg)),) = recorder.launches
    assert "e4m3_g128_sfue8m0" in name and q_arg is q
    assert sf_arg is sf  # no view on the host: the kernel writes the integers' bytes (sf_math.packed_sf_bytes)


def test_the_backward_hands_grad_y_as_one_row_and_grad_x_as_halves(recorder, monkeypatch) -> None:
    monkeypatch.setenv("TILEPLUG_CUDA_SWIGLU_SIGMOID_TABLE", "0")  # (the table's launcher: test_cuda_swiglu_sigmoid_table)
    x = torch.randn(6, 2 * 64, dtype=BF16)
    grad_y = torch.randn(6, 64, dtype=FP32)
    weights = torch.rand(6)
    kernel, call, inputs = _prepared(ops.swiglu_backward, x, grad_y, topk_weights=weights)
    grad_x, grad_w = torch.empty(6, 128, dtype=BF16), torch.empty(6)
    kernel.prepare(call)(inputs, type("Outputs", (), {"grad_x": grad_x, "grad_topk_weights": grad_w})())
    ((name, (_, gy, w, e, gx, gw)),) = recorder.launches
    assert name.startswith("swiglu_backward_bf16_fp32_h64_w")
    assert gy.shape == (6, 1, 64) and gx.shape == (6, 2, 64) and gx.data_ptr() == grad_x.data_ptr()
    assert w is weights and e is x and gw is grad_w


def test_swiglu_declines_with_reasons() -> None:
    kernel, call = _KERNELS["swiglu"], describe_call(ops.swiglu, torch.randn(2, 8, dtype=torch.float64))[0]
    assert "float64" in kernel.supports(call)
    call = describe_call(ops.swiglu, torch.randn(1, 2 * 40000, dtype=BF16))[0]
    assert "do not fit one CTA's registers" in kernel.supports(call)
    call = describe_call(ops.swiglu_backward, torch.randn(1, 2 * 12290), torch.randn(1, 12290),
                         topk_weights=torch.rand(1))[0]
    assert "shared memory" in _KERNELS["swiglu_backward"].supports(call)


def test_specialisations_do_not_depend_on_the_row_count() -> None:
    names = set()
    for rows in (1, 7, 4096):
        call = describe_call(ops.swiglu_per_token_cast, torch.randn(rows, 2 * 7168, dtype=BF16))[0]
        names.add(_KERNELS["swiglu_per_token_cast"].spec(call).name)
    assert len(names) == 1


def assert_arrival_counter(counter: torch.Tensor, offset: torch.Tensor) -> None:
    """A draw's arrival counter: int32 [1] on the offset's device, the same tensor for every draw of that offset."""
    from tileplug.backend_cuda.random.arrivals import arrival_counter

    assert counter.dtype == torch.int32 and counter.shape == (1,) and counter.device == offset.device
    assert arrival_counter(offset) is counter and arrival_counter(torch.zeros(1, dtype=torch.int64)) is not counter


def test_counters_come_from_a_zeroed_slab_made_outside_a_graph_capture(monkeypatch) -> None:
    """A generator's counter is handed out at its first draw from its device's slab of zeroed counters, so a
    first draw during a capture takes one whose zero fill happened before it; a slab to make during a capture
    (the device's first draw, or its counters run out) is refused by name, and nothing is recorded for the
    offset."""
    from tileplug.backend_cuda.random import arrivals

    monkeypatch.setattr(arrivals, "_COUNTERS", {})
    monkeypatch.setattr(arrivals, "_SLABS", {})
    monkeypatch.setattr(arrivals, "SLAB_COUNTERS", 3)
    offsets = [torch.zeros(1, dtype=torch.int64) for _ in range(4)]
    with torch.inference_mode():
        counters = [arrivals.arrival_counter(offset) for offset in offsets[:3]]
    slab = counters[0]._base
    assert slab is not None and not slab.is_inference() and slab.shape == (3,) and slab.dtype == torch.int32
    assert [counter.data_ptr() - slab.data_ptr() for counter in counters] == [0, 4, 8]
    assert all(int(counter) == 0 and counter.shape == (1,) for counter in counters)
    fourth = arrivals.arrival_counter(offsets[3])  # a second slab
    assert fourth._base is not slab and int(fourth) == 0

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(arrivals, "SLAB_COUNTERS", 2)
    made_before = torch.zeros(2, dtype=torch.int32)
    arrivals._SLABS[cuda] = (made_before, 0)  # a CUDA device's slab made before the capture (a CPU stand-in)
    offset = SimpleNamespace(data_ptr=lambda: 4096, device=cuda)
    counter = arrivals.arrival_counter(offset)
    assert counter.data_ptr() == made_before.data_ptr() and arrivals.arrival_counter(offset) is counter
    assert arrivals.arrival_counter(SimpleNamespace(data_ptr=lambda: 8192, device=cuda))._base is made_before
    with pytest.raises(RuntimeError, match="make one draw on this device before capturing a CUDA graph"):
        arrivals.arrival_counter(SimpleNamespace(data_ptr=lambda: 12288, device=cuda))
    assert 12288 not in arrivals._COUNTERS and arrivals._SLABS[cuda] == (made_before, 2)


@pytest.mark.parametrize("op", ("fill_rand", "fill_randn"))
def test_a_draw_picks_its_store_form_by_alignment_and_is_one_launch(recorder, op) -> None:
    function = getattr(ops, op)
    seed, offset = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    storage = torch.empty(4100)
    assert storage.data_ptr() % 16 == 0
    for values, form in ((storage[:4097], "v128"), (storage[1:4098], "scalar")):
        call, inputs = describe_call(function, values, seed, offset)
        _KERNELS[op].prepare(call)(inputs, None)
        draw, (flat, seed_arg, offset_arg, counter) = recorder.launches[-1]
        suffix = "_reduced" if op == "fill_randn" else ""  # (the default Box-Muller's kernels are named so)
        assert draw == f"{op}_fp32_{form}_t256{suffix}"
        assert flat.dim() == 1 and flat.data_ptr() == values.data_ptr() and seed_arg is seed and offset_arg is offset
        assert_arrival_counter(counter, offset)
    assert len(recorder.launches) == 2  # the offset advances inside the draw: no second launch


@pytest.mark.parametrize("source, target, short", [(FP32, BF16, "fp32_to_bf16"),
                                                    (FP32, torch.float8_e4m3fn, "fp32_to_e4m3"),
                                                    (BF16, torch.float8_e4m3fn, "bf16_to_e4m3")])
def test_stochastic_cast_takes_the_128_bit_form_only_when_x_and_result_are_aligned(recorder, source, target,
                                                                                   short) -> None:
    seed, offset = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    x_storage, result_storage = torch.empty(4100, dtype=source), torch.empty(4100, dtype=target)
    assert x_storage.data_ptr() % 16 == 0 and result_storage.data_ptr() % 16 == 0
    forms = ((x_storage[:4097], result_storage[:4097], "v128"), (x_storage[1:4098], result_storage[:4097], "scalar"),
             (x_storage[:4097], result_storage[1:4098], "scalar"))
    for x, result, form in forms:
        call, inputs = describe_call(ops.stochastic_cast, result.view(17, 241), x.view(17, 241), seed, offset)
        _KERNELS["stochastic_cast"].prepare(call)(inputs, None)
        cast, (result_arg, x_arg, seed_arg, offset_arg, counter) = recorder.launches[-1]
        assert cast == f"stochastic_cast_{short}_{form}_t256"
        assert result_arg.shape == x_arg.shape == (4097,)
        assert result_arg.data_ptr() == result.data_ptr() and x_arg.data_ptr() == x.data_ptr()
        assert seed_arg is seed and offset_arg is offset
        assert_arrival_counter(counter, offset)
    assert len(recorder.launches) == 3  # the offset advances inside the cast's kernel
    assert [spec.name for spec in _KERNELS["stochastic_cast"].specs(call)] == [
        f"stochastic_cast_{short}_v128_t256", f"stochastic_cast_{short}_scalar_t256"]


def test_nearest_cast_takes_the_128_bit_form_only_when_aligned_and_draws_nothing(recorder) -> None:
    x_storage, result_storage = torch.empty(4100), torch.empty(4100, dtype=torch.float8_e4m3fn)
    for x, result, form in ((x_storage[:4097], result_storage[:4097], "v128"),
                            (x_storage[1:4098], result_storage[:4097], "scalar"),
                            (x_storage[:4097], result_storage[1:4098], "scalar")):
        call, inputs = describe_call(ops.nearest_cast, result, x)
        _KERNELS["nearest_cast"].prepare(call)(inputs, None)
        cast, (result_arg, x_arg) = recorder.launches[-1]
        assert cast == f"nearest_cast_fp32_to_e4m3_{form}_t256"
        assert result_arg.data_ptr() == result.data_ptr() and x_arg.data_ptr() == x.data_ptr()
    assert len(recorder.launches) == 3  # no advance launch
    assert [spec.name for spec in _KERNELS["nearest_cast"].specs(call)] == [
        "nearest_cast_fp32_to_e4m3_v128_t256", "nearest_cast_fp32_to_e4m3_scalar_t256"]


def test_a_draw_compiles_two_specialisations() -> None:
    call = describe_call(ops.fill_randn, torch.empty(3, 5, dtype=BF16), torch.zeros(1, dtype=torch.int64),
                         torch.zeros(1, dtype=torch.int64))[0]
    assert [spec.name for spec in _KERNELS["fill_randn"].specs(call)] == [
        "fill_randn_bf16_v128_t256_reduced", "fill_randn_bf16_scalar_t256_reduced"]


def test_each_draw_runs_its_measured_bytes_a_thread_unless_asked(monkeypatch) -> None:
    from tileplug.backend_cuda.random.spec import RUN_BYTES_VARIABLE, RandomKernelSpec

    seed, offset = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    uniform = describe_call(ops.fill_rand, torch.empty(7, dtype=torch.float32), seed, offset)[0]
    normal = describe_call(ops.fill_randn, torch.empty(7, dtype=torch.float32), seed, offset)[0]
    monkeypatch.delenv(RUN_BYTES_VARIABLE, raising=False)
    rand, randn = _KERNELS["fill_rand"].spec(uniform), _KERNELS["fill_randn"].spec(normal)
    assert (rand.blocks_per_thread, rand.name) == (2, "fill_rand_fp32_v128_t256")
    assert (randn.blocks_per_thread, randn.name) == (4, "fill_randn_fp32_v128_t256_reduced")
    assert not rand.wide_product and randn.wide_product  # fill_rand fp32 keeps the split product
    assert RandomKernelSpec("fill_rand") == rand and RandomKernelSpec("fill_randn", box_muller="reduced") == randn
    monkeypatch.setenv(RUN_BYTES_VARIABLE, "64")
    longer = _KERNELS["fill_rand"].spec(uniform)
    assert (longer.blocks_per_thread, longer.name) == (4, "fill_rand_fp32_v128_t256_run64")
    monkeypatch.setenv(RUN_BYTES_VARIABLE, "32")
    shorter = _KERNELS["fill_randn"].spec(normal)
    assert (shorter.blocks_per_thread, shorter.name) == (2, "fill_randn_fp32_v128_t256_run32_reduced")
    monkeypatch.setenv(RUN_BYTES_VARIABLE, "48")
    with pytest.raises(ValueError, match=f"{RUN_BYTES_VARIABLE}='48': expected one of 32, 64"):
        _KERNELS["fill_rand"].spec(uniform)


# ---------------------------------------------------------------------- the fp32 sigmoid's error, emulated

def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add: the exact fp64 product plus ``c``, rounded to fp32 (a double
    rounding only at a near-tie of the fp64 sum: rare, and never more than the fma's half ulp)."""
    return (a.double() * b.double() + c.double()).float()


def _sigmoid_fp32_emulated(g: torch.Tensor) -> torch.Tensor:
    """``activation.sigmoid_fp32`` step by step on fp32 tensors, with the kernel module's own
    constants (a change of a constant there shows here)."""
    from tileplug.backend_cuda.swiglu import activation as a

    def c(value: float) -> torch.Tensor:
        return torch.tensor(value, dtype=FP32)

    one = c(1.0)
    size = torch.fmin(g.abs(), c(a.SATURATION))  # CUDA's fminf: a NaN is dropped
    steps = _fma(size, c(a.LOG2E), c(a.ROUND_MAGIC)) - c(a.ROUND_MAGIC)
    r = _fma(steps, c(a.LN2_HIGH), -size)
    r = _fma(steps, c(a.LN2_LOW), r)
    poly = c(a.EXPM1_TERMS[0]).expand_as(r)
    for term in a.EXPM1_TERMS[1:]:
        poly = _fma(poly, r, c(term))
    m = _fma(r * r, poly, r)
    scaled_power = ((127 + a.SCALE_BITS - steps.to(torch.int32)) << 23).view(FP32)
    power = scaled_power * c(2.0 ** -a.SCALE_BITS)
    one_plus = one + power
    d_high = _fma(power, m, one_plus)
    d_low = _fma(power, m, one_plus - d_high) + (power - (one_plus - one))
    t_high = one + m
    negative = g < 0
    n_high = torch.where(negative, scaled_power * t_high, c(2.0 ** a.SCALE_BITS))
    n_low = torch.where(negative, scaled_power * ((one - t_high) + m), c(0.0))
    reciprocal = (1.0 / d_high.double()).float() * (1 + 2.0 ** -22)  # __fdividef is approximate: a 2-ulp stand-in
    quotient = n_high * reciprocal
    residual = _fma(-quotient, d_high, n_high)
    residual = _fma(-quotient, d_low, residual + n_low)
    corrected = _fma(residual, reciprocal, quotient)
    return corrected * c(2.0 ** -a.SCALE_BITS)


def test_the_fp32_sigmoid_is_within_one_ulp_of_the_correctly_rounded_one() -> None:
    """Over dense samples of [-120, 25] and the edges (saturation, subnormal results, ±inf): never
    more than 1 ulp from the reference's correctly rounded sigmoid, equal to it for at least 95 % of
    the values (what ``SwigluKernelSpec.sigmoid`` promises bf16 results). A NaN gate gives a finite
    sigmoid and a NaN ``g · s``: the NaN reaches every output through ``g``."""
    generator = torch.Generator().manual_seed(3)
    g = torch.cat([torch.linspace(-120, 25, 1_000_001), torch.randn(1_000_000, generator=generator) * 4,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 17.5, 20.0, 200.0, -87.5, -100.0, -103.9, -104.0,
                                 -110.0, -1e30, float("inf"), float("-inf")])]).float()
    emulated = _sigmoid_fp32_emulated(g)
    reference = torch.sigmoid(g.double()).float()
    nan = torch.isnan(reference)
    assert not bool(nan.any()) and not bool(torch.isnan(emulated).any())
    distance = (emulated[~nan].view(torch.int32).long() - reference[~nan].view(torch.int32).long()).abs()
    assert int(distance.max()) <= 1, f"worst {int(distance.max())} ulp at g = {float(g[~nan][distance.argmax()])}"
    assert float((distance == 0).double().mean()) >= 0.95
    nan_in = torch.tensor([float("nan"), -float("nan")])
    sigmoid = _sigmoid_fp32_emulated(nan_in)
    assert bool(torch.isfinite(sigmoid).all()) and bool(torch.isnan(nan_in * sigmoid).all())


def test_a_bf16_y_takes_the_branchless_sigmoid_unless_asked_for_another(monkeypatch) -> None:
    """By default a bf16 ``y`` takes the branchless hardware-exponential sigmoid and, without the
    sigmoid table (``TILEPLUG_CUDA_SWIGLU_SIGMOID_TABLE=0``), fp32 results and the cast the reduced
    fp64 one (their kernel names say so, keeping the index entries apart), on a tile of 2 vectors a lane that asks for 2 CTAs an SM where their registers fit;
    ``TILEPLUG_CUDA_SWIGLU_BF16_SIGMOID`` names the guarded or the accurate one,
    ``TILEPLUG_CUDA_SWIGLU_FP64_SIGMOID=library`` the library one, and the vectors a lane and the
    CTAs an SM are tuning variables too; every variant has its own kernel name, and a wrong value
    is an error naming the variable."""
    from tileplug.backend_cuda.swiglu.spec import (
        CHUNKS_VARIABLE,
        CTAS_PER_SM_VARIABLE,
        FP64_SIGMOID_VARIABLE,
        SIGMOID_VARIABLE,
    )

    x = torch.randn(2, 2 * 7168, dtype=BF16)
    bf16_call = describe_call(ops.swiglu, x)[0]
    fp32_call = describe_call(ops.swiglu, x, out_dtype=FP32)[0]
    cast_call = describe_call(ops.swiglu_per_token_cast, x)[0]
    spec = _KERNELS["swiglu"].spec
    cast_spec = _KERNELS["swiglu_per_token_cast"].spec
    for variable in (SIGMOID_VARIABLE, FP64_SIGMOID_VARIABLE, CHUNKS_VARIABLE, CTAS_PER_SM_VARIABLE):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("TILEPLUG_CUDA_SWIGLU_SIGMOID_TABLE", "0")
    assert spec(bf16_call).sigmoid == "branchless" and spec(bf16_call).name.endswith("_branchless")
    assert spec(fp32_call).sigmoid == "reduced" and cast_spec(cast_call).sigmoid == "reduced"
    default = cast_spec(cast_call)
    assert (default.tile.threads, default.tile.chunks, default.ctas_per_sm) == (448, 2, 2)
    assert default.name.endswith("_b2_" + "_".join(default.quant.name_parts(clamp_tag="m")) + "_reduced")
    names = {spec(bf16_call).name, spec(fp32_call).name, default.name}
    monkeypatch.setenv(SIGMOID_VARIABLE, "accurate")
    assert spec(bf16_call).sigmoid == "accurate" and not spec(bf16_call).name.endswith("_branchless")
    names.add(spec(bf16_call).name)
    monkeypatch.setenv(SIGMOID_VARIABLE, "guarded")
    assert spec(bf16_call).sigmoid == "guarded" and spec(bf16_call).name.endswith("_guarded")
    assert spec(fp32_call).sigmoid == "reduced" and cast_spec(cast_call).sigmoid == "reduced"
    names.add(spec(bf16_call).name)
    monkeypatch.setenv(FP64_SIGMOID_VARIABLE, "library")
    assert spec(fp32_call).sigmoid == "library" and cast_spec(cast_call).sigmoid == "library"
    assert spec(bf16_call).sigmoid == "guarded"
    names |= {spec(fp32_call).name, cast_spec(cast_call).name}
    monkeypatch.setenv(CHUNKS_VARIABLE, "4")
    monkeypatch.setenv(CTAS_PER_SM_VARIABLE, "0")
    tuned = cast_spec(cast_call)
    assert tuned.tile.threads == 224 and tuned.tile.chunks == 4 and tuned.ctas_per_sm == 0
    names.add(tuned.name)
    assert len(names) == 8, names
    for variable in (SIGMOID_VARIABLE, FP64_SIGMOID_VARIABLE):
        monkeypatch.setenv(variable, "fast")
        with pytest.raises(ValueError, match=variable):
            spec(bf16_call if variable == SIGMOID_VARIABLE else fp32_call)
        monkeypatch.delenv(variable)


@pytest.mark.parametrize("hidden,dtype,want", [
    (7168, BF16, (448, 2, 2)),    # 2 vectors a lane, 2 CTAs of 448 threads: 72 registers fit
    (4096, BF16, (256, 2, 2)),
    (1408, BF16, (192, 1, 2)),
    (8192, BF16, (512, 2, 0)),    # 512 threads: two CTAs leave 64 registers, fewer than 72
    (14336, BF16, (448, 4, 0)),   # the lane holds 4 vectors (512 threads at most): ptxas' choice
    (16384, FP32, (512, 8, 0)),
    (256, BF16, (128, 1, 0)),     # a tile of several rows keeps ptxas' choice
])
def test_the_default_tile_asks_for_two_ctas_only_where_their_registers_fit(monkeypatch, hidden, dtype, want) -> None:
    """The default SwiGLU tile aims for 2 vectors a lane and asks ptxas for 2 CTAs an SM only where
    a lane holds at most 2 vectors of one row and ``2 · threads · 72`` registers fit the SM's 65536;
    the backward takes the same tile."""
    from tileplug.backend_cuda.swiglu.spec import CHUNKS_VARIABLE, CTAS_PER_SM_VARIABLE

    for variable in (CHUNKS_VARIABLE, CTAS_PER_SM_VARIABLE):
        monkeypatch.delenv(variable, raising=False)
    x = torch.randn(3, 2 * hidden, dtype=dtype)
    forward = _KERNELS["swiglu"].spec(describe_call(ops.swiglu, x)[0])
    backward = _KERNELS["swiglu_backward"].spec(
        describe_call(ops.swiglu_backward, x, torch.randn(3, hidden, dtype=dtype))[0])
    for spec in (forward, backward):
        assert (spec.tile.threads, spec.tile.chunks, spec.ctas_per_sm) == want, spec.name
        assert ("_b2" in spec.name.split(spec.tile.name)[1]) == (want[2] == 2)


@pytest.mark.parametrize("name, value, expected", [("CTAS_PER_SM_VARIABLE", "yes", "expected an integer"),
                                                    ("SIGMOID_TABLE_VARIABLE", "2", "expected 0 or 1")])
def test_a_tuning_variable_the_knob_cannot_take_is_named(monkeypatch, name, value, expected) -> None:
    """A tuning variable holding something its knob cannot take (a count that is not an integer, a
    switch that is not 0 or 1) fails with the variable's name and value, not a bare ``int()`` message."""
    from tileplug.backend_cuda.swiglu import spec

    variable = getattr(spec, name)
    monkeypatch.setenv(variable, value)
    x = torch.randn(2, 2 * 7168, dtype=BF16)
    with pytest.raises(ValueError) as raised:
        _KERNELS["swiglu_per_token_cast"].spec(describe_call(ops.swiglu_per_token_cast, x)[0])
    assert str(raised.value) == f"{variable}={value!r}: {expected}"


@pytest.mark.parametrize("source, target, fields, blocks, run", [(FP32, BF16, 2, 1, 8),
                                                                 (FP32, torch.float8_e4m3fn, 4, 1, 16),
                                                                 (BF16, torch.float8_e4m3fn, 4, 1, 16)])
def test_a_stochastic_cast_thread_takes_whole_blocks_of_its_pairs_fields(source, target, fields, blocks, run) -> None:
    """A thread's run of one 128-bit access is ``R / (4k)`` Philox blocks of ``k`` fields a word
    (core's field widths: 16, 8, 8 bits); the nearest cast's run is the same access."""
    from tileplug.backend_cuda.quant.element_cast import ElementCastSpec, TL_DTYPES
    from tileplug.core.contracts.cast import RANDOM_FIELD_BITS

    spec = ElementCastSpec("stochastic_cast", TL_DTYPES[source], TL_DTYPES[target])
    assert spec.field_bits == RANDOM_FIELD_BITS[source, target] and spec.fields_per_word == fields
    assert (spec.blocks_per_thread, spec.values_per_thread) == (blocks, run)
    assert spec.blocks_per_thread * 4 * spec.fields_per_word == spec.values_per_thread
    nearest = ElementCastSpec("nearest_cast", TL_DTYPES[source], TL_DTYPES[target])
    assert nearest.values_per_thread == run and nearest.blocks_per_thread * 4 == run


def _kernel_field(words: torch.Tensor, field: int, width: int, position: int) -> torch.Tensor:
    """``element_kernels.random_field`` on int64 tensors holding uint32 words: shifted to the top
    (mod 2^32), down to ``position``, masked below it."""
    moved = ((words << (width * field)) & 0xFFFFFFFF) >> (32 - width - position)
    return moved if position == 0 else moved & (((1 << width) - 1) << position)


@pytest.mark.parametrize("width, position", [(16, 0), (16, 4), (8, 12), (8, 16), (24, 0)])
def test_the_kernels_field_shifts_give_the_references_fields(width, position) -> None:
    """Field ``s`` of each word as the CUDA kernels extract it equals the reference's field of
    element ``k·w + s`` (moved from the 24-bit scale to ``position``)."""
    from tileplug.reference.quant.stochastic_cast import element_random_bits
    from tileplug.reference.random.philox import words

    seed, offset = torch.tensor([0x243F6A8885A308D3]), torch.tensor([7])
    per_word = 32 // width
    drawn = words(seed, offset, 1024)
    reference = element_random_bits(seed, offset, (1024 * per_word,), width).view(1024, per_word)
    for field in range(per_word):
        want = reference[:, field] >> (24 - width) << position
        assert torch.equal(_kernel_field(drawn, field, width, position), want)


def _carry_rounding_model(value: torch.Tensor, field: torch.Tensor, width: int) -> torch.Tensor:
    """``element_kernels.carry_round_to_e4m3`` on the CPU: ``a = |value|``; below 2^-6 the pattern of
    ``a + 2^-6`` added toward zero (in [2^-6, 2^-5) its ulp is 2^-29: 2^-6's pattern plus
    ``floor(a · 2^29)``, an exact scaling and floor in fp32); the ``width``-bit field added at bits
    ``20 − width`` … 19, the pattern cut to e4m3's mantissa, minus 2^-6, the sign put back, NaN kept,
    and the store's ``satfinite`` (torch's own conversion gives NaN past 448) → e4m3."""
    magnitude = value.abs()
    small = magnitude < 2.0**-6
    smallest_normal_bits = torch.tensor(2.0**-6).view(torch.int32).to(torch.int64)
    truncated_sum = smallest_normal_bits + (magnitude * 2.0**29).floor().to(torch.int64)
    summed = torch.where(small, truncated_sum, magnitude.view(torch.int32).to(torch.int64))
    rounded = ((summed + (field << (20 - width))) & 0xFFF00000).to(torch.int32).view(torch.float32)
    result = (rounded - torch.where(small, 2.0**-6, 0.0)).copysign(value)
    return torch.where(value.isnan(), value, result.clamp(-448.0, 448.0)).to(torch.float8_e4m3fn)


def test_the_bf16_to_e4m3_rounding_equals_the_reference_on_every_bf16() -> None:
    """``element_kernels.carry_round_to_e4m3``'s arithmetic at 8 bits (a carry at bits 12–19),
    modelled on the CPU, against the reference's rule for all 65536 bf16 patterns and a spread of
    8-bit fields (0, 1, the middle, 255, random)."""
    from tileplug.reference.quant.stochastic_cast import round_to_e4m3

    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    value = patterns.view(BF16).float()
    generator = torch.Generator().manual_seed(5)
    fields = [torch.full_like(patterns, f, dtype=torch.int64) for f in (0, 1, 127, 128, 255)]
    fields += [torch.randint(0, 256, patterns.shape, generator=generator) for _ in range(3)]
    for index, field in enumerate(fields):
        assert_bytes_equal(_carry_rounding_model(value, field, 8), round_to_e4m3(value, field << 16),
                           f"every bf16 pattern (element = pattern), fields {index}", nan_equal=True)


def test_the_fp32_to_e4m3_rounding_equals_the_reference() -> None:
    """The same arithmetic at 16 bits (a carry at bits 4–19, the sum below 2^-6 toward zero) against
    the reference's rule on 2^20 random fp32 patterns, every binade's edges (each power of two, one
    ulp either side, both signs), e4m3's subnormal range densely, and fields 0, 1, the middle,
    2^16 − 1 and random ones."""
    from tileplug.reference.quant.stochastic_cast import round_to_e4m3

    generator = torch.Generator().manual_seed(6)
    random_patterns = torch.randint(-(2**31), 2**31, (1 << 20,), generator=generator, dtype=torch.int64)
    powers = torch.arange(-149, 128, dtype=torch.float64).exp2().float()
    edges = torch.cat([powers, powers.view(torch.int32).add(1).view(torch.float32),
                       powers.view(torch.int32).sub(1).view(torch.float32)])
    subnormal_steps = torch.rand(1 << 16, generator=generator) * 2.0**-6
    value = torch.cat([random_patterns.to(torch.int32).view(torch.float32), edges, -edges, subnormal_steps,
                       torch.tensor([0.0, -0.0, 448.0, 464.0, 480.0, 3.4e38, math.inf, -math.inf, math.nan])])
    fields = [torch.full(value.shape, f, dtype=torch.int64) for f in (0, 1, 1 << 15, (1 << 16) - 1)]
    fields += [torch.randint(0, 1 << 16, value.shape, generator=generator) for _ in range(2)]
    for index, field in enumerate(fields):
        assert_bytes_equal(_carry_rounding_model(value, field, 16), round_to_e4m3(value, field << 8),
                           f"fp32 values, fields {index}", nan_equal=True)
    # Below 2^-6, where a nearest-even sum would carry into the field's bits: a = k · 2^-25 plus
    # 15.75 units of 2^-29 (k ones-complemented in the field) sits one short of the threshold; added
    # toward zero it rounds down, as the reference does (a nearest-even sum would round it up).
    k = torch.randint(1, (1 << 16) - 1, (4096,), generator=generator)
    value = k.double() * 2.0**-25 + 15.75 * 2.0**-29
    assert torch.equal(value.float().double(), value)  # exact in fp32
    value, field = value.float(), (1 << 16) - 1 - k
    expected = (k.double() * 2.0**-25 / 2.0**-9).floor() * 2.0**-9  # the step below: p truncated is k · 2^-16
    assert torch.equal(round_to_e4m3(value, field << 8).double(), expected)
    assert_bytes_equal(_carry_rounding_model(value, field, 16), round_to_e4m3(value, field << 8),
                       "the crafted values", nan_equal=True)
