"""Lowering any Ascend kernel specialisation through TileLang's Ascend pipeline, memoised on
disk, and compiling it once per specialisation (shared by every family).

* :func:`lower_prim_func` -- TileLang's Ascend lowering inside the target context (SIMT
  regions need it). Not cached.
* :func:`lower_cached` -- a specialisation's :class:`Lowered` (Ascend C and the two UB byte
  counts the UB check compares with the plan), stored as JSON under
  ``$TILEPLUG_ASCEND_LOWER_CACHE`` (default ``~/.cache/tileplug/ascend-lower``) under two keys:
  the *spec key* (the specialisation's repr, the TileLang and TVM versions and a hash of every
  source file the kernels are built from: all of ``tileplug.backend_ascend`` and the core
  modules it takes numbers from -- the formats, the scale math, the cast contract's random field
  widths, the SwiGLU sigmoid table), whose hit skips tracing and lowering; and the *TIR key* (a
  digest of the traced prim_func's TVMScript, the versions and a hash of the two modules that
  turn a prim_func into a :class:`Lowered`), whose hit skips lowering. An edit of one kernel
  family changes every spec key but only the TIR of the specialisations it really changes, so
  the others are traced again and not lowered again. Every check still runs on the stored
  text. A hit refreshes the file's modification time (what a run read can be told from what it
  did not: ``tests/grid_cache.py`` packs it). A cache file that cannot be read is ignored, one
  that cannot be written is skipped.
* :class:`CheckedLowering` -- what the lowering grid and ``core.lower`` get from a kernel:
  the lowering, the backend's own UB plan and budget, and the header comment.
* :class:`CompileCache` -- per-specialisation compiled kernels (NPU only), built once each.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Hashable

CACHE_ENV = "TILEPLUG_ASCEND_LOWER_CACHE"
DEFAULT_CACHE_DIR = Path("~/.cache/tileplug/ascend-lower")


@dataclass(frozen=True)
class Lowered:
    """What TileLang's Ascend pipeline made of one specialisation: its Ascend C (``source``),
    the compiler's merged UB bytes (``dyn_shared_memory_buf``) and the traced prim_func's UB
    bytes (``alloc_shared`` x annotated versions, each 32-byte aligned)."""

    source: str
    compiler_ub_bytes: int
    primfunc_ub_bytes: int


@dataclass(frozen=True)
class CheckedLowering:
    """A kernel specialisation lowered for the checks: ``lowered``, the backend's UB plan
    (``plan_bytes``) and ``budget`` (bytes per vector core), ``name`` (the specialisation,
    as the grid names it) and ``header`` (comment lines ``core.lower`` puts in front)."""

    name: str
    lowered: Lowered
    plan_bytes: int
    budget: int
    header: str


def lower_prim_func(prim_func):
    """TileLang's Ascend lowering of ``prim_func``, inside the Ascend target context (SIMT
    regions need it): the lowered artifact (``.kernel_source``, ``.device_mod``). Not cached."""
    import tilelang
    from tilelang.backend.target import determine_target

    target = determine_target("ascend", return_object=True)
    with target:
        return tilelang.lower(prim_func, target=target)


def lower_uncached(prim_func) -> Lowered:
    """Lower a traced ``prim_func`` and count its UB bytes both ways."""
    from tileplug.backend_ascend.lowering_checks import compiler_ub_bytes, primfunc_ub_bytes

    artifact = lower_prim_func(prim_func)
    return Lowered(artifact.kernel_source, compiler_ub_bytes(artifact), primfunc_ub_bytes(prim_func))


def cache_dir() -> Path:
    """Where lowered specialisations are stored (``$TILEPLUG_ASCEND_LOWER_CACHE`` if set)."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()


def _digest_files(paths: list[Path], root: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(str(path.relative_to(root) if path.is_relative_to(root) else path.name).encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _versions() -> dict[str, str]:
    """TileLang / TVM versions and the hash of the modules that make a :class:`Lowered` of a prim_func."""
    import tilelang
    import tvm

    from tileplug.backend_ascend import lowering_checks

    here = Path(__file__).parent
    return {"tilelang": tilelang.__version__, "tvm": str(getattr(tvm, "__version__", "?")),
            "lowering": _digest_files([Path(__file__), Path(lowering_checks.__file__)], here)}


@functools.lru_cache(maxsize=1)
def _inputs_fingerprint() -> dict[str, str]:
    """Versions and source hash that, with the specialisation, determine a lowering."""
    import tileplug.backend_ascend as backend
    from tileplug.core.backend import kernel_constant_sources

    root = Path(backend.__file__).parent
    files = sorted(root.rglob("*.py")) + kernel_constant_sources()  # with the core modules the kernels read
    return {**_versions(), "sources": _digest_files(files, root)}


def cache_key(spec: Any) -> dict[str, str]:
    """The spec key of a specialisation: its repr, the TileLang/TVM versions, the source hash."""
    return {"spec": repr(spec), **_inputs_fingerprint()}


def tir_key(prim_func: Any) -> dict[str, str]:
    """The TIR key of a traced prim_func: a digest of its TVMScript and the versions."""
    return {"tir": hashlib.sha256(prim_func.script().encode()).hexdigest(), **_versions()}


def _cache_file(key: dict[str, str]) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_dir() / f"{name}.json"


def _read(key: dict[str, str]) -> Lowered | None:
    path = _cache_file(key)
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") != key:
            return None
        lowered = Lowered(**stored["lowered"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        os.utime(path)
    except OSError:
        pass
    return lowered


def _write(key: dict[str, str], lowered: Lowered, tir_file: str | None = None) -> None:
    """Store ``lowered`` under ``key``; a spec-key entry names its TIR-key entry (``tir_file``)."""
    path = _cache_file(key)
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as handle:
            temporary = handle.name
            json.dump({"key": key, "lowered": asdict(lowered), **({"tir_file": tir_file} if tir_file else {})},
                      handle)
        os.replace(temporary, path)  # atomic: concurrent writers of one key leave one whole file
    except OSError:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)


def lower_cached(spec: Any, trace: Callable[[], Any]) -> Lowered:
    """``spec`` lowered (``trace()`` gives its prim_func), from the disk cache when stored there
    (the spec key first, then the TIR key). ``spec``'s repr must name everything the prim_func
    depends on."""
    key = cache_key(spec)
    lowered = _read(key)
    if lowered is not None:
        return lowered
    prim_func = trace()
    traced_key = tir_key(prim_func)
    lowered = _read(traced_key)
    if lowered is None:
        lowered = lower_uncached(prim_func)
        _write(traced_key, lowered)
    _write(key, lowered, _cache_file(traced_key).name)
    return lowered


class CompileCache:
    """Per-specialisation compiled kernels (``tilelang.compile(trace(spec), target="ascend")``),
    built once each, thread-safe. Used on an NPU only."""

    def __init__(self, trace: Callable[[Any], Any]) -> None:
        self._trace = trace
        self._lock = threading.Lock()
        self._kernels: dict[Hashable, Any] = {}
        self._building: dict[Hashable, threading.Lock] = {}

    def get(self, spec: Hashable):
        kernel = self._kernels.get(spec)
        if kernel is not None:
            return kernel
        with self._lock:
            lock = self._building.setdefault(spec, threading.Lock())
        with lock:
            kernel = self._kernels.get(spec)
            if kernel is None:
                import tilelang

                kernel = tilelang.compile(self._trace(spec), target="ascend")
                self._kernels[spec] = kernel
        return kernel
