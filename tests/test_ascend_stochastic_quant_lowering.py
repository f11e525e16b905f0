"""Ascend quant tile kernel with ``stochastic_rounding=True`` (``per_token_cast`` / ``per_block_cast``,
docs/spec.md §10.2): LOWERING tests and a CPU emulation of the narrowing. Nothing here runs on an NPU.

* Every ``stochastic_cases()`` case of the op table lowers to Ascend C (disk-cached, in a process
  pool of 2, as tests/test_ascend_lowering.py) and passes the checks the quant grid applies, or is
  declined with a reason the backend states (e4m3-stored sf). Its source holds the Philox rounds of
  ``fill_rand`` once per draw a traced tile row makes (its whole groups of 1024 elements, a last
  partial one), the words split into 8-bit fields, the state DMA'd GM -> UB before the tile loop
  and never written, and the integer grid rounding; the same specialisation without stochastic
  rounding holds none of it.
* The emulation runs the very functions the kernel is traced from on numpy (the rounding of
  ``quant/stochastic_cast.py``'s ``grid_codes`` on the format's ``CodeGrid``; the tile kernel's
  ``row_draw`` / ``first_block_of`` / ``group_random_bits`` over the tiles as the kernel walks them)
  and compares bytes with the reference: edge values and exact thresholds of both formats, the
  random fields of every element of tiled calls (docs/spec.md §10.2: element ``i = t·H + h`` takes
  the 8-bit field ``i mod 4`` of word ``i // 4``, core's ``QUANT_RANDOM_FIELD_BITS``) against the
  reference's ``element_random_bits``, and whole casts against the reference's ``q``. What it
  cannot show: that the hardware instructions behave as ``random/vector_ops.py`` assumes.

No ``from __future__ import annotations``: TileLang parses macro sources in the modules imported.
"""

import math
import os
import re
import struct
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch

from test_ascend_rng_lowering import MASK
from test_ascend_stochastic_cast_lowering import EDGE_RANDOM_BITS, CastNumpyOps, edge_inputs
from tileplug import core
from tileplug.core.contracts.cast import QUANT_RANDOM_FIELD_BITS
from tileplug.core.ops.quant import stochastic_cases
from tileplug.core.ops.random import as_int64_word
from tileplug.core.random import Generator

pytestmark = pytest.mark.ascend_lower

META = "meta"
TOKENS = 5
FORMATS = ("e4m3", "e2m1")
ROUNDING_BITS = 24
"""The fixed point of the kernel's rounding: a field ``f`` of ``w`` bits enters it as ``f << (24 − w)``."""
FIELDS_PER_WORD = 32 // QUANT_RANDOM_FIELD_BITS
GROUP_ELEMENTS = 64 * 4 * FIELDS_PER_WORD
"""Elements of one draw over the 64 lanes: 64 Philox blocks of 4 words of 4 fields (1024)."""


def expected_row_draws(widths) -> list[int]:
    """The draws the source should hold for tile rows of ``widths`` columns, as the 64-lane
    registers of fields each stores: per width a loop over whole groups of 1024 elements (traced
    once, all 16 registers) when the row has one, and a last partial group storing only the
    registers up to the width."""
    draws = []
    for width in widths:
        if width >= GROUP_ELEMENTS:
            draws.append(GROUP_ELEMENTS // 64)
        if width % GROUP_ELEMENTS:
            draws.append(math.ceil(width % GROUP_ELEMENTS / 64))
    return draws


def _describe(case, tokens=TOKENS, device=META):
    with core.config.host_layout("ascend"):
        args, kwargs = case.arguments(tokens, device)
        call, inputs = core.describe_call(case.op, *args, **kwargs)
    return call, inputs


def _kernels() -> dict:
    from tileplug.backend_ascend.plugin import kernel_table

    return kernel_table()


def _grid() -> tuple[list, dict]:
    """([(specialisation, first case it serves)], {case id: decline reason}) of the op table's
    stochastic per-token / per-block cases."""
    table = _kernels()
    grid, declined = {}, {}
    for case in stochastic_cases():
        call, _ = _describe(case)
        why = table[call.op].supports(call)
        if why is not None:
            declined[case.id] = why
        else:
            grid.setdefault(table[call.op].describe(call), case)
    return list(grid.items()), declined


def lower_and_check(entry) -> dict:
    """Worker: lower the case's specialisation and the same one without stochastic rounding
    (both disk-cached), run the quant grid's checks on the stochastic one."""
    from tileplug.backend_ascend import lowering_checks as checks
    from tileplug.backend_ascend.quant.common import spec_of
    from tileplug.backend_ascend.quant.lowered import lower_spec
    from tileplug.backend_ascend.quant.spec import Tiling

    name, case = entry
    call, _ = _describe(case)
    (lowering,) = _kernels()[call.op].lowerings(call)
    lowered = lowering.lowered
    spec = spec_of(call)
    tiling = Tiling(spec)
    deterministic, _ = lower_spec(replace(spec, stochastic=False))
    return {
        "name": name,
        "source": lowered.source,
        "deterministic": deterministic.source,
        "fmt": spec.fmt,
        "widths": [tiling.width] * (tiling.full > 0) + [tiling.tail] * (tiling.tail > 0),  # the traced tile widths
        "checks": {
            "ub": checks.check_ub(lowered.compiler_ub_bytes, lowered.primfunc_ub_bytes, lowering.plan_bytes,
                                  lowering.budget),
            "pipelined": checks.check_pipelined(lowered.source),
            "vector": checks.check_vector(lowered.source),
            "nonempty": ("__gm__" in lowered.source, "kernel has __gm__ parameters"),
        },
    }


CASES, DECLINED = _grid()


@pytest.fixture(scope="module")
def lowered() -> dict:
    with ProcessPoolExecutor(min(2, os.cpu_count() or 1)) as pool:
        return {result["name"]: result for result in pool.map(lower_and_check, CASES)}


def test_every_stochastic_case_is_served_or_declined_for_a_stated_reason():
    """Ten cases: nine specialisations served (both formats, plain / round_sf / packed UE8M0 /
    column-major scales, a re-quantized e2m1 input, fp32 and padded inputs, per-block 32x32 to
    128x128); the e2m1 case with e4m3-stored scales is declined as every e4m3-sf call is."""
    assert len(stochastic_cases()) == 10
    assert len(CASES) == 9 and all(name.endswith(" stochastic") for name, _ in CASES)
    assert {name.split()[3] for name, _ in CASES} == set(FORMATS)
    assert list(DECLINED.values()) and all("e4m3-stored" in why for why in DECLINED.values()), DECLINED


@pytest.mark.parametrize("case", CASES, ids=[name for name, _ in CASES])
def test_lowering_passes_checks(lowered, case):
    failed = {name: detail for name, (ok, detail) in lowered[case[0]]["checks"].items() if not ok}
    assert not failed, failed


def _f32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


@pytest.mark.parametrize("case", CASES, ids=[name for name, _ in CASES])
def test_philox_and_state_only_in_the_stochastic_specialisation(lowered, case):
    """The stochastic source: the Philox multipliers, nine key increments and 20 ``vmull`` per
    draw of a traced tile row (full and last tile: a loop over whole groups of 1024 elements, a last
    partial group), each word split into four 8-bit fields moved to bits ``[16, 24)`` (``(w >> 8) &
    0xFF0000``, ``w & 0xFF0000``, ``(w << 8) & 0xFF0000`` and ``(w << 16) & 0xFF0000``), one store
    into ``bits_ub`` per register of fields up to the tile width, the seed and offset DMA'd GM -> UB
    once, before the tile loop, and never written; the rounding's carry out of bit 24 and the grid's
    saturation and smallest-normal exponent as integers; e4m3 codes stored without an fp8
    conversion. The same specialisation without stochastic rounding: none of it."""
    from tileplug.backend_ascend.random import philox

    result = lowered[case[0]]
    source, plain = result["source"], result["deterministic"]
    draws = expected_row_draws(result["widths"])
    for constant in philox.MULTIPLIERS:
        assert f"(uint32_t){constant}" in source, hex(constant)
    for constant in philox.WEYL_CONSTANTS:
        assert source.count(f"(uint32_t){constant}") == 9 * len(draws), hex(constant)
    assert source.count("simd_inst::vmull(") == 2 * philox.ROUNDS * len(draws)
    # each word register a stored register needs, split once: field s (bits [24 − 8s, 32 − 8s))
    # shifted right by 8 − 8s (field 0 right by 8, field 1 not at all, fields 2 and 3 left by 8
    # and 16), each masked to bits [16, 24)
    words_split = sum(math.ceil(registers / FIELDS_PER_WORD) for registers in draws)
    field_mask = ((1 << QUANT_RANDOM_FIELD_BITS) - 1) << (ROUNDING_BITS - QUANT_RANDOM_FIELD_BITS)
    for field in range(FIELDS_PER_WORD):
        shift = 32 - QUANT_RANDOM_FIELD_BITS * (field + 1) - (ROUNDING_BITS - QUANT_RANDOM_FIELD_BITS)
        if shift:
            instruction = "vshrs" if shift > 0 else "vshls"
            moved = re.findall(rf"field{field}_moved\w* = simd_inst::{instruction}\(elements_\w+, "
                               rf"\(uint32_t\){abs(shift)},", source)
            assert len(moved) == words_split, (field, len(moved), words_split)
            operand = rf"field{field}_moved\w*"
        else:  # the field is in place: the ordered word itself is masked
            assert f"field{field}_moved" not in source, field
            operand = r"elements_\w+"
        masked = re.findall(rf"field{field}\w* = simd_inst::vand\({operand}, "
                            rf"simd_inst::vdup<uint32_t>\(\(uint32_t\){field_mask},", source)
        assert len(masked) == words_split, (field, len(masked), words_split)
    stores = re.findall(r"simd_inst::vsts\w*\(\(\*\(vector_s32 \*\)\(&\(drawn_bits\w*\)\)\)", source)
    assert len(stores) == sum(draws), (len(stores), draws)
    loop = source.index("for (int32_t it = 0;")
    for state in ("SEED", "OFFSET"):
        (line,) = [line for line in source.splitlines() if f"(&({state}[" in line]  # one access: the copy in
        assert line.strip().startswith("asc_copy_gm2ub_align(") and source.index(line) < loop, line
    assert re.search(r"round_up\w* = simd_inst::vshrs\(fraction_sum\w*, \(uint32_t\)24,", source)
    largest, min_biased = {"e4m3": (448.0, 121), "e2m1": (6.0, 127)}[result["fmt"]]
    assert re.search(rf"saturated\w* = simd_inst::vmins\(magnitude\w*, \(uint32_t\){_f32_bits(largest)},", source)
    assert re.search(rf"step_exponent\w* = simd_inst::vmaxs\(biased_exponent\w*, \(uint32_t\){min_biased},", source)
    if result["fmt"] == "e4m3":
        assert "vcvt<float8" not in source
    for marker in [f"(uint32_t){c}" for c in philox.MULTIPLIERS + philox.WEYL_CONSTANTS] + [
            "simd_inst::vmull(", "SEED", "OFFSET", "fraction_sum", "random_bits", "field0", "drawn_bits"]:
        assert marker not in plain, marker


def test_every_quant_specialisation_of_the_grid_has_philox_only_when_stochastic():
    """Across the op table's per-token / per-block cases (descriptions only: the lowering is
    tests/test_ascend_lowering.py's), a specialisation is stochastic exactly when its call is."""
    table = _kernels()
    for op in ("per_token_cast", "per_block_cast"):
        for case in core.opdefs.get(op).cases():
            call, _ = _describe(case)
            if table[op].supports(call) is None:
                assert table[op].describe(call).endswith(" stochastic") == bool(call.cast.stochastic), case.id


# ---------------------------------------------------------------------- declines, launch, core.lower


def test_declines_carry_reasons():
    """e4m3-stored scales are declined as for every cast; a stochastic call in another mode (the
    contract never makes one; made by hand) is declined naming the main casts."""
    from tileplug.core.call import QuantMode

    kernel = _kernels()["per_token_cast"]
    for case_id, why in DECLINED.items():
        assert "e4m3-stored" in why, (case_id, why)
    call, _ = _describe(stochastic_cases()[0])
    assert kernel.supports(call) is None
    why = kernel.supports(replace(call, mode=QuantMode.SF_ONLY))
    assert why is not None and "main per_token_cast / per_block_cast" in why and "falls to the reference" in why


@pytest.mark.parametrize("index", [0, 3], ids=["plain", "requantized"])
def test_launch_passes_the_state_words_last_then_advances_the_offset(index):
    """``__call__`` (CPU tensors, the compiled kernel replaced by a recorder): x, [input sf,] q, sf,
    then the int32 word views of seed and offset in the prim_func's order, the offset as the kernel
    reads it; after the launch the kernel object advances the offset by one (a carry into its upper
    word here), the seed untouched."""
    from tileplug.backend_ascend.quant import common

    case = stochastic_cases()[index]
    call, inputs = _describe(case, 4, "cpu")
    kernel = _kernels()[call.op]
    inputs.seed.fill_(-1)
    inputs.offset.fill_(2**32 - 1)
    hidden = call.hidden
    q = torch.empty(4, hidden, dtype=torch.float8_e4m3fn)
    sf = torch.empty(4, math.ceil(hidden / call.cast.block[1]))
    launched = []

    def record(*args):
        launched.append([(arg.data_ptr(), arg.dtype, arg.clone()) for arg in args])

    with core.config.override(ascend_vector_cores=8), mock.patch.object(common.compiled, "get", lambda spec: record):
        kernel(call, inputs, SimpleNamespace(q=q, sf=sf))
    (args,) = launched
    expected = [inputs.x] + ([inputs.input_sf] if call.quantized_input is not None else []) + [q, sf]
    assert [ptr for ptr, _, _ in args[:len(expected)]] == [t.data_ptr() for t in expected]
    seed_words, offset_words = args[len(expected):]
    assert seed_words[0] == inputs.seed.data_ptr() and seed_words[2].tolist() == [-1, -1]
    assert offset_words[0] == inputs.offset.data_ptr() and offset_words[2].tolist() == [-1, 0]
    assert {seed_words[1], offset_words[1]} == {torch.int32}
    assert inputs.offset.tolist() == [2**32] and inputs.seed.tolist() == [-1]


def test_core_lower_names_the_stochastic_specialisation():
    case = stochastic_cases()[7]  # per-block 32x32 e2m1, round_sf
    with core.config.host_layout("ascend"):
        args, kwargs = case.arguments(TOKENS, META)
        source = core.lower(case.op, *args, backend="ascend", **kwargs)
    assert "LOWERED" in source and "not verified" in source and "stand-in" in source
    assert "specialisation: block H=576 32x32 e2m1 cast bfloat16 round_sf stochastic" in source
    assert "__global__" in source


def test_capabilities_say_lowered():
    from tileplug.backend_ascend import plugin

    text = plugin.capabilities()
    line = text[text.index("stochastic_rounding=True on per_token_cast / per_block_cast"):]
    assert "Lowered, never run on an NPU" in line.split("\n")[2]


# ---------------------------------------------------------------------- CPU emulation: the narrowing

GRID_VALUES = {
    "e4m3": torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float(),
    "e2m1": torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]),
}


def _reference_codes(values: torch.Tensor, random_bits: np.ndarray, fmt: str) -> np.ndarray:
    """The reference's bytes: ``round_on_grid`` then the format's deterministic encoder (e4m3
    bytes, e2m1 codes one per byte)."""
    from tileplug.core.quant import formats
    from tileplug.reference.quant.stochastic_cast import round_on_grid

    rounded = round_on_grid(values, torch.from_numpy(random_bits.astype(np.int64)), formats.QUANT_FORMATS[fmt])
    if fmt == "e4m3":
        return formats.saturate_e4m3(rounded).view(torch.uint8).numpy()
    return formats.e2m1_codes(rounded).numpy()


def _kernel_codes(ops, values: torch.Tensor, random_bits: np.ndarray, fmt: str) -> np.ndarray:
    """What the stochastic store computes for fp32 ``y`` (its bit patterns) with the words
    ``random_bits``: ``grid_codes`` on the format's grid, narrowed to a byte (in range: checked)."""
    from tileplug.backend_ascend.quant.stochastic_cast import CODE_GRIDS, grid_codes

    patterns = values.contiguous().view(torch.int32).numpy().view(np.uint32)
    codes = np.asarray(grid_codes(ops, patterns, random_bits, CODE_GRIDS[fmt]()))
    assert (codes < (256 if fmt == "e4m3" else 16)).all(), "a code wider than the format"
    return codes.astype(np.uint8)


def _assert_codes_equal(got: np.ndarray, want: np.ndarray, fmt: str, what: str) -> None:
    """Bytewise; for e4m3 any NaN equals any NaN (e2m1 has no NaN: both give 6's code)."""
    if fmt == "e4m3":
        nan = (want & 0x7F) == 0x7F
        assert ((got & 0x7F) == 0x7F)[nan].all(), what
        got, want = got[~nan], want[~nan]
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, f"{what}: {bad.size} differ, first at {bad[:5]}: {got[bad[:5]]} != {want[bad[:5]]}"


def narrowing_edges(fmt: str) -> torch.Tensor:
    """fp32 values ``x·inv`` may take, both signs: the stochastic cast's edge inputs (every e4m3
    value and midpoint and their neighbours, NaNs, infinities, denormals, the top of fp32), every
    grid value of ``fmt`` with its step midpoints, quarter points and fp32 neighbours, and values
    around the saturation."""
    grid = GRID_VALUES[fmt]
    points = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, grid[:-1] + (grid[1:] - grid[:-1]) / 4,
                        torch.tensor([grid[-1].item() * f for f in (1.0001, 1.25, 1.5, 2.0, 1e6)])])
    bits = points.view(torch.int32)
    near = torch.cat([bits - 1, bits, bits + 1]).clamp(min=0).view(torch.float32)
    values = torch.cat([edge_inputs(), near, -near])
    return values


def _threshold_bits(values: torch.Tensor, fmt: str, field_bits: int) -> list[np.ndarray]:
    """Per value, the ``w``-bit fields at its rounding threshold (``w = field_bits``), as the 24-bit
    ``r = f << (24 − w)`` the rounding adds: ``f = 2^w − floor(p·2^w)`` (rounds up) and one less
    (rounds down), clipped to ``w`` bits; computed here in fp64 on the grid table. ``w = 24``: every
    bit of ``r``; ``w = 8``: the fields the casts' draw gives (docs/spec.md §10.2)."""
    grid = GRID_VALUES[fmt].double()
    magnitude = values.double().abs().nan_to_num(0.0).clamp(max=grid[-1].item())
    low_index = (torch.searchsorted(grid, magnitude, right=True) - 1).clamp(max=grid.numel() - 2)
    low, high = grid[low_index], grid[low_index + 1]
    fraction = torch.floor((magnitude - low) / (high - low) * 2**field_bits).to(torch.int64).clamp(0, 2**field_bits)
    up = (2**field_bits - fraction).clamp(0, 2**field_bits - 1).numpy().astype(np.uint32)
    shift = ROUNDING_BITS - field_bits
    return [up << shift, np.where(up > 0, up - 1, 0).astype(np.uint32) << shift]


@pytest.mark.parametrize("flush_denormals", [False, True], ids=["denormals-kept", "denormals-flushed"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_emulated_narrowing_of_the_edge_values_is_the_reference(fmt, flush_denormals):
    """Each edge value with 24-bit ``r`` at the fixed boundaries (0, 1, 2^23, 2^24 − 1, ...), at its
    own threshold and one below (to the last of the 24 bits, and as 8-bit fields ``f << 16``, what
    the casts' draw gives), and random ones (24-bit and ``f << 16``): the kernel's codes are the
    reference's bytes."""
    values = narrowing_edges(fmt)
    chooser = np.random.default_rng(11)
    field_shift = ROUNDING_BITS - QUANT_RANDOM_FIELD_BITS
    words = [np.full(values.numel(), r, dtype=np.uint32) for r in EDGE_RANDOM_BITS]
    words += _threshold_bits(values, fmt, ROUNDING_BITS) + _threshold_bits(values, fmt, QUANT_RANDOM_FIELD_BITS)
    words += [chooser.integers(0, 1 << 24, values.numel(), dtype=np.uint32) for _ in range(3)]
    words += [chooser.integers(0, 1 << QUANT_RANDOM_FIELD_BITS, values.numel(), dtype=np.uint32) << field_shift
              for _ in range(3)]
    ops = CastNumpyOps(flush_denormals)
    for index, random_bits in enumerate(words):
        _assert_codes_equal(_kernel_codes(ops, values, random_bits, fmt), _reference_codes(values, random_bits, fmt),
                            fmt, f"{fmt} words #{index}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_emulated_thresholds_round_up_exactly_there(fmt):
    """Between two grid neighbours, a value rounds up exactly when ``floor(p·2^8) + f ≥ 2^8`` for
    its 8-bit field ``f`` (docs/spec.md §10.2; the kernel adds ``r = f << 16`` to ``floor(p·2^24)``):
    at the threshold field the result is the upper neighbour, one below it the lower one (the codes
    differ by one); the expected value over every one of the 256 fields is the value."""
    grid = GRID_VALUES[fmt]
    values = (grid[:-1] + (grid[1:] - grid[:-1]) * 0.3125).float()
    up, down = _threshold_bits(values, fmt, QUANT_RANDOM_FIELD_BITS)
    ops = CastNumpyOps()
    high = _kernel_codes(ops, values, up, fmt).astype(np.int64)
    low = _kernel_codes(ops, values, down, fmt).astype(np.int64)
    assert (high - low == 1).all() and (low == np.arange(values.numel())).all()
    field_shift = ROUNDING_BITS - QUANT_RANDOM_FIELD_BITS
    residues = np.arange(0, 1 << QUANT_RANDOM_FIELD_BITS, dtype=np.uint32) << field_shift
    for value in values.tolist():
        codes = _kernel_codes(ops, torch.full((residues.size,), value), residues, fmt)
        mean = GRID_VALUES[fmt][torch.from_numpy(codes.astype(np.int64))].double().mean().item()
        assert mean == pytest.approx(value, rel=0, abs=1e-9), value


def test_emulation_catches_a_wrong_grid():
    """The comparison can fail: with e2m1's smallest normal exponent or NaN code wrong, or e4m3's
    saturation one pattern low, some byte differs."""
    from tileplug.backend_ascend.quant import stochastic_cast as kernel

    for fmt, constant, value in (("e2m1", "E2M1_MIN_BIASED", 126), ("e2m1", "E2M1_NAN", 6),
                                 ("e4m3", "E4M3_MAX_PATTERN", _f32_bits(448.0) - 1)):
        values = narrowing_edges(fmt)
        random_bits = np.random.default_rng(3).integers(0, 1 << 24, values.numel(), dtype=np.uint32)
        random_bits[::2] = 0  # (448 saturated one pattern low rounds back up unless r is small)
        want = _reference_codes(values, random_bits, fmt)
        with mock.patch.object(kernel, constant, value):
            got = _kernel_codes(CastNumpyOps(), values, random_bits, fmt)
        with pytest.raises(AssertionError):
            _assert_codes_equal(got, want, fmt, constant)


# ---------------------------------------------------------------------- CPU emulation: which fields

UNSTORED = 0xFFFFFFFF
"""What a column of ``bits_ub`` no draw stored holds in the emulation: no ``f << 16`` of an 8-bit field."""


def emulated_tile_bits(spec, tiling, tokens: int, seed: int, offset: int) -> np.ndarray:
    """The random bits the kernel rounds element ``(t, h)`` with (its field ``f`` as ``f << 16``),
    ``[T, H]`` uint32: the kernel's walk over its (row tile, column tile) items -- row tiles of
    ``spec.rows`` rows, column tiles of ``tiling.width`` and the last of ``tiling.tail`` --, per
    valid row of a tile the draws of ``row_draw(w)`` (whole groups of 1024 elements, then the first
    registers of a last one) from ``first_block_of(row, col0, H)``, through ``group_random_bits``
    (element order) into that row of ``bits_ub`` as the plan sizes it (a store past its end fails),
    each element of the tile taking the bits at its column. The rows of a row tile are drawn
    together (numpy lanes ``[rows, 64]``); the kernel draws them one after the other."""
    from tileplug.backend_ascend.quant import tile_kernel
    from tileplug.backend_ascend.random import philox

    ops = CastNumpyOps()
    hidden, rows = spec.hidden, spec.rows
    key = (np.uint32(seed & MASK), np.uint32(seed >> 32))
    counter = (np.uint32(offset & MASK), np.uint32(offset >> 32))
    multipliers = philox.multiplier_registers(ops)
    (_, row_length), _, _ = spec.plan(tiling.width)["bits_ub"]
    tiles = [(index * tiling.width, tiling.width) for index in range(tiling.full)]
    if tiling.tail:
        tiles.append((tiling.full * tiling.width, tiling.tail))
    result = np.zeros((tokens, hidden), dtype=np.uint32)
    for row0 in range(0, tokens, rows):
        tile_rows = np.arange(row0, min(row0 + rows, tokens), dtype=np.uint32)
        for col0, width in tiles:
            whole_groups, last_registers = tile_kernel.row_draw(width)
            draws = [(group, tile_kernel.RANDOM_GROUP_REGISTERS) for group in range(whole_groups)]
            draws += [(whole_groups, last_registers)] if last_registers else []
            bits_ub = np.full((tile_rows.size, row_length), UNSTORED, dtype=np.uint32)
            blocks = tile_kernel.first_block_of(tile_rows, np.uint32(col0), hidden)
            for group, registers in draws:
                firsts = (blocks + np.uint32(group * philox.BLOCKS_PER_GROUP)).astype(np.uint32)
                fields = tile_kernel.group_random_bits(ops, multipliers, key, counter, firsts, registers)
                for index, register in enumerate(fields):  # [rows, 64] each
                    at = group * tile_kernel.RANDOM_GROUP_ELEMENTS + index * 64
                    assert at + 64 <= row_length, f"a store at {at} past the {row_length} columns of bits_ub"
                    bits_ub[:, at:at + 64] = register
            result[row0:row0 + tile_rows.size, col0:col0 + width] = bits_ub[:, :width]
    return result


def _spec_and_tiling(case, width=None):
    from tileplug.backend_ascend.quant.common import spec_of
    from tileplug.backend_ascend.quant.spec import Tiling

    call, _ = _describe(case)
    spec = spec_of(call)
    return spec, Tiling(spec, width)


LAYOUTS = [(1, None, 3), (4, None, 9), (4, 256, 9), (7, 192, 3), (7, None, 40), (5, None, 2), (5, 1152, 2),
           (6, None, 300), (8, None, 131), (8, 1024, 131), (9, 128, 70)]
"""(stochastic case index, forced tile width or None, tokens): whole rows of 576 (the first 9 of a
group's 16 registers) and 592 (10 registers, the last one's 16 columns followed by padding), rows of
7168 (7 whole groups), tiles of 1152 columns (a whole group and 2 registers of a second) with a last
tile of 256, a 32-row tile of 576-wide rows, narrow tiles with a last partial tile (64- and 128-row
tiles; tiles of exactly one group, then one of 16 columns), partial row tiles at the end."""


@pytest.mark.parametrize("index, width, tokens", LAYOUTS,
                         ids=[f"case{i}-w{w or 'budget'}-T{t}" for i, w, t in LAYOUTS])
def test_emulated_fields_of_every_element_are_the_draw(index, width, tokens):
    """Element ``i = t·H + h`` gets field ``i mod 4`` of word ``i // 4`` of the draw under (seed,
    offset), its 8 bits as ``f << 16`` (docs/spec.md §10.2, core's ``QUANT_RANDOM_FIELD_BITS``):
    the kernel's tile walk (budget tiling or a forced narrower one) against the reference's
    ``element_random_bits(seed, offset, [T, H], QUANT_RANDOM_FIELD_BITS)``."""
    from tileplug.reference.quant.stochastic_cast import element_random_bits

    spec, tiling = _spec_and_tiling(stochastic_cases()[index], width)
    seed, offset = 0xA4093822299F31D0, 2**32 + 7
    got = emulated_tile_bits(spec, tiling, tokens, seed, offset)
    state = [torch.tensor([as_int64_word(v)], dtype=torch.int64) for v in (seed, offset)]
    want = element_random_bits(*state, (tokens, spec.hidden), QUANT_RANDOM_FIELD_BITS).numpy()
    assert np.array_equal(got.astype(np.int64), want)


def test_emulation_catches_a_wrong_field_layout():
    """The comparison can fail: the layouts before docs/spec.md §10.2 took 8-bit fields (16-bit
    fields, two a word, a block per 8 elements; before that a word's top 24 bits an element, a block
    per 4 elements), a first block one too far, rows numbered by a padded stride, a word's four
    fields in the other order, or a last partial group one register short give other bits."""
    from tileplug.backend_ascend.quant import stochastic_cast, tile_kernel
    from tileplug.reference.quant.stochastic_cast import element_random_bits

    spec, tiling = _spec_and_tiling(stochastic_cases()[4], 256)  # tiles of 256, 256 and 80 columns
    state = (torch.tensor([5]), torch.tensor([0]))
    want = element_random_bits(*state, (3, spec.hidden), QUANT_RANDOM_FIELD_BITS).numpy()
    assert np.array_equal(emulated_tile_bits(spec, tiling, 3, 5, 0).astype(np.int64), want)
    first_block_of, row_draw = tile_kernel.first_block_of, tile_kernel.row_draw
    field_order = stochastic_cast.field_order

    def block_too_far(row, column, hidden):
        return first_block_of(row, column, hidden) + 1

    def padded_stride(row, column, hidden):
        return first_block_of(row, column, hidden + 16)

    def bottom_field_first(ops, fields):
        return field_order(ops, fields[::-1])

    def last_group_short(width):
        whole_groups, last_registers = row_draw(width)
        return whole_groups, last_registers - 1

    two_fields_a_word = dict(QUANT_RANDOM_FIELD_BITS=16, RANDOM_FIELDS_PER_WORD=2, RANDOM_BLOCK_ELEMENTS=8,
                             RANDOM_GROUP_ELEMENTS=512, RANDOM_GROUP_REGISTERS=8)
    word_per_element = dict(QUANT_RANDOM_FIELD_BITS=24, RANDOM_FIELDS_PER_WORD=1, RANDOM_BLOCK_ELEMENTS=4,
                            RANDOM_GROUP_ELEMENTS=256, RANDOM_GROUP_REGISTERS=4)
    wrongs = [
        mock.patch.multiple(tile_kernel, **two_fields_a_word),
        mock.patch.multiple(tile_kernel, **word_per_element),
        mock.patch.object(tile_kernel, "first_block_of", block_too_far),
        mock.patch.object(tile_kernel, "first_block_of", padded_stride),
        mock.patch.object(stochastic_cast, "field_order", bottom_field_first),
        mock.patch.object(tile_kernel, "row_draw", last_group_short),
    ]
    for index, wrong in enumerate(wrongs):
        with wrong:
            got = emulated_tile_bits(spec, tiling, 3, 5, 0)
        assert not np.array_equal(got.astype(np.int64), want), index


WHOLE_CASTS = [0, 1, 4, 6, 7, 8]
"""Stochastic cases cast whole: e4m3 per-token plain and UE8M0, e2m1 per-token round_sf on a
padded fp32 input, per-block 128x128 e4m3, 32x32 e2m1, 64x64 fp32 UE8M0."""


@pytest.mark.parametrize("index", WHOLE_CASTS, ids=[f"case{i}" for i in WHOLE_CASTS])
def test_emulated_cast_is_the_reference_bytewise(index):
    """A whole cast on the CPU: ``y = x·inv`` as the reference forms it (the kernel's product is
    the deterministic cast's, compared elsewhere), narrowed by the emulated kernel -- its tile walk's
    words and ``grid_codes`` --, e2m1 nibbles packed; equal to the reference's ``q`` bytewise."""
    from tileplug.core.quant import formats
    from tileplug.core.quant.sf_math import compute_scales, group_amax, scale_groups
    from tileplug.reference.quant.grouped_cast import input_values

    case = stochastic_cases()[index]
    tokens = 131
    call, inputs = _describe(case, tokens, "cpu")
    torch.manual_seed(index)
    x = inputs.x
    x.copy_((torch.randn(x.shape) * torch.exp2(torch.randint(-6, 7, (x.shape[0], 1)).float())).to(x.dtype))
    x[:, ::97] = float("nan") if x.dtype != torch.float32 else float("inf")  # a non-finite group scale
    spec, tiling = _spec_and_tiling(case)
    seed, offset = int(inputs.seed.item()) & (2**64 - 1), int(inputs.offset.item()) & (2**64 - 1)
    generator = Generator.over(inputs.seed.clone(), inputs.offset.clone())
    with core.use_backend("reference"):
        args, kwargs = case.arguments(tokens, "cpu")
        kwargs = {**kwargs, "generator": generator}
        q, _ = getattr(core.ops, case.op)(x, *args[1:], **kwargs)

    cast = call.cast
    data, _ = input_values(call, inputs)
    scales = compute_scales(group_amax(data, cast.block), cast.fmt, cast.clamp_min, cast.round_sf, cast.use_e4m3_sf)
    y = scale_groups(data, scales.inverse, cast.block)
    words = emulated_tile_bits(spec, tiling, tokens, seed, offset)
    codes = _kernel_codes(CastNumpyOps(), y.reshape(-1), words.reshape(-1), spec.fmt).reshape(y.shape)
    want = q.view(torch.uint8).numpy()
    if spec.fmt == "e2m1":
        got = formats.pack_nibbles(torch.from_numpy(codes)).view(torch.uint8).numpy()
        assert np.array_equal(got, want)
    else:
        _assert_codes_equal(codes.reshape(-1), want.reshape(-1), "e4m3", case.id)
