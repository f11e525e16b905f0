"""Ascend SwiGLU kernels: LOWERING tests (TileLang's Ascend pipeline -> Ascend C, on a CPU machine).

Nothing here executes a kernel. Every op-table case of ``swiglu``, ``swiglu_per_token_cast``
and ``swiglu_backward`` the Ascend backend serves, and specialisations beyond the grid (the
MoE widths H = 1408 / 7168 / 14336, rows split into column tiles, e2m1 with 16-wide groups,
packed UE8M0 column-major scales, expert layouts with weights and a clamp), is lowered and
checked: UB within budget, a pipelined row loop with 2 buffer versions, a SIMD hot loop. Each
check is shown failing on a bad variant of these kernels (tests/ascend_bad_kernels.py), the
declines carry their reasons, and the two pieces of the kernels' math that are not the
reference's own words (the padding-row test, the overflow-free sigmoid) are emulated on the
CPU against the reference. "Lowered" is all this proves; NPU execution is
tests/npu/test_ascend_swiglu.py.

Lowerings are memoised on disk like tests/test_ascend_lowering.py's
(``$TILEPLUG_ASCEND_LOWER_CACHE``), lowered by a process pool of 2.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import pytest
import torch

from tileplug import core

pytestmark = pytest.mark.ascend_lower

META = "meta"
TOKENS = 5
SWIGLU_OPS = ("swiglu", "swiglu_per_token_cast", "swiglu_backward")
_BF16, _FP32 = torch.bfloat16, torch.float32


def _kernels() -> dict:
    from tileplug.backend_ascend.plugin import kernel_table

    return kernel_table()


def _call(op: str, hidden: int, dtype=_BF16, grad_dtype=None, weighted=False, experts=None, **kwargs):
    """The call of ``op`` on meta tensors ``x`` ``[5, 2H]`` (and ``grad_y`` ``[5, H]``) in the Ascend layout."""
    x = torch.empty(TOKENS, 2 * hidden, dtype=dtype, device=META)
    args = [x]
    if op == "swiglu_backward":
        args.append(torch.empty(TOKENS, hidden, dtype=grad_dtype or dtype, device=META))
    if weighted:
        kwargs["topk_weights"] = torch.empty(TOKENS, dtype=_FP32, device=META)
    if experts is not None:
        kwargs["expert_ends"] = torch.empty(experts, dtype=torch.int32, device=META)
    with core.config.host_layout("ascend"):
        call, _ = core.describe_call(getattr(core.ops, op), *args, **kwargs)
    return call


def _case_call(case):
    with core.config.host_layout("ascend"):
        args, kwargs = case.arguments(TOKENS, META)
        call, _ = core.describe_call(case.op, *args, **kwargs)
    return call


def _grid() -> tuple[list, dict]:
    """([(case id, case)] the Ascend kernels serve, {case id: decline reason})."""
    table, served, declined = _kernels(), [], {}
    for name in SWIGLU_OPS:
        for case in core.opdefs.get(name).cases():
            why = table[name].supports(_case_call(case))
            if why is None:
                served.append((case.id, case))
            else:
                declined[case.id] = why
    return served, declined


GRID, DECLINED = _grid()

BEYOND = {
    "swiglu-H1408-moe-weights-clamp": ("swiglu", 1408, dict(weighted=True, experts=64, clamp_value=7.0,
                                                            routed_scaling_factor=2.5, expert_alignment=128)),
    "swiglu-H7168-fp32": ("swiglu", 7168, dict(dtype=_FP32)),
    "swiglu-H14336-bf16-to-fp32": ("swiglu", 14336, dict(out_dtype=_FP32)),
    "swiglu-H14336-fp32-tiled-moe": ("swiglu", 14336, dict(dtype=_FP32, weighted=True, experts=160, clamp_value=10.0)),
    "cast-H1408-e2m1-g16": ("swiglu_per_token_cast", 1408, dict(fmt="e2m1", num_per_channels=16)),
    "cast-H7168-ue8m0-col-major-moe": ("swiglu_per_token_cast", 7168, dict(
        weighted=True, experts=256, clamp_value=7.0, expert_alignment=128, num_per_channels=128, round_sf=True,
        use_packed_ue8m0=True, use_tma_aligned_col_major_sf=True)),
    "cast-H2048-e2m1-g32-ue8m0": ("swiglu_per_token_cast", 2048, dict(fmt="e2m1", num_per_channels=32, round_sf=True,
                                                                       use_packed_ue8m0=True)),
    "cast-H14336-fp32-tiled-ue8m0": ("swiglu_per_token_cast", 14336, dict(dtype=_FP32, num_per_channels=64,
                                                                          round_sf=True, use_packed_ue8m0=True)),
    "backward-H1408-moe-weights-clamp": ("swiglu_backward", 1408, dict(weighted=True, experts=64, clamp_value=7.0,
                                                                      routed_scaling_factor=2.5, expert_alignment=16)),
    "backward-H7168-fp32-weighted": ("swiglu_backward", 7168, dict(dtype=_FP32, weighted=True)),
    "backward-H14336-fp32-tiled-weighted": ("swiglu_backward", 14336, dict(dtype=_FP32, weighted=True, experts=8)),
    "backward-H14336-bf16-fp32-grad": ("swiglu_backward", 14336, dict(grad_dtype=_FP32)),
}
"""Specialisations beyond the op table's grid: id -> (op, H, arguments of :func:`_call`)."""


def _checks(lowering) -> dict:
    from tileplug.backend_ascend import lowering_checks as checks

    lowered = lowering.lowered
    return {
        "ub": checks.check_ub(lowered.compiler_ub_bytes, lowered.primfunc_ub_bytes, lowering.plan_bytes,
                              lowering.budget),
        "pipelined": checks.check_pipelined(lowered.source),
        "vector": checks.check_vector(lowered.source),
        "nonempty": ("__gm__" in lowered.source, "kernel has __gm__ parameters"),
    }


def _lower_and_check(entry) -> dict:
    """Worker: lower one specialisation (disk-cached) and run the checks."""
    name, what = entry
    call = _case_call(what) if not isinstance(what, tuple) else _call(what[0], what[1], **what[2])
    kernel = _kernels()[call.op]
    why = kernel.supports(call)
    if why is not None:
        return {"name": name, "declined": why}
    lowering = kernel.lowering(call)
    return {"name": name, "spec": lowering.name, "checks": _checks(lowering)}


@pytest.fixture(scope="module")
def lowered() -> dict[str, dict]:
    entries = GRID + list(BEYOND.items())
    with ProcessPoolExecutor(min(2, os.cpu_count() or 1)) as pool:
        return {result["name"]: result for result in pool.map(_lower_and_check, entries)}


@pytest.mark.parametrize("name", [name for name, _ in GRID] + list(BEYOND))
def test_swiglu_lowering_passes_checks(lowered, name):
    """The specialisation lowers to Ascend C and passes every check."""
    result = lowered[name]
    assert "declined" not in result, result.get("declined")
    failed = {k: v[1] for k, v in result["checks"].items() if not v[0]}
    assert not failed, (result["spec"], failed)


def test_every_op_table_case_is_lowered_or_declined_for_the_quant_kernels_reasons():
    """Every swiglu and swiglu_backward case of the op table is served; the cast cases the
    Ascend backend leaves are exactly those its per_token_cast declines, with the same reasons
    (e4m3-stored scales, H not a multiple of 16)."""
    from tileplug.backend_ascend.quant.common import decline_reason as cast_decline_reason

    assert len(GRID) + len(DECLINED) == sum(len(core.opdefs.get(name).cases()) for name in SWIGLU_OPS)
    assert not [case for case in DECLINED if not case.startswith("swiglu_per_token_cast[")]
    for case in core.opdefs.get("swiglu_per_token_cast").cases():
        assert DECLINED.get(case.id) == cast_decline_reason(_case_call(case).quant), case.id
    assert len(GRID) >= 18 and set(DECLINED.values()) <= {
        "hidden size must be a multiple of 16 (got 3)", "hidden size must be a multiple of 16 (got 72)",
        "e4m3-stored scale factors are not produced on Ascend (use round_sf / packed UE8M0 or fp32 sf)"}


def test_wide_rows_are_split_into_column_tiles():
    """Rows whose double-buffered plan exceeds UB are split into column tiles: multiples of 64
    (for the cast, of whole groups and UE8M0 pairs) with a narrower last tile, each kind its own
    SIMD function in the one pipelined loop; rows that fit stay whole."""
    from tileplug.backend_ascend.swiglu.spec import spec_of

    for name in ("swiglu-H14336-fp32-tiled-moe", "cast-H14336-fp32-tiled-ue8m0", "backward-H14336-fp32-tiled-weighted"):
        op, hidden, kwargs = BEYOND[name]
        spec = spec_of(_call(op, hidden, **kwargs))
        assert spec.tiles >= 2 and spec.width % spec.unit() == 0 and spec.footprint <= spec.budget, spec.describe()
        wider = replace(spec, width=spec.width + spec.unit())
        assert wider.footprint > wider.budget, name  # the widest tile that fits
        source = _kernels()[op].lowering(_call(op, hidden, **kwargs)).lowered.source
        assert source.count("__simd_vf__") == (2 if spec.tail else 1), name
    assert spec_of(_call("swiglu_per_token_cast", 14336, dtype=_FP32, num_per_channels=64, round_sf=True,
                         use_packed_ue8m0=True)).unit() == 128
    for name in ("swiglu-H7168-fp32", "backward-H7168-fp32-weighted", "cast-H7168-ue8m0-col-major-moe"):
        op, hidden, kwargs = BEYOND[name]
        assert spec_of(_call(op, hidden, **kwargs)).tiles == 1, name


def test_tiled_backward_carries_the_row_sum_across_tiles():
    """With column tiles the backward's running row sum lives in UB (``acc_ub``) and continues
    from the previous tile of the row (a whole-row order whatever the tiling); whole rows have
    no carried sum."""
    from tileplug.backend_ascend.swiglu.spec import spec_of

    op, hidden, kwargs = BEYOND["backward-H14336-fp32-tiled-weighted"]
    tiled = spec_of(_call(op, hidden, **kwargs))
    whole = spec_of(_call(*BEYOND["backward-H7168-fp32-weighted"][:2], **BEYOND["backward-H7168-fp32-weighted"][2]))
    assert tiled.tiles == 2 and "acc_ub" in tiled.plan() and "acc_ub" not in whole.plan()
    source = _kernels()[op].lowering(_call(op, hidden, **kwargs)).lowered.source
    assert source.count("vcmps_eq(simd_inst::vdup<int32_t>(") == 2  # each tile kind asks whether it is the first


@pytest.mark.parametrize("op,hidden,kwargs", [
    ("swiglu", 704, dict(weighted=True, experts=8, out_dtype=_FP32)),
    ("swiglu_per_token_cast", 704, dict(experts=8, fmt="e2m1", num_per_channels=32, round_sf=True,
                                        use_packed_ue8m0=True, use_tma_aligned_col_major_sf=True)),
    ("swiglu_per_token_cast", 704, dict(weighted=True, num_per_channels=128)),
    ("swiglu_backward", 704, dict(dtype=_FP32, grad_dtype=_BF16, weighted=True, experts=8)),
], ids=["swiglu", "cast-e2m1-ue8m0-col", "cast-e4m3", "backward"])
def test_launch_arguments_match_the_prim_func_parameters(op, hidden, kwargs):
    """The tensors handed to the kernel (inputs, then the outputs the op table allocates, column-
    major scales as their transpose) have, parameter by parameter, the prim_func's dtype and shape."""
    from tileplug.backend_ascend.swiglu import row_kernel
    from tileplug.backend_ascend.swiglu.spec import spec_of

    x = torch.empty(TOKENS, 2 * hidden, dtype=kwargs.pop("dtype", _BF16), device=META)
    args = [x] if op != "swiglu_backward" else [x, torch.empty(TOKENS, hidden, dtype=kwargs.pop("grad_dtype"),
                                                               device=META)]
    if kwargs.pop("weighted", False):
        kwargs["topk_weights"] = torch.empty(TOKENS, device=META)
    if "experts" in kwargs:
        kwargs["expert_ends"] = torch.empty(kwargs.pop("experts"), dtype=torch.int32, device=META)
    with core.config.host_layout("ascend"):
        call, inputs = core.describe_call(getattr(core.ops, op), *args, **kwargs)
    outputs = call.allocation_plan(core.ASCEND_LAYOUT).allocate(TOKENS, torch.device(META))
    spec = spec_of(call)
    parameters, _ = row_kernel.parameters(spec)
    values = row_kernel.arguments(spec, inputs, outputs)
    assert len(values) == len(parameters)
    for (name, buffer), value in zip(parameters, values):
        assert str(value.dtype).replace("torch.", "") == str(buffer.dtype), name
        dims = [TOKENS if not isinstance(dim, int) and not hasattr(dim, "value") else int(dim) for dim in buffer.shape]
        assert list(value.shape) == dims, (name, tuple(value.shape), dims)
        assert value.stride(-1) == 1 or value.shape[-1] == 1, name


def test_declines_carry_reasons():
    """fp64 (the gradcheck dtype) falls to the reference; the cast's own declines keep the
    Ascend per_token_cast's reasons; expert ends too many for UB even at the narrowest tile."""
    table = _kernels()
    fp64 = torch.float64
    reasons = {
        "fp64, the gradcheck dtype, falls to the reference": [
            ("swiglu", _call("swiglu", 64, dtype=fp64)), ("swiglu_backward", _call("swiglu_backward", 64, dtype=fp64))],
        "e4m3-stored scale factors": [("swiglu_per_token_cast",
                                       _call("swiglu_per_token_cast", 1408, use_e4m3_sf=True))],
        "hidden size must be a multiple of 16": [("swiglu_per_token_cast", _call("swiglu_per_token_cast", 1000))],
        "70000 expert ends": [("swiglu", _call("swiglu", 64, experts=70000))],
    }
    for expected, calls in reasons.items():
        for op, call in calls:
            why = table[op].supports(call)
            assert why is not None and expected in why, (op, expected, why)
    assert table["swiglu"].supports(_call("swiglu_backward", 64)) is not None


def _checked(prim_func, spec) -> dict:
    """The checks of a traced prim_func (lowered without the disk cache) against ``spec``'s plan."""
    from tileplug.backend_ascend.lowering import CheckedLowering, lower_uncached

    return _checks(CheckedLowering(spec.describe(), lower_uncached(prim_func), spec.footprint, spec.budget, ""))


@pytest.mark.parametrize("op", SWIGLU_OPS)
def test_checks_fail_on_bad_variants(op):
    """Each kernel passes every check, and each check fails on a bad variant of it: (a) 8
    buffer versions of a whole 7168-column fp32 row, over the UB budget (the builder refuses
    it; forced through, the UB check fails, or for the cast TileLang's loop scheduler refuses it); (b) a serial,
    single-buffered row loop; (c) the tile's math (for the cast: the quantization) in scalar
    code on the kernel body."""
    import ascend_bad_kernels as bad_kernels

    from tileplug.backend_ascend.device import UBBudgetError
    from tileplug.backend_ascend.swiglu import swiglu, swiglu_backward, swiglu_per_token_cast
    from tileplug.backend_ascend.swiglu.spec import spec_of

    module, scalar = {
        "swiglu": (swiglu, bad_kernels.swiglu_scalar_tiles),
        "swiglu_per_token_cast": (swiglu_per_token_cast, bad_kernels.swiglu_cast_scalar_tiles),
        "swiglu_backward": (swiglu_backward, bad_kernels.swiglu_backward_scalar_tiles),
    }[op]
    spec = spec_of(_call(op, 576, num_per_channels=64) if op == "swiglu_per_token_cast" else _call(op, 576))
    good = _checked(module.build(spec), spec)
    assert all(ok for ok, _ in good.values()), good

    wide = replace(spec, hidden=7168, width=7168, in_dtype="float32", num_buffers=8)
    assert wide.footprint > wide.budget
    with pytest.raises(UBBudgetError):
        module.build(wide)
    if op == "swiglu_per_token_cast":
        # TileLang's loop scheduler refuses the cast's versioned rows itself (its 1-version scratch rows
        # already fill UB), before the UB check is reached, as for moe_unpermute; both refusals asserted
        with pytest.raises(Exception, match="capacity is negative"):
            _checked(bad_kernels.row_over_budget(module.build, wide), wide)
    else:
        ok, detail = _checked(bad_kernels.row_over_budget(module.build, wide), wide)["ub"]
        assert not ok and "over budget" in detail, detail

    ok, detail = _checked(bad_kernels.row_serial_loop(module.build, spec), spec)["pipelined"]
    assert not ok and "versions=[1]" in detail, detail

    ok, detail = _checked(scalar(spec), spec)["vector"]
    assert not ok and "scalar UB dereference" in detail, detail


def test_core_lower_names_the_specialisation():
    """core.lower of a SwiGLU op on a CPU (meta inputs): headed LOWERED / not verified, naming
    the specialisation, the stand-ins and the tile; a declined call is refused with its reason."""
    x = torch.empty(7, 2 * 1408, dtype=_BF16, device=META)
    ends = torch.empty(16, dtype=torch.int32, device=META)
    with core.config.host_layout("ascend"):
        source = core.lower(core.ops.swiglu_per_token_cast, x, expert_ends=ends, fmt="e2m1", num_per_channels=16,
                            backend="ascend")
        with pytest.raises(Exception, match="falls to the reference"):
            core.lower(core.ops.swiglu, torch.empty(3, 8, dtype=torch.float64, device=META), backend="ascend")
    assert "LOWERED" in source and "not verified" in source and "stand-in" in source
    assert "specialisation: swiglu_per_token_cast [N, 2x1408] bfloat16 experts=16/align=128 cast=e2m1/1x16" in source
    assert "one row per pipeline step, whole in UB" in source and "__simt_vf__" in source


def test_capabilities_say_lowered():
    from tileplug.backend_ascend import plugin

    text = plugin.capabilities()
    assert "swiglu_per_token_cast" in text and "swiglu_backward" in text and "lowered" in text.lower()
    assert "verified on" not in text


# ---------------------------------------------------------------------- the math, emulated on the CPU


def test_padding_row_test_equals_the_layouts_valid_rows():
    """The kernels' padding-row test (``m <= floor(row / a)·a`` and ``row < max(ends)``, ``m`` the
    largest end at or before the row) agrees with ``valid_rows_of`` on random layouts (empty
    experts, rows past the last end, alignments 1 to 128)."""
    from tileplug.core.swiglu.layout import expert_ends_for, valid_rows_of

    for seed in range(200):
        generator = torch.Generator().manual_seed(seed)
        rows = int(torch.randint(1, 400, (1,), generator=generator))
        experts = int(torch.randint(1, 20, (1,), generator=generator))
        alignment = (1, 3, 4, 16, 128)[seed % 5]
        ends = expert_ends_for(rows, experts, alignment, seed).long()
        row = torch.arange(rows)
        below = torch.where(ends[None, :] <= row[:, None], ends[None, :], 0).amax(1)
        kept = (below <= row // alignment * alignment) & (row < ends.max())
        assert torch.equal(kept, valid_rows_of(rows, ends.int(), alignment)), (seed, ends.tolist(), alignment)


def _kernel_sigmoid(g: torch.Tensor) -> torch.Tensor:
    """The kernels' sigmoid in fp32 with a correctly rounded exp standing in for the vector exp."""
    from tileplug.core.moe.formulas import correctly_rounded

    t = correctly_rounded(torch.exp, -g.abs())
    return torch.where(g >= 0, torch.ones_like(t), t) / (1 + t)


def test_sigmoid_and_rounding_points_emulated():
    """The overflow-free sigmoid ``(g >= 0 ? 1 : t) / (1 + t)``, ``t = exp(−|g|)``, is within 2
    ulp fp32 of the correctly rounded one (given a correctly rounded exp; the vector exp adds up
    to 1 ulp), finite and exact at the ends (0 below −104, 1 above 17); with the reference's
    sigmoid in its place, the kernels' order of products gives the reference's ``y`` and
    ``grad_x`` bit for bit (the rounding points are the reference's)."""
    from tileplug.core.contracts.swiglu import SwigluInputs
    from tileplug.core.moe.formulas import correctly_rounded
    from tileplug.core.testing import ulp_distance
    from tileplug.reference.swiglu import formulas

    g = torch.cat([torch.randn(200_000, generator=torch.Generator().manual_seed(1)) * 8,
                   torch.linspace(-120, 120, 24001)]).float()
    assert int(ulp_distance(_kernel_sigmoid(g), correctly_rounded(torch.sigmoid, g)).max()) <= 2
    assert _kernel_sigmoid(torch.tensor([-105.0, 0.0, 18.0])).tolist() == [0.0, 0.5, 1.0]

    rows, hidden, clamp, factor = 64, 96, 3.0, 1.5
    generator = torch.Generator().manual_seed(2)
    x, grad = torch.randn(rows, 2 * hidden, generator=generator) * 3, torch.randn(rows, hidden, generator=generator)
    weights = torch.rand(rows, generator=generator)
    call = _call("swiglu_backward", hidden, dtype=_FP32, weighted=True, clamp_value=clamp, routed_scaling_factor=factor)
    reference_x, _ = formulas.backward(call, SwigluInputs(x, weights, None, grad))
    reference_y = formulas.forward(call, SwigluInputs(x, weights))

    gate, up = x[:, :hidden], x[:, hidden:]
    c = torch.tensor(clamp)
    g, u = torch.where(gate > c, c, gate), torch.where(up > c, c, torch.where(up < -c, -c, up))
    s = correctly_rounded(torch.sigmoid, g)  # the reference's sigmoid: only the order of products is compared
    scale = (weights * torch.tensor(factor))[:, None]
    y = g * s * u * scale
    grad_silu = grad * (g * s)
    grad_gate = torch.where(gate > c, 0.0, grad * u * scale * s * ((g * (1 - s)) + 1))
    grad_up = torch.where(up.abs() > c, 0.0, grad_silu * scale)
    assert torch.equal(y, reference_y)
    assert torch.equal(torch.cat((grad_gate, grad_up), dim=1), reference_x)


# ---------------------------------------------------------------------- the sigmoid table (bf16 x, fp32 y)


def test_the_sigmoid_table_serves_a_bf16_x_with_an_fp32_y_only():
    """``swiglu`` with an fp32 ``y`` and the fused cast of a bf16 x read the table (a 32 KiB UB buffer,
    named in the specialisation); a bf16 ``y``, an fp32 x and the backward evaluate the sigmoid."""
    from tileplug.backend_ascend.swiglu.spec import spec_of
    from tileplug.core.swiglu.sigmoid_table import ENTRIES

    table = [_call("swiglu", 7168, out_dtype=_FP32), _call("swiglu_per_token_cast", 7168),
             _call("swiglu_per_token_cast", 1408, fmt="e2m1", num_per_channels=16, experts=8)]
    evaluated = [_call("swiglu", 7168), _call("swiglu", 7168, dtype=_FP32, out_dtype=_FP32),
                 _call("swiglu_per_token_cast", 7168, dtype=_FP32), _call("swiglu_backward", 7168)]
    for call in table:
        spec = spec_of(call)
        assert spec.sigmoid_table and "sigmoid=table" in spec.describe(), spec.describe()
        assert spec.plan()["table_ub"] == ((ENTRIES,), "float32", 1)
        assert spec.footprint <= spec.budget
    for call in evaluated:
        spec = spec_of(call)
        assert not spec.sigmoid_table and "table_ub" not in spec.plan(), spec.describe()


@pytest.mark.parametrize("clamp", [None, 7.0])
def test_the_table_is_read_into_ub_once_a_core_and_gathered_by_the_gates_bits(clamp):
    """The lowered ``swiglu`` (bf16 x, fp32 ``y``): the table's DMA into UB sits before the row
    pipeline, one ``vgather2`` a register with the index arithmetic's constants (``LOW``, ``HIGH``,
    ``SPAN`` of ``tileplug.core.swiglu.sigmoid_table``), no vector exp; with a clamp, the constant
    ``sigmoid(c)`` as the reference rounds it is selected where the gate exceeds ``c``."""
    from tileplug.core.swiglu import sigmoid_table as layout

    x = torch.empty(TOKENS, 2 * 7168, dtype=_BF16, device=META)
    source = core.lower(core.ops.swiglu, x, out_dtype=_FP32, clamp_value=clamp, backend="ascend")
    vector_code, kernel = source.split("__global__")
    assert vector_code.count("vgather2(") == 1 and "vexp" not in source
    for constant in (layout.LOW, layout.HIGH, layout.SPAN, 0x7FFF):
        assert f"(uint32_t){constant})" in vector_code or f"(uint32_t){constant}," in vector_code, constant
    table_copy = re.search(r"asc_copy_gm2ub\w*\([^;]*TABLE\[0\][^;]*\b32768\b", kernel)
    assert table_copy is not None, "no copy of the 32 KiB table into UB"
    assert table_copy.start() < kernel.index("for (int32_t it"), "the table is copied inside the row loop"
    if clamp is not None:
        constants = {float.fromhex(text) for text in re.findall(r"float\((-?0x[0-9a-f.]+p[-+]?\d+)f", vector_code)}
        assert layout.clamp_sigmoid(clamp) in constants and clamp in constants
        assert "vcmps_gt(gate," in vector_code
    else:
        assert "vcmps_gt" not in vector_code


def test_the_kernels_table_index_is_the_tables_for_every_bf16_gate():
    """The vector index arithmetic (:func:`~tileplug.backend_ascend.swiglu.macros.table_sigmoid`,
    on the fp32 register of a widened bf16 gate: its bits shifted right by 16, the magnitude
    clamped to ``[LOW, HIGH]``, the sign bit moved to ``SPAN``), emulated in uint32 on every bf16
    bit pattern, picks ``table_index``'s entry, whose value is the reference's sigmoid of the gate
    (±0, ±inf and NaN included: NaN reads a finite entry, its ``y`` is NaN through ``g``)."""
    from tileplug.core.moe.formulas import correctly_rounded
    from tileplug.core.swiglu import sigmoid_table as layout

    bits16 = torch.arange(65536, dtype=torch.int32)
    gates = bits16.to(torch.int16).view(_BF16).float()
    words = gates.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # the register's lanes as uint32
    shifted = words >> 16
    magnitude = torch.clamp(shifted & 0x7FFF, layout.LOW, layout.HIGH)
    entry = magnitude + ((shifted >> 3) & layout.SPAN) - layout.LOW
    assert torch.equal(entry.to(torch.int32), layout.table_index(bits16))
    table = correctly_rounded(torch.sigmoid, layout.table_gates())
    finite = ~torch.isnan(gates)
    looked_up = table[entry]
    want = correctly_rounded(torch.sigmoid, gates)
    assert torch.equal(looked_up[finite].view(torch.int32), want[finite].view(torch.int32))


def test_the_launch_hands_the_devices_table_after_the_expert_ends():
    """``row_kernel.arguments`` puts the device's table (computed on the CPU by the reference's
    formula, one tensor for every call) where the prim_func declares ``TABLE``: after the inputs,
    before the outputs."""
    from tileplug.backend_ascend.swiglu import row_kernel
    from tileplug.backend_ascend.swiglu.spec import spec_of
    from tileplug.core.moe.formulas import correctly_rounded
    from tileplug.core.swiglu import sigmoid_table as layout

    x = torch.randn(TOKENS, 2 * 704).to(_BF16)
    ends = torch.tensor([2, 5], dtype=torch.int32)
    with core.config.host_layout("ascend"):
        call, inputs = core.describe_call(core.ops.swiglu, x, out_dtype=_FP32, expert_ends=ends)
    outputs = call.allocation_plan(core.ASCEND_LAYOUT).allocate(TOKENS, x.device)
    spec = spec_of(call)
    names = [name for name, _ in row_kernel.parameters(spec)[0]]
    assert names == ["X", "ENDS", "TABLE", "Y"]
    values = row_kernel.arguments(spec, inputs, outputs)
    table = values[names.index("TABLE")]
    assert table is row_kernel.arguments(spec, inputs, outputs)[2]
    assert torch.equal(table, correctly_rounded(torch.sigmoid, layout.table_gates()))
