"""Ascend backend: LOWERING tests (TileLang's Ascend pipeline -> Ascend C, on a CPU machine).

Nothing here executes a kernel: every specialisation of the grid is traced and lowered to
Ascend C, and the lowered result is checked (UB within budget, pipelined row loop with more
than one buffer version, SIMD hot loop). Each check is also shown failing on a deliberately
bad kernel (tests/ascend_bad_kernels.py). "Lowered" is all this proves; NPU execution is
tests/npu/test_ascend_quant.py and tests/npu/test_ascend_norm.py.

The grid is lowered by a process pool of 2 (CI runs this on a 2-core machine). Lowerings are
memoised on disk (``$TILEPLUG_ASCEND_LOWER_CACHE``, default ``~/.cache/tileplug/ascend-lower``,
keyed by the TileSpec, the TileLang version and the backend's sources), so a second run on the
same machine skips tracing and lowering; the checks always run on the (stored) Ascend C.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import pytest
import torch

from tileplug import core

pytestmark = pytest.mark.ascend_lower

META = "meta"


def _x(tokens, hidden, dtype=torch.bfloat16):
    return torch.empty(tokens, hidden, dtype=dtype, device=META)


TOKENS = 5  # the token count of the meta inputs (T is dynamic in every Ascend kernel; H is not)


def _describe(case):
    """The call of an op-table case on meta tensors in the Ascend layout."""
    with core.config.host_layout("ascend"):
        args, kwargs = case.arguments(TOKENS, META)
        call, _ = core.describe_call(case.op, *args, **kwargs)
    return call


def _kernels() -> dict:
    from tileplug.backend_ascend.plugin import kernel_table

    return kernel_table()


def _grid() -> tuple[list[tuple[str, object]], dict[str, str]]:
    """([(specialisation, first case it serves)], {case id: decline reason}): every case of
    every op in the op table that has an Ascend kernel, one entry per distinct kernel
    specialisation (ops without an Ascend kernel fall to the reference)."""
    table = _kernels()
    grid: dict[str, object] = {}
    declined: dict[str, str] = {}
    for opdef in core.opdefs.all_ops():
        kernel = table.get(opdef.kernel)
        if kernel is None or not kernel.exists():  # (the family module lacks it: the reference serves the op)
            continue
        for case in opdef.cases():
            call = _describe(case)
            why = kernel.supports(call)
            if why is not None:
                declined[case.id] = why
                continue
            grid.setdefault(kernel.describe(call), case)
    return list(grid.items()), declined


def lower_and_check(entry) -> dict:
    """Worker: describe the case's call, lower it through its Ascend kernel (disk-cached), run the checks."""
    from tileplug.backend_ascend import lowering_checks as checks

    name, case = entry
    call = _describe(case)
    kernel = _kernels()[call.op]
    result = {"name": name, "op": call.op}
    why = kernel.supports(call)
    if why is not None:
        result["declined"] = why
        return result
    lowerings = kernel.lowerings(call)
    result["checks"] = {}
    for lowering in lowerings:  # every kernel the call launches (the norm backward: rows, then the column sum)
        lowered, source = lowering.lowered, lowering.lowered.source
        result["checks"].update({
            f"{lowering.name}: ub": checks.check_ub(lowered.compiler_ub_bytes, lowered.primfunc_ub_bytes,
                                                    lowering.plan_bytes, lowering.budget),
            f"{lowering.name}: pipelined": checks.check_pipelined(source),
            f"{lowering.name}: vector": checks.check_vector(source),
            f"{lowering.name}: nonempty": ("__gm__" in source, "kernel has __gm__ parameters"),
        })
    if call.op in STOCHASTIC_CAPABLE_OPS:  # the Philox rounds and the state only where the call rounds stochastically
        stochastic = bool(call.cast.stochastic)
        for lowering in lowerings:
            source = lowering.lowered.source
            drawn = "simd_inst::vmull(" in source or "SEED" in source or "OFFSET" in source
            result["checks"][f"{lowering.name}: philox iff stochastic"] = (
                drawn == stochastic, f"stochastic rounding {stochastic}, Philox / state in the source {drawn}")
    if call.op in ROW_REDUCING_OPS:
        with core.config.override(ascend_vector_cores=OTHER_VECTOR_CORES):
            others = kernel.lowerings(call)
        for lowering, other in zip(lowerings, others):
            result["checks"][f"{lowering.name}: deterministic"] = checks.check_deterministic(
                lowering.lowered.source, other.lowered.source)
    return result


ROW_REDUCING_OPS = ("rms_norm_backward", "layer_norm_backward", "moe_expert_counts")
"""Ops whose kernels sum over rows (the weight / bias gradients, the expert counts): also
checked deterministic."""
OTHER_VECTOR_CORES = 40
"""A second vector-core count the row-reducing ops are lowered for: the Ascend C must not change."""
STOCHASTIC_CAPABLE_OPS = ("per_token_cast", "per_block_cast")
"""Ops whose calls may round stochastically (docs/spec.md §10.2): also checked to draw Philox
words exactly when they do (tests/test_ascend_stochastic_quant_lowering.py checks the draw)."""


CASES, DECLINED = _grid()


@pytest.fixture(scope="module")
def lowered(request) -> dict[str, dict]:
    """The checks of every grid entry this session runs a test of (``-k`` lowers only those)."""
    selected = {item.callspec.params["case"][0] for item in request.session.items
                if getattr(item, "module", None) is request.module and hasattr(item, "callspec")
                and "case" in item.callspec.params}
    entries = [entry for entry in CASES if entry[0] in selected]
    workers = min(2, os.cpu_count() or 1)
    with ProcessPoolExecutor(workers) as pool:
        results = list(pool.map(lower_and_check, entries, chunksize=4))
    return {r["name"]: r for r in results}


@pytest.mark.parametrize("case", CASES, ids=[name for name, _ in CASES])
def test_lowering_passes_checks(lowered, case):
    """The specialisation lowers to Ascend C and its lowering passes every check."""
    result = lowered[case[0]]
    assert "declined" not in result, result.get("declined")
    failed = {k: v[1] for k, v in result["checks"].items() if not v[0]}
    assert not failed, failed


def test_the_grid_covers_every_case_of_the_op_table():
    """Every case of an op with an Ascend kernel is lowered or declined for a reason the
    backend's capabilities state (stochastic rounding of the per-token / per-block casts is served:
    tests/test_ascend_stochastic_quant_lowering.py): e4m3-stored sf, scales stored in a layout that is not
    Ascend's, or a UB plan over budget (per-block re-quantization of a UE8M0-scaled 1 x 128
    input: 401504 bytes at the narrowest tile, so it falls through to the reference; see
    docs/ascend-backend.md; every per_block_cast_lossless case is lowered: the 15 whose per-element
    plan is about 370 KB take the compact decode, tests/test_ascend_lossless_lowering.py); for the fused RMSNorm + cast: 3-D input, e2m1, packed UE8M0, or
    the cast's own declines. Every norm and RoPE case the fused-cast rules leave is lowered, every
    topk_gate, moe_topk_gate_backward, normalize_weight, moe_expert_counts, moe_permute and moe_unpermute case
    too, every moe_topk_gate case (group-limited routing included), and every swiglu and swiglu_backward case
    (swiglu_per_token_cast: the per-token cast's declines, tests/test_ascend_swiglu_lowering.py), and every
    fill_rand / fill_randn case."""
    total = sum(len(opdef.cases()) for opdef in core.opdefs.all_ops())
    assert len(CASES) > 100 and len(CASES) + len(DECLINED) <= total
    allowed = ("e4m3-stored", "not an Ascend layout", "the Ascend layouts", "UB plan needs", "falls to the reference",
               "no split-row form", "not produced by the fused norm + cast", "writes e4m3 only",
               "hidden size must be a multiple of 16", "does not divide D")
    unexpected = {case: why for case, why in DECLINED.items() if not any(a in why for a in allowed)}
    assert not unexpected, unexpected
    row_ops = ("rms_norm[", "layer_norm[", "apply_rotary[", "rms_norm_backward[", "layer_norm_backward[",
               "topk_gate[", "moe_topk_gate[", "moe_topk_gate_backward[", "normalize_weight[", "moe_expert_counts[", "moe_permute[",
               "moe_unpermute[", "swiglu[", "swiglu_backward[",
               "fill_rand[", "fill_randn[")
    assert not [case for case in DECLINED if case.startswith(row_ops)]
    assert not [case for case in DECLINED if case.startswith("per_block_cast_lossless[")]


# ---------------------------------------------------------------------- the checks can fail


def _spec(hidden=2048, dtype=torch.float32, **kwargs):
    from tileplug.backend_ascend.quant.common import spec_of

    with core.config.host_layout("ascend"):
        call, _ = core.describe_call(core.ops.per_token_cast, _x(3, hidden, dtype), **kwargs)
    return spec_of(call)


def test_lowering_ub_check_fails_on_an_over_budget_plan():
    """Lowering check (a): an 8-version, whole-row 128-column-group plan at H = 7168 over the UB
    budget lowers silently in TileLang, and the UB check catches it; the builder refuses it."""
    import ascend_bad_kernels as bad_kernels

    from tileplug.backend_ascend import lowering_checks as checks
    from tileplug.backend_ascend.device import UBBudgetError
    from tileplug.backend_ascend.quant.lowered import lower_prim_func
    from tileplug.backend_ascend.quant.spec import Tiling
    from tileplug.backend_ascend.quant.tile_kernel import build

    bad = replace(_spec(hidden=7168), num_buffers=8)
    tiling = Tiling(bad, 7168)
    prim_func = bad_kernels.over_budget(bad, tiling)
    artifact = lower_prim_func(prim_func)
    ok, detail = checks.check_ub(
        checks.compiler_ub_bytes(artifact), checks.primfunc_ub_bytes(prim_func), tiling.footprint, tiling.budget
    )
    assert not ok and "over budget" in detail, detail
    with pytest.raises(UBBudgetError):
        build(bad, tiling)


def test_lowering_pipeline_check_fails_on_a_serial_loop():
    """Lowering check (b): a plain serial, single-buffered row loop fails the pipelining check."""
    import ascend_bad_kernels as bad_kernels

    from tileplug.backend_ascend import lowering_checks as checks
    from tileplug.backend_ascend.quant.lowered import lower_prim_func, lower_spec

    good, _ = lower_spec(_spec())
    bad = lower_prim_func(bad_kernels.serial_loop(_spec()))
    assert checks.check_pipelined(good.source)[0]
    ok, detail = checks.check_pipelined(bad.kernel_source)
    assert not ok and "versions=[1]" in detail, detail


def test_lowering_vector_check_fails_on_scalar_code():
    """Lowering check (c): per-element scalar code in the kernel body fails the vector check."""
    import ascend_bad_kernels as bad_kernels

    from tileplug.backend_ascend import lowering_checks as checks
    from tileplug.backend_ascend.quant.lowered import lower_prim_func, lower_spec

    good, _ = lower_spec(_spec())
    bad = lower_prim_func(bad_kernels.scalar_tiles(_spec()))
    assert checks.check_vector(good.source)[0]
    ok, detail = checks.check_vector(bad.kernel_source)
    assert not ok and "PIPE_S" in detail and "scalar UB dereference" in detail, detail


def test_lowering_through_core_lower_states_stand_ins():
    """core.lower(..., backend="ascend") lowers on a CPU and its header names the stand-ins."""
    with core.config.host_layout("ascend"):
        source = core.lower(core.ops.per_token_cast, _x(7, 576), backend="ascend", num_per_channels=64)
        with core.config.override(ascend_vector_cores=40):
            overridden = core.lower(core.ops.per_token_cast, _x(7, 576), backend="ascend", num_per_channels=64)
    assert "LOWERED" in source and "not verified" in source and "stand-in" in source
    assert "__global__" in source
    assert "vector cores = 40 (config override" in overridden
    assert ">> 6" in source or "64" in source


def test_lowering_declines_e4m3_stored_sf_with_reason():
    """e4m3-stored sf is declined by supports() (lowering refuses with the reason)."""
    with core.config.host_layout("ascend"):
        with pytest.raises(core.LoweringError if hasattr(core, "LoweringError") else Exception, match="e4m3-stored"):
            core.lower(core.ops.per_token_cast, _x(3, 576), backend="ascend", use_e4m3_sf=True)


def test_tileplug_info_reports_lowered_not_verified():
    """The backend's capabilities text says what lowered, and never claims verification."""
    from tileplug.backend_ascend import plugin

    text = plugin.capabilities()
    assert "lowered" in text.lower() and "not verified" in text
    assert "verified on" not in text


# ---------------------------------------------------------------------- the checks fail on bad row kernels


def _row_specs():
    """A plain rms_norm and a plain NeoX apply_rotary specialisation (bf16, the stand-ins)."""
    from tileplug.backend_ascend.norm.spec import spec_of as norm_spec
    from tileplug.backend_ascend.rope.spec import spec_of as rotary_spec

    with core.config.host_layout("ascend"):
        norm_call, _ = core.describe_call(core.ops.rms_norm, _x(3, 2048), torch.empty(2048, device=META))
        rope_call, _ = core.describe_call(
            core.ops.apply_rotary, torch.empty(3, 4, 128, dtype=torch.bfloat16, device=META),
            torch.empty(16, 128, device=META),
        )
    return norm_spec(norm_call), rotary_spec(rope_call)


def _checked(prim_func, spec):
    from tileplug.backend_ascend import lowering_checks as checks
    from tileplug.backend_ascend.lowering import lower_prim_func

    artifact = lower_prim_func(prim_func)
    source = artifact.kernel_source
    return {
        "ub": checks.check_ub(checks.compiler_ub_bytes(artifact), checks.primfunc_ub_bytes(prim_func), spec.footprint,
                              spec.budget),
        "pipelined": checks.check_pipelined(source),
        "vector": checks.check_vector(source),
    }


@pytest.mark.parametrize("family", ["norm", "rope"])
def test_row_kernel_checks_fail_on_bad_variants(family):
    """Each lowering check fails on a bad variant of the norm / RoPE row kernels, and passes on
    the production kernel of the same specialisation: (a) 8 buffer versions of a wide row / many
    heads, over the UB budget (lowered silently by TileLang; the builder refuses it); (b) a
    serial, single-buffered row loop; (c) the row's math in scalar code on the kernel body."""
    import ascend_bad_kernels as bad_kernels

    from tileplug.backend_ascend.device import UBBudgetError
    from tileplug.backend_ascend.norm import rms_norm
    from tileplug.backend_ascend.rope import apply_rotary

    norm_spec, rope_spec = _row_specs()
    if family == "norm":
        build, spec, scalar = rms_norm.build, norm_spec, bad_kernels.rms_scalar_rows
        wide = replace(spec, hidden=16384, in_dtype="float32", residual=True, num_buffers=8)
    else:
        build, spec, scalar = apply_rotary.build, rope_spec, bad_kernels.rotary_scalar_tokens
        wide = replace(spec, query_heads=128, dtype="float32", num_buffers=8)

    good = _checked(build(spec), spec)
    assert all(ok for ok, _ in good.values()), good

    assert wide.footprint > wide.budget
    with pytest.raises(UBBudgetError):
        build(wide)
    ok, detail = _checked(bad_kernels.row_over_budget(build, wide), wide)["ub"]
    assert not ok and "over budget" in detail, detail

    ok, detail = _checked(bad_kernels.row_serial_loop(build, spec), spec)["pipelined"]
    assert not ok and "versions=[1]" in detail, detail

    ok, detail = _checked(scalar(spec), spec)["vector"]
    assert not ok and "scalar UB dereference" in detail, detail


def test_core_lower_of_the_row_ops_names_the_specialisation():
    """core.lower works for the norm and RoPE kernels on a CPU (meta inputs), with the header
    naming the specialisation and the stand-ins, and refuses a declined call with its reason."""
    with core.config.host_layout("ascend"):
        norm = core.lower(core.ops.rms_norm, _x(7, 576), torch.empty(576, device=META), backend="ascend",
                          return_rstd=True)
        rope = core.lower(core.ops.apply_rotary, torch.empty(7, 4, 128, dtype=torch.bfloat16, device=META),
                          torch.empty(64, 128, device=META), interleaved=True, backend="ascend")
        with pytest.raises(Exception, match="falls to the reference"):
            core.lower(core.ops.rms_norm, _x(3, 64, torch.float64), backend="ascend")
    assert "specialisation: rms_norm [T, 576] bfloat16" in norm and "stats" in norm and "stand-in" in norm
    assert "specialisation: apply_rotary [T, N, D] bfloat16" in rope and "gptj" in rope
    assert "__global__" in norm and "__global__" in rope


# ---------------------------------------------------------------------- the fused QK-norm + RoPE + cast


def _norm_rope_cast_call(heads, head_dim, dtype, rotary_dim=None, **kwargs):
    with core.config.host_layout("ascend"):
        x = torch.empty(5, heads, head_dim, dtype=dtype, device=META)
        call, _ = core.describe_call(core.ops.rms_norm_rope_per_token_cast, x, torch.empty(head_dim, device=META),
                                     torch.empty(64, rotary_dim or head_dim, device=META), **kwargs)
    return call


@pytest.mark.parametrize("heads,head_dim,dtype,kwargs", [
    (8, 128, torch.bfloat16, dict(num_per_channels=16, round_sf=True)),
    (8, 128, torch.bfloat16, dict(num_per_channels=32, interleaved=True, return_unquantized=True)),
    (4, 256, torch.float32, dict(num_per_channels=64, use_tma_aligned_col_major_sf=True, weight_offset=1.0)),
    (2, 384, torch.bfloat16, dict(num_per_channels=128, interleaved=True)),
], ids=["g16-round", "g32-gptj-y", "fp32-g64-col", "d384-g128-gptj"])
def test_rms_norm_rope_per_token_cast_lowers_beyond_the_grid(heads, head_dim, dtype, kwargs):
    """Specialisations of the fused QK-norm + RoPE + cast the op table's grid does not reach
    (narrow groups, several groups per head, GPT-J, fp32, Gemma offset) lower and pass every
    check; the kernel's description names the op and the cast."""
    from tileplug.backend_ascend import lowering_checks as checks

    call = _norm_rope_cast_call(heads, head_dim, dtype, **kwargs)
    kernel = _kernels()[call.op]
    assert kernel.supports(call) is None
    lowering = kernel.lowering(call)
    lowered = lowering.lowered
    results = {
        "ub": checks.check_ub(lowered.compiler_ub_bytes, lowered.primfunc_ub_bytes, lowering.plan_bytes,
                              lowering.budget),
        "pipelined": checks.check_pipelined(lowered.source),
        "vector": checks.check_vector(lowered.source),
    }
    assert all(ok for ok, _ in results.values()), results
    assert lowering.name.startswith("rms_norm_rope_per_token_cast") and f"1x{kwargs['num_per_channels']}" in lowering.name
    assert "__gm__ fp8_e4_t* Q" in lowered.source and "__gm__ float* SF" in lowered.source


def test_rms_norm_rope_per_token_cast_declines_with_reasons():
    """What the fused kernel leaves to the reference, each with its reason: a group spanning two
    heads, R not a multiple of 128, e2m1, packed UE8M0."""
    kernel = _kernels()["rms_norm_rope"]
    reasons = {
        "does not divide D": _norm_rope_cast_call(3, 192, torch.bfloat16, rotary_dim=128, num_per_channels=128),
        "a multiple of 128": _norm_rope_cast_call(3, 192, torch.bfloat16, num_per_channels=64),
        "writes e4m3 only": _norm_rope_cast_call(2, 128, torch.bfloat16, fmt="e2m1", num_per_channels=32),
        "not produced by the fused norm + cast": _norm_rope_cast_call(2, 128, torch.bfloat16, round_sf=True,
                                                                      use_packed_ue8m0=True),
    }
    for expected, call in reasons.items():
        why = kernel.supports(call)
        assert why is not None and expected in why, (expected, why)


# ---------------------------------------------------------------------- the norm backward: checks that can fail


def _backward_spec():
    """A plain bf16 rms_norm_backward specialisation with a weight (the stand-ins)."""
    from tileplug.backend_ascend.norm.backward import spec_of

    x = _x(3, 2048)
    rstd = torch.empty(3, device=META)
    with core.config.host_layout("ascend"):
        call, _ = core.describe_call(core.ops.rms_norm_backward, x, x, torch.empty(2048, dtype=torch.bfloat16,
                                                                                    device=META), rstd)
    return spec_of(call)


def test_backward_checks_fail_on_bad_variants():
    """The norm backward's row kernel and column sum pass every check, and each check fails on a
    bad variant of them: (a) 8 buffer versions of a wide fp32 row, over the UB budget (the
    builder refuses it); (b) a serial, single-buffered row loop (row kernel and column sum);
    (c) the row's math in scalar code; (d, the determinism check) the partial sums added into
    one row with a store-mode atomic, and the rows split by the vector-core count (its Ascend C
    changes with the device)."""
    import ascend_bad_kernels as bad_kernels

    from tileplug.backend_ascend import lowering_checks as checks
    from tileplug.backend_ascend.device import UBBudgetError
    from tileplug.backend_ascend.lowering import lower_prim_func
    from tileplug.backend_ascend.norm import backward, rms_norm_backward

    def build(spec):
        return backward.build_rows(spec, rms_norm_backward.row_compute)

    spec = _backward_spec()
    other = replace(spec, vector_cores=OTHER_VECTOR_CORES)
    good = _checked(build(spec), spec)
    assert all(ok for ok, _ in good.values()), good
    source = lower_prim_func(build(spec)).kernel_source
    assert checks.check_deterministic(source, lower_prim_func(build(other)).kernel_source)[0]
    column = backward.ColumnSumSpec(spec.hidden)
    good_column = _checked(backward.build_column_sum(column), column)
    assert all(ok for ok, _ in good_column.values()), good_column

    wide = replace(spec, hidden=16384, in_dtype="float32", weight_dtype="float32", grad_residual=True, num_buffers=8)
    assert wide.footprint > wide.budget
    with pytest.raises(UBBudgetError):
        build(wide)
    ok, detail = _checked(bad_kernels.row_over_budget(build, wide), wide)["ub"]
    assert not ok and "over budget" in detail, detail

    for serial, bad_spec in ((bad_kernels.row_serial_loop(build, spec), spec),
                             (bad_kernels.row_serial_loop(backward.build_column_sum, column), column)):
        ok, detail = _checked(serial, bad_spec)["pipelined"]
        assert not ok and "versions=[1]" in detail, detail

    ok, detail = _checked(bad_kernels.rms_backward_scalar_rows(spec), spec)["vector"]
    assert not ok and "scalar UB dereference" in detail, detail

    atomic = lower_prim_func(bad_kernels.backward_atomic_partials(build, spec)).kernel_source
    ok, detail = checks.check_deterministic(atomic, atomic)
    assert not ok and "atomics armed" in detail, detail

    split = lower_prim_func(bad_kernels.backward_split_by_cores(build, spec)).kernel_source
    split_other = lower_prim_func(bad_kernels.backward_split_by_cores(build, other)).kernel_source
    ok, detail = checks.check_deterministic(split, split_other)
    assert not ok and "vector-core count" in detail, detail


def test_core_lower_of_a_backward_op_gives_both_kernels():
    """core.lower of a norm backward gives the row kernel and the column sum, each with its header."""
    x = _x(3, 576)
    stat = torch.empty(3, device=META)
    with core.config.host_layout("ascend"):
        source = core.lower(core.ops.layer_norm_backward, x, x, torch.empty(576, dtype=torch.bfloat16, device=META),
                            stat, stat, backend="ascend")
    assert source.count("LOWERED") == 2 and source.count("__global__") == 2
    assert "specialisation: layer_norm_backward [T, 576] bfloat16" in source
    assert "specialisation: norm_column_sum [64, 576] float32" in source


# ---------------------------------------------------------------------- the MoE routing kernels


def _moe_specs():
    """A topk_gate (E = 72, k = 6) and a moe_topk_gate (sigmoid, E = 100, k = 4, no bias) specialisation."""
    from tileplug.backend_ascend.moe import moe_topk_gate, topk_gate

    with core.config.host_layout("ascend"):
        topk_call, _ = core.describe_call(core.ops.topk_gate, torch.empty(3, 72, device=META), 6)
        gate_call, _ = core.describe_call(core.ops.moe_topk_gate, torch.empty(3, 100, dtype=torch.bfloat16,
                                                                              device=META), 4, scoring="sigmoid",
                                          renormalize=False)
    return topk_gate.spec_of(topk_call), moe_topk_gate.spec_of(gate_call)


@pytest.mark.parametrize("op", ["topk_gate", "moe_topk_gate"])
def test_moe_kernel_checks_fail_on_bad_variants(op):
    """The MoE routing kernels pass every check, and each check fails on a bad variant of them:
    (a) 8 buffer versions of a 16384-expert row, over the UB budget (the builder refuses it);
    (b) a serial, single-buffered row loop; (c) the ranking (and scoring) in scalar code."""
    import ascend_bad_kernels as bad_kernels

    from tileplug.backend_ascend.device import UBBudgetError
    from tileplug.backend_ascend.moe import moe_topk_gate, topk_gate

    topk_spec, gate_spec = _moe_specs()
    if op == "topk_gate":
        build, spec, scalar = topk_gate.build, topk_spec, bad_kernels.topk_scalar_rows
    else:
        build, spec, scalar = moe_topk_gate.build, gate_spec, bad_kernels.gate_scalar_rows

    good = _checked(build(spec), spec)
    assert all(ok for ok, _ in good.values()), good

    wide = replace(spec, experts=16384, num_buffers=8)
    assert wide.footprint > wide.budget
    with pytest.raises(UBBudgetError):
        build(wide)
    ok, detail = _checked(bad_kernels.row_over_budget(build, wide), wide)["ub"]
    assert not ok and "over budget" in detail, detail

    ok, detail = _checked(bad_kernels.row_serial_loop(build, spec), spec)["pipelined"]
    assert not ok and "versions=[1]" in detail, detail

    ok, detail = _checked(scalar(spec), spec)["vector"]
    assert not ok and "scalar UB dereference" in detail, detail


def test_moe_kernels_decline_with_reasons():
    """What the Ascend MoE kernels leave to the reference, each with its reason: k > 32, more than
    64 expert groups, fp64 logits; a mask and group-limited routing (8 groups) are served."""
    table = _kernels()
    with core.config.host_layout("ascend"):
        wide_k, _ = core.describe_call(core.ops.topk_gate, torch.empty(3, 128, device=META), 40)
        groups, _ = core.describe_call(core.ops.moe_topk_gate, torch.empty(3, 64, device=META), 4, num_groups=8,
                                       topk_groups=2)
        many_groups, _ = core.describe_call(core.ops.moe_topk_gate, torch.empty(3, 256, device=META), 4,
                                            num_groups=128, topk_groups=2)
        masked, _ = core.describe_call(core.ops.moe_topk_gate, torch.empty(3, 64, device=META), 4,
                                       mask=torch.empty(3, dtype=torch.bool, device=META))
        fp64, _ = core.describe_call(core.ops.moe_topk_gate, torch.empty(3, 64, dtype=torch.float64, device=META), 4)
    reasons = {"num_topk = 40 > 32": (table["topk_gate"], wide_k),
               "num_groups = 128 > 64": (table["moe_topk_gate"], many_groups),
               "not served on Ascend": (table["moe_topk_gate"], fp64)}
    for expected, (kernel, call) in reasons.items():
        why = kernel.supports(call)
        assert why is not None and expected in why and "falls to the reference" in why, (expected, why)
    assert table["moe_topk_gate"].supports(masked) is None
    assert table["moe_topk_gate"].supports(groups) is None


def _routing_specs():
    """A normalize_weight (K = 9) and a moe_expert_counts (E = 72, K = 6, int32, alignment 16)
    specialisation: the count kernel's and the scan kernel's."""
    from tileplug.backend_ascend.moe import expert_counts, normalize_weight

    with core.config.host_layout("ascend"):
        weights, _ = core.describe_call(core.ops.normalize_weight, torch.empty(3, 9, device=META))
        counts, _ = core.describe_call(core.ops.moe_expert_counts, torch.empty(3, 6, dtype=torch.int32, device=META),
                                       72, 16)
    return normalize_weight.spec_of(weights), expert_counts.spec_of(counts), expert_counts.scan_spec_of(counts)


def test_normalize_weight_checks_fail_on_bad_variants():
    """normalize_weight's row kernel passes every check, and each check fails on a bad variant:
    (a) 8 buffer versions of 16384-slot rows, over the UB budget (the builder refuses it);
    (b) a serial, single-buffered row loop; (c) the slot sum and the divisions in scalar code."""
    import ascend_bad_kernels as bad_kernels

    from tileplug.backend_ascend.device import UBBudgetError
    from tileplug.backend_ascend.moe import normalize_weight

    spec, _, _ = _routing_specs()
    build = normalize_weight.build
    good = _checked(build(spec), spec)
    assert all(ok for ok, _ in good.values()), good

    wide = replace(spec, slots=16384, num_buffers=8)
    assert wide.footprint > wide.budget
    with pytest.raises(UBBudgetError):
        build(wide)
    ok, detail = _checked(bad_kernels.row_over_budget(build, wide), wide)["ub"]
    assert not ok and "over budget" in detail, detail

    ok, detail = _checked(bad_kernels.row_serial_loop(build, spec), spec)["pipelined"]
    assert not ok and "versions=[1]" in detail, detail

    ok, detail = _checked(bad_kernels.normalize_scalar_rows(spec), spec)["vector"]
    assert not ok and "scalar UB dereference" in detail, detail


def test_expert_counts_checks_fail_on_bad_variants():
    """moe_expert_counts' count and scan kernels pass every check (the count kernel's Ascend C
    the same for 64 and 40 vector cores), and each check fails on a bad variant: (a) 65536
    experts' accumulator over the UB budget (the builder refuses it); (b) a serial,
    single-buffered row loop (count and scan kernels); (c) the pairs counted in scalar code;
    (d) the block counts added into one row with a store-mode atomic, and the rows split by
    the vector-core count."""
    import ascend_bad_kernels as bad_kernels

    from tileplug.backend_ascend import lowering_checks as checks
    from tileplug.backend_ascend.device import UBBudgetError
    from tileplug.backend_ascend.lowering import lower_prim_func
    from tileplug.backend_ascend.moe import expert_counts

    _, spec, scan = _routing_specs()
    build = expert_counts.build_count
    other = replace(spec, vector_cores=OTHER_VECTOR_CORES)
    good = _checked(build(spec), spec)
    assert all(ok for ok, _ in good.values()), good
    good_scan = _checked(expert_counts.build_scan(scan), scan)
    assert all(ok for ok, _ in good_scan.values()), good_scan
    source = lower_prim_func(build(spec)).kernel_source
    assert checks.check_deterministic(source, lower_prim_func(build(other)).kernel_source)[0]

    wide = replace(scan, experts=8192, num_buffers=8)
    assert wide.footprint > wide.budget
    with pytest.raises(UBBudgetError):
        expert_counts.build_scan(wide)
    ok, detail = _checked(bad_kernels.row_over_budget(expert_counts.build_scan, wide), wide)["ub"]
    assert not ok and "over budget" in detail, detail
    with pytest.raises(UBBudgetError):
        build(replace(spec, experts=65536))

    for serial, bad_spec in ((bad_kernels.row_serial_loop(build, spec), spec),
                             (bad_kernels.row_serial_loop(expert_counts.build_scan, scan), scan)):
        ok, detail = _checked(serial, bad_spec)["pipelined"]
        assert not ok and "versions=[1]" in detail, detail

    ok, detail = _checked(bad_kernels.counts_scalar_rows(spec), spec)["vector"]
    assert not ok and "scalar UB dereference" in detail, detail

    atomic = lower_prim_func(bad_kernels.counts_atomic_partials(spec)).kernel_source
    ok, detail = checks.check_deterministic(atomic, atomic)
    assert not ok and "atomics armed" in detail, detail

    split = lower_prim_func(bad_kernels.counts_split_by_cores(spec)).kernel_source
    split_other = lower_prim_func(bad_kernels.counts_split_by_cores(other)).kernel_source
    ok, detail = checks.check_deterministic(split, split_other)
    assert not ok and "vector-core count" in detail, detail


def test_routing_kernels_decline_with_reasons():
    """What normalize_weight and moe_expert_counts leave to the reference, each with its reason:
    K > 1024 slots; E > 8192 experts, K > 64 slots."""
    table = _kernels()
    with core.config.host_layout("ascend"):
        wide, _ = core.describe_call(core.ops.normalize_weight, torch.empty(3, 1025, device=META))
        many, _ = core.describe_call(core.ops.moe_expert_counts, torch.empty(3, 8, dtype=torch.int64, device=META),
                                     8193)
        slots, _ = core.describe_call(core.ops.moe_expert_counts, torch.empty(3, 65, dtype=torch.int32, device=META),
                                      64)
        served, _ = core.describe_call(core.ops.moe_expert_counts, torch.empty(3, 64, dtype=torch.int64, device=META),
                                       8192, 128)
    reasons = {"K = 1025 > 1024": (table["normalize_weight"], wide),
               "E = 8193 > 8192": (table["moe_expert_counts"], many),
               "K = 65 > 64": (table["moe_expert_counts"], slots)}
    for expected, (kernel, call) in reasons.items():
        why = kernel.supports(call)
        assert why is not None and expected in why and "falls to the reference" in why, (expected, why)
    assert table["moe_expert_counts"].supports(served) is None


def test_core_lower_of_moe_expert_counts_gives_both_kernels():
    """core.lower of moe_expert_counts gives the count kernel and the scan kernel, each headed."""
    with core.config.host_layout("ascend"):
        source = core.lower(core.ops.moe_expert_counts, torch.empty(7, 8, dtype=torch.int64, device=META), 256, 128,
                            backend="ascend")
    assert source.count("LOWERED") == 2 and source.count("__global__") == 2
    assert "specialisation: moe_expert_counts [T, 8] int64 E=256" in source
    assert "specialisation: moe_expert_scan [64, 256] float32 alignment=128" in source


def _unpermute_spec():
    """A bf16 moe_unpermute specialisation (H = 576, K = 6, int32 permutation)."""
    from tileplug.backend_ascend.moe import unpermute

    with core.config.host_layout("ascend"):
        call, _ = core.describe_call(core.ops.moe_unpermute, _x(40, 576), torch.empty(5, 6, dtype=torch.int32,
                                                                                      device=META),
                                     torch.empty(5, 6, device=META), 5)
    return unpermute.spec_of(call)


def test_unpermute_checks_fail_on_bad_variants():
    """moe_unpermute's kernel (one (token, column tile) per pipelined step, the slots' rows DMA'd
    by their GM row index) passes every check, and each check fails on a bad variant: (a) 8
    12 slots' 4096-column tiles with 3 buffer versions, over the UB budget; (b) a
    serial, single-buffered loop; (c) the weighted sums in scalar code. (a) is refused by the
    builder and, when forced through, by TileLang's own loop scheduler (before the UB check)."""
    import ascend_bad_kernels as bad_kernels

    from tileplug.backend_ascend.device import UBBudgetError
    from tileplug.backend_ascend.moe import unpermute

    spec = _unpermute_spec()
    assert spec.width == 576 and spec.tiles == 1
    build = unpermute.build
    good = _checked(build(spec), spec)
    assert all(ok for ok, _ in good.values()), good

    wide = replace(spec, hidden=4096, width=4096, slots=12, num_buffers=3)
    assert wide.footprint > wide.budget
    with pytest.raises(UBBudgetError):
        build(wide)
    # Unlike the row kernels' over-budget variants, TileLang refuses this one itself (its loop
    # scheduler finds the versioned slot rows over the UB capacity), so the UB check is not
    # reached: the builder's refusal and TileLang's are both asserted.
    with pytest.raises(Exception, match="capacity is negative"):
        _checked(bad_kernels.row_over_budget(build, wide), wide)

    ok, detail = _checked(bad_kernels.row_serial_loop(build, spec), spec)["pipelined"]
    assert not ok and "versions=[1]" in detail, detail

    ok, detail = _checked(bad_kernels.unpermute_scalar_rows(spec), spec)["vector"]
    assert not ok and "scalar UB dereference" in detail, detail


def test_unpermute_tiles_and_declines():
    """A 7168-column bf16 row with 9 slots is split into column tiles that fit UB (the last one
    overlapping); K > 32 slots is declined with its reason."""
    from tileplug.backend_ascend.moe import unpermute

    with core.config.host_layout("ascend"):
        wide, _ = core.describe_call(core.ops.moe_unpermute, _x(40, 7168), torch.empty(5, 9, device=META,
                                                                                       dtype=torch.int64),
                                     torch.empty(5, 9, device=META), 5)
        many, _ = core.describe_call(core.ops.moe_unpermute, _x(40, 64), torch.empty(1, 33, device=META,
                                                                                     dtype=torch.int32),
                                     torch.empty(1, 33, device=META), 1)
    spec = unpermute.spec_of(wide)
    assert spec.width % 64 == 0 and spec.width < 7168 and spec.footprint <= spec.budget and spec.tiles >= 2
    why = _kernels()["moe_unpermute"].supports(many)
    assert why is not None and "K = 33 > 32" in why and "falls to the reference" in why, why


def _permute_call(x, topk_idx, experts, **kwargs):
    with core.config.host_layout("ascend"):
        call, _ = core.describe_call(core.ops.moe_permute, x, topk_idx, experts, **kwargs)
    return call


def _permute_specs():
    """A bf16 moe_permute (H = 576, E = 72, K = 6, int32 topk_idx, alignment 16): the index
    kernel's and the copy kernel's specialisation."""
    from tileplug.backend_ascend.moe import permute

    call = _permute_call(_x(5, 576), torch.empty(5, 6, dtype=torch.int32, device=META), 72, alignment=16)
    return permute.index_spec_of(call), permute.copy_spec_of(call)


def test_permute_checks_fail_on_bad_variants():
    """moe_permute's index kernel (one block, two pipelined walks over topk_idx) and copy kernel
    (one (token, column tile) per pipelined step) pass every check, the index kernel's Ascend C
    the same for 64 and 40 vector cores; each check fails on a bad variant: (a) 65536 experts'
    cursors / a 16384-word tile with 4 versions over the UB budget (the builders refuse them);
    (b) serial, single-buffered loops; (c) the pairs placed / the words copied in scalar code."""
    import ascend_bad_kernels as bad_kernels

    from tileplug.backend_ascend import lowering_checks as checks
    from tileplug.backend_ascend.device import UBBudgetError
    from tileplug.backend_ascend.lowering import lower_prim_func
    from tileplug.backend_ascend.moe import permute

    index, copy = _permute_specs()
    assert copy.row_words == 288 and copy.width == 288 and copy.tiles == 1
    for build, spec in ((permute.build_index, index), (permute.build_copy, copy)):
        good = _checked(build(spec), spec)
        assert all(ok for ok, _ in good.values()), good
    source = lower_prim_func(permute.build_index(index)).kernel_source
    other = lower_prim_func(permute.build_index(replace(index, vector_cores=OTHER_VECTOR_CORES))).kernel_source
    assert checks.check_deterministic(source, other)[0]

    many = replace(index, experts=65536)
    wide = replace(copy, row_words=16384, width=16384, num_buffers=4)
    for build, spec in ((permute.build_index, many), (permute.build_copy, wide)):
        assert spec.footprint > spec.budget
        with pytest.raises(UBBudgetError):
            build(spec)
    ok, detail = _checked(bad_kernels.row_over_budget(permute.build_copy, wide), wide)["ub"]
    assert not ok and "over budget" in detail, detail

    for build, spec in ((permute.build_index, index), (permute.build_copy, copy)):
        ok, detail = _checked(bad_kernels.row_serial_loop(build, spec), spec)["pipelined"]
        assert not ok and "versions=[1]" in detail, detail

    for bad, spec in ((bad_kernels.permute_scalar_place, index), (bad_kernels.permute_scalar_copy, copy)):
        ok, detail = _checked(bad(spec), spec)["vector"]
        assert not ok and "scalar UB dereference" in detail, detail


def test_permute_tiles_and_declines():
    """A 16384-column fp32 row is split into word tiles that fit UB (the last one overlapping);
    rows that are not whole 4-byte words and E > 8192 are declined with their reasons."""
    from tileplug.backend_ascend.moe import permute

    idx = torch.empty(5, 8, dtype=torch.int64, device=META)
    spec = permute.copy_spec_of(_permute_call(_x(5, 16384, torch.float32), idx, 64))
    assert spec.width % 64 == 0 and spec.width < 16384 and spec.footprint <= spec.budget and spec.tiles >= 2
    kernel = _kernels()["moe_permute"]
    reasons = {"4-byte": _permute_call(_x(5, 3, torch.float16), idx, 64),
               "E = 8193 > 8192": _permute_call(_x(5, 64), idx, 8193)}
    for expected, call in reasons.items():
        why = kernel.supports(call)
        assert why is not None and expected in why and "falls to the reference" in why, (expected, why)


def test_core_lower_of_moe_permute_gives_both_kernels():
    """core.lower of a quantized moe_permute gives the index kernel and the copy kernel (with the
    scale rows), each headed."""
    x = torch.empty(7, 512, dtype=torch.float8_e4m3fn, device=META)
    with core.config.host_layout("ascend"):
        source = core.lower(core.ops.moe_permute, x, torch.empty(7, 8, dtype=torch.int64, device=META), 32,
                            x_sf=torch.empty(7, 4, device=META), backend="ascend")
    assert source.count("LOWERED") == 2 and source.count("__global__") == 2
    assert "specialisation: moe_permute_index [T, 8] int64 E=32 alignment=1" in source
    assert "specialisation: moe_permute_rows [R, 128] words + sf [R, 4] words K=8 W=128" in source


def _backward_call(experts, slots, index_dtype=torch.int32, scores_dtype=torch.float32, **kwargs):
    scores = torch.empty(5, experts, dtype=scores_dtype, device=META)
    weights = torch.empty(5, slots, dtype=scores_dtype, device=META)
    with core.config.host_layout("ascend"):
        call, _ = core.describe_call(core.ops.moe_topk_gate_backward, scores,
                                     torch.empty(5, slots, dtype=index_dtype, device=META), weights, weights,
                                     kwargs.pop("scoring", "sigmoid"), **kwargs)
    return call


def test_gate_backward_checks_fail_on_bad_variants():
    """moe_topk_gate_backward's row kernel (sigmoid, E = 100, K = 6, int32, no renormalization)
    passes every check, and each fails on a bad variant: (a) 4 versions of an E = 8192 row over
    the UB budget (refused by the builder and, forced through, by TileLang's loop scheduler); (b) a serial, single-buffered row loop; (c) the
    gradient computed in scalar code."""
    import ascend_bad_kernels as bad_kernels

    from tileplug.backend_ascend.device import UBBudgetError
    from tileplug.backend_ascend.moe import gate_backward

    spec = gate_backward.spec_of(_backward_call(100, 6, renormalize=False))
    build = gate_backward.build
    good = _checked(build(spec), spec)
    assert all(ok for ok, _ in good.values()), good

    wide = replace(spec, experts=8192, num_buffers=4)
    assert wide.footprint > wide.budget
    with pytest.raises(UBBudgetError):
        build(wide)
    # As moe_unpermute's: TileLang's loop scheduler refuses the versioned rows over the UB
    # capacity itself, before the UB check is reached; both refusals are asserted.
    with pytest.raises(Exception, match="capacity is negative"):
        _checked(bad_kernels.row_over_budget(build, wide), wide)

    ok, detail = _checked(bad_kernels.row_serial_loop(build, spec), spec)["pipelined"]
    assert not ok and "versions=[1]" in detail, detail

    ok, detail = _checked(bad_kernels.backward_scalar_rows(spec), spec)["vector"]
    assert not ok and "scalar UB dereference" in detail, detail


def test_gate_backward_declines_with_reasons():
    """fp64 scores (gradcheck's) and K > 64 slots fall to the reference with their reasons; a
    mask and int64 indices are served."""
    kernel = _kernels()["moe_topk_gate_backward"]
    reasons = {"fp32 only": _backward_call(64, 4, scores_dtype=torch.float64),
               "K = 65 > 64": _backward_call(128, 65)}
    for expected, call in reasons.items():
        why = kernel.supports(call)
        assert why is not None and expected in why and "falls to the reference" in why, (expected, why)
    masked = _backward_call(64, 4, torch.int64, mask=torch.empty(5, dtype=torch.bool, device=META))
    assert kernel.supports(masked) is None


def test_group_routing_checks_fail_on_bad_variants():
    """moe_topk_gate with group-limited routing (sigmoid, E = 256, 8 groups, the best 4) passes
    every check; a serial row loop fails the pipelining check. (Scalar code of the group
    limiting would sit inside the kernel's SIMD region, where the vector check does not look
    for scalar UB access; the scalar variant of the whole row, ``gate_scalar_rows``, is the one
    shown failing it.)"""
    import ascend_bad_kernels as bad_kernels

    from tileplug.backend_ascend.moe import moe_topk_gate

    with core.config.host_layout("ascend"):
        call, _ = core.describe_call(core.ops.moe_topk_gate, torch.empty(3, 256, device=META), 8, scoring="sigmoid",
                                     num_groups=8, topk_groups=4)
    spec = moe_topk_gate.spec_of(call)
    assert spec.num_groups == 8 and spec.topk_groups == 4
    good = _checked(moe_topk_gate.build(spec), spec)
    assert all(ok for ok, _ in good.values()), good
    ok, detail = _checked(bad_kernels.row_serial_loop(moe_topk_gate.build, spec), spec)["pipelined"]
    assert not ok and "versions=[1]" in detail, detail
