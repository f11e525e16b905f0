"""The CUDA kernel index (no GPU needed: modules are compiled for sm_90 with nvcc and loaded
with tvm_ffi, which loads a CUDA module without a device).

A fresh process whose kernel is indexed loads it without importing TileLang or compiling;
a corrupt index file is a miss that is recompiled and replaced; ``tileplug precompile``
fills the index from the op table's grid and compiles nothing the second time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.nvcc

ARCH = "sm_90"

CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from tileplug.core import describe_call, ops
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.backend_cuda import jit
    call, _ = describe_call(ops.cast_back, (torch.empty(3, 256, dtype=torch.float8_e4m3fn, device="meta"),
                                            torch.empty(3, 2, device="meta")), "bf16", (1, 128))
    entry = jit.entry(_KERNELS["cast_back"].spec(call), "sm_90")
    print(json.dumps({"hits": jit.index_hits, "compiles": jit.compile_count, "callable": callable(entry),
                      "tilelang_imported": "tilelang" in sys.modules}))
    """
)


def _child(index: str) -> dict:
    env = dict(os.environ, TILEPLUG_CUDA_KERNEL_INDEX=index)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cast_back_spec():
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core import describe_call, ops

    call, _ = describe_call(ops.cast_back, (torch.empty(3, 256, dtype=torch.float8_e4m3fn, device="meta"),
                                            torch.empty(3, 2, device="meta")), "bf16", (1, 128))
    return _KERNELS["cast_back"].spec(call)


def test_a_fresh_process_loads_an_indexed_kernel_without_tilelang(tmp_path) -> None:
    from tileplug.backend_cuda import jit

    index = str(tmp_path / "index")
    first = _child(index)
    assert first == {"hits": 0, "compiles": 1, "callable": True, "tilelang_imported": True}
    os.environ[jit.INDEX_VARIABLE] = index
    try:
        path = jit.index_path(_cast_back_spec(), ARCH)
    finally:
        del os.environ[jit.INDEX_VARIABLE]
    assert path.is_file() and path.stat().st_size > 1000
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".staging-")]  # published by rename
    second = _child(index)
    assert second == {"hits": 1, "compiles": 0, "callable": True, "tilelang_imported": False}

    path.write_bytes(b"not a shared library")  # a corrupt entry is a miss, recompiled and replaced
    third = _child(index)
    assert third == {"hits": 0, "compiles": 1, "callable": True, "tilelang_imported": True}
    assert path.stat().st_size > 1000
    assert _child(index)["hits"] == 1


def test_index_paths_differ_per_specialisation_and_architecture(monkeypatch, tmp_path) -> None:
    import dataclasses

    from tileplug.backend_cuda import jit

    monkeypatch.setenv(jit.INDEX_VARIABLE, str(tmp_path))
    spec = _cast_back_spec()
    other = dataclasses.replace(spec, warps=spec.warps * 2)
    paths = {jit.index_path(spec, "sm_90"), jit.index_path(spec, "sm_100"), jit.index_path(other, "sm_90")}
    assert len(paths) == 3
    assert all(p.parent.parent == tmp_path for p in paths)
    monkeypatch.setenv(jit.INDEX_VARIABLE, "off")
    assert jit.index_path(spec, "sm_90") is None


def test_index_defaults_to_tilelang_cache_dir(monkeypatch, tmp_path) -> None:
    from tileplug.backend_cuda import jit

    monkeypatch.delenv(jit.INDEX_VARIABLE, raising=False)
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    assert jit.index_dir() == tmp_path / "tileplug-index"


def test_precompile_command_fills_the_index_once(tmp_path) -> None:
    env = dict(os.environ, TILEPLUG_CUDA_KERNEL_INDEX=str(tmp_path), TILEPLUG_CUDA_ARCH=ARCH)
    command = [sys.executable, "-m", "tileplug.core.cli", "precompile", "--device", "cuda", "--backends", "cuda",
               "--ops", "cast_back", "--workers", "2"]
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-2000:]
    line = [t for t in first.stdout.splitlines() if t.startswith("cuda:")][-1]
    compiled = int(line.split("compiled ")[1].split()[0])
    assert compiled >= 2  # cast_back's grid: e4m3 / e2m1 inputs, several sf encodings and layouts
    assert len(list(tmp_path.rglob("*.so"))) == compiled
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "compiled 0 kernel(s)" in second.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where the cuda backend is unavailable")
def test_precompile_without_an_available_backend_says_why() -> None:
    done = subprocess.run([sys.executable, "-m", "tileplug.core.cli", "precompile", "--device", "cuda"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert "no available backend for cuda compiles ahead of time" in done.stdout
    assert "cuda: " in done.stdout and "--backends" in done.stdout


def test_precompile_rejects_an_unknown_device() -> None:
    done = subprocess.run([sys.executable, "-m", "tileplug.core.cli", "precompile", "--device", "bogus"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--device" in done.stderr


def test_precompile_plans_every_declared_op(monkeypatch) -> None:
    """``tileplug precompile`` with no ``--ops`` asks every kernel of the cuda backend for the
    specialisations its calls run: each op the backend serves contributes at least one, and
    every kernel object answers ``specs`` (no compilation here: the compile is stubbed)."""
    from tileplug.backend_cuda import jit, plugin
    from tileplug.core import opdefs
    from tileplug.core.precompile import grid_calls
    from tileplug.core.registry import registry

    planned: list = []
    monkeypatch.setattr(jit, "precompile", lambda specs, **options: planned.extend(specs) or len(specs))
    calls = grid_calls(registry.get("cuda"), "cuda")
    assert plugin.precompile(calls) == len(planned)
    kernels = plugin._KERNELS
    served = {call.op for call in calls if call.op in kernels and kernels[call.op].supports(call) is None}
    from tileplug.backend_cuda.moe import table

    from tileplug.backend_cuda.quant import per_token_cast

    unverified = set() if table.GATE_VERIFIED else {"moe_topk_gate"}  # declines every call until GPU-verified
    if not per_token_cast.FAKE_QUANT_VERIFIED:
        unverified.add("per_token_cast_and_cast_back")
    # (an op whose family module has no CUDA kernel yet falls to the reference: not planned)
    assert served == {name for name in opdefs.names() if name in plugin._KERNELS and plugin._KERNELS[name].exists()} \
        - unverified
    names = {spec.name for spec in planned}
    for op in served:
        prefix = {"per_block_cast": "per_block", "per_channel_cast": "per_channel",
                  "moe_expert_counts": "moe_chunk_counts",
                  "per_token_cast_and_cast_back": "fake_quant"}.get(op, op)
        if op == "per_block_cast_lossless":  # the per-token / block / channel tiles in their lossless mode
            assert any(name.endswith("_lossless") for name in names), f"{op}: no specialisation planned"
            continue
        assert any(name.startswith(prefix) for name in names), f"{op}: no specialisation planned"


RANK = textwrap.dedent(
    """
    import json, os, sys, time, torch
    from tileplug.core import describe_call, ops
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.backend_cuda import jit
    call, _ = describe_call(ops.cast_back, (torch.empty(3, 256, dtype=torch.float8_e4m3fn, device="meta"),
                                            torch.empty(3, 2, device="meta")), "bf16", (1, 128))
    spec = _KERNELS["cast_back"].spec(call)
    go = sys.argv[1]
    while not os.path.exists(go):  # every rank imported: start together
        time.sleep(0.01)
    entry = jit.entry(spec, "sm_90")
    print(json.dumps({"compiles": jit.compile_count, "hits": jit.index_hits, "waits": jit.index_waits,
                      "callable": callable(entry)}))
    """
)


def test_eight_processes_starting_at_once_compile_a_specialisation_once(tmp_path) -> None:
    """Eight ranks with one empty cache directory make the same first call at the same moment:
    one compiles, the seven others wait on the spec's lock and load what it published; a
    ninth process then loads it from the index (nothing torn, nothing recompiled)."""
    env = dict(os.environ, TILELANG_CACHE_DIR=str(tmp_path / "cache"),
               TILEPLUG_CUDA_KERNEL_INDEX=str(tmp_path / "index"))
    go = tmp_path / "go"
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(go)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(8)]
    go.touch()
    results = []
    for rank in ranks:
        out, err = rank.communicate(timeout=900)
        assert rank.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(result["callable"] for result in results)
    assert sum(result["compiles"] for result in results) == 1, results
    assert sum(result["hits"] for result in results) == 7 and sum(result["waits"] for result in results) <= 7
    ninth = subprocess.run([sys.executable, "-c", RANK, str(go)], env=env, capture_output=True, text=True, timeout=600)
    assert ninth.returncode == 0, ninth.stderr[-2000:]
    assert json.loads(ninth.stdout.strip().splitlines()[-1]) == {"compiles": 0, "hits": 1, "waits": 0, "callable": True}
    published = list((tmp_path / "index").rglob("*.so"))
    assert len(published) == 1 and not list((tmp_path / "index").rglob(".staging-*"))

