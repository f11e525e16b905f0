"""Ascend ``stochastic_cast`` kernel: LOWERING tests and a CPU emulation of its rounding. Nothing
here runs on an NPU.

* Every op-table case lowers to Ascend C (disk-cached, in a process pool, as
  tests/test_ascend_rng_lowering.py) and passes the three checks; the source holds the Philox
  rounds once per group of ``256·k`` elements (``k = 32 / w`` elements a word: 2 for fp32 → bf16,
  4 for fp32 → e4m3, 4 for bf16 → e4m3), the tile's first block ``t · 1024 / k``, the field
  extraction and interleave, reads the state and ``x`` from GM and rounds on integers; each check
  fails on a bad variant; declines carry their reasons; the launch passes the tensors in the
  prim_func's order and advances the offset.
* The emulation: the kernel's rounding (``backend_ascend/quant/stochastic_cast.py``) is plain
  Python over an ``ops`` object; :class:`CastNumpyOps` (the RNG test's ``NumpyOps`` with the
  instructions the rounding adds) runs the very functions the kernel is traced from — the Philox
  words, the word interleave, the split of each word into its ``k`` fields of ``w`` bits and their
  interleave into element order, the widening of bf16, the bf16 / e4m3 rounding — and the bytes
  equal the reference's (any NaN equal to any NaN) on random inputs, every bf16 pattern and the
  edge inputs, also when ``vmul`` flushes denormals; the fields each element gets are the
  reference's ``element_random_bits`` and, on arbitrary words, field ``i mod k`` of word ``i // k``
  counted from its top. What it cannot show: that the hardware instructions behave as assumed
  (``random/vector_ops.py`` lists the assumptions).

No ``from __future__ import annotations``: TileLang parses the bad kernel's macro source.
"""

import os
import re
import struct
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
import torch

from test_ascend_rng_lowering import MASK, NumpyOps, emulated_words
from tileplug import core
from tileplug.core.ops.random import as_int64_word

pytestmark = pytest.mark.ascend_lower

META = "meta"
OP = "stochastic_cast"
PAIRS = [(torch.float32, torch.bfloat16), (torch.float32, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e4m3fn)]
PAIR_IDS = ["fp32-bf16", "fp32-e4m3", "bf16-e4m3"]


def _kernel():
    from tileplug.backend_ascend.plugin import kernel_table

    return kernel_table()[OP]


def _describe(case):
    with core.config.host_layout("ascend"):
        args, kwargs = case.arguments(5, META)
        call, _ = core.describe_call(case.op, *args, **kwargs)
    return call


def _cast_call(count, source=torch.float32, target=torch.bfloat16):
    state = [torch.zeros(1, dtype=torch.int64, device=META) for _ in range(2)]
    with core.config.host_layout("ascend"):
        call, _ = core.describe_call(core.ops.stochastic_cast, torch.empty(count, dtype=target, device=META),
                                     torch.empty(count, dtype=source, device=META), *state)
    return call


def _grid() -> list:
    """``[(specialisation, first case it serves)]`` of every stochastic_cast case of the op table."""
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
    """The op table's six cases make one specialisation per pair (the element count is dynamic)."""
    assert len(core.opdefs.get(OP).cases()) == 6
    assert sorted(name for name, _ in CASES) == sorted(
        f"stochastic_cast [N] {str(source).removeprefix('torch.')} -> {str(target).removeprefix('torch.')} tile=4096"
        for source, target in PAIRS)


@pytest.mark.parametrize("case", CASES, ids=[name for name, _ in CASES])
def test_lowering_passes_checks(lowered, case):
    result = lowered[case[0]]
    assert result["declined"] is None, result["declined"]
    failed = {name: detail for name, (ok, detail) in result["checks"].items() if not ok}
    assert not failed, failed


@pytest.mark.parametrize("case", CASES, ids=[name for name, _ in CASES])
def test_source_holds_the_draw_and_the_integer_rounding(lowered, case):
    """The Philox rounds of the draw once per group (multipliers, nine key increments, 20 ``vmull``),
    the state and ``x`` DMA'd from GM and the result DMA'd to it, no scalar GM write; the groups of
    ``256·k`` elements: the tile's first block ``t · 4096 / (4k)``, ``16 / k`` groups a tile, ``4k``
    element registers a group, each with the rounding's carry out of bit 24 and the NaN test on the
    patterns; ``k > 1``: ``4k`` field masks and the interleaves (4 for the words, then one per word
    register for ``k = 2``, four for ``k = 4``); e4m3: the saturation at 448 and the truncating
    conversions, and no fp8 conversion (the codes are integers)."""
    from tileplug.backend_ascend.quant import stochastic_cast as kernel

    name, case_ = case
    source = lowered[name]["source"]
    spec = kernel.spec_of(_describe(case_))
    k = spec.elements_per_word
    assert k == {"bfloat16": 2, "float8_e4m3fn": 4}[spec.target]
    registers = 4 * k
    blocks_per_tile = spec.tile // (4 * k)
    assert f"(((int32_t)block_idx) * {blocks_per_tile})) + (g * 64)), INC_ORDER)" in source  # the block ramp
    assert f"(it * {blocks_per_tile * spec.vector_cores})" in source
    assert f"for (int32_t g = 0; g < min({spec.tile // (256 * k)}, " in source
    for index in range(1, registers):  # the x_ub register loads of a group, at 256·k·g + 64·index
        assert f"(g * {256 * k})) + {64 * index})" in source, index
    assert f"(g * {256 * k})) + {64 * registers})" not in source
    masks = {16: 0xFFFF00, 8: 0xFF0000}
    for bits, mask in masks.items():
        assert source.count(f"(uint32_t){mask},") == (registers if spec.field_bits == bits else 0), hex(mask)
    assert source.count("simd_inst::vintlv(") == {1: 4, 2: 8, 4: 20}[k]
    for constant in (0xD2511F53, 0xCD9E8D57):
        assert f"(uint32_t){constant}" in source, hex(constant)
    for constant in (0x9E3779B9, 0xBB67AE85):
        assert source.count(f"(uint32_t){constant}") == 9, hex(constant)
    assert source.count("simd_inst::vmull(") == 20
    for tensor in ("SEED", "OFFSET", "X"):
        assert f"(__gm__ uint8_t*)((&({tensor}[" in source, tensor
    assert "asc_copy_ub2gm_align((__gm__ uint8_t*)((&(RESULT[" in source
    assert not any(f"{tensor}[0] =" in source for tensor in ("SEED", "OFFSET", "RESULT"))
    carries = re.findall(r"round_up\w* = simd_inst::vshrs\(fraction_sum\w*, \(uint32_t\)24,", source)
    assert len(carries) == registers, carries  # up = (fraction + r) >> 24, once per element register of a group
    assert len(re.findall(rf"vcmps_gt\(magnitude\w*, \(uint32_t\){kernel.INF_PATTERN}, ", source)) == registers
    if "float8_e4m3fn" in name:
        assert f"(uint32_t){kernel.E4M3_MAX_PATTERN}" in source and source.count("ROUND_Z") == 2 * registers
        assert "vcvt<float8" not in source and "vsts_pack_quarter" in source
    if "bfloat16 tile" in name:
        assert "vsts_pack_b32" in source
    if name.startswith("stochastic_cast [N] bfloat16"):
        assert "vlds_unpack<bfloat16_t>" in source
        assert source.count("(uint32_t)16, v, MODE_ZEROING)") >= registers  # the widening of each register


def test_core_lower_states_lowered_and_the_specialisation():
    state = [torch.zeros(1, dtype=torch.int64, device=META) for _ in range(2)]
    with core.config.host_layout("ascend"):
        source = core.lower(core.ops.stochastic_cast, torch.empty(3, 7, dtype=torch.float8_e4m3fn, device=META),
                            torch.empty(3, 7, dtype=torch.bfloat16, device=META), *state, backend="ascend")
    assert "LOWERED" in source and "not verified" in source and "stand-in" in source
    assert "specialisation: stochastic_cast [N] bfloat16 -> float8_e4m3fn tile=4096" in source
    assert "__global__" in source


def test_capabilities_say_lowered():
    from tileplug.backend_ascend import plugin

    text = plugin.capabilities()
    line = text[text.index("stochastic_cast"):]
    assert "fp32 -> bf16, fp32 -> e4m3, bf16 -> e4m3" in line and "Lowered, never run on an NPU" in line


def test_declines_carry_reasons():
    """Past ``2^31 − 4096`` elements the draw's int32 index arithmetic would overflow: the reference
    serves it; a call of another pair (the contract refuses it; here made by hand) is declined."""
    from tileplug.backend_ascend.random.draw import MAX_ELEMENTS

    kernel = _kernel()
    for source, target in PAIRS:
        assert kernel.supports(_cast_call(MAX_ELEMENTS, source, target)) is None
        why = kernel.supports(_cast_call(MAX_ELEMENTS + 1, source, target))
        assert why is not None and "int32" in why and "falls to the reference" in why, why
    why = kernel.supports(replace(_cast_call(8), target=torch.float32))
    assert why is not None and "not a stochastic narrowing" in why, why
    assert "serves stochastic_cast" in kernel.supports(replace(_cast_call(8), op="fill_rand"))


def test_launch_passes_the_tensors_and_advances_the_offset():
    """``__call__`` (CPU tensors, the compiled kernel replaced by a recorder): the int32 word views of
    seed and offset, the flat x and result in the prim_func's order, then offset + 1."""
    kernel = _kernel()
    x, result = torch.randn(3, 5), torch.empty(3, 5, dtype=torch.float8_e4m3fn)
    seed, offset = torch.tensor([-1], dtype=torch.int64), torch.tensor([2**32 - 1], dtype=torch.int64)
    call, inputs = core.describe_call(core.ops.stochastic_cast, result, x, seed, offset)
    launched = []

    def record(*args):  # what the kernel would see: the tensors' storage and their values at launch
        launched.append([(arg.data_ptr(), arg.dtype, arg.clone()) for arg in args])

    with core.config.override(ascend_vector_cores=8), mock.patch.object(kernel.compiled, "get",
                                                                        lambda spec: record):
        kernel(call, inputs, None)
    (seed_words, offset_words, flat_x, flat_result), = launched
    assert seed_words[0] == seed.data_ptr() and seed_words[2].tolist() == [-1, -1]
    assert offset_words[0] == offset.data_ptr() and offset_words[2].tolist() == [-1, 0]
    assert {seed_words[1], offset_words[1]} == {torch.int32}
    assert flat_x[0] == x.data_ptr() and flat_x[2].shape == (15,) and flat_x[1] == torch.float32
    assert flat_result[0] == result.data_ptr() and flat_result[2].shape == (15,)
    assert flat_result[1] == torch.float8_e4m3fn
    assert offset.tolist() == [2**32] and seed.tolist() == [-1]


# ---------------------------------------------------------------------- the checks can fail


def _scalar_cast_compute(spec):
    """Per-element scalar truncation of an fp32 tile to bf16 on the scalar unit: no SIMD region."""
    import tilelang.ascend.language as T

    W = spec.tile

    @T.macro
    def compute(buffers, first_block, groups):
        for i in T.serial(W):
            buffers["out_ub"][i] = T.Cast("bfloat16", buffers["x_ub"][i])

    return compute


def test_checks_fail_on_bad_variants():
    """fp32 → bf16 passes every check; (a) an 8-version tile of 65536 elements over the UB budget
    (the builder refuses it; forced through, the UB check fails), (b) a serial, single-buffered
    tile loop, (c) the cast in per-element scalar code each fail theirs."""
    import ascend_bad_kernels as bad_kernels

    from test_ascend_lowering import _checked  # the three checks on a traced prim_func
    from tileplug.backend_ascend.device import UBBudgetError
    from tileplug.backend_ascend.quant import stochastic_cast as kernel

    spec = kernel.spec_of(_cast_call(1000))
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

    with mock.patch.object(kernel, "rounding_compute", _scalar_cast_compute):
        scalar = kernel.build(spec)
    ok, detail = _checked(scalar, spec)["vector"]
    assert not ok and "scalar UB dereference" in detail, detail


# ---------------------------------------------------------------------- CPU emulation


class CastNumpyOps(NumpyOps):
    """``NumpyOps`` with the instructions the rounding adds (``vector_ops.VectorOps``' word shifts,
    or, unsigned min / max / compare, reinterpretations, truncation), each doing what the
    instruction is assumed to do. ``flush_denormals``: ``vmul`` / ``vmuls`` / ``vsub`` on fp32
    take and give denormals as zero (what a flush-to-zero unit would do)."""

    def __init__(self, flush_denormals: bool = False) -> None:
        super().__init__()
        self._flush = flush_denormals

    def _flushed(self, value):
        value = np.asarray(value, dtype=np.float32)
        return np.where(np.abs(value) < np.float32(2.0**-126), np.float32(0.0) * np.sign(value), value)

    def mul(self, a, b, name=""):
        if not self._flush:
            return super().mul(a, b, name)
        return self._flushed(super().mul(self._flushed(a), self._flushed(b), name))

    def scale(self, a, factor, name=""):
        if not self._flush:
            return super().scale(a, factor, name)
        return self._flushed(super().scale(self._flushed(a), factor, name))

    def sub(self, a, b, name=""):
        if not self._flush or np.asarray(a).dtype != np.float32:
            return super().sub(a, b, name)
        return self._flushed(super().sub(self._flushed(a), self._flushed(b), name))

    def shift_left(self, a, bits, name=""):
        return (np.asarray(a, dtype=np.uint64) << np.uint64(bits)).astype(np.uint32)

    def add_words(self, a, b, name=""):
        return (np.asarray(a, dtype=np.uint64) + np.asarray(b, dtype=np.uint64)).astype(np.uint32)

    def or_words(self, a, b, name=""):
        return np.bitwise_or(np.asarray(a, dtype=np.uint32), np.asarray(b, dtype=np.uint32))

    def or_word(self, a, word, name=""):
        return np.bitwise_or(np.asarray(a, dtype=np.uint32), np.uint32(word))

    def min_word(self, a, word, name=""):
        return np.minimum(np.asarray(a, dtype=np.uint32), np.uint32(word))

    def max_word(self, a, word, name=""):
        return np.maximum(np.asarray(a, dtype=np.uint32), np.uint32(word))

    def above(self, a, word, name=""):
        return np.asarray(a, dtype=np.uint32) > np.uint32(word)

    def bits_as_float(self, a, name=""):
        return np.ascontiguousarray(a, dtype=np.uint32).view(np.float32)

    def float_bits(self, a, name=""):
        return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)

    def truncate(self, a, name=""):
        value = np.asarray(a, dtype=np.float32)
        assert (value >= 0).all() and (value < 2.0**31).all(), "truncate: outside [0, 2^31)"
        return np.trunc(value).astype(np.int64).astype(np.uint32)


TARGET_VIEW = {torch.bfloat16: (np.uint16, torch.int16), torch.float8_e4m3fn: (np.uint8, torch.uint8)}


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _loaded_registers(x: torch.Tensor, garbage_seed: int = 1) -> np.ndarray:
    """What the kernel's loads give for flat ``x``: ``uint32`` lanes, fp32 patterns or, for bf16
    (``UNPK_B16``), the pattern in the low half and an unspecified high half (random here)."""
    if x.dtype == torch.float32:
        return x.view(torch.int32).numpy().view(np.uint32).copy()
    low = x.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    high = np.random.default_rng(garbage_seed).integers(0, 1 << 16, low.shape, dtype=np.uint32)
    return low | (high << np.uint32(16))


def _elements_per_word(source: torch.dtype, target: torch.dtype) -> int:
    from tileplug.core.contracts.cast import RANDOM_FIELD_BITS

    return 32 // RANDOM_FIELD_BITS[source, target]


def emulated_cast(ops, x: torch.Tensor, target: torch.dtype, seed: int, offset: int) -> torch.Tensor:
    """What the kernel writes for flat ``x``: each group's Philox words (64 blocks, the groups
    numbered from block 0 in steps of 64) and its ``256·k`` loaded values through ``round_group``
    (``4k`` registers of 64 elements in element order, each loaded when asked for), the groups in
    order, cut at the element count; the result as ``target``."""
    from tileplug.backend_ascend.quant.stochastic_cast import round_group
    from tileplug.backend_ascend.random import philox

    count = x.numel()
    per_word = _elements_per_word(x.dtype, target)
    per_group = philox.ELEMENTS_PER_GROUP * per_word
    groups = -(-count // per_group)
    loaded = np.zeros(groups * per_group, dtype=np.uint32)
    loaded[:count] = _loaded_registers(x)
    registers = loaded.reshape(groups, philox.WORDS_PER_BLOCK * per_word, 64)
    words = emulated_words(ops, (seed & MASK, seed >> 32), offset, np.arange(groups) * philox.BLOCKS_PER_GROUP)
    asked = []

    def load(index):
        asked.append(index)
        return registers[:, index]

    rounded = list(round_group(ops, words, load, _dtype_name(x.dtype), _dtype_name(target)))
    assert [index for index, _ in rounded] == asked == list(range(registers.shape[1]))
    flat = np.stack([np.broadcast_to(register, (groups, 64)) for _, register in rounded],
                    axis=1).reshape(-1)[:count]
    numpy_dtype = TARGET_VIEW[target][0]
    assert (flat >> np.uint32(8 * np.dtype(numpy_dtype).itemsize) == 0).all(), "a code wider than the target"
    return torch.from_numpy(flat.astype(numpy_dtype).view(np.int16 if numpy_dtype is np.uint16 else np.uint8)
                            ).view(target)


def reference_cast(x: torch.Tensor, target: torch.dtype, seed: int, offset: int) -> tuple[torch.Tensor, int]:
    """The reference's ``stochastic_cast`` of flat ``x`` on the CPU → (result, advanced offset)."""
    from tileplug.reference.quant.stochastic_cast import stochastic_cast

    result = torch.empty(x.shape, dtype=target)
    state = [torch.tensor([as_int64_word(value)], dtype=torch.int64) for value in (seed, offset)]
    call, inputs = core.describe_call(core.ops.stochastic_cast, result, x, *state)
    stochastic_cast(call, inputs, None)
    return result, int(state[1].item()) & (2**64 - 1)


def _patterns(values) -> torch.Tensor:
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32).view(torch.float32)


def _f32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def edge_inputs() -> torch.Tensor:
    """fp32 edge values, each with both signs: zeros, infinities, NaNs of several encodings, 448 and
    what lies past it, every e4m3 value and the midpoints and neighbours of its steps (subnormals
    included), fp32 denormals, the largest finite fp32 and the bf16 steps below it, values exactly
    on a bf16 target and the patterns next to them."""
    e4m3 = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    midpoints = (e4m3[1:] + e4m3[:-1]) / 2
    magnitudes = [_f32_bits(v) for v in torch.cat([e4m3, midpoints]).tolist()]
    magnitudes += [bits + delta for bits in list(magnitudes) for delta in (-1, 1) if bits + delta > 0]
    magnitudes += [0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x7FBFFFFF]  # inf and NaNs
    magnitudes += [_f32_bits(v) for v in (448.0, 448.5, 464.0, 479.9, 480.0, 1e6, 2.0**100)]
    magnitudes += [0x43E00001, 0x7F7FFFFF, 0x7F7F0000, 0x7F7F8000, 0x7F7EFFFF, 0x7F000000]  # top of fp32
    magnitudes += [1, 2, 0x3FF, 0x400000, 0x7FFFFF, 0x800000, 0x800001, 0xFFFF, 0x10000, 0x18000]  # denormals
    magnitudes += [_f32_bits(v) for v in (2.0**-6, 2.0**-7, 2.0**-9, 2.0**-10, 2.0**-33, 2.0**-34, 1.0, 1.5)]
    magnitudes += [bits + delta for bits in (0x3F800000, 0x3F810000, 0x40490000, 0x3F80FFFF) for delta in (-1, 0, 1)]
    magnitudes += [0x3F808000, 0x3F807FFF, 0x3F80FFFF, 0x3F800001]  # bf16 midpoints and near-targets
    unique = sorted(set(magnitudes))
    return _patterns(unique + [bits | 0x80000000 for bits in unique])


EDGE_RANDOM_BITS = [0, 1, 2**23 - 1, 2**23, 2**24 - 2, 2**24 - 1]


@pytest.mark.parametrize("flush_denormals", [False, True], ids=["denormals-kept", "denormals-flushed"])
@pytest.mark.parametrize("source, target", PAIRS, ids=PAIR_IDS)
def test_emulated_rounding_of_the_edge_inputs_is_the_reference(source, target, flush_denormals):
    """Each edge input with random bits at the boundaries (0, 2^23, 2^24 − 1, ...) and random ones,
    through the kernel's rounding (``source_patterns`` and the target's rounding) against the
    reference's ``round_to_bf16`` / ``round_to_e4m3`` with the same bits: bytewise, any NaN equal."""
    from tileplug.backend_ascend.quant import stochastic_cast as kernel
    from tileplug.core.testing import assert_bytes_equal
    from tileplug.reference.quant.stochastic_cast import round_to_bf16, round_to_e4m3

    values = edge_inputs().to(source)
    if source == torch.bfloat16:  # every bf16 pattern
        values = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    chooser = np.random.default_rng(7)
    bits = [np.full(values.numel(), r, dtype=np.uint32) for r in EDGE_RANDOM_BITS]
    bits += [chooser.integers(0, 1 << 24, values.numel(), dtype=np.uint32) for _ in range(2)]
    ops = CastNumpyOps(flush_denormals)
    loaded = _loaded_registers(values)
    for random_bits in bits:
        patterns = kernel.source_patterns(ops, loaded, _dtype_name(source))
        codes = kernel.ROUNDINGS[_dtype_name(target)](ops, patterns, random_bits)
        numpy_dtype = TARGET_VIEW[target][0]
        got = torch.from_numpy(codes.astype(numpy_dtype).view(np.int16 if numpy_dtype is np.uint16 else np.uint8))
        wide = values.to(torch.float32)
        reference_bits = torch.from_numpy(random_bits.astype(np.int64))
        want = round_to_bf16(wide, reference_bits) if target == torch.bfloat16 else round_to_e4m3(values,
                                                                                                  reference_bits)
        assert_bytes_equal(got.view(target), want, what=f"{source}->{target} r={random_bits[:1]}", nan_equal=True)


def _random_inputs(source: torch.dtype, count: int, seed: int) -> torch.Tensor:
    """Half random fp32 bit patterns (every exponent, NaNs and infinities among them), half values
    around e4m3's range (``randn · 2^k``, ``k`` in [-14, 10])."""
    chooser = np.random.default_rng(seed)
    half = count // 2
    patterns = torch.from_numpy(chooser.integers(-(2**31), 2**31, half, dtype=np.int64).astype(np.int32))
    scales = torch.from_numpy(np.exp2(chooser.integers(-14, 11, count - half)).astype(np.float32))
    near = torch.from_numpy(chooser.standard_normal(count - half).astype(np.float32)) * scales
    return torch.cat([patterns.view(torch.float32), near]).to(source)


@pytest.mark.parametrize("seed, offset", [(0, 0), (2**64 - 1, 2**64 - 1), (0x243F6A8885A308D3, 2**32 + 5)])
@pytest.mark.parametrize("source, target", PAIRS, ids=PAIR_IDS)
def test_emulated_kernel_is_the_reference_bytewise(source, target, seed, offset):
    """The whole group path (Philox words, word interleave, fields, load widening, rounding) over a
    cast that spans three tiles and ends inside a group, a Philox block and a word (``2·4096 +
    1001`` elements: odd, so the last word's later fields go unused), against the reference's
    ``stochastic_cast`` (which draws its own words): bytewise, any NaN equal; the reference's
    offset advances by one, as the kernel object's does."""
    from tileplug.core.testing import assert_bytes_equal

    x = _random_inputs(source, 2 * 4096 + 1001, seed % 1000)
    got = emulated_cast(CastNumpyOps(), x, target, seed, offset)
    want, advanced = reference_cast(x, target, seed, offset)
    assert advanced == (offset + 1) % 2**64
    assert_bytes_equal(got, want, what=f"{source}->{target}", nan_equal=True)


@pytest.mark.parametrize("constant, value, source, target", [
    ("E4M3_MIN_BIASED", 122, torch.float32, torch.float8_e4m3fn),
    ("MANTISSA_SHIFT", 9, torch.float32, torch.float8_e4m3fn),
    ("MANTISSA_SHIFT", 9, torch.float32, torch.bfloat16), ("MANTISSA_SHIFT", 7, torch.bfloat16, torch.float8_e4m3fn),
    ("RANDOM_BITS", 25, torch.float32, torch.bfloat16), ("INF_PATTERN", 0x7F7FFFFF, torch.float32, torch.bfloat16)])
def test_emulation_catches_a_wrong_rounding(constant, value, source, target):
    """The comparison can fail: with one constant of the kernel's rounding wrong (e4m3 subnormals
    in the wrong binade, 23 random bits, the fields moved one bit off, the bf16 carry taken one bit
    high, inf taken for a NaN), some byte differs."""
    from tileplug.backend_ascend.quant import stochastic_cast as kernel

    x = torch.cat([edge_inputs(), _random_inputs(torch.float32, 4096, 3)]).to(source)
    want, _ = reference_cast(x, target, 5, 0)
    with mock.patch.object(kernel, constant, value):
        got = emulated_cast(CastNumpyOps(), x, target, 5, 0)
    both_nan = got.float().isnan() & want.float().isnan()
    view = TARGET_VIEW[target][1]
    assert not torch.equal(got.view(view)[~both_nan], want.view(view)[~both_nan])


def test_emulated_rounding_is_unbiased_where_the_spec_says():
    """Averaged over every value of an element's ``w``-bit field (``r = f · 2^(24 − w)``), a value
    between two targets rounds to its own value (fp32 → bf16: 16 fractional bits, ``w = 16``;
    fp32 → e4m3 and bf16 → e4m3: a normal step with at most 8 fractional bits, ``w = 8``, and on a
    finer 16-bit grid)."""
    from tileplug.backend_ascend.quant import stochastic_cast as kernel

    ops = CastNumpyOps()
    to_e4m3 = lambda codes: torch.from_numpy(codes.astype(np.uint8)).view(torch.float8_e4m3fn)  # noqa: E731
    for value, rounding, decode, step in [
        (1.0 + 3 * 2.0**-20, kernel.bf16_patterns,
         lambda codes: torch.from_numpy(codes.astype(np.uint16).view(np.int16)).view(torch.bfloat16), 1 << 8),
        (13.0 + 0.3125, kernel.e4m3_codes, to_e4m3, 1 << 16),  # w = 8; exact in bf16: 1.1010101 · 2^3
        (13.0 + 0.3125, kernel.e4m3_codes, to_e4m3, 1 << 8),
    ]:
        grid = np.arange(0, 1 << 24, step, dtype=np.uint32)  # every field of 24 − log2(step) bits
        patterns = np.full(grid.shape, _f32_bits(value), dtype=np.uint32)
        mean = decode(rounding(ops, patterns, grid)).to(torch.float64).mean().item()
        assert mean == pytest.approx(struct.unpack("<f", struct.pack("<f", value))[0], rel=0, abs=1e-12), value


# ---------------------------------------------------------------------- CPU emulation: which bits


@pytest.mark.parametrize("source, target", PAIRS, ids=PAIR_IDS)
def test_fields_of_a_word_go_to_their_elements(source, target):
    """On arbitrary words (not Philox's: every bit pattern matters), ``element_bits`` gives element
    ``i`` of a group field ``i mod k`` of word ``i // k`` counted from the word's top, as a 24-bit
    ``r`` -- written out per pair as the spec's examples: fp32 → bf16 element ``2j`` takes
    ``(word_j >> 16) << 8`` and ``2j + 1`` ``(word_j & 0xFFFF) << 8``; fp32 → e4m3 and bf16 → e4m3
    element ``4j + s`` ``((word_j >> (24 − 8s)) & 0xFF) << 16``; at 24 bits (no element cast since
    the field widths of spec §10.2 capped at 16) element ``j`` would take ``word_j >> 8``. Word ``j``
    of a group is word ``j mod 4`` of block ``j // 4`` (lane ``j // 4`` of register ``j mod 4``)."""
    from tileplug.backend_ascend.quant import stochastic_cast as kernel

    ops = CastNumpyOps()
    chooser = np.random.default_rng(11)
    groups = 3
    registers = [chooser.integers(0, 1 << 32, (groups, 64), dtype=np.uint32) for _ in range(4)]
    registers[0][0, :4] = [0x01234567, 0x89ABCDEF, 0xFFFFFFFF, 0]  # distinct bytes, all ones, all zeros
    width = kernel.FIELD_BITS[_dtype_name(source), _dtype_name(target)]
    k = 32 // width
    assert k == _elements_per_word(source, target)
    got = list(kernel.element_bits(ops, tuple(registers), width))
    assert len(got) == 4 * k and all(register.shape == (groups, 64) for register in got)
    bits = np.stack(got, axis=1).reshape(groups, -1).astype(np.int64)  # [group, element]
    word = np.stack(registers, axis=-1).reshape(groups, -1).astype(np.int64)  # [group, 4·block + i]
    if k == 2:
        want = np.stack([(word >> 16) << 8, (word & 0xFFFF) << 8], axis=-1)
    elif k == 4:
        want = np.stack([((word >> (24 - 8 * s)) & 0xFF) << 16 for s in range(4)], axis=-1)
    else:
        want = (word >> 8)[..., None]
    assert np.array_equal(bits, want.reshape(groups, -1))
    assert (bits < 1 << 24).all() and (bits & ((1 << (24 - width)) - 1) == 0).all()


@pytest.mark.parametrize("shape", [(7, 613), (4096 * 2 + 3,), (1,), (5,)], ids=["7x613", "8195", "1", "5"])
@pytest.mark.parametrize("source, target", PAIRS, ids=PAIR_IDS)
def test_emulated_bits_of_every_element_are_the_reference_fields(source, target, shape):
    """The kernel's fields (Philox words of the groups, numbered as the tiles number them, through
    ``element_bits``) against the reference's ``element_random_bits(seed, offset, shape, w)``, for
    element counts that are not a multiple of the tile, of the group or of ``k`` (4291, 8195, 1, 5):
    element ``i`` (row-major) gets the same 24-bit ``r``; the tiles of 4096 elements start at block
    ``t · 1024 / k``, which numbering the groups from block 0 in steps of 64 matches."""
    from tileplug.backend_ascend.quant import stochastic_cast as kernel
    from tileplug.backend_ascend.random import draw, philox
    from tileplug.reference.quant.stochastic_cast import element_random_bits

    seed, offset = 0xA4093822299F31D0, 2**32 + 7
    spec = kernel.spec_of(_cast_call(8, source, target))
    k = spec.elements_per_word
    count = int(np.prod(shape))
    bits = []
    for tile in range(-(-count // spec.tile)):  # the tile walk of draw.tile_kernel
        first_block = tile * (spec.tile // (philox.WORDS_PER_BLOCK * k))
        groups = min(spec.tile // spec.elements_per_group, -(-(count - tile * spec.tile) // spec.elements_per_group))
        firsts = first_block + np.arange(groups) * philox.BLOCKS_PER_GROUP
        words = emulated_words(CastNumpyOps(), (seed & MASK, seed >> 32), offset, firsts)
        registers = list(kernel.element_bits(CastNumpyOps(), words, spec.field_bits))
        bits.append(np.stack([np.broadcast_to(r, (groups, 64)) for r in registers], axis=1).reshape(-1))
    got = np.concatenate(bits)[:count].astype(np.int64)
    assert spec.tile == draw.TILE_ELEMENTS and spec.tile % spec.elements_per_group == 0
    state = [torch.tensor([as_int64_word(value)], dtype=torch.int64) for value in (seed, offset)]
    want = element_random_bits(*state, shape, spec.field_bits).reshape(-1).numpy()
    assert np.array_equal(got, want)


@pytest.mark.parametrize("source, target", PAIRS[::2], ids=PAIR_IDS[::2])
def test_emulation_catches_a_wrong_field_layout(source, target):
    """The comparison can fail: the fields not interleaved (a word's ``k`` fields in ``k``
    different registers, not ``k`` consecutive elements), or taken from the word's bottom first,
    give other bytes."""
    from tileplug.backend_ascend.quant import stochastic_cast as kernel

    x = _random_inputs(source, 4096 + 77, 5)
    want, _ = reference_cast(x, target, 9, 3)
    view = TARGET_VIEW[target][1]
    right = kernel.field_order
    for wrong in (lambda ops, fields: tuple(fields), lambda ops, fields: right(ops, tuple(fields)[::-1])):
        with mock.patch.object(kernel, "field_order", wrong):
            got = emulated_cast(CastNumpyOps(), x, target, 9, 3)
        both_nan = got.float().isnan() & want.float().isnan()
        assert not torch.equal(got.view(view)[~both_nan], want.view(view)[~both_nan])
