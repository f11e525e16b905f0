"""The compile / lowering cache seed (tests/grid_cache.py) and the two keys of the Ascend
lowering cache (backend_ascend/lowering.py)."""

from __future__ import annotations

import json
import os

import pytest

import grid_cache


@pytest.fixture
def seed_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(grid_cache, "SEED_DIR", tmp_path / "seed")
    for name, (variable, _) in grid_cache.CACHES.items():
        monkeypatch.setenv(variable, str(tmp_path / name))
    monkeypatch.delenv(grid_cache.SEED_VARIABLE, raising=False)
    return tmp_path


def _entry(path, content: dict, mtime: float | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content))
    if mtime is not None:
        os.utime(path, (mtime, mtime))


def test_pack_keeps_what_a_run_read_and_the_tir_entries_it_names(seed_dir) -> None:
    cache = seed_dir / "run"
    _entry(cache / "spec-a.json", {"tir_file": "tir-a.json", "v": 1}, mtime=2_000)
    _entry(cache / "tir-a.json", {"v": 1}, mtime=5)  # not read this run, named by spec-a
    _entry(cache / "stale.json", {"v": 2}, mtime=5)  # neither read nor named: dropped
    _entry(cache / "tir-b.json", {"v": 3}, mtime=3_000)
    assert grid_cache.pack("ascend-lower", cache, since=1_000) == 3
    assert sorted(grid_cache.read_seed("ascend-lower")) == ["spec-a.json", "tir-a.json", "tir-b.json"]


def test_seeds_fill_only_missing_entries_with_time_zero(seed_dir, monkeypatch) -> None:
    source = seed_dir / "source"
    _entry(source / "one.json", {"v": "seed"}, mtime=2_000)
    _entry(source / "two.json", {"v": "seed"}, mtime=2_000)
    grid_cache.pack("cuda-compile", source, since=1_000)
    target = grid_cache.cache_directory("cuda-compile")
    _entry(target / "one.json", {"v": "local"})
    assert grid_cache.write_seeds()["cuda-compile"] == 1
    assert json.loads((target / "one.json").read_text()) == {"v": "local"}  # never overwritten
    assert json.loads((target / "two.json").read_text()) == {"v": "seed"}
    assert (target / "two.json").stat().st_mtime == 0  # not counted as read by a refresh run
    (target / "two.json").unlink()
    monkeypatch.setenv(grid_cache.SEED_VARIABLE, "off")
    assert grid_cache.write_seeds() == {} and not (target / "two.json").exists()


def test_an_unreadable_seed_is_empty(seed_dir) -> None:
    (seed_dir / "seed").mkdir()
    (seed_dir / "seed" / "ascend-lower.json.xz").write_bytes(b"not xz")
    assert grid_cache.read_seed("ascend-lower") == {}


def test_committed_seeds_are_readable_entries() -> None:
    for name in grid_cache.CACHES:
        entries = grid_cache.read_seed(name)
        assert entries, f"tests/fixtures/grid-cache/{name}.json.xz is missing or empty (hatch run grid-cache)"
        for text in list(entries.values())[:20]:
            assert isinstance(json.loads(text), dict)


class _Traced:
    def __init__(self, text: str) -> None:
        self.text = text

    def script(self) -> str:
        return self.text


def test_ascend_lowering_cache_hits_by_spec_then_by_tir(tmp_path, monkeypatch) -> None:
    """A spec-key hit traces nothing; after a source edit (new spec key) an unchanged TIR is
    traced but not lowered; a changed TIR is lowered."""
    pytest.importorskip("tilelang")
    from tileplug.backend_ascend import lowering

    monkeypatch.setenv(lowering.CACHE_ENV, str(tmp_path))
    lowered_texts, traces = [], []

    def lower(prim_func):
        lowered_texts.append(prim_func.script())
        return lowering.Lowered(f"source of {prim_func.script()}", 1, 2)

    def trace(text):
        def run():
            traces.append(text)
            return _Traced(text)

        return run

    monkeypatch.setattr(lowering, "lower_uncached", lower)
    first = lowering.lower_cached("spec-1", trace("tir-1"))
    assert first == lowering.lower_cached("spec-1", trace("tir-1"))
    assert traces == ["tir-1"] and lowered_texts == ["tir-1"]
    fingerprint = dict(lowering._inputs_fingerprint())
    monkeypatch.setattr(lowering, "_inputs_fingerprint", lambda: {**fingerprint, "sources": "edited"})
    assert lowering.lower_cached("spec-1", trace("tir-1")) == first
    assert traces == ["tir-1", "tir-1"] and lowered_texts == ["tir-1"]
    assert lowering.lower_cached("spec-1b", trace("tir-2")).source == "source of tir-2"
    assert lowered_texts == ["tir-1", "tir-2"]
    spec_entry = json.loads(lowering._cache_file(lowering.cache_key("spec-1b")).read_text())
    assert spec_entry["tir_file"] == lowering._cache_file(lowering.tir_key(_Traced("tir-2"))).name


def test_both_backends_key_their_caches_on_the_core_constants_kernels_read(monkeypatch, tmp_path) -> None:
    """The CUDA kernel index / compile grid and the Ascend lowering cache key on their own sources and on the
    core modules their kernels are traced with, taken from one list
    (``tileplug.core.backend.kernel_constant_sources``): an edited copy of one of them (the cast contract with
    another random field width, the stochastic tiles' ``w``) changes both keys, so those kernels are compiled /
    lowered again rather than loaded from a cache."""
    from pathlib import Path

    from tileplug.backend_ascend import lowering
    from tileplug.backend_cuda import jit
    from tileplug.core import backend
    from tileplug.core.contracts import cast

    listed = backend.kernel_constant_sources()
    contract = Path(cast.__file__)
    assert contract in listed and len(set(listed)) == len(listed) >= 4
    assert all(path.is_file() for path in listed)
    cuda_files = jit.kernel_source_files()
    assert Path(jit.__file__) in cuda_files and cuda_files[-len(listed):] == listed
    text = contract.read_text()
    width = f"QUANT_RANDOM_FIELD_BITS = {cast.QUANT_RANDOM_FIELD_BITS}\n"
    assert text.count(width) == 1
    edited = tmp_path / contract.name
    edited.write_text(text.replace(width, f"QUANT_RANDOM_FIELD_BITS = {2 * cast.QUANT_RANDOM_FIELD_BITS}\n"))

    lowering._inputs_fingerprint.cache_clear()
    monkeypatch.setattr(jit, "_fingerprint", [])
    ascend_before, cuda_before = lowering._inputs_fingerprint()["sources"], jit._source_fingerprint()
    monkeypatch.setattr(backend, "kernel_constant_sources",
                        lambda: [edited if path == contract else path for path in listed])
    lowering._inputs_fingerprint.cache_clear()
    monkeypatch.setattr(jit, "_fingerprint", [])
    try:
        assert lowering._inputs_fingerprint()["sources"] != ascend_before
        assert jit._source_fingerprint() != cuda_before
    finally:
        lowering._inputs_fingerprint.cache_clear()
