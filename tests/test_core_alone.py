"""tileplug-core works with no reference installed: info, demo, bench, ledger in a venv that
holds only core and a minimal third-party backend (written and built by this test).

The venv is a plain one (no system site-packages: the workspace's editable tileplug installs
must stay out). torch and pluggy come from the test interpreter's environment through a
directory of symlinks to exactly the distributions they need (their requirement closure),
named in a ``.pth`` file; no tileplug distribution is among them, which the test checks.
Wheels are built with ``pip wheel --no-deps --no-build-isolation`` and installed with the
test interpreter's pip into the venv (``pip --python``), offline.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MINIMAL = "minimal"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("hatchling") is None or importlib.util.find_spec("packaging") is None,
    reason="building the wheels needs hatchling and packaging in the test environment",
)


PLUGIN = '''
"""A minimal tileplug backend: per_token_cast with the default flags in plain torch."""

import torch
import torch.nn.functional as F

from tileplug.core import CUDA_LAYOUT, Backend, QuantMode, hookimpl


class PerTokenCast:
    def supports(self, call):
        cast = call.cast
        if call.mode is not QuantMode.CAST or call.quantized_input is not None or cast is None:
            return "only the plain cast of a bf16/fp32 input"
        if (cast.fmt.name, cast.block) != ("e4m3", (1, 128)) or cast.round_sf or cast.use_packed_ue8m0 \\
                or cast.use_e4m3_sf or cast.col_major_sf:
            return "only the default flags (e4m3, groups of 128, fp32 row-major sf)"
        return None

    def __call__(self, call, inputs, outputs):
        x = inputs.x.float()
        tokens, hidden = x.shape
        groups = -(-hidden // 128)
        padded = F.pad(x, (0, groups * 128 - hidden)).view(tokens, groups, 128)
        sf = padded.abs().amax(dim=-1).clamp(min=call.cast.clamp_min) / 448.0
        outputs.sf.copy_(sf)
        q = (padded / sf.unsqueeze(-1)).clamp(-448.0, 448.0).view(tokens, groups * 128)[:, :hidden]
        outputs.q.copy_(q.to(torch.float8_e4m3fn))


@hookimpl
def tileplug_backends():
    return [Backend(name="minimal", device_types=("cpu",), priority=10, traits=CUDA_LAYOUT,
                    kernels={"per_token_cast": PerTokenCast()}, description="plain-torch per_token_cast")]
'''

PYPROJECT = '''
[build-system]
requires = ["hatchling>=1.21"]
build-backend = "hatchling.build"

[project]
name = "tileplug-backend-minimal"
version = "0.0.1"
requires-python = ">=3.10"
dependencies = ["tileplug-core>=0.1,<0.2"]

[project.entry-points."tileplug.backends"]
minimal = "tileplug.backend_minimal.plugin"

[tool.hatch.build.targets.wheel]
packages = ["src/tileplug"]
'''


def _closure(names: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``names`` need at run time (requirements, markers evaluated)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, importlib.metadata.Distribution] = {}
    pending = list(names)
    while pending:
        name = canonicalize_name(pending.pop())
        if name in found:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found[name] = dist
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return list(found.values())


def _link_dependencies(target: Path, names: tuple[str, ...] = ("torch", "pluggy", "numpy")) -> list[str]:
    """Symlink the top-level entries (packages, modules, dist-info) of the closure of
    ``names`` (default torch, pluggy and numpy, which torch imports when present) into
    ``target``; returns their names."""
    target.mkdir()
    linked = []
    for dist in _closure(list(names)):
        assert not dist.metadata["Name"].lower().startswith("tileplug"), dist.metadata["Name"]
        entries = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for entry in sorted(entries):
            source = Path(dist.locate_file(entry))
            if entry.endswith(".pth") or entry in ("__pycache__", "bin") or not source.exists():
                continue
            if entry.startswith("tileplug") or (target / entry).exists():
                continue
            (target / entry).symlink_to(source)
            linked.append(entry)
    return linked


def _run(command: list, env: dict, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"{result.args}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    return result


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """(env, bin directory, wheels): a venv with tileplug-core only; torch and pluggy linked in."""
    base = tmp_path_factory.mktemp("core_alone")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TILEPLUG_BACKEND", "PYTHONHOME",
                                                              "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", base / "venv"], env))
    python = base / "venv" / "bin" / "python"
    site = _ok(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env)).stdout.strip()
    linked = _link_dependencies(base / "deps")
    assert "torch" in linked and "pluggy" in linked and not any(n.startswith("tileplug") for n in linked)
    (Path(site) / "_tileplug_test_deps.pth").write_text(f"{base / 'deps'}\n")

    project = base / "minimal"
    (project / "src" / "tileplug" / "backend_minimal").mkdir(parents=True)
    (project / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (project / "src" / "tileplug" / "backend_minimal" / "__init__.py").write_text('"""Minimal backend."""\n')
    (project / "src" / "tileplug" / "backend_minimal" / "plugin.py").write_text(textwrap.dedent(PLUGIN))
    wheels = base / "wheels"
    for source in (ROOT / "packages" / "core", project):
        _ok(_run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                  "-w", wheels, source], env))
    core_wheel = next(wheels.glob("tileplug_core-*.whl"))
    _ok(_run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", core_wheel],
             env))
    return env, base / "venv" / "bin", wheels


def _install_minimal(venv) -> None:
    env, bin_dir, wheels = venv
    minimal = next(wheels.glob("tileplug_backend_minimal-*.whl"))
    _ok(_run([sys.executable, "-m", "pip", "--python", bin_dir / "python", "install", "--no-deps", "--no-index",
              minimal], env))


CHECK_ALONE = """
import importlib.metadata as m, importlib.util, sys
import tileplug.core
assert tileplug.core.__file__.startswith(sys.prefix), tileplug.core.__file__
for name in ("tileplug-reference", "tileplug-backend-cuda", "tileplug-backend-ascend"):
    try:
        m.distribution(name)
    except m.PackageNotFoundError:
        continue
    raise SystemExit(f"{name} is installed in the venv")
assert importlib.util.find_spec("tileplug.reference") is None
print("core", m.version("tileplug-core"), "torch", m.version("torch"))
"""


def test_core_alone_then_with_a_minimal_backend(venv):
    env, bin_dir, _ = venv
    tileplug = bin_dir / "tileplug"
    assert "core 0.1.0" in _ok(_run([bin_dir / "python", "-c", CHECK_ALONE], env, cwd=bin_dir)).stdout

    # core alone: no backend at all, and info says how to install one
    info = _ok(_run([tileplug, "info"], env, cwd=bin_dir)).stdout
    assert "no backend is installed: pip install ./packages/reference" in info
    assert "op x backend" in info
    assert any(line.startswith("per_token_cast ") and "bench per_token_cast" in line for line in info.splitlines())

    _install_minimal(venv)
    _ok(_run([bin_dir / "python", "-c", CHECK_ALONE], env, cwd=bin_dir))  # still no reference
    version = _ok(_run([tileplug, "--version"], env, cwd=bin_dir)).stdout
    assert "tileplug-core 0.1.0" in version and "minimal 0.0.1 (tileplug-backend-minimal)" in version

    info = _ok(_run([tileplug, "info"], env, cwd=bin_dir)).stdout
    rows = {line.split()[0]: line.split() for line in info.splitlines() if line.strip()}
    assert rows[MINIMAL][1:3] == ["tileplug-backend-minimal", "0.0.1"] and rows[MINIMAL][-1] == "available"
    assert "no backend is installed" not in info
    assert rows["per_token_cast"][1] == "yes"  # the matrix: the default-flags bench case
    assert rows["per_block_cast"][1] == "-" and rows["cast_back"][1] == "-"
    assert rows["per_token_cast_with_sf_only"][1] == "no"

    demo = _ok(_run([tileplug, "demo", "--tokens", "8", "--hidden", "256"], env, cwd=bin_dir)).stdout
    demo_rows = {line.split()[0]: line for line in demo.splitlines() if line.startswith("per_")}
    assert demo_rows["per_token_cast"].split()[1] == MINIMAL
    assert "(8, 256) float8_e4m3fn" in demo_rows["per_token_cast"] and "(8, 2) float32" in demo_rows["per_token_cast"]
    assert "n/a" in demo_rows["per_token_cast"] and "cast_back" in demo_rows["per_token_cast"]  # nobody dequantizes
    assert demo_rows["per_block_cast"].split()[1] == "none" and "no backend can run" in demo_rows["per_block_cast"]

    report_path = bin_dir.parent / "bench.json"
    bench = _ok(_run([tileplug, "bench", "--tokens", "1,4", "--hidden", "256", "--no-compile", "--json",
                      report_path], env, cwd=bin_dir)).stdout
    assert "copy ceiling" in bench
    report = json.loads(report_path.read_text())
    measured = {(r["case"], r["tokens"]): r for r in report["rows"] if r["runner"] == MINIMAL}
    assert measured[("per_token_cast", 4)]["gbps"] > 0
    assert measured[("per_token_cast", 4)]["ledger_bytes"] == 4 * 256 * 2 + 4 * 256 + 4 * 2 * 4
    assert measured[("per_block_cast", 1)]["median_us"] is None and "kernel" in measured[("per_block_cast", 1)]["note"]
    assert report["dispatch"]["per_token_cast"]["backend"] == MINIMAL
    assert "note" in report["dispatch"]["cast_back"]  # no backend runs cast_back here: said, not crashed

    ledger = json.loads(_ok(_run([tileplug, "ledger", "per_token_cast", "--tokens", "4"], env, cwd=bin_dir)).stdout)
    assert (ledger["bytes_read"], ledger["bytes_written"]) == (4 * 7168 * 2, 4 * 7168 + 4 * 56 * 4)
