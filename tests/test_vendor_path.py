"""The vendor path, as docs/writing-a-backend.md tells it: install the template, run the
documented conformance command exactly as written; copy the template, rename it with the
documented commands, install it and run the same command against the renamed backend.

Wheels are built and pip-installed into the running environment (as in
tests/test_discovery.py) and uninstalled at teardown. The runs use ``--tileplug-tokens=1,3``
(the documented option) to keep CI time down; the documented default runs 0,1,3,129.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
from install_helpers import pip

from tileplug import core
from tileplug.core import opdefs

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "writing-a-backend.md"
TEMPLATE_DIR = ROOT / "examples" / "backend-template"
TOKENS = "1,3"
CONTROL_VARIABLES = ("TILEPLUG_BACKEND", "TILEPLUG_TEMPLATE_DISABLE", "TILEPLUG_ACME_DISABLE")


def marked_block(marker: str) -> str:
    """The fenced code block that follows ``<!-- marker -->`` in the guide (indentation of a
    list item removed)."""
    text = DOC.read_text()
    found = re.search(rf"<!-- {re.escape(marker)} -->\s*\n\s*```[a-z]*\n(.*?)\n\s*```", text, re.S)
    assert found, f"docs/writing-a-backend.md has no block marked <!-- {marker} -->"
    lines = found.group(1).splitlines()
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    return "\n".join(line[indent:] for line in lines)


def conformance_command() -> list[str]:
    argv = shlex.split(marked_block("conformance-command"))
    assert argv[:3] == ["python", "-m", "pytest"], argv
    return argv


def install(project: Path, wheels: Path) -> None:
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(project))
    built = sorted(wheels.glob("*.whl"))
    assert len(built) == 1, built
    pip("install", "--no-deps", "--force-reinstall", str(built[0]))


def environment() -> dict[str, str]:
    """This interpreter's environment, its bin directory first on PATH (so ``python`` is it)."""
    env = {k: v for k, v in os.environ.items() if k not in CONTROL_VARIABLES}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run_conformance(argv: list[str], cwd: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict[str, int]]:
    """Run ``argv`` (``python`` replaced by this interpreter) with ``extra`` options; returns
    the process and the junit counts (tests, failures, errors, skipped, passed)."""
    report = cwd / "report.xml"
    command = [sys.executable, *argv[1:], *extra, f"--junit-xml={report}", "-q", "-p", "no:cacheprovider"]
    result = subprocess.run(command, cwd=cwd, env=environment(), capture_output=True, text=True)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if report.exists():
        suite = ElementTree.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {key: int(suite.get(key, 0)) for key in counts}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return result, counts


def suite_size() -> int:
    return sum(len(opdef.cases()) for opdef in opdefs.all_ops()) * len(TOKENS.split(","))


def declined_by_template() -> int:
    """Cases the template's kernels decline (its e2m1 demonstration), at the token counts:
    its ``supports`` asked about each case's call, described on ``meta`` (shapes only)."""
    from tileplug.reference import conformance

    template = core.registry.get("template")
    declined = 0
    for case, tokens in conformance.cases(tuple(int(t) for t in TOKENS.split(","))):
        with core.config.host_layout(template.traits_for("cpu")):
            args, kwargs = case.arguments(tokens, "meta")
            call, _ = core.describe_call(case.op, *args, **kwargs)
        declined += template.kernels[call.op].supports(call) is not None
    return declined


@pytest.fixture(scope="module")
def template_installed(tmp_path_factory):
    install(TEMPLATE_DIR, tmp_path_factory.mktemp("template-wheel"))
    try:
        core.registry.reload()
        yield
    finally:
        pip("uninstall", "--yes", "tileplug-backend-template")
        core.registry.reload()


def test_doc_command_runs_as_written(template_installed, tmp_path):
    """The documented command, on the template: every case not declined passes; the
    template's e2m1 declines fail the strict run and are the only skips with
    --tileplug-allow-declined."""
    argv = conformance_command()
    assert "--tileplug-backend=template" in argv and "--tileplug-device=cpu" in argv
    size, declined = suite_size(), declined_by_template()
    assert size > 0 and 0 < declined < size

    result, counts = run_conformance(argv, tmp_path, f"--tileplug-tokens={TOKENS}")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]  # 1: tests failed (2 would be a usage/collection error)
    assert counts["tests"] == size, counts
    assert counts["failures"] == declined and counts["errors"] == 0, counts
    assert counts["passed"] == size - declined, counts
    assert "template declines" in output and "e2m1" in output

    result, counts = run_conformance(argv, tmp_path, f"--tileplug-tokens={TOKENS}", "--tileplug-allow-declined")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert counts == {"tests": size, "failures": 0, "errors": 0, "skipped": declined, "passed": size - declined}


def test_doc_command_without_backend_is_a_usage_error(template_installed, tmp_path):
    argv = [a for a in conformance_command() if not a.startswith("--tileplug-backend")]
    result, _ = run_conformance(argv, tmp_path)
    assert result.returncode != 0
    assert "--tileplug-backend=NAME" in result.stdout + result.stderr


def test_rename_recipe_makes_a_conforming_backend(tmp_path):
    """Copy the template, apply the guide's rename commands (and its step-7 removal of the
    demonstration decline), build and install it, run the documented command against
    ``acme``: every case passes."""
    project = tmp_path / "tileplug-backend-acme"
    shutil.copytree(TEMPLATE_DIR, project, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__"))
    for marker in ("rename-commands", "accept-e2m1"):
        script = marked_block(marker)
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=project, capture_output=True, text=True)
        assert done.returncode == 0, f"{marker}:\n{script}\n{done.stderr}"
    assert not (project / "src" / "tileplug" / "backend_template").exists()
    assert not (project / "src" / "tileplug" / "__init__.py").exists()
    leftovers = [str(p.relative_to(project)) for p in project.rglob("*") if p.is_file()
                 and re.search(r"backend_template|tileplug-backend-template", p.read_text())]
    assert leftovers == [], leftovers
    plugin = (project / "src" / "tileplug" / "backend_acme" / "plugin.py").read_text()
    assert 'NAME = "acme"' in plugin and "tileplug.backend_template" not in plugin

    argv = [a.replace("--tileplug-backend=template", "--tileplug-backend=acme") for a in conformance_command()]
    install(project, tmp_path / "wheel")
    try:
        result, counts = run_conformance(argv, tmp_path, f"--tileplug-tokens={TOKENS}")
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        size = suite_size()
        assert counts == {"tests": size, "failures": 0, "errors": 0, "skipped": 0, "passed": size}, counts
        listed = subprocess.run([sys.executable, "-c", "from tileplug import core; b = core.registry.get('acme'); "
                                 "print(b.name, b.distribution, type(b.kernels['per_token_cast']).__module__)"],
                                env=environment(), capture_output=True, text=True, cwd=tmp_path)
        assert listed.stdout.split() == ["acme", "tileplug-backend-acme", "tileplug.backend_acme.kernels"], listed
    finally:
        pip("uninstall", "--yes", "tileplug-backend-acme")
