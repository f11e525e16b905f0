"""Ascend ``transpose_weight_sf`` kernel: LOWERING tests and a CPU emulation of its arithmetic.
Nothing here runs on an NPU.

* Every op-table case's specialisations (an sf0 and an sf1 kernel per distinct weight shape) lower
  to Ascend C (disk-cached, process pool of 2) and pass the three checks; the source reads the
  scales from GM, writes sf0 / sf1 with DMAs, de-interleaves (sf0), gathers (``vselr``) and holds
  the byte rule's constants; each check fails on a bad variant; declines carry their reasons; the
  launch passes the scales as ``[G, R, C]`` and the outputs in memory order.
* The emulation: the kernel's arithmetic (``backend_ascend/quant/transpose_weight_sf.py``:
  ``ue8m0_bytes``, ``row_pair_words``, ``column_pair_words``, ``expansion_index``,
  ``expanded_register``) is plain Python over an ``ops`` object; :class:`WeightScaleNumpyOps` runs
  those very functions item by item as the kernel does (UB past the valid scales holding random
  garbage) and the packed bytes equal the reference's on the special scales and on random shapes
  (R, C odd, stacked groups, transpose_sf1); a mutated constant of the byte rule makes it fail.
  What it cannot show: that the instructions behave as assumed (the module docstring lists them).

No ``from __future__ import annotations``: TileLang parses the bad kernel's macro source.
"""

import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
import torch

from test_ascend_stochastic_cast_lowering import CastNumpyOps
from tileplug import core

pytestmark = pytest.mark.ascend_lower

META = "meta"
OP = "transpose_weight_sf"
TOKENS = 5


def _kernel():
    from tileplug.backend_ascend.plugin import kernel_table

    return kernel_table()[OP]


def _describe(case):
    with core.config.host_layout("ascend"):
        args, kwargs = case.arguments(TOKENS, META)
        call, _ = core.describe_call(case.op, *args, **kwargs)
    return call


def _call(shapes, block_size=128, transpose_sf1=False, device=META):
    tensors = tuple(torch.empty(shape, dtype=torch.float32, device=device) for shape in shapes)
    with core.config.host_layout("ascend"):
        call, inputs = core.describe_call(core.ops.transpose_weight_sf, tensors if len(tensors) > 1 else tensors[0],
                                          block_size, transpose_sf1)
    return call, inputs


def _grid() -> tuple[list, dict]:
    """``([(specialisation, first case it appears in)], {case id: decline reason})``."""
    from tileplug.backend_ascend.quant.transpose_weight_sf import specs_of

    kernel = _kernel()
    grid, declined = {}, {}
    for case in core.opdefs.get(OP).cases():
        call = _describe(case)
        why = kernel.supports(call)
        if why is not None:
            declined[case.id] = why
            continue
        for spec in specs_of(call):
            grid.setdefault(spec.describe(), (spec, case))
    return [(name, entry[0]) for name, entry in grid.items()], declined


def lower_and_check(entry) -> dict:
    """Worker: lower one specialisation (disk-cached) and run the checks on it."""
    from tileplug.backend_ascend import lowering_checks as checks
    from tileplug.backend_ascend.device import lowering_target
    from tileplug.backend_ascend.kernel import checked_lowering
    from tileplug.backend_ascend.quant.transpose_weight_sf import build

    name, spec = entry
    lowering = checked_lowering(spec, build, lowering_target())
    lowered = lowering.lowered
    return {"name": name, "source": lowered.source, "checks": {
        "ub": checks.check_ub(lowered.compiler_ub_bytes, lowered.primfunc_ub_bytes, lowering.plan_bytes,
                              lowering.budget),
        "pipelined": checks.check_pipelined(lowered.source),
        "vector": checks.check_vector(lowered.source),
        "nonempty": ("__gm__" in lowered.source, "kernel has __gm__ parameters"),
    }}


CASES, DECLINED = _grid()


@pytest.fixture(scope="module")
def lowered() -> dict:
    with ProcessPoolExecutor(min(2, os.cpu_count() or 1)) as pool:
        return {result["name"]: result for result in pool.map(lower_and_check, CASES)}


def test_every_case_of_the_op_table_is_served():
    """All 24 cases are served (none declined); their weight shapes make the specialisations
    below, an sf0 and an sf1 kernel each."""
    assert len(core.opdefs.get(OP).cases()) == 24
    assert DECLINED == {}
    names = [name for name, _ in CASES]
    assert len(names) == len(set(names)) and len(names) % 2 == 0
    assert {name.split(" ")[1] for name in names} == {"sf0", "sf1"}
    assert "transpose_weight_sf sf0 [G, 1, 56] bs=128" in names and "transpose_weight_sf sf1 [G, 3, 5] bs=128" in names


def test_pack_factor_is_the_ascend_layouts():
    """The kernel packs what the Ascend layout says: 2 UE8M0 bytes per int16."""
    from tileplug.backend_ascend.quant import transpose_weight_sf as kernel
    from tileplug.core.quant.layouts import ASCEND_LAYOUT

    assert ASCEND_LAYOUT.ue8m0_pack_factor == kernel.PACK_FACTOR == 2
    assert ASCEND_LAYOUT.ue8m0_pack_dtype == torch.int16 and kernel.PACK_DTYPE == "int16"


@pytest.mark.parametrize("case", CASES, ids=[name for name, _ in CASES])
def test_lowering_passes_checks(lowered, case):
    result = lowered[case[0]]
    failed = {name: detail for name, (ok, detail) in result["checks"].items() if not ok}
    assert not failed, failed


@pytest.mark.parametrize("case", CASES, ids=[name for name, _ in CASES])
def test_source_holds_the_byte_rule_and_the_layout(lowered, case):
    """``S`` DMA'd from GM, the output DMA'd to it (no scalar GM write), one SIMD function with the
    byte rule's constants (the ``-0`` test, ``0x7FFFFF``, ``>> 23``, ``2^-127``'s pattern, the
    largest finite pattern, ``0xFF``), the ``VST_VLD`` barrier, the ``vselr`` expansion and the
    packing 16-bit store; sf0: ``vdintlv`` and the high byte masked past C, one strided DMA of
    ``P0`` rows of ``bs`` int16; sf1: the second row's DMA only when it exists."""
    from tileplug.backend_ascend.quant import transpose_weight_sf as kernel

    name, spec = case
    source = lowered[name]["source"]
    output = "SF0" if spec.side == "sf0" else "SF1"
    assert "(__gm__ uint8_t*)((&(S[" in source and f"asc_copy_ub2gm_align((__gm__ uint8_t*)((&({output}[" in source
    assert f"{output}[0] =" not in source
    assert source.count("__simd_vf__") == 1
    for constant in (kernel.NEGATIVE_ZERO, kernel.MAGNITUDE_MASK, kernel.CEILING_ADDEND, kernel.SMALLEST_SCALE_PATTERN,
                     kernel.LARGEST_FINITE, kernel.NONFINITE_BYTE):
        assert f"(uint32_t){constant})" in source or f"(uint32_t){constant}," in source, hex(constant)
    assert "vshrs(rounded_up, (uint32_t)23," in source and "high_byte = simd_inst::vshls(" in source
    assert "simd_inst::mem_bar(VST_VLD)" in source and "simd_inst::vselr(" in source
    assert "simd_inst::vsts_pack_b32" in source
    if spec.side == "sf0":
        assert "simd_inst::vdintlv(" in source
        bursts = (1, 2 * spec.packed * spec.block) if spec.rows == 1 else (spec.packed, 2 * spec.block)
        assert f"{bursts[0]}, {bursts[1]}," in source  # P0 bursts of bs int16 (R = 1: rows adjacent, one burst)
    else:
        assert re.search(r"second_kept = simd_inst::vand\(ue8m0_byte\w*, keep_second,", source)
        assert source.count("asc_copy_gm2ub_align") == (2 if spec.rows > 1 else 1)  # R = 1: no second row, ever


def test_core_lower_states_lowered_and_every_kernel():
    with core.config.host_layout("ascend"):
        source = core.lower(core.ops.transpose_weight_sf, torch.empty(3, 5, device=META), 128, backend="ascend")
    assert "LOWERED" in source and "not verified" in source and "stand-in" in source
    assert "specialisation: transpose_weight_sf sf0 [G, 3, 5] bs=128" in source
    assert "specialisation: transpose_weight_sf sf1 [G, 3, 5] bs=128" in source
    assert source.count("__global__") == 2


def test_capabilities_say_lowered():
    from tileplug.backend_ascend import plugin

    text = plugin.capabilities()
    paragraph = text[text.index("transpose_weight_sf ("):]
    paragraph = paragraph[:paragraph.index("Lowered, never run on an NPU.") + len("Lowered, never run on an NPU.")]
    assert "2 per int16" in paragraph and "Declined" in paragraph
    assert "verified" not in paragraph


def test_declines_carry_reasons():
    """A block size outside 16 .. 128 (the contract refuses it; here made by hand), a call laid out
    for the CUDA pack factor (made by hand) and an sf1 row too long for UB (C·bs = 65536 int16,
    double-buffered) are declined; the reference serves them. An empty weight needs no kernel."""
    kernel = _kernel()
    call, _ = _call([(4, 7)], 128)
    assert kernel.supports(call) is None
    why = kernel.supports(replace(call, block_size=8))
    assert why is not None and "block_size 8" in why and "falls to the reference" in why, why
    wide, _ = _call([(2, 512)], 128)
    why = kernel.supports(wide)
    assert why is not None and "UB plan" in why and "falls to the reference" in why, why
    assert kernel.supports(_call([(2, 400)], 128)[0]) is None
    assert "serves transpose_weight_sf" in kernel.supports(replace(call, op="nearest_cast"))
    from tileplug.core.quant.layouts import CUDA_LAYOUT

    why = kernel.supports(replace(call, host_layout=CUDA_LAYOUT))
    assert why is not None and "4 UE8M0 bytes per integer" in why and "falls to the reference" in why, why
    empty, _ = _call([(0, 7), (4, 7)], 64)
    assert kernel.supports(empty) is None and kernel.describe(empty).count("[G, 4, 7]") == 2


def test_launch_passes_scales_and_memory_order_outputs():
    """``__call__`` (CPU tensors, the compiled kernels replaced by a recorder): per weight the sf0
    then the sf1 kernel, each given the scales as ``[G, R, C]`` and its output's storage as the
    contiguous ``[G, P, L]``; an empty weight launches nothing."""
    kernel = _kernel()
    scales = (torch.rand(2, 3, 5), torch.rand(4, 7), torch.rand(0, 3))
    with core.config.host_layout("ascend"):
        call, inputs = core.describe_call(core.ops.transpose_weight_sf, scales, 32, True)
    from tileplug.core.quant.layouts import ASCEND_LAYOUT

    outputs = call.allocation_plan(ASCEND_LAYOUT).allocate(0, torch.device("cpu"))
    launched = []

    def compiled(spec):
        def record(*args):
            launched.append((spec.describe(), [(arg.data_ptr(), tuple(arg.shape), arg.is_contiguous()) for arg in args]))
        return record

    with core.config.override(ascend_vector_cores=8), mock.patch.object(kernel.compiled, "get", compiled):
        kernel(call, inputs, outputs)
    assert [name for name, _ in launched] == [
        "transpose_weight_sf sf0 [G, 3, 5] bs=32", "transpose_weight_sf sf1 [G, 3, 5] bs=32",
        "transpose_weight_sf sf0 [G, 4, 7] bs=32", "transpose_weight_sf sf1 [G, 4, 7] bs=32"]
    assert launched[0][1] == [(scales[0].data_ptr(), (2, 3, 5), True), (outputs[0].data_ptr(), (2, 3, 96), True)]
    assert launched[1][1] == [(scales[0].data_ptr(), (2, 3, 5), True), (outputs[1].data_ptr(), (2, 2, 160), True)]
    assert launched[2][1] == [(scales[1].data_ptr(), (1, 4, 7), True), (outputs[2].data_ptr(), (1, 4, 128), True)]
    assert launched[3][1] == [(scales[1].data_ptr(), (1, 4, 7), True), (outputs[3].data_ptr(), (1, 2, 224), True)]


# ---------------------------------------------------------------------- the checks can fail


def _scalar_pack_compute(spec):
    """Per-element scalar expansion on the scalar unit: no SIMD region."""
    import tilelang.ascend.language as T

    @T.macro
    def compute(buffers, keep_second):
        for i in T.serial(spec.expanded):
            buffers["out_ub"][i] = T.Cast("int16", buffers["scales_ub"][i % spec.cols])

    return compute


def test_checks_fail_on_bad_variants():
    """sf1 of ``[G, 4, 7]`` bs=128 passes every check; (a) a 490-column sf1 row (61 440 int16,
    double-buffered) over the UB budget: the builder refuses it and, forced through, TileLang's loop
    scheduler does ("capacity is negative") before the UB check is reached, as for moe_unpermute;
    the UB check fails when the plan it is held against is not the kernel's (3 versions claimed,
    2 built); (b) a serial, single-buffered item loop, (c) the expansion in per-element scalar code
    each fail theirs."""
    import ascend_bad_kernels as bad_kernels
    import tvm

    from test_ascend_lowering import _checked
    from tileplug.backend_ascend.device import UBBudgetError
    from tileplug.backend_ascend.quant import transpose_weight_sf as kernel

    spec = kernel.WeightScaleSpec("sf1", 4, 7, 128)
    good = _checked(kernel.build(spec), spec)
    assert all(ok for ok, _ in good.values()), good

    wide = replace(spec, cols=490)
    assert wide.footprint > wide.budget
    with pytest.raises(UBBudgetError):
        kernel.build(wide)
    with pytest.raises(tvm.error.InternalError, match="capacity is negative"):
        _checked(bad_kernels.row_over_budget(kernel.build, wide), wide)
    claimed = replace(spec, num_buffers=3)
    ok, detail = _checked(kernel.build(spec), claimed)["ub"]
    assert not ok and "disagree" in detail, detail

    ok, detail = _checked(bad_kernels.row_serial_loop(kernel.build, spec), spec)["pipelined"]
    assert not ok and "versions=[1]" in detail, detail

    sf1_small = kernel.WeightScaleSpec("sf1", 4, 7, 16)
    with mock.patch.object(kernel, "pack_compute", _scalar_pack_compute):
        scalar = kernel.build(sf1_small)
    ok, detail = _checked(scalar, sf1_small)["vector"]
    assert not ok and ("scalar UB dereference" in detail or "no __simd_vf__" in detail), detail


# ---------------------------------------------------------------------- CPU emulation


class WeightScaleNumpyOps(CastNumpyOps):
    """``CastNumpyOps`` with the instructions this kernel adds: ``vdintlv`` (even then odd lanes of
    ``a ++ b``), ``vselr`` (lane ``j`` takes lane ``index[j]``), ``vand`` of two registers."""

    def deinterleave(self, a, b, name=""):
        a, b = np.broadcast_arrays(a, b)
        both = np.concatenate([a, b], axis=-1)
        return both[..., 0::2], both[..., 1::2]

    def gather(self, source, index, name=""):
        source, index = np.broadcast_arrays(np.asarray(source, dtype=np.uint32), np.asarray(index, dtype=np.uint32))
        assert (index < 64).all()
        return np.take_along_axis(source, index.astype(np.int64), axis=-1)

    def and_words(self, a, b, name=""):
        return np.bitwise_and(a, b)


def _garbage(shape, rng) -> np.ndarray:
    return rng.integers(0, 1 << 32, shape, dtype=np.uint64).astype(np.uint32)


def _expand(ops, words_ub: np.ndarray, spec) -> np.ndarray:
    """The expansion of every item's words (``[items, W]``) → ``[items, expanded]`` int16 patterns."""
    from tileplug.backend_ascend.quant import transpose_weight_sf as kernel

    registers = -(-spec.expanded // 64)
    out = np.zeros((words_ub.shape[0], registers * 64), dtype=np.uint32)
    for register in range(registers):
        chunk, index = kernel.expansion_index(ops, register, spec.block)
        gathered = kernel.expanded_register(ops, words_ub[:, chunk * 64:chunk * 64 + 64], index)
        assert (np.asarray(gathered) < (1 << 16)).all(), "a word wider than 16 bits"
        out[:, register * 64:register * 64 + 64] = gathered
    return out[:, :spec.expanded]


def emulated_sides(ops, scales: torch.Tensor, block: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """What the two kernels write for fp32 ``scales`` ``[G, R, C]``: ``sf0`` ``[G, P0, N]`` and
    ``sf1`` ``[G, P1, K]`` as uint16 patterns, item by item as the kernel computes them (UB past the
    valid scales and the unused words filled with random garbage)."""
    from tileplug.backend_ascend.quant import transpose_weight_sf as kernel

    groups, rows, cols = scales.shape
    patterns = scales.contiguous().view(torch.int32).numpy().view(np.uint32)
    rng = np.random.default_rng(seed)

    spec0 = kernel.WeightScaleSpec("sf0", rows, cols, block)
    width = spec0.input_width
    scales_ub = _garbage((groups * rows, width), rng)
    scales_ub[:, :cols] = patterns.reshape(groups * rows, cols)
    words_ub = _garbage((groups * rows, kernel.align(spec0.words, 64)), rng)
    for chunk in range(width // 128):
        words_ub[:, chunk * 64:chunk * 64 + 64] = kernel.row_pair_words(
            ops, scales_ub[:, chunk * 128:chunk * 128 + 64], scales_ub[:, chunk * 128 + 64:chunk * 128 + 128],
            ops.ramp(chunk * 64), cols)
    tiles = _expand(ops, words_ub, spec0).reshape(groups, rows, spec0.packed, block)
    sf0 = tiles.transpose(0, 2, 1, 3).reshape(groups, spec0.packed, rows * block)

    spec1 = kernel.WeightScaleSpec("sf1", rows, cols, block)
    pairs, width = spec1.packed, spec1.input_width
    scales_ub = _garbage((groups, pairs, 2, width), rng)
    padded = np.zeros((groups, 2 * pairs, cols), dtype=np.uint32)
    padded[:, :rows] = patterns
    exists = np.ones((groups, pairs, 2), dtype=bool)
    exists[:, :, 1] = (2 * np.arange(pairs) + 1) < rows
    scales_ub[..., :cols] = np.where(exists[..., None], padded.reshape(groups, pairs, 2, cols), scales_ub[..., :cols])
    keep = np.where(exists[:, :, 1], np.uint32(0xFFFFFFFF), np.uint32(0)).reshape(-1, 1)
    flat = scales_ub.reshape(groups * pairs, 2, width)
    words_ub = _garbage((groups * pairs, kernel.align(spec1.words, 64)), rng)
    for register in range(width // 64):
        words_ub[:, register * 64:register * 64 + 64] = kernel.column_pair_words(
            ops, flat[:, 0, register * 64:register * 64 + 64], flat[:, 1, register * 64:register * 64 + 64], keep)
    sf1 = _expand(ops, words_ub, spec1).reshape(groups, pairs, cols * block)
    return sf0.astype(np.uint16), sf1.astype(np.uint16)


def _memory_order(tensor: torch.Tensor, transposed: bool) -> np.ndarray:
    view = tensor if transposed else tensor.transpose(-1, -2)
    return view.reshape(-1, view.shape[-2], view.shape[-1]).contiguous().numpy().view(np.uint16)


def reference_sides(scale_tensors, block: int, transpose_sf1: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """The reference's outputs on the CPU in the Ascend layout, each in memory order."""
    from tileplug.core.quant.layouts import ASCEND_LAYOUT
    from tileplug.reference.quant.transpose_weight_sf import transpose_weight_sf

    with core.config.host_layout("ascend"):
        call, inputs = core.describe_call(core.ops.transpose_weight_sf, tuple(scale_tensors), block, transpose_sf1)
    outputs = call.allocation_plan(ASCEND_LAYOUT).allocate(0, torch.device("cpu"))
    transpose_weight_sf(call, inputs, outputs)
    return [(_memory_order(outputs[2 * i], False), _memory_order(outputs[2 * i + 1], transpose_sf1))
            for i in range(len(scale_tensors))]


def _assert_same(scale_tensors, block, transpose_sf1=False, ops=None):
    ops = ops or WeightScaleNumpyOps()
    for scales, (want0, want1) in zip(scale_tensors, reference_sides(scale_tensors, block, transpose_sf1)):
        stacked = scales.reshape(-1, *scales.shape[-2:])
        got0, got1 = emulated_sides(ops, stacked, block)
        np.testing.assert_array_equal(got0, want0, err_msg=f"sf0 of {tuple(scales.shape)} bs={block}")
        np.testing.assert_array_equal(got1, want1, err_msg=f"sf1 of {tuple(scales.shape)} bs={block}")


def special_scales() -> torch.Tensor:
    """Zeros of both signs, subnormals around ``2^-127`` (``0x3FFFFF``, ``0x400000``, ``0x400001``,
    the smallest and the largest), the smallest normal, ``2^127``, ``2^127·(1 + 2^-23)``, fp32 max,
    ±inf, NaNs, negatives, powers of two and non-powers of two across the range."""
    patterns = [0x00000000, 0x80000000, 0x00000001, 0x003FFFFF, 0x00400000, 0x00400001, 0x007FFFFF,
                0x00800000, 0x00800001, 0x7F000000, 0x7F000001, 0x7F7FFFFF, 0x7F800000, 0xFF800000,
                0x7FC00000, 0xFFC00000, 0x7F800001, 0x80000001, 0xBF800000, 0xC2F60000, 0x3F800000,
                0x3F800001, 0x3FFFFFFF, 0x40000000, 0x3E800000, 0x00200000, 0x7EFFFFFF, 0x0C000000,
                0x2E99A8A6, 0x4B189680, 0x807FFFFF]
    values = np.asarray(patterns, dtype=np.uint32).view(np.float32)
    return torch.from_numpy(values.copy())


@pytest.mark.parametrize("block", [16, 32, 64, 128])
def test_emulated_bytes_of_the_special_scales_are_the_reference(block):
    """The special scales laid out as a ``[R, C]`` weight with R and C odd (and as its transpose),
    so each value meets both byte positions and the padding: bytewise the reference's."""
    special = special_scales()
    values = torch.cat([special, special.flip(0)[:4]])  # 35 values
    weights = [values.reshape(5, 7), values.reshape(7, 5), values.reshape(1, 35), values.reshape(35, 1)]
    _assert_same(weights, block)
    _assert_same(weights, block, transpose_sf1=True)


def test_emulated_byte_rule_names_what_the_spec_says():
    """Hand-picked bytes, independent of the reference: 0 for ±0 and subnormals up to ``2^-127``, 1
    just above, 127 for 1, 128 for ``1 + 2^-23`` and 2, 254 for ``2^127``, 0xFF for ``2^127·(1 +
    2^-23)``, fp32 max, ±inf, NaN and negatives."""
    from tileplug.backend_ascend.quant.transpose_weight_sf import ue8m0_bytes

    patterns = np.asarray([0x0, 0x80000000, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFF, 0x800000, 0x3F800000,
                           0x3F800001, 0x40000000, 0x7F000000, 0x7F000001, 0x7F7FFFFF, 0x7F800000, 0xFF800000,
                           0x7FC00000, 0xBF800000, 0x80000001], dtype=np.uint32)
    got = ue8m0_bytes(WeightScaleNumpyOps(), patterns).tolist()
    assert got == [0, 0, 0, 0, 1, 1, 1, 127, 128, 128, 254, 255, 255, 255, 255, 255, 255, 255], got


def _random_scales(shape, rng) -> torch.Tensor:
    """fp32 scales: powers of two from ``2^-140`` to ``2^127`` (subnormals included), random fp32
    patterns, and a sprinkling of zeros, negatives, inf and NaN."""
    exponents = rng.integers(-140, 128, shape)
    values = np.ldexp(np.ones(shape, dtype=np.float64), exponents).astype(np.float32)
    random_bits = rng.integers(0, 1 << 32, shape, dtype=np.uint64).astype(np.uint32).view(np.float32)
    choice = rng.random(shape)
    values = np.where(choice < 0.3, random_bits, values)
    values = np.where((choice > 0.95) & (choice < 0.97), np.float32(0.0), values)
    values = np.where(choice >= 0.99, np.float32(np.inf), values)
    return torch.from_numpy(values.astype(np.float32))


@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("transpose_sf1", [False, True], ids=["sf1", "sf1-transposed"])
def test_emulated_kernel_is_the_reference_on_random_shapes(block, transpose_sf1):
    """Random scales of several weights in one call: R and C odd and even, not multiples of the
    pack factor, C past one 128-column chunk, stacked groups: bytewise the reference's."""
    rng = np.random.default_rng(block + transpose_sf1)
    shapes = [(3, 5), (1, 1), (7, 131), (2, 4, 9), (3, 6, 1), (11, 64), (4, 129)]
    _assert_same([_random_scales(shape, rng) for shape in shapes], block, transpose_sf1)


@pytest.mark.parametrize("case", core.opdefs.get(OP).cases(), ids=lambda case: case.id)
def test_emulated_kernel_is_the_reference_on_the_op_table_cases(case):
    """The op table's own arguments (at 300 weight rows) on the CPU: bytewise the reference's."""
    args, kwargs = case.arguments(300, "cpu")
    scales = args[0] if isinstance(args[0], tuple) else (args[0],)
    _assert_same(list(scales), kwargs.get("block_size", 128), kwargs.get("transpose_sf1", False))


MUTATIONS = [
    ("CEILING_ADDEND", 0x7FFFFE),  # 1 + 2^-23 rounds down to 127
    ("SMALLEST_SCALE_PATTERN", 0x3FFFFF),  # 2^-127 itself gives byte 1
    ("LARGEST_FINITE", 0x7FFFFFFF),  # a positive NaN takes the finite path: 256, not a byte
    ("NEGATIVE_ZERO", 0x7FFFFFFF),  # -0 gives 0xFF
    ("NONFINITE_BYTE", 0xFE),
    ("BYTE_BITS", 16),  # the high byte lands outside the int16
]


@pytest.mark.parametrize("constant, value", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_emulation_catches_a_wrong_constant(constant, value):
    """The comparison can fail: with one constant of the byte rule or the packing wrong, the special
    scales' bytes differ from the reference's (or a word no longer fits 16 bits)."""
    from tileplug.backend_ascend.quant import transpose_weight_sf as kernel

    values = special_scales()
    weights = [torch.cat([values, values[:4]]).reshape(5, 7), _random_scales((4, 9), np.random.default_rng(0))]
    with mock.patch.object(kernel, constant, value), pytest.raises(AssertionError):
        _assert_same(weights, 32)
