"""Ascend ``nearest_cast`` kernel: LOWERING tests and a CPU emulation of its conversions. Nothing
here runs on an NPU.

* Every op-table case lowers to Ascend C (disk-cached, in a process pool, as
  tests/test_ascend_stochastic_cast_lowering.py) and passes the three checks; the source reads ``x``
  from GM and writes the result, reads no generator state, runs no Philox rounds and converts on
  integers (no fp8 ``vcvt``); each check fails on a bad variant; declines carry their reasons; the
  launch passes the flat tensors in the prim_func's order and advances nothing.
* The emulation: the kernel's conversions (``backend_ascend/quant/nearest_cast.py``) are plain
  Python over an ``ops`` object; :class:`NearestNumpyOps` (the stochastic test's ``CastNumpyOps``)
  runs the very functions the kernel is traced from — the loads' widening (with unspecified high
  bits in each lane), the bf16 / e4m3 / fp32 narrowing, register by register — and the bytes equal
  the reference's (any NaN equal to any NaN) for all nine pairs on the edge inputs (±0, ±inf, NaNs,
  448 and past it, every e4m3 value and the ties between neighbours, fp32 denormals, the top of
  fp32), every bf16 pattern, every e4m3 code, random inputs and the op table's own cases, also when
  ``vmul`` / ``vadds`` flush denormals; a mutated constant makes it fail. What it cannot show: that
  the hardware instructions behave as assumed (``random/vector_ops.py`` lists the assumptions).

No ``from __future__ import annotations``: TileLang parses the bad kernel's macro source.
"""

import os
import struct
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
import torch

from test_ascend_stochastic_cast_lowering import CastNumpyOps, _loaded_registers, _random_inputs, edge_inputs
from tileplug import core

pytestmark = pytest.mark.ascend_lower

META = "meta"
OP = "nearest_cast"
DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float8_e4m3fn: "e4m3"}
PAIRS = [(source, target) for source in DTYPES for target in DTYPES]
PAIR_IDS = [f"{SHORT[source]}-{SHORT[target]}" for source, target in PAIRS]
CODE_VIEW = {torch.float32: (np.uint32, np.int32, torch.int32), torch.bfloat16: (np.uint16, np.int16, torch.int16),
             torch.float8_e4m3fn: (np.uint8, np.uint8, torch.uint8)}
"""Target → (unsigned numpy type of its patterns, the numpy and torch types to view them through)."""


def _kernel():
    from tileplug.backend_ascend.plugin import kernel_table

    return kernel_table()[OP]


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(case):
    with core.config.host_layout("ascend"):
        args, kwargs = case.arguments(5, META)
        call, _ = core.describe_call(case.op, *args, **kwargs)
    return call


def _nearest_call(count, source=torch.float32, target=torch.float8_e4m3fn):
    with core.config.host_layout("ascend"):
        call, _ = core.describe_call(core.ops.nearest_cast, torch.empty(count, dtype=target, device=META),
                                     torch.empty(count, dtype=source, device=META))
    return call


def _grid() -> list:
    """``[(specialisation, first case it serves)]`` of every nearest_cast case of the op table."""
    kernel = _kernel()
    grid = {}
    for case in core.opdefs.get(OP).cases():
        grid.setdefault(kernel.describe(_describe(case)), case)
    return list(grid.items())


def lower_and_check(entry) -> dict:
    """Worker: lower the case's specialisation (disk-cached) and run the checks on it."""
    from tileplug.backend_ascend import lowering_checks as checks

    name, case = entry
    call = _describe(case)
    kernel = _kernel()
    result = {"name": name, "declined": kernel.supports(call)}
    if result["declined"] is not None:
        return result
    (lowering,) = kernel.lowerings(call)
    lowered = lowering.lowered
    result["source"] = lowered.source
    result["checks"] = {
        "ub": checks.check_ub(lowered.compiler_ub_bytes, lowered.primfunc_ub_bytes, lowering.plan_bytes,
                              lowering.budget),
        "pipelined": checks.check_pipelined(lowered.source),
        "vector": checks.check_vector(lowered.source),
        "nonempty": ("__gm__" in lowered.source, "kernel has __gm__ parameters"),
    }
    return result


CASES = _grid()


@pytest.fixture(scope="module")
def lowered() -> dict:
    with ProcessPoolExecutor(min(2, os.cpu_count() or 1)) as pool:
        return {result["name"]: result for result in pool.map(lower_and_check, CASES)}


def test_every_case_of_the_op_table_is_served():
    """The op table's twelve cases make one specialisation per pair, all nine of them (the element
    count is dynamic)."""
    assert len(core.opdefs.get(OP).cases()) == 12
    assert sorted(name for name, _ in CASES) == sorted(
        f"nearest_cast [N] {_name(source)} -> {_name(target)} tile=4096" for source, target in PAIRS)


@pytest.mark.parametrize("case", CASES, ids=[name for name, _ in CASES])
def test_lowering_passes_checks(lowered, case):
    result = lowered[case[0]]
    assert result["declined"] is None, result["declined"]
    failed = {name: detail for name, (ok, detail) in result["checks"].items() if not ok}
    assert not failed, failed


@pytest.mark.parametrize("case", CASES, ids=[name for name, _ in CASES])
def test_source_holds_the_integer_conversion(lowered, case):
    """``x`` DMA'd from GM and the result DMA'd to it (no scalar GM write); no generator state, no
    Philox rounds, no truncating conversion and no fp8 ``vcvt`` (the codes are integers); the loads
    unpack bf16 / e4m3 into 32-bit lanes; per target: the bf16 RNE bias and quiet NaN, the e4m3
    saturation at 448 and the ``+ 2^23`` rounding of the steps, a packing store (fp32: a plain one);
    an e4m3 source's decoding (the rebias ``120 << 23``, the NaN code test)."""
    from tileplug.backend_ascend.quant import nearest_cast as kernel
    from tileplug.backend_ascend.quant import stochastic_cast as element

    name, _ = case
    source = lowered[name]["source"]
    source_dtype, target_dtype = name.removeprefix("nearest_cast [N] ").removesuffix(" tile=4096").split(" -> ")
    assert "(__gm__ uint8_t*)((&(X[" in source and "asc_copy_ub2gm_align((__gm__ uint8_t*)((&(RESULT[" in source
    assert "RESULT[0] =" not in source
    assert "SEED" not in source and "OFFSET" not in source and "vmull" not in source
    assert "ROUND_Z" not in source and "vcvt<float8" not in source and "vcvt<bfloat16" not in source
    assert source.count("__simd_vf__") == 1
    if source_dtype == "bfloat16":
        assert "vlds_unpack<bfloat16_t>" in source and "vshls(loaded, (uint32_t)16," in source
    if source_dtype == "float8_e4m3fn":
        assert "vlds_unpack4<float8_e4m3_t>" in source
        assert f"(uint32_t){kernel.E4M3_REBIAS}" in source and f"(uint32_t){kernel.E4M3_LARGEST_FINITE}" in source
    if target_dtype == "bfloat16":
        assert f"(uint32_t){kernel.BF16_HALF_STEP}" in source and f"(uint32_t){element.INF_PATTERN}" in source
        assert "vsts_pack_b32" in source
    if target_dtype == "float8_e4m3fn":
        assert f"(uint32_t){element.E4M3_MAX_PATTERN}" in source and "vadds(scaled, float(0x1p+23f" in source
        assert "vsts_pack_quarter" in source
    if target_dtype == "float32":
        assert "simd_inst::vsts_norm((*(vector_f32 *)" in source and "vsts_pack" not in source


def test_core_lower_states_lowered_and_the_specialisation():
    with core.config.host_layout("ascend"):
        source = core.lower(core.ops.nearest_cast, torch.empty(3, 7, dtype=torch.bfloat16, device=META),
                            torch.empty(3, 7, dtype=torch.float8_e4m3fn, device=META), backend="ascend")
    assert "LOWERED" in source and "not verified" in source and "stand-in" in source
    assert "specialisation: nearest_cast [N] float8_e4m3fn -> bfloat16 tile=4096" in source
    assert "groups of 256 elements" in source and "__global__" in source


def test_capabilities_say_lowered():
    from tileplug.backend_ascend import plugin

    text = plugin.capabilities()
    paragraph = text[text.index("nearest_cast ("):]
    paragraph = paragraph[:paragraph.index("Lowered, never run on an NPU.") + len("Lowered, never run on an NPU.")]
    assert "every pair of fp32 / bf16 / e4m3" in paragraph and "< 2**31 - 4096" in paragraph
    assert "verified" not in paragraph


def test_declines_carry_reasons():
    """Past ``2^31 − 4096`` elements the tile kernel's int32 index arithmetic would overflow: the
    reference serves it; a call of another dtype (the contract refuses it; here made by hand) is
    declined."""
    from tileplug.backend_ascend.random.draw import MAX_ELEMENTS

    kernel = _kernel()
    for source, target in PAIRS:
        assert kernel.supports(_nearest_call(MAX_ELEMENTS, source, target)) is None
        why = kernel.supports(_nearest_call(MAX_ELEMENTS + 1, source, target))
        assert why is not None and "int32" in why and "falls to the reference" in why, why
    for changed in ({"target": torch.float16}, {"source": torch.float64}):
        why = kernel.supports(replace(_nearest_call(8), **changed))
        assert why is not None and "not one of the dtypes" in why, why
    assert "serves nearest_cast" in kernel.supports(replace(_nearest_call(8), op="stochastic_cast"))


def test_launch_passes_the_flat_tensors():
    """``__call__`` (CPU tensors, the compiled kernel replaced by a recorder): the flat x and result in
    the prim_func's order, nothing else launched or written."""
    kernel = _kernel()
    x, result = torch.randn(3, 5).to(torch.bfloat16), torch.empty(3, 5, dtype=torch.float8_e4m3fn)
    call, inputs = core.describe_call(core.ops.nearest_cast, result, x)
    launched = []

    def record(*args):  # what the kernel would see: the tensors' storage and their values at launch
        launched.append([(arg.data_ptr(), arg.dtype, arg.shape) for arg in args])

    before = x.clone()
    with core.config.override(ascend_vector_cores=8), mock.patch.object(kernel.compiled, "get",
                                                                        lambda spec: record):
        kernel(call, inputs, None)
    (flat_x, flat_result), = launched
    assert flat_x == (x.data_ptr(), torch.bfloat16, (15,))
    assert flat_result == (result.data_ptr(), torch.float8_e4m3fn, (15,))
    assert torch.equal(x, before)
    assert kernel.spec_of(call).reads_state is False and "seed_ub" not in kernel.spec_of(call).plan()


# ---------------------------------------------------------------------- the checks can fail


def _scalar_nearest_compute(spec):
    """Per-element scalar conversion of a tile on the scalar unit: no SIMD region."""
    import tilelang.ascend.language as T

    W = spec.tile

    @T.macro
    def compute(buffers, first_block, groups):
        for i in T.serial(W):
            buffers["out_ub"][i] = T.Cast(spec.target, buffers["x_ub"][i])

    return compute


def test_checks_fail_on_bad_variants():
    """fp32 → e4m3 passes every check; (a) an 8-version tile of 65536 elements over the UB budget
    (the builder refuses it; forced through, the UB check fails), (b) a serial, single-buffered
    tile loop, (c) the conversion in per-element scalar code each fail theirs."""
    import ascend_bad_kernels as bad_kernels

    from test_ascend_lowering import _checked  # the three checks on a traced prim_func
    from tileplug.backend_ascend.device import UBBudgetError
    from tileplug.backend_ascend.quant import nearest_cast as kernel

    spec = kernel.spec_of(_nearest_call(1000))
    good = _checked(kernel.build(spec), spec)
    assert all(ok for ok, _ in good.values()), good

    wide = replace(spec, tile=65536, num_buffers=8)
    assert wide.footprint > wide.budget
    with pytest.raises(UBBudgetError):
        kernel.build(wide)
    ok, detail = _checked(bad_kernels.row_over_budget(kernel.build, wide), wide)["ub"]
    assert not ok and "over budget" in detail, detail

    ok, detail = _checked(bad_kernels.row_serial_loop(kernel.build, spec), spec)["pipelined"]
    assert not ok and "versions=[1]" in detail, detail

    with mock.patch.object(kernel, "conversion_compute", _scalar_nearest_compute):
        scalar = kernel.build(spec)
    ok, detail = _checked(scalar, spec)["vector"]
    assert not ok and "scalar UB dereference" in detail, detail


# ---------------------------------------------------------------------- CPU emulation


class NearestNumpyOps(CastNumpyOps):
    """``CastNumpyOps``; with ``flush_denormals`` the fp32 ``vadds`` (``plus``) takes and gives
    denormals as zero too, as ``vmul`` / ``vmuls`` / ``vsub`` do there."""

    def plus(self, a, addend, name=""):
        if not self._flush:
            return super().plus(a, addend, name)
        return self._flushed(super().plus(self._flushed(a), addend, name))


def loaded_registers(x: torch.Tensor, garbage_seed: int = 1) -> np.ndarray:
    """What the kernel's loads give for flat ``x``: ``uint32`` lanes, the fp32 pattern, or the bf16
    pattern / e4m3 code in the low half / byte with the other bits unspecified (random here)."""
    if x.dtype != torch.float8_e4m3fn:
        return _loaded_registers(x, garbage_seed)
    low = x.view(torch.uint8).numpy().astype(np.uint32)
    high = np.random.default_rng(garbage_seed).integers(0, 1 << 24, low.shape, dtype=np.uint32)
    return low | (high << np.uint32(8))


def emulated_nearest(ops, x: torch.Tensor, target: torch.dtype, garbage_seed: int = 1) -> torch.Tensor:
    """What the kernel writes for ``x`` (flattened): its 64-lane registers (the last one padded)
    through ``convert_register``, cut at the element count, as ``target``."""
    from tileplug.backend_ascend.quant.nearest_cast import convert_register
    from tileplug.backend_ascend.ub import LANES

    count = x.numel()
    registers = -(-count // LANES)
    loaded = np.zeros(registers * LANES, dtype=np.uint32)
    loaded[:count] = loaded_registers(x.reshape(-1), garbage_seed)
    codes = convert_register(ops, loaded.reshape(registers, LANES), _name(x.dtype), _name(target))
    flat = np.broadcast_to(np.asarray(codes, dtype=np.uint32), (registers, LANES)).reshape(-1)[:count]
    unsigned, viewed, torch_view = CODE_VIEW[target]
    assert (flat.astype(np.uint64) >> np.uint64(8 * np.dtype(unsigned).itemsize) == 0).all(), "a code too wide"
    return torch.from_numpy(flat.astype(unsigned).view(viewed).copy()).view(torch_view).view(target).reshape(x.shape)


def reference_nearest(x: torch.Tensor, target: torch.dtype) -> torch.Tensor:
    """The reference's ``nearest_cast`` of ``x`` on the CPU."""
    from tileplug.reference.quant.nearest_cast import nearest_cast

    result = torch.empty(x.shape, dtype=target)
    call, inputs = core.describe_call(core.ops.nearest_cast, result, x)
    nearest_cast(call, inputs, None)
    return result


def _f32_patterns(values) -> torch.Tensor:
    return torch.tensor(np.asarray(values, dtype=np.uint32).view(np.int32)).view(torch.float32)


def _f32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def fp32_edge_inputs() -> torch.Tensor:
    """The stochastic test's fp32 edge values (zeros, infinities, NaNs, 448 and past it, every e4m3
    value, the midpoints of its steps and their neighbours, fp32 denormals, the top of fp32, bf16
    midpoints) and more ties, each with both signs: every bf16 midpoint of a few binades (kept last
    bit even and odd) and its neighbours, the ties past 448 (464, 480 ± 16), the e4m3 subnormal
    ties from ``2^-10`` up, and the denormals' own bf16 ties."""
    magnitudes = [0x3F800000 + (k << 16) + 0x8000 + delta for k in range(8) for delta in (-1, 0, 1)]
    magnitudes += [0x00008000, 0x00018000, 0x007F8000, 0x007FFFFF, 0x00800000, 0x7F7F8000, 0x7F7F7FFF, 0x7F7E8000]
    magnitudes += [_f32_bits(v) for v in (464.0, 480.0, 496.0, 447.99997, 448.00003, 2.0**-10, 3 * 2.0**-10,
                                          5 * 2.0**-10, 7 * 2.0**-10, 15 * 2.0**-10, 2.0**-11, 2.0**-149)]
    extra = sorted(set(magnitudes))
    return torch.cat([edge_inputs(), _f32_patterns(extra + [bits | 0x80000000 for bits in extra])])


def every_pattern(source: torch.dtype) -> torch.Tensor:
    """The edge inputs of ``source``: fp32 :func:`fp32_edge_inputs`, all 65536 bf16 patterns, all
    256 e4m3 codes."""
    if source == torch.bfloat16:
        return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    if source == torch.float8_e4m3fn:
        return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    return fp32_edge_inputs()


@pytest.mark.parametrize("flush_denormals", [False, True], ids=["denormals-kept", "denormals-flushed"])
@pytest.mark.parametrize("source, target", PAIRS, ids=PAIR_IDS)
def test_emulated_conversion_of_the_edge_inputs_is_the_reference(source, target, flush_denormals):
    """Each pair on its source's edge inputs (every bf16 pattern, every e4m3 code, the fp32 edge
    values and ties), two draws of the lanes' unspecified high bits: bytewise equal to the
    reference, any NaN equal. A flushing ``vmul`` / ``vadds`` changes nothing but fp32 → fp32 and
    fp32 → bf16, which never multiply."""
    from tileplug.core.testing import assert_bytes_equal

    x = every_pattern(source)
    want = reference_nearest(x, target)
    for garbage_seed in (1, 2):
        got = emulated_nearest(NearestNumpyOps(flush_denormals), x, target, garbage_seed)
        assert_bytes_equal(got, want, what=f"{SHORT[source]}->{SHORT[target]}", nan_equal=True)


def test_emulated_conversion_keeps_what_the_spec_names():
    """Hand-picked bytes, independent of the reference: e4m3 saturation of an infinity and of values
    past 448, -0, the ties to even (``2^-10`` → 0, ``3 · 2^-10`` → code 2, ``1 + 2^-4`` → 1,
    ``1 + 3 · 2^-4`` → ``1.25``), NaN → ``0x7F`` with its sign; bf16: the largest finite fp32 → inf,
    a tie with an odd kept bit rounding up; e4m3 → fp32 of every subnormal code exact."""
    ops = NearestNumpyOps()
    x = torch.tensor([float("inf"), -float("inf"), 464.0, -1e6, -0.0, 2.0**-10, 3 * 2.0**-10, 1 + 2.0**-4,
                      1 + 3 * 2.0**-4, float("nan"), -float("nan")])
    codes = emulated_nearest(ops, x, torch.float8_e4m3fn).view(torch.uint8).tolist()
    assert codes[:9] == [0x7E, 0xFE, 0x7E, 0xFE, 0x80, 0x00, 0x02, 0x38, 0x3A], [hex(c) for c in codes]
    assert codes[9] & 0x7F == 0x7F and codes[10] & 0x7F == 0x7F
    bf16 = emulated_nearest(ops, _f32_patterns([0x7F7FFFFF, 0x3F818000, 0x3F808000, 0x80000000]), torch.bfloat16)
    assert [bits & 0xFFFF for bits in bf16.view(torch.int16).tolist()] == [0x7F80, 0x3F82, 0x3F80, 0x8000]
    subnormals = torch.arange(8, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    assert emulated_nearest(ops, subnormals, torch.float32).tolist() == [k * 2.0**-9 for k in range(8)]


def _random_of(source: torch.dtype, count: int, seed: int) -> torch.Tensor:
    """fp32 / bf16: the stochastic test's random inputs (random fp32 patterns, NaNs and infinities
    among them, and values around e4m3's range); e4m3: random codes."""
    if source == torch.float8_e4m3fn:
        codes = np.random.default_rng(seed).integers(0, 256, count, dtype=np.uint8)
        return torch.from_numpy(codes).view(torch.float8_e4m3fn)
    return _random_inputs(source, count, seed)


@pytest.mark.parametrize("source, target", PAIRS, ids=PAIR_IDS)
def test_emulated_kernel_is_the_reference_on_random_inputs(source, target):
    """Random inputs over a cast that spans three tiles and ends inside a register: bytewise, any
    NaN equal."""
    from tileplug.core.testing import assert_bytes_equal

    for seed in (3, 11):
        x = _random_of(source, 2 * 4096 + 1001, seed)
        assert_bytes_equal(emulated_nearest(NearestNumpyOps(), x, target), reference_nearest(x, target),
                           what=f"{SHORT[source]}->{SHORT[target]} seed={seed}", nan_equal=True)


@pytest.mark.parametrize("case", core.opdefs.get(OP).cases(), ids=lambda case: case.id)
def test_emulated_kernel_is_the_reference_on_the_op_table_cases(case):
    """The op table's own arguments (every special value in the first row) at 3 tokens, on the CPU:
    the emulated kernel's result is the reference's, by the op's own comparison."""
    args, _ = case.arguments(3, "cpu")
    result, x = args
    got = emulated_nearest(NearestNumpyOps(), x, result.dtype)
    case_compare = core.opdefs.get(OP).compare
    case_compare(case, 3, [got], [reference_nearest(x, result.dtype)])


MUTATIONS = [
    ("ROUNDING_ADDEND", 2.0**22, torch.float32, torch.float8_e4m3fn),  # steps rounded to even numbers of steps
    ("BF16_HALF_STEP", 0x8000, torch.float32, torch.bfloat16),  # ties away from zero
    ("E4M3_REBIAS", 121 << 23, torch.float8_e4m3fn, torch.float32),  # every normal code decoded twice too big
    ("E4M3_LARGEST_FINITE", 0x7F, torch.float8_e4m3fn, torch.bfloat16),  # the NaN code decoded as 480
    ("E4M3_LARGEST_SUBNORMAL", 6, torch.float8_e4m3fn, torch.float32),  # code 7 decoded as a normal
]


@pytest.mark.parametrize("constant, value, source, target", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_emulation_catches_a_wrong_conversion(constant, value, source, target):
    """The comparison can fail: with one constant of the kernel's conversion wrong, some byte of the
    edge inputs differs from the reference's (NaN lanes equal to NaN lanes set aside)."""
    from tileplug.backend_ascend.quant import nearest_cast as kernel

    x = every_pattern(source)
    want = reference_nearest(x, target)
    with mock.patch.object(kernel, constant, value):
        got = emulated_nearest(NearestNumpyOps(), x, target)
    both_nan = got.float().isnan() & want.float().isnan()
    view = CODE_VIEW[target][2]
    assert not torch.equal(got.view(view)[~both_nan], want.view(view)[~both_nan])


def test_emulation_catches_a_wrong_shared_constant():
    """The e4m3 steps are the stochastic cast's: with its smallest binade one too high, the nearest
    conversion of the fp32 edge inputs differs too."""
    from tileplug.backend_ascend.quant import stochastic_cast as element

    x = every_pattern(torch.float32)
    want = reference_nearest(x, torch.float8_e4m3fn)
    with mock.patch.object(element, "E4M3_MIN_BIASED", 122):
        got = emulated_nearest(NearestNumpyOps(), x, torch.float8_e4m3fn)
    both_nan = got.float().isnan() & want.float().isnan()
    assert not torch.equal(got.view(torch.uint8)[~both_nan], want.view(torch.uint8)[~both_nan])
