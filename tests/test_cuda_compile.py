"""CUDA backend, compile-only (no GPU): every specialisation of the grid lowers for sm_90
and its source compiles with nvcc; the main load path is 128-bit vectorized; core.lower
works on meta tensors.

Runs on a GPU-less CI machine with nvcc (marker ``nvcc``; skipped without nvcc). The grid
is lowered and compiled once, in a process pool of 2, by a module fixture (~3 minutes on
2 cores); each specialisation is then its own test.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

pytestmark = pytest.mark.nvcc

ARCH = "sm_90"
BATCH = 13  # kernels per nvcc translation unit
H = 576  # partial 128-groups; H is dynamic in every kernel, so one size covers all
SF_MODES = {
    "plain": {},
    "round": {"round_sf": True},
    "ue8m0": {"round_sf": True, "use_packed_ue8m0": True},
    "e4m3sf": {"use_e4m3_sf": True},
}

# ------------------------------------------------------------------ the grid
# A case: (id, op name, input description, kwargs). Inputs are described, not built, so
# cases cross the process boundary: ("float", dtype name) or ("quant", fmt, sf dtype name,
# sf shape) plus optional given sf ("sf", dtype name, shape).


def _grid() -> list[tuple]:
    cases: list[tuple] = []
    for fmt in ("e4m3", "e2m1"):
        for i, (group, mode) in enumerate((g, m) for g in (16, 32, 64, 128) for m in SF_MODES):
            col = bool(i % 2) if mode != "ue8m0" else bool((i // 4) % 2)
            kwargs = {"fmt": fmt, "num_per_channels": group, "use_tma_aligned_col_major_sf": col, **SF_MODES[mode]}
            cases.append((f"per_token[{fmt},g{group},{mode},col={col}]", "per_token_cast", ("float", "bfloat16"), kwargs))
        for mode in ("plain", "ue8m0") if fmt == "e4m3" else ("round", "e4m3sf"):
            kwargs = {"fmt": fmt, "num_per_channels": 64, **SF_MODES[mode]}
            cases.append((f"per_token_fp32[{fmt},g64,{mode}]", "per_token_cast", ("float", "float32"), kwargs))
            cases.append((f"per_token_sf_only[{fmt},g64,{mode}]", "per_token_cast_with_sf_only", ("float", "bfloat16"), kwargs))
        for block, modes in (((32, 32), ("plain", "round", "ue8m0")), ((128, 128), ("plain", "round", "ue8m0")),
                             ((16, 64), ("round",)), ((64, 16), ("ue8m0",))):
            for mode in modes:
                for col in (False, True) if mode == "ue8m0" and block[0] != 64 else (block[0] == 64,):
                    kwargs = {"fmt": fmt, "block_size": block, "use_tma_aligned_col_major_sf": col, **SF_MODES[mode]}
                    cases.append((f"per_block[{fmt},{block[0]}x{block[1]},{mode},col={col}]", "per_block_cast",
                                  ("float", "bfloat16"), kwargs))
        cases.append((f"per_block_fp32[{fmt},128x128]", "per_block_cast", ("float", "float32"), {"fmt": fmt}))
        cases.append((f"per_block_sf_only[{fmt},128x128,ue8m0]", "per_block_cast_with_sf_only", ("float", "bfloat16"),
                      {"fmt": fmt, **SF_MODES["ue8m0"]}))
        for group in (32, 128):
            for mode in ("plain", "round", "ue8m0"):
                kwargs = {"fmt": fmt, "num_per_tokens": group, **SF_MODES[mode]}
                cases.append((f"per_channel[{fmt},g{group},{mode}]", "per_channel_cast", ("float", "bfloat16"), kwargs))
        cases.append((f"per_channel_fp32[{fmt},g128]", "per_channel_cast", ("float", "float32"), {"fmt": fmt}))
    # precomputed sf of each encoding
    for name, dtype, shape, kwargs in (
        ("fp32", "float32", (3, 5), {"num_per_channels": 128}),
        ("e4m3", "float8_e4m3fn", (3, 36), {"fmt": "e2m1", "num_per_channels": 16}),
        ("ue8m0", "int32", (3, 5), {"num_per_channels": 32}),
    ):
        cases.append((f"per_token_precomputed[{name}]", "per_token_cast_with_precomputed_sf", ("float", "bfloat16"),
                      kwargs, ("sf", dtype, shape)))
    cases.append(("per_block_precomputed[fp32]", "per_block_cast_with_precomputed_sf", ("float", "bfloat16"), {},
                  ("sf", "float32", (1, 5))))
    cases.append(("per_block_precomputed[ue8m0,32x32]", "per_block_cast_with_precomputed_sf", ("float", "bfloat16"),
                  {"block_size": (32, 32)}, ("sf", "int32", (1, 5))))
    # re-quantization of (xq, sf) inputs
    for ident, op, quant, kwargs in (
        ("per_token_requant[e4m3,1x32 fp32]", "per_token_cast", ("quant", "e4m3", "float32", (3, 18)), {"x_block_size": (1, 32)}),
        ("per_token_requant[e2m1,1x64 ue8m0]", "per_token_cast", ("quant", "e2m1", "int32", (3, 3)),
         {"x_block_size": (1, 64), "fmt": "e2m1", "round_sf": True}),
        ("per_token_requant[e4m3,128x1 fp32]", "per_token_cast", ("quant", "e4m3", "float32", (1, H)), {"x_block_size": (128, 1)}),
        ("per_block_requant[e4m3,1x128]", "per_block_cast", ("quant", "e4m3", "float32", (3, 5)), {"x_block_size": (1, 128)}),
        ("per_channel_requant[e4m3,1x128]", "per_channel_cast", ("quant", "e4m3", "float32", (3, 5)), {"num_per_channels": 128}),
        ("per_token_requant_sf_only[e4m3sf in]", "per_token_cast_with_sf_only", ("quant", "e4m3", "float8_e4m3fn", (3, 36)),
         {"x_block_size": (1, 16)}),
    ):
        cases.append((ident, op, quant, kwargs))
    cases.append(("per_token_requant_precomputed[e4m3]", "per_token_cast_with_precomputed_sf",
                  ("quant", "e4m3", "float32", (3, 18)), {"x_block_size": (1, 32)}, ("sf", "float32", (3, 5))))
    # cast_back of every sf layout family
    for ident, quant, block in (
        ("1x128 fp32", ("quant", "e4m3", "float32", (3, 5)), (1, 128)),
        ("128x128 fp32", ("quant", "e4m3", "float32", (1, 5)), (128, 128)),
        ("128x1 fp32", ("quant", "e4m3", "float32", (1, H)), (128, 1)),
        ("1x32 ue8m0", ("quant", "e2m1", "int32", (3, 5)), (1, 32)),
        ("32x1 ue8m0", ("quant", "e4m3", "int32", (1, H)), (32, 1)),
        ("1x16 e4m3sf", ("quant", "e2m1", "float8_e4m3fn", (3, 36)), (1, 16)),
    ):
        for out in ("bf16", "fp32"):
            cases.append((f"cast_back[{ident}->{out}]", "cast_back", quant, {"fmt": out, "x_block_size": block}))
    return cases


GRID = _grid()


def _inputs(description: tuple, given: tuple | None) -> tuple[tuple, dict]:
    meta = torch.device("meta")
    if description[0] == "float":
        args: tuple = (torch.empty(3, H, dtype=getattr(torch, description[1]), device=meta),)
    else:
        _, fmt, sf_dtype, sf_shape = description
        xq = (torch.empty(3, H, dtype=torch.float8_e4m3fn, device=meta) if fmt == "e4m3"
              else torch.empty(3, H // 2, dtype=torch.int8, device=meta))
        args = ((xq, torch.empty(sf_shape, dtype=getattr(torch, sf_dtype), device=meta)),)
    extra = {}
    if given is not None:
        extra["sf"] = torch.empty(given[2], dtype=getattr(torch, given[1]), device=meta)
    return args, extra


def describe(case: tuple, input_alignment: int | None = None):
    """(kernel, call) of a grid case."""
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core import ops
    from tileplug.core.lowering import describe_call

    ident, op, description, kwargs = case[:4]
    args, extra = _inputs(description, case[4] if len(case) > 4 else None)
    call, _ = describe_call(getattr(ops, op), *args, **kwargs, **extra)
    if input_alignment is not None:
        call = dataclasses.replace(call, input_alignment=input_alignment)
    return _KERNELS[call.op], call


def nvcc_flags() -> list[str]:
    from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    return ["-std=c++20", f"-arch={ARCH}", "-w", "-Xcudafe", "--diag_suppress=177",
            f"-I{TILELANG_TEMPLATE_PATH}", f"-I{CUTLASS_INCLUDE_DIR}"]


def lower_case(case: tuple, input_alignment: int | None = None) -> dict:
    """Lower one case for sm_90: {"id", "ok", "source" | "error", "spec"}."""
    result = {"id": case[0], "ok": False}
    try:
        kernel, call = describe(case, input_alignment)
        reason = kernel.supports(call)
        if reason is not None:
            result["error"] = f"declined: {reason}"
            return result
        started = time.perf_counter()
        result["source"] = kernel.source(call, ARCH)
        result["lower_s"] = time.perf_counter() - started
        result["spec"] = kernel.spec(call).name
        result["ok"] = True
    except Exception as error:  # noqa: BLE001 - reported by the test
        result["error"] = f"lowering failed: {type(error).__name__}: {error}"[-3000:]
    return result


def nvcc(source: str, ptx: bool = False) -> tuple[str | None, str, str]:
    """Compile CUDA ``source`` (cubin with ptxas -v, or PTX when ``ptx``) →
    (error or None, PTX text, ptxas report)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cu")
        with open(path, "w") as handle:
            handle.write(source)
        output = os.path.join(tmp, "kernel.ptx" if ptx else "kernel.cubin")
        mode = ["-ptx"] if ptx else ["-cubin", "-Xptxas", "-v"]
        done = subprocess.run([shutil.which("nvcc") or "nvcc", *nvcc_flags(), *mode, path, "-o", output],
                              capture_output=True, text=True)
        if done.returncode:
            return f"nvcc failed:\n{done.stderr[-3000:]}", "", ""
        if ptx:
            with open(output) as handle:
                return None, handle.read(), ""
    return None, "", done.stderr


SPILLS = re.compile(r"Function properties for (\w+)\s*\n\s*\d+ bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def spill_bytes(report: str) -> dict[str, int]:
    """Kernel symbol → spilled bytes (stores + loads) from a ptxas -v report."""
    return {name: int(stores) + int(loads) for name, stores, loads in SPILLS.findall(report)}


def compile_batch(sources: list[str]) -> tuple[list[str | None], dict[str, int]]:
    """nvcc one translation unit holding every source (the heavy TileLang headers are parsed
    once); on failure each source is compiled alone to name the broken one. Also returns the
    spills ptxas reports per kernel symbol."""
    error, _, report = nvcc("\n".join(sources))
    if error is None or len(sources) == 1:
        return [error] * len(sources), spill_bytes(report)
    errors, spills = [], {}
    for source in sources:
        error, _, report = nvcc(source)
        errors.append(error)
        spills.update(spill_bytes(report))
    return errors, spills


def lower_and_compile(case: tuple, input_alignment: int | None = None, ptx: bool = False) -> dict:
    """Lower one case for sm_90 and compile it alone."""
    result = lower_case(case, input_alignment)
    if result["ok"]:
        error, result["ptx"], _ = nvcc(result["source"], ptx)
        if error is not None:
            result.update(ok=False, error=error)
    return result


# ------------------------------------------------------------------ the 128-bit check

VECTOR_LOAD = re.compile(r"=\s*\*\((?:uint4|float4|int4|ulonglong2|longlong2)\*\)\(x \+")
SCALAR_LOAD = re.compile(r"(?<![\w.])x\[")
PTX_V4_LOAD = re.compile(r"ld\.global(?:\.nc)?(?:\.L1::\S+)?(?:\.L2::\S+)?\.v4\.(?:u32|b32|f32|s32)")


def x_loads_are_128_bit(source: str) -> bool:
    """True when every load of ``x`` in the CUDA source is a 128-bit vector load."""
    return bool(VECTOR_LOAD.search(source)) and not SCALAR_LOAD.search(source)


# ------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def compiled_grid() -> dict[str, dict]:
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    pytest.importorskip("tilelang")
    with ProcessPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lower_case, GRID))
        lowered = [r for r in results if r["ok"]]
        batches = [lowered[i : i + BATCH] for i in range(0, len(lowered), BATCH)]
        for batch, (errors, spills) in zip(batches, pool.map(compile_batch, [[r["source"] for r in b] for b in batches])):
            for result, error in zip(batch, errors):
                result["spill_bytes"] = spills.get(result["spec"] + "_kernel")
                if error is not None:
                    result.update(ok=False, error=error)
    return {r["id"]: r for r in results}


@pytest.mark.parametrize("case", GRID, ids=[c[0] for c in GRID])
def test_specialisation_lowers_and_compiles(case: tuple, compiled_grid: dict[str, dict]) -> None:
    result = compiled_grid[case[0]]
    assert result["ok"], result.get("error")


def test_no_specialisation_spills_registers(compiled_grid: dict[str, dict]) -> None:
    """ptxas reports no local-memory spills for any kernel of the grid (a tile geometry that
    needs more registers than its launch bounds allow would read and write local memory)."""
    spilled = {i: r["spill_bytes"] for i, r in compiled_grid.items() if r.get("spill_bytes")}
    unknown = [i for i, r in compiled_grid.items() if r["ok"] and r.get("spill_bytes") is None]
    assert not unknown, f"no ptxas report for {unknown[:5]}"
    assert not spilled, f"register spills (bytes): {spilled}"


MAIN_PATHS = [c for c in GRID if c[2][0] == "float"]


@pytest.mark.parametrize("case", MAIN_PATHS, ids=[c[0] for c in MAIN_PATHS])
def test_main_load_path_is_128_bit(case: tuple, compiled_grid: dict[str, dict]) -> None:
    result = compiled_grid[case[0]]
    assert result["ok"], result.get("error")
    assert x_loads_are_128_bit(result["source"]), "the x load path is no longer 128-bit vectorized"


def test_vector_check_catches_a_scalar_variant() -> None:
    """The check fails on the variant made for 2-byte-aligned rows (scalar loads), and the
    PTX of the aligned variant really holds 128-bit global loads."""
    case = ("per_token", "per_token_cast", ("float", "bfloat16"), {})
    scalar = lower_and_compile(case, input_alignment=2, ptx=True)
    assert scalar["ok"], scalar.get("error")
    assert not x_loads_are_128_bit(scalar["source"])
    assert not PTX_V4_LOAD.search(scalar["ptx"])
    vector = lower_and_compile(case, ptx=True)
    assert vector["ok"], vector.get("error")
    assert x_loads_are_128_bit(vector["source"])
    assert PTX_V4_LOAD.search(vector["ptx"])


def test_core_lower_on_meta_tensors() -> None:
    pytest.importorskip("tilelang")
    from tileplug import core

    x = torch.empty(1, 7168, dtype=torch.bfloat16, device="meta")
    source = core.lower(core.ops.per_token_cast, x, backend="cuda")
    assert "__global__" in source and x_loads_are_128_bit(source)
    source = core.lower(core.ops.per_block_cast, x, backend="cuda", block_size=(32, 32), round_sf=True)
    assert "__syncthreads" in source
    source = core.lower(core.ops.per_channel_cast, x, backend="cuda", num_per_tokens=32, round_sf=True,
                        use_packed_ue8m0=True)
    assert "__global__" in source
    q = torch.empty(5, 7168, dtype=torch.float8_e4m3fn, device="meta")
    sf = torch.empty(5, 56, device="meta")
    source = core.lower(core.ops.cast_back, (q, sf), backend="cuda", x_block_size=(1, 128))
    assert "__global__" in source


def test_hidden_not_multiple_of_16_is_declined_with_a_reason() -> None:
    from tileplug import core
    from tileplug.core.lowering import LoweringError

    x = torch.empty(3, 584, dtype=torch.bfloat16, device="meta")
    with pytest.raises(LoweringError, match="multiple of 16"):
        core.lower(core.ops.per_token_cast, x, backend="cuda")
