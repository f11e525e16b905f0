"""Discovery and selection through real installed metadata.

A module-scoped fixture builds wheels of ``examples/backend-template`` and
``tests/fixtures/broken-backend``, pip-installs them into the running environment, and
re-discovers backends; teardown uninstalls both and re-discovers again. Nothing here
patches entry points: every plugin is found the way a user's would be.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from install_helpers import build_wheels, pip
import torch

from tileplug import core
from tileplug.core.registry import PluginRecord
from tileplug.core.testing import activation, assert_bytes_equal, assert_sf_equal

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE_DIR = ROOT / "examples" / "backend-template"
BROKEN_DIR = ROOT / "tests" / "fixtures" / "broken-backend"
WORKSPACE_PACKAGES = ("core", "reference", "backend-cuda", "backend-ascend")
FIXTURE_DISTRIBUTIONS = ("tileplug-backend-template", "tileplug-test-broken-backend")
CONTROL_VARIABLES = ("TILEPLUG_BACKEND", "TILEPLUG_TEMPLATE_DISABLE")
E2M1_REASON = "fmt 'e2m1' is not implemented by the template backend (it declines, the next backend runs it)"
DISABLED_REASON = "TILEPLUG_TEMPLATE_DISABLE=1 is set"


def run_python(code: str, **variables: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this environment, with ``variables`` set."""
    env = {k: v for k, v in os.environ.items() if k not in CONTROL_VARIABLES}
    env.update(variables)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The template and the broken fixture, installed for real; yields their wheels."""
    saved = {name: os.environ.pop(name) for name in CONTROL_VARIABLES if name in os.environ}
    wheels = build_wheels(tmp_path_factory.mktemp("fixture-wheels"), TEMPLATE_DIR, BROKEN_DIR)
    assert [w.name.split("-")[0] for w in wheels] == ["tileplug_backend_template", "tileplug_test_broken_backend"]
    try:
        pip("install", "--no-deps", "--force-reinstall", *map(str, wheels))
        core.registry.reload()
        yield wheels
    finally:
        pip("uninstall", "--yes", *FIXTURE_DISTRIBUTIONS)
        os.environ.update(saved)
        core.registry.reload()


@pytest.fixture
def cpu_call(installed):
    x = activation(5, 576)
    call, _ = core.describe_call(core.ops.per_token_cast, x)
    return x, call


def record(name: str) -> PluginRecord:
    found = [r for r in core.registry.records if r.name == name]
    assert len(found) == 1, f"entry point {name!r}: {core.registry.records}"
    return found[0]


# ---------------------------------------------------------------------- discovery


def test_template_is_discovered_with_distribution_and_version(installed):
    entry = record("template")
    assert entry.error is None
    assert entry.value == "tileplug.backend_template.plugin"
    assert entry.distribution == "tileplug-backend-template"
    assert entry.version == "0.1.0" == importlib.metadata.version("tileplug-backend-template")
    backend = core.registry.get("template")
    assert entry.backends == [backend]
    assert (backend.distribution, backend.version) == ("tileplug-backend-template", "0.1.0")
    assert backend.device_types == ("cpu",) and backend.priority == 10
    assert backend.traits == core.CUDA_LAYOUT
    assert set(backend.kernels) == core.opdefs.kernel_names()
    assert all(type(k).__name__ == "DelegatingToReferenceKernel" for k in backend.kernels.values())
    assert all(isinstance(k, core.Kernel) for k in backend.kernels.values())
    assert backend.unavailable_reason() is None


def test_fixture_wheels_have_no_namespace_init(installed):
    for wheel in installed:
        names = zipfile.ZipFile(wheel).namelist()
        assert "tileplug/__init__.py" not in names, wheel.name
    assert "tileplug/backend_template/plugin.py" in zipfile.ZipFile(installed[0]).namelist()


def test_broken_plugins_are_recorded_and_harm_no_other(installed, cpu_call):
    broken = record("broken")
    assert broken.distribution == "tileplug-test-broken-backend" and broken.version == "0.0.1"
    assert broken.backends == []
    assert broken.error.startswith("RuntimeError: broken on purpose")
    assert broken.load_error == broken.error and broken.refused == []
    assert "broken.py" in broken.error  # where it failed
    wrong_type = record("not_a_backend")
    assert wrong_type.backends == [] and wrong_type.load_error is None
    assert wrong_type.refused == [
        "refused: tileplug_backends() returned LooksLikeABackend, not a tileplug.core.Backend"]
    assert wrong_type.error == wrong_type.refused[0]
    bare = record("bare_backend")  # returned one Backend instead of an iterable of them
    assert bare.backends == [] and bare.refused == []
    assert bare.load_error == (
        "TypeError: tileplug_test_broken_backend.bare_backend: tileplug_backends() must return an iterable of "
        "tileplug.core.Backend, not Backend")
    names = {b.name for b in core.registry.backends}
    assert {"template", "reference"} <= names
    assert not names & {"not-a-backend", "bare"}
    ours = {"broken", "not_a_backend", "bare_backend"}
    assert all(r.error is None for r in core.registry.records if r.name not in ours)
    x, call = cpu_call
    q, sf = core.ops.per_token_cast(x)
    with core.use_backend("reference"):
        q_ref, sf_ref = core.ops.per_token_cast(x)
    assert_bytes_equal(q, q_ref, "q")
    assert_sf_equal(sf, sf_ref, (1, 128), *x.shape)


# ---------------------------------------------------------------------- selection


def test_template_wins_over_reference_on_cpu(cpu_call):
    _, call = cpu_call
    backend, kernel = core.registry.select("per_token_cast", call)
    assert backend.name == "template"
    assert kernel is backend.kernels["per_token_cast"]
    order = [b.name for b in core.registry.candidates("cpu")]
    assert order.index("template") < order.index("reference")
    assert core.registry.explain("per_token_cast", call)["template"] is None


def test_e2m1_falls_through_to_reference(installed):
    x = activation(3, 256)
    for op, kwargs in (
        (core.ops.per_token_cast, {"fmt": "e2m1", "num_per_channels": 32}),
        (core.ops.per_block_cast, {"fmt": "e2m1", "block_size": (32, 32)}),
        (core.ops.per_channel_cast, {"fmt": "e2m1", "num_per_tokens": 32}),
    ):
        call, _ = core.describe_call(op, x, **kwargs)
        reasons = core.registry.explain(call.op, call)
        assert reasons["template"] == E2M1_REASON
        assert reasons["reference"] is None
        assert core.registry.select(call.op, call)[0].name == "reference"
    q, sf = core.ops.per_token_cast(x, fmt="e2m1", num_per_channels=32)
    call, _ = core.describe_call(core.ops.cast_back, (q, sf), x_block_size=(1, 32))
    assert core.registry.explain("cast_back", call)["template"] == E2M1_REASON
    assert core.registry.select("cast_back", call)[0].name == "reference"
    e4m3, _ = core.describe_call(core.ops.per_token_cast, x, num_per_channels=32)
    assert core.registry.select("per_token_cast", e4m3)[0].name == "template"


def test_use_backend_changes_selection_for_the_block_only(cpu_call):
    x, call = cpu_call
    assert core.registry.select("per_token_cast", call)[0].name == "template"
    with core.use_backend("reference"):
        assert core.registry.forced() == ("reference",)
        assert core.registry.select("per_token_cast", call)[0].name == "reference"
        assert core.registry.explain("per_token_cast", call)["template"].startswith("not tried: only reference")
        core.ops.per_token_cast(x)
    assert core.registry.forced() is None
    assert core.registry.select("per_token_cast", call)[0].name == "template"


def test_use_backend_nonexistent_names_it_and_lists_the_others(cpu_call):
    x, _ = cpu_call
    with core.use_backend("nonexistent"), pytest.raises(core.NoBackendError) as caught:
        core.ops.per_token_cast(x)
    error = caught.value
    message = str(error)
    assert "nonexistent: is not installed" in message
    assert error.op == "per_token_cast" and error.device_type == "cpu"
    for name in ("template", "reference"):
        assert error.reasons[name].startswith("not tried: only nonexistent allowed")
        assert f"{name}: not tried: only nonexistent allowed" in message
    assert "broken on purpose" in message  # plugins that failed to load are listed too
    assert core.registry.select("per_token_cast", core.describe_call(core.ops.per_token_cast, x)[0])[0].name == "template"


def test_no_allowed_backend_serves_the_device_type_lists_every_reason(installed):
    call, _ = core.describe_call(core.ops.per_token_cast, torch.empty(4, 256, device="meta"))
    with core.use_backend("template"), pytest.raises(core.NoBackendError) as caught:
        core.registry.select("per_token_cast", call)
    message = str(caught.value)
    assert message.startswith("no backend can run per_token_cast on device 'meta': ")
    assert "template: does not serve device type 'meta'" in message
    assert "reference: not tried: only template allowed" in message
    assert "plugin 'broken' (tileplug-test-broken-backend): failed to load: RuntimeError: broken on purpose" in message
    assert "returned LooksLikeABackend" in message


def test_unserved_device_type_lists_every_installed_backend(installed):
    """Regression (fixed in 9c67a8c): installed backends that do not serve the device type
    used to be left out, and the message then claimed that no backend was installed."""
    call, _ = core.describe_call(core.ops.per_token_cast, torch.empty(4, 256, device="meta"))
    core.registry.unregister("reference")  # the reference serves every device type
    try:
        with pytest.raises(core.NoBackendError) as caught:
            core.registry.select("per_token_cast", call)
        message = str(caught.value)
        assert "pip install tileplug-reference" not in message  # i.e. not "no backend installed"
        for backend in core.registry.backends:
            assert f"{backend.name}: does not serve device type 'meta'" in message
    finally:
        core.registry.reload()
    assert core.registry.get("reference") is not None


def test_template_writes_the_reference_bytes(installed):
    x = activation(7, 576)
    cases = [
        (core.ops.per_token_cast, {}, (1, 128)),
        (core.ops.per_token_cast, dict(num_per_channels=64, round_sf=True, use_packed_ue8m0=True,
                                       use_tma_aligned_col_major_sf=True), (1, 64)),
        (core.ops.per_block_cast, dict(block_size=(32, 128), round_sf=True, use_packed_ue8m0=True), (32, 128)),
        (core.ops.per_channel_cast, dict(num_per_tokens=32), (32, 1)),
    ]
    for op, kwargs, block in cases:
        call, _ = core.describe_call(op, x, **kwargs)
        assert core.registry.select(call.op, call)[0].name == "template"
        q, sf = op(x, **kwargs)
        with core.use_backend("reference"):
            q_ref, sf_ref = op(x, **kwargs)
        assert_bytes_equal(q, q_ref, f"{call.op} q")
        assert_sf_equal(sf, sf_ref, block, *x.shape, what=f"{call.op} sf")
        back = core.ops.cast_back((q, sf), x_block_size=block)
        with core.use_backend("reference"):
            back_ref = core.ops.cast_back((q, sf), x_block_size=block)
        assert_bytes_equal(back, back_ref, "cast_back")
    q, sf = core.ops.per_token_cast(x[:0])  # zero tokens: no kernel runs, empty outputs
    assert q.shape == (0, 576) and sf.shape == (0, 5)


# ---------------------------------------------------------------------- environment variables


SELECT_SCRIPT = """
    import json, torch
    from tileplug import core
    from tileplug.backend_template.kernels import DelegatingToReferenceKernel

    def refuse(self, call, inputs, outputs):
        raise AssertionError("the template kernel ran")

    DelegatingToReferenceKernel.__call__ = refuse  # proves which backend really runs
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    call, _ = core.describe_call(core.ops.per_token_cast, x)
    backend, _ = core.registry.select("per_token_cast", call)
    try:
        core.ops.per_token_cast(x)
        ran = "not template"
    except core.BackendError as error:  # a kernel failing at call time names its backend
        assert isinstance(error.__cause__, AssertionError) and error.backend == "template"
        ran = "template"
    print(json.dumps({
        "forced": core.registry.forced(),
        "selected": backend.name,
        "ran": ran,
        "template_unavailable": core.registry.get("template").unavailable_reason(),
        "explain": core.registry.explain("per_token_cast", call),
    }))
"""


def test_tileplug_backend_variable_makes_the_reference_run(installed):
    result = json.loads(run_python(SELECT_SCRIPT, TILEPLUG_BACKEND="reference").stdout)
    assert result["forced"] == ["reference"]
    assert result["selected"] == "reference" and result["ran"] == "not template"
    assert result["explain"]["template"].startswith("not tried: only reference allowed (TILEPLUG_BACKEND")


def test_disable_variable_makes_template_unavailable(installed):
    result = json.loads(run_python(SELECT_SCRIPT, TILEPLUG_TEMPLATE_DISABLE="1").stdout)
    assert result["template_unavailable"] == DISABLED_REASON
    assert result["explain"]["template"] == f"unavailable: {DISABLED_REASON}"
    assert result["selected"] == "reference" and result["ran"] == "not template"
    control = json.loads(run_python(SELECT_SCRIPT).stdout)  # same script, variable unset
    assert control["selected"] == "template" and control["ran"] == "template"


# ---------------------------------------------------------------------- packaging


def test_workspace_packages_build_wheels_without_namespace_init(tmp_path):
    wheels = build_wheels(tmp_path, *(ROOT / "packages" / name for name in WORKSPACE_PACKAGES))
    built = {w.name.split("-")[0]: w for w in wheels}
    assert set(built) == {"tileplug_core", "tileplug_reference", "tileplug_backend_cuda", "tileplug_backend_ascend"}
    for name, wheel in built.items():
        files = zipfile.ZipFile(wheel).namelist()
        assert "tileplug/__init__.py" not in files, name
        module = name.removeprefix("tileplug_")
        assert f"tileplug/{module}/__init__.py" in files, name
    assert "tileplug/core/registry.py" in zipfile.ZipFile(built["tileplug_core"]).namelist()
