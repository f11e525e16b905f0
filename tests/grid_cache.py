"""The committed seed of the compile and lowering caches, and how it is refreshed.

Two disk caches make the CUDA compile grid (tests/test_cuda_compile.py) and the Ascend
lowering grids (tests/test_ascend_*lowering.py, ``core.lower(..., backend="ascend")``) cheap
to run twice: ``$TILEPLUG_CUDA_COMPILE_CACHE`` (default ``~/.cache/tileplug/cuda-compile``)
and ``$TILEPLUG_ASCEND_LOWER_CACHE`` (default ``~/.cache/tileplug/ascend-lower``). Each entry
is a JSON file whose name is a digest of its key, and each specialisation is stored under two
keys (a spec key: its name and a hash of the backend's sources, whose hit skips tracing; a TIR
key: a digest of the traced kernel, whose hit skips lowering and nvcc). An entry is what the
lowering or compilation would produce again from the same key: the checks of every test still
run on the stored text.

A fresh clone (CI) starts with empty caches, so ``tests/fixtures/grid-cache/<cache>.json.xz``
holds the entries a whole test run read, compressed, and ``pytest_configure`` (tests/conftest.py)
writes those a cache lacks into it before the tests start (``TILEPLUG_GRID_SEED=off``: not). An
entry the current sources no longer produce is never read (its key is not asked for), so a stale
seed costs time, never correctness: after editing a backend, run

    hatch run grid-cache

which runs the whole test suite on empty caches seeded from the committed files and packs what
that run read (modification times: a hit refreshes them; seeded files are written with time 0),
plus the TIR-key entries those spec-key entries name.
"""

from __future__ import annotations

import json
import lzma
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEED_DIR = Path(__file__).parent / "fixtures" / "grid-cache"
CACHES = {
    "cuda-compile": ("TILEPLUG_CUDA_COMPILE_CACHE", "~/.cache/tileplug/cuda-compile"),
    "ascend-lower": ("TILEPLUG_ASCEND_LOWER_CACHE", "~/.cache/tileplug/ascend-lower"),
}
"""Seed name -> (environment variable naming the cache directory, its default)."""
SEED_VARIABLE = "TILEPLUG_GRID_SEED"


def cache_directory(name: str) -> Path:
    variable, default = CACHES[name]
    return Path(os.environ.get(variable) or default).expanduser()


def read_seed(name: str) -> dict[str, str]:
    """File name -> JSON text of seed ``name`` ({} when there is none)."""
    try:
        with lzma.open(SEED_DIR / f"{name}.json.xz", "rt") as handle:
            return json.load(handle)
    except (OSError, ValueError, lzma.LZMAError):
        return {}


def write_seeds() -> dict[str, int]:
    """Write every seed entry a cache lacks into it (atomically, modification time 0) → the
    number written per cache. Nothing when ``TILEPLUG_GRID_SEED=off``."""
    if os.environ.get(SEED_VARIABLE) == "off":
        return {}
    written = {}
    for name in CACHES:
        entries = read_seed(name)
        directory = cache_directory(name)
        count = 0
        for file_name, text in entries.items():
            path = directory / file_name
            if path.exists():
                continue
            directory.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(f"{file_name}.{os.getpid()}.seed")
            temporary.write_text(text)
            os.utime(temporary, (0, 0))
            os.replace(temporary, path)
            count += 1
        written[name] = count
    return written


def pack(name: str, directory: Path, since: float) -> int:
    """Seed ``name`` := the entries of ``directory`` read or written since ``since`` and the
    TIR-key entries they name → the number of entries packed."""
    used: dict[str, str] = {}
    for path in directory.glob("*.json"):
        if path.stat().st_mtime >= since:
            used[path.name] = path.read_text()
    for text in list(used.values()):
        tir_file = json.loads(text).get("tir_file")
        if tir_file and tir_file not in used and (directory / tir_file).exists():
            used[tir_file] = (directory / tir_file).read_text()
    SEED_DIR.mkdir(parents=True, exist_ok=True)
    with lzma.open(SEED_DIR / f"{name}.json.xz", "wt", preset=9) as handle:
        json.dump(dict(sorted(used.items())), handle, sort_keys=True)
    return len(used)


def refresh(pytest_arguments: list[str]) -> int:
    """Run the test suite on empty caches (seeded from the committed files) and pack what it read."""
    with tempfile.TemporaryDirectory() as root:
        environment = dict(os.environ)
        for name, (variable, _) in CACHES.items():
            environment[variable] = os.path.join(root, name)
        environment.pop(SEED_VARIABLE, None)
        since = time.time() - 1
        command = [sys.executable, "-m", "pytest", "tests", "-n", "2", "--dist", "loadfile", *pytest_arguments]
        status = subprocess.run(command, env=environment, cwd=Path(__file__).parent.parent).returncode
        if status not in (0, 1):  # 1: some tests failed; their entries were still read
            return status
        for name in CACHES:
            count = pack(name, Path(root) / name, since)
            print(f"grid cache seed {name}: {count} entries, {(SEED_DIR / f'{name}.json.xz').stat().st_size} bytes")
        return status


if __name__ == "__main__":
    sys.exit(refresh(sys.argv[1:]))
