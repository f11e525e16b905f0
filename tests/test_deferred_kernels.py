"""Kernel tables whose family modules are imported at first use (``core.DeferredKernel``).

Discovering the installed backends imports none of their kernel modules: a CUDA host never
imports the Ascend backend's TileLang dialect, and a first call imports only its family.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types

import pytest

from tileplug import core
from tileplug.core import backend as backend_module


def test_discovery_imports_no_kernel_module_and_no_tilelang() -> None:
    child = textwrap.dedent(
        """
        import json, sys
        import torch
        from tileplug.core import registry
        registry.load()
        names = [b.name for b in registry.backends]
        families = sorted(m for m in sys.modules if m.count(".") == 2 and m.startswith(("tileplug.backend_cuda.",
                          "tileplug.backend_ascend.")) and not m.endswith((".plugin", ".devices")))
        from tileplug.core import ops
        ops.rms_norm(torch.randn(3, 64), torch.ones(64))  # the reference serves the CPU call
        print(json.dumps({"backends": names, "tilelang": "tilelang" in sys.modules, "families": families}))
        """
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"cuda", "ascend", "reference"} <= set(report["backends"])
    assert report == {"backends": report["backends"], "tilelang": False, "families": []}


@pytest.fixture
def family(monkeypatch):
    """A fake family module ``fake_family`` with one kernel (prepare-less) and a counter of builds."""
    module = types.ModuleType("fake_family")
    built = []

    class Plain:
        flavour = "plain"

        def supports(self, call):
            return None if call == "ok" else f"declines {call}"

        def __call__(self, call, inputs, outputs):
            outputs.append((call, inputs))

    def make_kernels():
        built.append(1)
        return {"per_token_cast": Plain()}

    module.make_kernels = make_kernels
    monkeypatch.setitem(sys.modules, "fake_family", module)
    monkeypatch.setattr(backend_module, "_family_tables", {})
    return built


def test_a_deferred_kernel_builds_its_family_once_and_forwards(family) -> None:
    first = core.DeferredKernel("fake_family", "per_token_cast")
    second = core.DeferredKernel("fake_family", "per_token_cast")
    assert family == []  # nothing imported or built yet
    assert first.supports("ok") is None and first.supports("bad") == "declines bad"
    assert second.flavour == "plain" and second.kernel() is first.kernel()
    assert family == [1]
    outputs: list = []
    first.prepare("ok")("in", outputs)  # no prepare of its own: __call__ bound to the call
    first("ok", "again", outputs)
    assert outputs == [("ok", "in"), ("ok", "again")]
    assert isinstance(first, core.Kernel)


def test_a_missing_or_broken_family_declines_with_its_reason(family, monkeypatch) -> None:
    missing = core.DeferredKernel("fake_family", "cast_back")
    assert missing.supports("ok") == "fake_family has no kernel for cast_back"
    with pytest.raises(ImportError, match="no kernel for cast_back"):
        missing.prepare("ok")
    broken = core.DeferredKernel("tileplug_no_such_family_module", "per_token_cast")
    assert broken.supports("ok").startswith("tileplug_no_such_family_module failed to import: ModuleNotFoundError")
    with pytest.raises(AttributeError):
        core.DeferredKernel("fake_family", "per_token_cast").__wrapped__


def test_deferred_tables_hold_the_ops_of_the_families_a_package_has(monkeypatch) -> None:
    table = core.deferred_kernel_table("tileplug.backend_ascend")
    assert set(table) == core.opdefs.kernel_names()  # the Ascend backend has a module for every family
    assert table["rms_norm"].module == "tileplug.backend_ascend.norm"
    quant_only = core.deferred_kernel_table("tileplug.backend_cuda", families=("quant",))
    assert set(quant_only) == {opdef.kernel for opdef in core.opdefs.all_ops() if opdef.family == "quant"}
    assert {"per_token_cast", "per_block_cast", "per_channel_cast", "cast_back"} <= set(quant_only)
    # a family without a module in the package: no entries at all (tileplug info shows '-'), nothing imported
    monkeypatch.setitem(sys.modules, "fake_backend_package", types.ModuleType("fake_backend_package"))
    sys.modules["fake_backend_package"].__path__ = []
    assert core.deferred_kernel_table("fake_backend_package") == {}
