"""Ascend ``per_block_cast_lossless`` (docs/spec.md §11): the lossless mode of the quant tile kernel,
LOWERING tests and a CPU emulation of its scale math. Nothing here runs on an NPU.

* Every op-table case is lowered by tests/test_ascend_lowering.py's grid (ids end in ``lossless``);
  here the lossless specialisation is lowered next to the plain re-quantization of the same
  ``(xq, sf)`` input into the same groups (``TileSpec.lossless`` off) and the two sources are
  compared: the lossless one holds the key rule (transpose_weight_sf's byte rule on the input
  scales' patterns) and the scale from exponent bits, the plain one the amax of ``|x|`` and the
  two divisions, and not the other's.
* The emulation runs the very functions the kernel is traced from (``ue8m0_bytes`` per element, the
  integer max over each group, ``sf_macros.lossless_group_scales``) on numpy and compares every
  group's sf, inv and UE8M0 byte with the reference's ``lossless_scales`` of ``given_scale_exponent``:
  special scales (zeros of both signs, subnormals around ``2^-127``, ``2^127`` and above, inf, NaN,
  negatives) and random ones, partial groups included. What it cannot show: that the hardware
  instructions behave as ``random/vector_ops.py`` assumes.

No ``from __future__ import annotations``: TileLang parses macro sources in the modules imported.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch

from test_ascend_weight_scales_lowering import WeightScaleNumpyOps, _random_scales, special_scales
from tileplug import core
from tileplug.core.ops.quant_reblock import lossless_cases

pytestmark = pytest.mark.ascend_lower

META = "meta"
TOKENS = 5
LARGEST_FINITE_PATTERN = "2139095039"
"""``0x7F7FFFFF`` as the Ascend C prints it: the byte rule's bound of a finite scale."""
HEADROOM_ADDEND = "4294967290"
"""``2^32 - 6`` as the Ascend C prints it: the lossless headroom taken off the largest key."""


def _call(case):
    with core.config.host_layout("ascend"):
        args, kwargs = case.arguments(TOKENS, META)
        call, _ = core.describe_call(case.op, *args, **kwargs)
    return call


def _case(hidden: int, **kwargs):
    """The first op-table case of ``hidden`` whose id holds every ``key=value`` of ``kwargs``."""
    for case in lossless_cases():
        if f"H={hidden}," in case.id and all(f"{key}={value}" in case.id for key, value in kwargs.items()):
            return case
    raise LookupError(f"no lossless case H={hidden} {kwargs}")


def test_lossless_source_holds_the_key_rule_and_the_plain_requantization_does_not():
    """An MXFP4-style 1 x 32 fp32-scaled input into 32 x 32 fp32-sf groups: the lossless kernel and the
    plain re-quantization of the same input and groups both lower and pass the grid's checks; only the
    lossless one holds the byte rule of the input scales and the headroom, and no division; only the
    plain one divides (sf = amax / 448, inv = 448 / amax)."""
    from tileplug.backend_ascend import lowering_checks as checks
    from tileplug.backend_ascend.quant.common import spec_of
    from tileplug.backend_ascend.quant.lowered import lower_spec

    call = _call(_case(576, input_sf="fp32", out_block_size="32x32", x_block_size="1x32"))
    lossless = spec_of(call)
    assert lossless.lossless and lossless.kind == "block" and lossless.qin == ("e2m1", 1, 32, "fp32", False)
    plain = replace(lossless, lossless=False)
    sources = {}
    for name, spec in (("lossless", lossless), ("plain", plain)):
        lowered, tiling = lower_spec(spec)
        source = lowered.source
        assert checks.check_ub(lowered.compiler_ub_bytes, lowered.primfunc_ub_bytes, tiling.footprint,
                               tiling.budget)[0]
        assert checks.check_pipelined(source)[0] and checks.check_vector(source)[0]
        sources[name] = source
    assert sources["lossless"] != sources["plain"]
    for marker in (LARGEST_FINITE_PATTERN, HEADROOM_ADDEND, "ue8m0_byte", "inv_pattern", "vcmax"):
        assert marker in sources["lossless"], marker
    assert "vdiv" not in sources["lossless"]
    for marker in (LARGEST_FINITE_PATTERN, HEADROOM_ADDEND, "ue8m0_byte", "inv_pattern"):
        assert marker not in sources["plain"], marker
    assert "vdiv" in sources["plain"] and "vcmax" in sources["plain"]


def test_lossless_takes_the_tile_of_its_output_groups():
    """1 x bn groups take the per-token tile, bm x 1 the per-channel tile (two row groups per tile
    with packed UE8M0), others the per-block tile; round_sf does not split the specialisation. The
    DeepGEMM layout (128 x 128 packed UE8M0 groups: a 256-column tile of 128 rows) is served."""
    from tileplug.backend_ascend.plugin import kernel_table
    from tileplug.backend_ascend.quant.common import spec_of

    kernel = kernel_table()["per_block_cast_lossless"]
    token = spec_of(_call(_case(576, out_block_size="1x128", round_sf="True", x_block_size="1x32")))
    channel = spec_of(_call(_case(576, out_block_size="128x1", use_packed_ue8m0="True", x_block_size="1x64")))
    block = spec_of(_call(_case(576, out_block_size="128x32", x_block_size="1x128")))
    assert (token.kind, token.rows) == ("token", 1)
    assert (channel.kind, channel.rows) == ("channel", 256)
    assert (block.kind, block.rows) == ("block", 128)
    assert not token.round_sf and all(spec.lossless for spec in (token, channel, block))
    assert kernel.supports(_call(_case(7168, use_packed_ue8m0="True"))) is None


COMPACT_CASES = 15
"""Op-table lossless cases whose per-element plan (fp32 decoded values and input scales) is over the
UB budget (about 370 KB), so they take the compact decode; every other case keeps its code."""


def test_cases_over_the_per_element_plan_take_the_compact_decode_and_lower():
    """The 15 op-table cases whose per-element plan does not fit (declined with the plan's size before)
    take ``TileSpec.compact_decode`` (bf16 decoded values, one fp32 input scale per input group), fit
    the budget, lower and pass the UB, pipelining and vector checks; no other case takes it. The
    DeepGEMM MXFP4 case (``1 x 32 -> 128 x 128``, packed UE8M0): its SIMT region stores the decoded
    values as bf16, the SIMD region widens them (``vlds_unpack<bfloat16_t>`` + ``vcvt<float>``) and
    loads each input scale broadcast (``vlds_brc_elem<float>``, two groups of 32 lanes per register),
    and its UB plan is 176224 bytes."""
    from tileplug.backend_ascend import lowering_checks as checks
    from tileplug.backend_ascend.device import UBBudgetError
    from tileplug.backend_ascend.plugin import kernel_table
    from tileplug.backend_ascend.quant.common import spec_of
    from tileplug.backend_ascend.quant.lowered import lower_spec
    from tileplug.backend_ascend.quant.spec import Tiling

    kernel = kernel_table()["per_block_cast_lossless"]
    compact = []
    for case in lossless_cases():
        call = _call(case)
        spec = spec_of(call)
        assert kernel.supports(call) is None, case.id
        if not spec.compact_decode:
            continue
        compact.append(case.id)
        assert spec.qin[0] == "e2m1" and spec.qin[2] > 1 and "compact_decode" in spec.describe()
        with pytest.raises(UBBudgetError, match="UB plan needs"):
            Tiling(replace(spec, compact_decode=False))
        lowered, tiling = lower_spec(spec)
        assert tiling.plan["d_ub"][1] == "bfloat16", case.id
        assert tiling.plan["s_ub"][0][1] < tiling.plan["d_ub"][0][1], case.id
        source = lowered.source
        ub_ok, ub_detail = checks.check_ub(lowered.compiler_ub_bytes, lowered.primfunc_ub_bytes, tiling.footprint,
                                           tiling.budget)
        assert ub_ok, (case.id, ub_detail)
        assert checks.check_pipelined(source)[0] and checks.check_vector(source)[0], case.id
        assert "vlds_unpack<bfloat16_t>" in source and "vlds_brc_elem<float>" in source, case.id
        assert "(bfloat16_t)" in source and LARGEST_FINITE_PATTERN in source, case.id
    assert len(compact) == COMPACT_CASES, compact

    deep_gemm = spec_of(_call(_case(7168, use_packed_ue8m0="True")))
    assert deep_gemm.compact_decode and deep_gemm.qin == ("e2m1", 1, 32, "fp32", False)
    lowered, tiling = lower_spec(deep_gemm)
    assert (tiling.width, tiling.footprint, tiling.budget) == (256, 176224, 221184)
    assert tiling.plan["d_ub"] == ((128, 256), "bfloat16", 1)
    assert tiling.plan["s_ub"] == ((128, 8), "float32", 1)
    assert lowered.source.count("vlds_brc_elem<float>") >= 4


def _emulated_group_scales(scales: torch.Tensor, block: tuple[int, int]):
    """The kernel's scale math on numpy for fp32 input scales ``[T, H]`` (one per element):
    keys per element, the integer max over each ``bm x bn`` group (pads give 0, as the kernel's
    masked lanes and skipped rows), then the group scales → (sf, inv, UE8M0 byte) per group."""
    from tileplug.backend_ascend.quant.sf_macros import lossless_group_scales
    from tileplug.backend_ascend.quant.transpose_weight_sf import ue8m0_bytes

    ops = WeightScaleNumpyOps()
    keys = ue8m0_bytes(ops, scales.numpy().view(np.uint32))
    bm, bn = block
    tokens, hidden = keys.shape
    rows, cols = -(-tokens // bm), -(-hidden // bn)
    padded = np.zeros((rows * bm, cols * bn), dtype=np.uint32)
    padded[:tokens, :hidden] = keys
    largest = padded.reshape(rows, bm, cols, bn).max(axis=(1, 3))
    sf, inverse, biased = lossless_group_scales(ops, largest)
    return (np.asarray(sf, dtype=np.uint32).view(np.float32), np.asarray(inverse, dtype=np.uint32).view(np.float32),
            np.asarray(biased, dtype=np.uint32))


@pytest.mark.parametrize("block", [(1, 1), (1, 32), (16, 16), (32, 1), (128, 128)])
@pytest.mark.parametrize("which", ["special", "random"])
def test_emulated_lossless_scales_are_the_reference(block, which):
    """Every group's sf, inv (bitwise) and UE8M0 byte as the reference's ``lossless_scales`` of
    ``given_scale_exponent``: the special scales, and random ones (powers of two from ``2^-140``,
    random patterns, zeros, negatives, inf, NaN), on a 37 x 80 grid (partial groups on both axes;
    1 x 1 groups, which the op does not take, give every element's own group scale)."""
    from tileplug.core.quant.sf_math import NONFINITE_EXPONENT, given_scale_exponent, lossless_scales

    rng = np.random.default_rng(11)
    if which == "special":
        special = special_scales()
        scales = special[torch.from_numpy(rng.integers(0, len(special), (37, 80)))]
    else:
        scales = _random_scales((37, 80), rng)
    reference = lossless_scales(given_scale_exponent(scales), block)
    sf, inverse, biased = _emulated_group_scales(scales, block)
    expected_byte = torch.where(reference.exponent == NONFINITE_EXPONENT, 255, reference.exponent + 127)
    assert np.array_equal(biased, expected_byte.numpy().astype(np.uint32))
    assert np.array_equal(sf.view(np.uint32), reference.value.numpy().view(np.uint32))
    assert np.array_equal(inverse.view(np.uint32), reference.inverse.numpy().view(np.uint32))
    if block == (1, 1):  # the floor, the ceiling and non-finite groups are all met
        assert {0, 121, 255} <= set(biased.ravel().tolist())
