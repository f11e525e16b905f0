"""Compiling and lowering kernel specialisations, each at most once per process.

``compiled(spec)`` returns the TileLang ``JITKernel`` (tvm_ffi execution backend) of a
:class:`KernelSpec`, compiling it on first use. Concurrent first calls for the same spec
wait for one compilation (a lock per spec); different specs compile in parallel.
``lower_source(spec, arch)`` returns the generated CUDA source without needing a GPU.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from tileplug.backend_cuda.quant.spec import KernelSpec

PASS_CONFIGS: dict[str, Any] = {
    # Every store is bounds-checked by the kernel itself; TileLang's extra guards would only
    # add predicates to the sf stores.
    "tl.disable_safe_memory_legalize": True,
    # IEEE semantics are part of the contract (denormals kept, exact division).
    "tl.enable_fast_math": False,
}
DEFAULT_ARCH = "sm_90"

_lock = threading.Lock()
_spec_locks: dict[KernelSpec, threading.Lock] = {}
_compiled: dict[tuple[KernelSpec, str], Any] = {}
compile_count = 0
"""Number of compilations this process ran (tests check concurrent first calls compile once)."""


def device_arch() -> str:
    """``sm_XY`` of the current CUDA device (``TILEPLUG_CUDA_ARCH`` overrides)."""
    forced = os.environ.get("TILEPLUG_CUDA_ARCH")
    if forced:
        return forced
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def prim_func(spec: KernelSpec):
    """The TileLang ``PrimFunc`` of ``spec``."""
    from tileplug.backend_cuda.quant.grouped import build_kernel

    return build_kernel(spec)


def lower_source(spec: KernelSpec, arch: str = DEFAULT_ARCH) -> str:
    """CUDA C++ source of ``spec`` for ``arch`` (no GPU needed)."""
    import tilelang
    from tilelang import tvm
    from tvm.target import Target

    target = Target({"kind": "cuda", "arch": arch})
    with tvm.transform.PassContext(opt_level=3, config=PASS_CONFIGS), target:
        artifact = tilelang.lower(prim_func(spec), target=target)
    return artifact.kernel_source


def _compile(spec: KernelSpec, arch: str) -> Any:
    import tilelang

    return tilelang.compile(
        prim_func(spec),
        target={"kind": "cuda", "arch": arch},
        execution_backend="tvm_ffi",
        pass_configs=dict(PASS_CONFIGS),
    )


def compiled(spec: KernelSpec, arch: str | None = None) -> Any:
    """The compiled kernel of ``spec`` (compiled on first use, once per process)."""
    global compile_count
    arch = arch or device_arch()
    key = (spec, arch)
    kernel = _compiled.get(key)
    if kernel is not None:
        return kernel
    with _lock:
        spec_lock = _spec_locks.setdefault(spec, threading.Lock())
    with spec_lock:
        kernel = _compiled.get(key)
        if kernel is None:
            kernel = _compile(spec, arch)
            with _lock:
                compile_count += 1
                _compiled[key] = kernel
    return kernel


def _compile_only(spec: KernelSpec, arch: str) -> str:
    _compile(spec, arch)  # fills TileLang's disk cache
    return spec.name


def precompile(specs, arch: str | None = None, workers: int | None = None) -> None:
    """Compile many specialisations in parallel processes (spawned: no CUDA state is
    inherited), then load them into this process from TileLang's disk cache.

    TileLang spends most of a compile in single-threaded Python and nvcc, so a process pool
    scales with the host's cores where threads would not.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

    arch = arch or device_arch()
    todo = [spec for spec in dict.fromkeys(specs) if (spec, arch) not in _compiled]
    if not todo:
        return
    workers = max(1, min(len(todo), workers or os.cpu_count() or 1))
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_compile_only, todo, [arch] * len(todo)))
    with ThreadPoolExecutor(min(8, workers)) as pool:
        list(pool.map(lambda spec: compiled(spec, arch), todo))
