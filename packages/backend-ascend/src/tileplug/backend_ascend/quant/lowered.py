"""Lowering a :class:`TileSpec` through TileLang's Ascend pipeline, memoised on disk.

:func:`lower_spec` returns a :class:`Lowered`: the Ascend C and the two UB byte counts the UB
check compares with the plan (the compiler's merged UB size and the traced prim_func's
``alloc_shared`` buffers x versions). Tracing and lowering one specialisation takes about a
second on one core and the CI lowering grid has ~90 of them, so each result is stored as JSON
under ``$TILEPLUG_ASCEND_LOWER_CACHE`` (default ``~/.cache/tileplug/ascend-lower``), keyed by
the TileSpec's repr, the TileLang and TVM versions, and a hash of every source file the kernel
is built from (all of ``tileplug.backend_ascend`` and the core modules it takes numbers from).
A hit skips tracing and lowering; every check still runs on the stored text and byte counts.
A cache file that cannot be read is ignored, one that cannot be written is skipped.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from tileplug.backend_ascend.quant.spec import TileSpec, Tiling

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


def lower_prim_func(prim_func):
    """TileLang's Ascend lowering of ``prim_func``, inside the Ascend target context (SIMT
    regions need it): the lowered artifact (``.kernel_source``, ``.device_mod``). Not cached."""
    import tilelang
    from tilelang.backend.target import determine_target

    target = determine_target("ascend", return_object=True)
    with target:
        return tilelang.lower(prim_func, target=target)


def lower_uncached(spec: TileSpec, tiling: Tiling) -> Lowered:
    """Trace ``spec`` tiled by ``tiling`` (UB budget checked) and lower it."""
    from tileplug.backend_ascend.lowering_checks import compiler_ub_bytes, primfunc_ub_bytes
    from tileplug.backend_ascend.quant.tile_kernel import build

    prim_func = build(spec, tiling)
    artifact = lower_prim_func(prim_func)
    return Lowered(artifact.kernel_source, compiler_ub_bytes(artifact), primfunc_ub_bytes(prim_func))


def cache_dir() -> Path:
    """Where lowered specialisations are stored (``$TILEPLUG_ASCEND_LOWER_CACHE`` if set)."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()


@functools.lru_cache(maxsize=1)
def _inputs_fingerprint() -> dict[str, str]:
    """Versions and source hash that, with the TileSpec, determine a lowering."""
    import tilelang
    import tvm

    import tileplug.backend_ascend as backend
    from tileplug.core.quant import formats, sf_math

    digest = hashlib.sha256()
    root = Path(backend.__file__).parent
    files = sorted(root.rglob("*.py")) + [Path(formats.__file__), Path(sf_math.__file__)]
    for path in files:
        digest.update(str(path.relative_to(root) if path.is_relative_to(root) else path.name).encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return {"tilelang": tilelang.__version__, "tvm": str(getattr(tvm, "__version__", "?")), "sources": digest.hexdigest()}


def cache_key(spec: TileSpec) -> dict[str, str]:
    """The disk-cache key of ``spec``: its repr, the TileLang/TVM versions, the source hash."""
    return {"spec": repr(spec), **_inputs_fingerprint()}


def _cache_file(key: dict[str, str]) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_dir() / f"{name}.json"


def _read(key: dict[str, str]) -> Lowered | None:
    try:
        stored = json.loads(_cache_file(key).read_text())
        if stored.get("key") != key:
            return None
        return Lowered(**stored["lowered"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(key: dict[str, str], lowered: Lowered) -> None:
    path = _cache_file(key)
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as handle:
            temporary = handle.name
            json.dump({"key": key, "lowered": asdict(lowered)}, handle)
        os.replace(temporary, path)  # atomic: concurrent writers of one key leave one whole file
    except OSError:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)


def lower_spec(spec: TileSpec) -> tuple[Lowered, Tiling]:
    """``spec`` lowered with the budget's tiling (from the disk cache when stored there)."""
    tiling = Tiling(spec)
    key = cache_key(spec)
    lowered = _read(key)
    if lowered is None:
        lowered = lower_uncached(spec, tiling)
        _write(key, lowered)
    return lowered, tiling
