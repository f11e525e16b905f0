"""Compiling, caching and lowering kernel specialisations, each at most once per process.

Shared by every kernel family of the backend. A *spec* is a frozen, hashable dataclass of
a kernel's compile-time constants with a ``name`` (identifier-safe, unique per
specialisation: the device symbol and the index file name) and ``build()`` (its TileLang
``PrimFunc``); e.g. ``quant.spec.KernelSpec``.

``entry(spec)`` returns the callable entry point of a spec's compiled module
(what a launcher calls). It comes from the *kernel index* when the index holds the spec —
a directory of compiled modules next to TileLang's own cache, keyed by the spec, the
architecture, the TileLang version and a hash of the kernel sources, loaded with
``tvm_ffi.load_module`` without importing TileLang or re-tracing the kernel (a warm first
call costs milliseconds, not the seconds of TileLang's import, trace and cache lookup).
On a miss, ``compiled(spec)`` compiles it with TileLang (whose disk cache may still hit)
and the module is published to the index by an atomic rename, so concurrent processes
never read a torn file. Concurrent first calls in one process wait for one load (a lock
per spec); different specs load in parallel. Across processes sharing the index (eight
ranks of one host starting at once), a miss takes an exclusive ``flock`` on the spec's
``.lock`` file beside its index entry and looks again once it holds it: one process
compiles a specialisation, the others wait for it and load what it published
(``index_waits`` counts those). The lock is the kernel's, so a process that dies while
compiling releases it.

``lower_source(spec, arch)`` returns the generated CUDA source without needing a GPU.

Index location: ``TILEPLUG_CUDA_KERNEL_INDEX`` if set (``off`` disables the index), else
``$TILELANG_CACHE_DIR/tileplug-index`` (TileLang's default ``~/.tilelang/cache``), so an
empty ``TILELANG_CACHE_DIR`` is a cold start for both.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from typing import Protocol

try:
    import fcntl
except ImportError:  # not POSIX: processes may compile a spec twice (each publish is still atomic)
    fcntl = None


class KernelSpec(Protocol):
    """What this module needs of a spec (see the module docstring)."""

    @property
    def name(self) -> str: ...

    def build(self) -> Any: ...


PASS_CONFIGS: dict[str, Any] = {
    # Every store is bounds-checked by the kernel itself; TileLang's extra guards would only
    # add predicates to the sf stores.
    "tl.disable_safe_memory_legalize": True,
    # IEEE semantics are part of the contract (denormals kept, exact division).
    "tl.enable_fast_math": False,
}
DEFAULT_ARCH = "sm_90"

INDEX_VARIABLE = "TILEPLUG_CUDA_KERNEL_INDEX"
"""The index key hashes every Python source of this package (all kernel families) and the
quant formats of core: editing any of them makes every indexed module stale."""

_lock = threading.Lock()
_spec_locks: dict[tuple[KernelSpec, str], threading.RLock] = {}
_compiled: dict[tuple[KernelSpec, str], Any] = {}
_entries: dict[tuple[KernelSpec, str], Callable[..., Any]] = {}
compile_count = 0
"""Number of TileLang compilations (``compiled``) this process ran."""
load_count = 0
"""Number of specialisations this process made ready (from the index or compiled): tests
check that concurrent first calls load once."""
index_hits = 0
"""How many of those came from the kernel index."""
index_waits = 0
"""How many of those hits found the index filled by another process while this one waited
for the spec's compile lock."""


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
    return spec.build()


def lower_source(spec: KernelSpec, arch: str = DEFAULT_ARCH) -> str:
    """CUDA C++ source of ``spec`` for ``arch`` (no GPU needed)."""
    return lower_traced(prim_func(spec), arch)


def lower_traced(func: Any, arch: str = DEFAULT_ARCH) -> str:
    """CUDA C++ source of an already traced ``PrimFunc`` for ``arch`` (no GPU needed)."""
    import tilelang
    from tilelang import tvm
    from tvm.target import Target

    target = Target({"kind": "cuda", "arch": arch})
    with tvm.transform.PassContext(opt_level=3, config=PASS_CONFIGS), target:
        artifact = tilelang.lower(func, target=target)
    return artifact.kernel_source


def _compile(spec: KernelSpec, arch: str) -> Any:
    import tilelang

    return tilelang.compile(
        prim_func(spec),
        target={"kind": "cuda", "arch": arch},
        execution_backend="tvm_ffi",
        pass_configs=dict(PASS_CONFIGS),
    )


def _once(cache: dict, spec: KernelSpec, arch: str | None, make: Callable[[KernelSpec, str], Any]) -> Any:
    """``cache[(spec, arch)]``, made by ``make(spec, arch)`` the first time: one maker per key
    at a time (concurrent first calls wait for it; different keys proceed in parallel)."""
    key = (spec, arch or device_arch())
    value = cache.get(key)
    if value is not None:
        return value
    with _lock:
        spec_lock = _spec_locks.setdefault(key, threading.RLock())
    with spec_lock:
        value = cache.get(key)
        if value is None:
            value = make(*key)
            with _lock:
                cache[key] = value
    return value


def compiled(spec: KernelSpec, arch: str | None = None) -> Any:
    """The TileLang ``JITKernel`` of ``spec`` (compiled on first use, once per process)."""
    return _once(_compiled, spec, arch, _counted_compile)


def _counted_compile(spec: KernelSpec, arch: str) -> Any:
    global compile_count
    kernel = _compile(spec, arch)
    with _lock:
        compile_count += 1
    return kernel


def entry(spec: KernelSpec, arch: str | None = None) -> Callable[..., Any]:
    """The entry point of ``spec``'s compiled module, called with the kernel's tensors: from
    the kernel index when it holds ``spec``, else compiled (and then published to the index)."""
    return _once(_entries, spec, arch, _load)


def _load(spec: KernelSpec, arch: str) -> Callable[..., Any]:
    global load_count, index_hits, index_waits
    function = _load_indexed(spec, arch)
    hit, waited = function is not None, False
    if function is None:
        with compile_lock(spec, arch):
            function = _load_indexed(spec, arch)  # another process may have published it meanwhile
            hit = waited = function is not None
            if function is None:
                kernel = compiled(spec, arch)
                _publish(spec, arch, kernel)
                function = entry_of(kernel)
    with _lock:
        load_count += 1
        index_hits += hit
        index_waits += waited
    return function


@contextlib.contextmanager
def compile_lock(spec: KernelSpec, arch: str):
    """Hold the exclusive cross-process lock of ``spec``'s index entry (a no-op with the index
    off, without ``fcntl``, or where the lock file cannot be made)."""
    path = index_path(spec, arch)
    handle = None
    if path is not None and fcntl is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            handle = None
    try:
        if handle is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        if handle is not None:
            os.close(handle)  # closing releases the flock


def entry_of(jit_kernel: Any) -> Callable[..., Any]:
    """The compiled module's entry function of a TileLang ``JITKernel``, called with the
    tensors directly.

    ``JITKernel.__call__`` goes through a Python wrapper that sorts inputs from outputs and
    allocates outputs (we pass every buffer, so it has nothing to do) before calling this
    same executable; skipping it saves microseconds per call. The executable keeps every
    argument check of the generated host code (dtypes, shapes, strides, devices, the
    ``T.assume`` conditions). Falls back to the wrapper if the adapter has no executable.
    """
    adapter = getattr(jit_kernel, "adapter", None)
    for name in ("get_exportable_executable", "_get_executable"):
        getter = getattr(adapter, name, None)
        if getter is not None and not getattr(adapter, "result_idx", None):
            try:
                return _main_of(getter())
            except Exception:  # noqa: BLE001 - keep the wrapper path
                break
    return jit_kernel


def _main_of(module: Any) -> Callable[..., Any]:
    """``module.main`` (the entry ``Module.__call__`` forwards to, without its Python frame)."""
    try:
        return module.main
    except AttributeError:
        return module


# ---------------------------------------------------------------------- the kernel index


def index_dir() -> Path | None:
    """Directory of the kernel index (None: disabled by ``TILEPLUG_CUDA_KERNEL_INDEX=off``)."""
    forced = os.environ.get(INDEX_VARIABLE)
    if forced:
        return None if forced.strip().lower() in ("off", "0", "false", "none") else Path(forced)
    tilelang_cache = os.environ.get("TILELANG_CACHE_DIR") or os.path.expanduser("~/.tilelang/cache")
    return Path(tilelang_cache) / "tileplug-index"


_fingerprint: list[str] = []


def kernel_source_files() -> list[Path]:
    """The files the generated code of a CUDA kernel follows from: every module of this backend, and
    the core modules whose numbers its kernels are traced with
    (:func:`tileplug.core.backend.kernel_constant_sources`). The kernel index and the compile grid's
    cache key on them, so that an edit of any of them misses the cache."""
    from tileplug.core.backend import kernel_constant_sources

    return sorted(Path(__file__).parent.rglob("*.py")) + kernel_constant_sources()


def _source_fingerprint() -> str:
    """TileLang's version and a hash of the kernel-defining sources (computed once)."""
    if not _fingerprint:
        from importlib import metadata

        digest = hashlib.sha256()
        try:
            digest.update(metadata.version("tilelang").encode())
        except metadata.PackageNotFoundError:
            digest.update(b"tilelang-unknown")
        for path in kernel_source_files():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
        digest.update(repr(sorted(PASS_CONFIGS.items())).encode())
        _fingerprint.append(digest.hexdigest()[:16])
    return _fingerprint[0]


def index_path(spec: KernelSpec, arch: str) -> Path | None:
    """Where the index keeps ``spec``'s module for ``arch`` (None: index disabled)."""
    root = index_dir()
    if root is None:
        return None
    digest = hashlib.sha256(f"{spec!r}|{arch}".encode()).hexdigest()[:16]
    return root / _source_fingerprint() / f"{spec.name[:120]}-{arch}-{digest}.so"


_runtime: list[Any] = []


def _load_runtime() -> None:
    """Load TileLang's TVM runtime library (it registers the CUDA module loader a compiled
    module needs) without importing TileLang's Python package."""
    if _runtime:
        return
    found = importlib.util.find_spec("tilelang")
    if found is None or not found.submodule_search_locations:
        raise ImportError("tilelang is not installed")
    library = Path(list(found.submodule_search_locations)[0]) / "lib" / "libtvm_runtime.so"
    _runtime.append(ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL))


def _load_indexed(spec: KernelSpec, arch: str) -> Callable[..., Any] | None:
    """The indexed module's entry, or None (not indexed, index disabled, or unloadable: an
    unloadable file is removed and the spec recompiled)."""
    if not _indexed(spec, arch):
        return None
    path = index_path(spec, arch)
    try:
        _load_runtime()
        import tvm_ffi

        return _main_of(tvm_ffi.load_module(str(path)))
    except Exception:  # noqa: BLE001 - a bad entry is a miss, never an error
        try:
            path.unlink()
        except OSError:
            pass
        return None


def _publish(spec: KernelSpec, arch: str, kernel: Any) -> None:
    """Put ``kernel``'s module into the index: written beside its final name, then renamed
    over it (atomic: readers see the whole file or none). Failures only cost the next
    process a TileLang cache lookup."""
    path = index_path(spec, arch)
    if path is None or path.is_file():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(prefix=".staging-", suffix=".so", dir=path.parent)
        os.close(handle)
        try:
            cached = None
            cache_dir = getattr(kernel, "_tilelang_cache_path", None)
            for name in ("executable.so", "kernel_lib.so"):
                if cache_dir and os.path.isfile(os.path.join(cache_dir, name)):
                    cached = os.path.join(cache_dir, name)
                    break
            if cached is not None:
                shutil.copyfile(cached, staging)
            else:
                kernel.export_library(staging)
            os.replace(staging, path)
        finally:
            if os.path.exists(staging):
                os.unlink(staging)
    except Exception:  # noqa: BLE001 - the index is an optimisation
        pass


def _indexed(spec: KernelSpec, arch: str) -> bool:
    """Whether the kernel index holds ``spec`` for ``arch`` (False when the index is off)."""
    path = index_path(spec, arch)
    return path is not None and path.is_file()


def _compile_only(spec: KernelSpec, arch: str) -> str:
    if not _indexed(spec, arch):
        with compile_lock(spec, arch):
            if not _indexed(spec, arch):
                _publish(spec, arch, _compile(spec, arch))  # fills TileLang's disk cache and the index
    return spec.name


def precompile(specs, arch: str | None = None, workers: int | None = None, load: bool = True) -> int:
    """Compile the specialisations the kernel index lacks in parallel processes (spawned: no
    CUDA state is inherited), publishing each to the index, then (``load``) load them all
    into this process. Returns how many the index lacked (each compiled through TileLang, whose
    own disk cache may still hit; with the index off, every one).

    TileLang spends most of a compile in single-threaded Python and nvcc, so a process pool
    scales with the host's cores where threads would not.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

    arch = arch or device_arch()
    todo = [spec for spec in dict.fromkeys(specs) if (spec, arch) not in _entries]
    missing = [spec for spec in todo if not _indexed(spec, arch)]
    workers = max(1, min(len(missing), workers or os.cpu_count() or 1))
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_compile_only, missing, [arch] * len(missing)))
    elif not load:  # one worker: compile here (with ``load`` the entries below compile)
        for spec in missing:
            _compile_only(spec, arch)
    if load:
        with ThreadPoolExecutor(min(8, max(1, len(todo)))) as pool:
            list(pool.map(lambda spec: entry(spec, arch), todo))
    return len(missing)
