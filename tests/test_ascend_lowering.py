"""Ascend backend: LOWERING tests (TileLang's Ascend pipeline -> Ascend C, on a CPU machine).

Nothing here executes a kernel: every specialisation of the grid is traced and lowered to
Ascend C, and the lowered result is checked (UB within budget, pipelined row loop with more
than one buffer version, SIMD hot loop). Each check is also shown failing on a deliberately
bad kernel (tests/ascend_bad_kernels.py). "Lowered" is all this proves; NPU execution is
tests/npu/test_ascend_quant.py.

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


def _pair(tokens, hidden, fmt, block, sf_kind, col_major):
    """A quantized (xq, sf) meta pair in the Ascend layout."""
    data = torch.empty(tokens, hidden if fmt == "e4m3" else hidden // 2,
                       dtype=torch.float8_e4m3fn if fmt == "e4m3" else torch.int8, device=META)
    rows, cols = -(-tokens // block[0]), -(-hidden // block[1])
    if sf_kind == "ue8m0":
        if block[1] == 1:
            rows = -(-rows // 2)
        else:
            cols = -(-cols // 2)
    dtype = torch.int16 if sf_kind == "ue8m0" else torch.float32
    sf = torch.empty(cols, rows, dtype=dtype, device=META).t() if col_major else torch.empty(rows, cols, dtype=dtype, device=META)
    return data, sf


def _given(tokens, hidden, block, sf_kind, col_major):
    return _pair(tokens, hidden, "e4m3", block, sf_kind, col_major)[1]


SF_MODES = {  # name -> kwargs of per_token / per_block casts
    "plain": {},
    "colmajor": {"use_tma_aligned_col_major_sf": True},
    "round": {"round_sf": True},
    "ue8m0": {"round_sf": True, "use_packed_ue8m0": True},
    "ue8m0_colmajor": {"round_sf": True, "use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True},
}


def grid() -> list[tuple[str, str, tuple, dict]]:
    """(case id, op name, args builder spec, kwargs). Built lazily in the workers."""
    cases = []
    # per token: H x g x fmt x sf mode (bf16), fp32 input on a subset
    for hidden in (576, 7168):
        for g in (16, 32, 64, 128):
            for fmt in ("e4m3", "e2m1"):
                for mode in ("plain", "ue8m0_colmajor") if hidden == 7168 else ("plain", "colmajor", "ue8m0"):
                    cases.append((f"token-H{hidden}-g{g}-{fmt}-{mode}-bf16", "per_token_cast",
                                  ("x", hidden, "bf16"), dict(fmt=fmt, num_per_channels=g, **SF_MODES[mode])))
            if hidden == 576:
                cases.append((f"token-H{hidden}-g{g}-e4m3-round-fp32", "per_token_cast", ("x", hidden, "fp32"),
                              dict(num_per_channels=g, round_sf=True)))
    for g in (32, 128):
        cases.append((f"token-sfonly-H2048-g{g}", "per_token_cast_with_sf_only", ("x", 2048, "bf16"),
                      dict(num_per_channels=g, round_sf=True, use_packed_ue8m0=True)))
        for kind, cm in (("fp32", False), ("ue8m0", True)):
            cases.append((f"token-precomputed-H576-g{g}-{kind}{'-cm' if cm else ''}", "per_token_cast_with_precomputed_sf",
                          ("xg", 576, "bf16", (1, g), kind, cm), dict(num_per_channels=g)))
    # re-quantization of (xq, sf) pairs
    for fmt, block, kind, cm, g in (
        ("e4m3", (1, 128), "fp32", False, 128), ("e2m1", (1, 32), "ue8m0", True, 32),
        ("e4m3", (128, 128), "fp32", True, 64), ("e4m3", (128, 1), "ue8m0", False, 16),
        ("e2m1", (1, 16), "fp32", False, 128),
    ):
        cases.append((f"token-requant-{fmt}-{block[0]}x{block[1]}-{kind}{'-cm' if cm else ''}-g{g}", "per_token_cast",
                      ("q", 576, fmt, block, kind, cm), dict(num_per_channels=g, x_block_size=block, round_sf=True)))
    # per block
    for block in ((16, 16), (32, 32), (64, 128), (128, 128), (128, 32)):
        for fmt, mode in (("e4m3", "plain"), ("e2m1", "ue8m0_colmajor")):
            cases.append((f"block-{block[0]}x{block[1]}-H7168-{fmt}-{mode}", "per_block_cast", ("x", 7168, "bf16"),
                          dict(fmt=fmt, block_size=block, **SF_MODES[mode])))
    cases.append(("block-128x128-H576-fp32-round", "per_block_cast", ("x", 576, "fp32"), dict(block_size=(128, 128), round_sf=True)))
    cases.append(("block-sfonly-32x32-H576", "per_block_cast_with_sf_only", ("x", 576, "bf16"), dict(block_size=(32, 32))))
    cases.append(("block-precomputed-128x128-ue8m0-cm", "per_block_cast_with_precomputed_sf",
                  ("xg", 2048, "bf16", (128, 128), "ue8m0", True), dict(block_size=(128, 128))))
    cases.append(("block-requant-e4m3-1x128", "per_block_cast", ("q", 2048, "e4m3", (1, 128), "fp32", False),
                  dict(block_size=(128, 128), x_block_size=(1, 128))))
    # per channel
    for g in (32, 128):
        for hidden, fmts in ((576, ("e4m3", "e2m1")), (7168, ("e2m1",))):
            for fmt in fmts:
                for packed in (False, True) if hidden == 576 else (True,):
                    flags = dict(round_sf=True, use_packed_ue8m0=True) if packed else {}
                    cases.append((f"channel-{g}-H{hidden}-{fmt}-{'ue8m0' if packed else 'plain'}", "per_channel_cast",
                                  ("x", hidden, "bf16"), dict(fmt=fmt, num_per_tokens=g, **flags)))
    cases.append(("channel-requant-e4m3-1x128", "per_channel_cast", ("q", 2048, "e4m3", (1, 128), "fp32", False),
                  dict(num_per_tokens=128, num_per_channels=128)))
    # cast back
    for fmt, block, kind, cm in (
        ("e4m3", (1, 128), "fp32", False), ("e2m1", (1, 32), "ue8m0", True), ("e4m3", (128, 128), "ue8m0", False),
        ("e4m3", (32, 1), "ue8m0", False), ("e2m1", (1, 16), "fp32", True),
    ):
        for out in ("bf16",) if block[1] != 128 else ("bf16", "fp32"):
            cases.append((f"back-{fmt}-{block[0]}x{block[1]}-{kind}{'-cm' if cm else ''}-{out}", "cast_back",
                          ("q", 7168, fmt, block, kind, cm), dict(fmt=out, x_block_size=block)))
    # outside the grid above: odd hidden sizes, g=16 with fp32 input, tiny H
    cases += [
        ("extra-token-H592-g16-fp32-e2m1-ue8m0", "per_token_cast", ("x", 592, "fp32"),
         dict(fmt="e2m1", num_per_channels=16, round_sf=True, use_packed_ue8m0=True)),
        ("extra-token-H1040-g128-bf16", "per_token_cast", ("x", 1040, "bf16"), dict(num_per_channels=128)),
        ("extra-block-H1040-64x64-fp32", "per_block_cast", ("x", 1040, "fp32"), dict(block_size=(64, 64), round_sf=True)),
        ("extra-channel-H592-32-fp32", "per_channel_cast", ("x", 592, "fp32"), dict(num_per_tokens=32)),
        ("extra-token-H16-g16", "per_token_cast", ("x", 16, "bf16"), dict(num_per_channels=16)),
        ("extra-back-H1040-1x64-fp32", "cast_back", ("q", 1040, "e4m3", (1, 64), "fp32", False), dict(fmt="fp32", x_block_size=(1, 64))),
    ]
    return cases


def _args(builder):
    tokens = 5
    if builder[0] == "x":
        return (_x(tokens, builder[1], torch.bfloat16 if builder[2] == "bf16" else torch.float32),)
    if builder[0] == "q":
        _, hidden, fmt, block, kind, cm = builder
        return (_pair(tokens, hidden, fmt, block, kind, cm),)
    _, hidden, dtype, block, kind, cm = builder
    return (_x(tokens, hidden), _given(tokens, hidden, block, kind, cm))


def lower_and_check(case) -> dict:
    """Worker: describe the call, lower it through the backend (disk-cached), run the checks."""
    from tileplug.backend_ascend import lowering_checks as checks
    from tileplug.backend_ascend.quant.common import decline_reason, spec_of
    from tileplug.backend_ascend.quant.lowered import lower_spec

    name, op, builder, kwargs = case
    args = _args(builder)
    function = getattr(core.ops, op)
    if op.endswith("_with_precomputed_sf"):
        x, sf = args
        args, kwargs = (x,), dict(kwargs, sf=sf)
    with core.config.host_layout("ascend"):
        call, _ = core.describe_call(function, *args, **kwargs)
    result = {"name": name, "op": call.op}
    why = decline_reason(call)
    if why is not None:
        result["declined"] = why
        return result
    spec = spec_of(call)
    lowered, tiling = lower_spec(spec)
    source = lowered.source
    result["checks"] = {
        "ub": checks.check_ub(lowered.compiler_ub_bytes, lowered.primfunc_ub_bytes, tiling.footprint, tiling.budget),
        "pipelined": checks.check_pipelined(source),
        "vector": checks.check_vector(source),
        "nonempty": ("__gm__" in source, "kernel has __gm__ parameters"),
    }
    return result


CASES = grid()


@pytest.fixture(scope="module")
def lowered() -> dict[str, dict]:
    workers = min(2, os.cpu_count() or 1)
    with ProcessPoolExecutor(workers) as pool:
        results = list(pool.map(lower_and_check, CASES, chunksize=4))
    return {r["name"]: r for r in results}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_lowering_passes_checks(lowered, case):
    """The specialisation lowers to Ascend C and its lowering passes every check."""
    result = lowered[case[0]]
    assert "declined" not in result, result.get("declined")
    failed = {k: v[1] for k, v in result["checks"].items() if not v[0]}
    assert not failed, failed


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
