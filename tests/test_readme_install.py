"""The README's install lines from a clone work as written.

Each line of the README block marked ``<!-- install-from-clone -->`` is run (its ``pip
install`` arguments, from the repository root) in a fresh venv that holds no tileplug
distribution; torch, pluggy and TileLang are linked in from this environment (as in
``test_core_alone``) so pip finds them installed and downloads nothing heavy. Then
``tileplug info`` there lists exactly the backends the line installs, and the first line's
``tileplug demo`` runs on the reference.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from test_core_alone import _link_dependencies, _ok, _run

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKER = "<!-- install-from-clone -->"


def install_lines() -> list[list[str]]:
    """The ``pip install`` argument lists of the marked block, comments stripped."""
    text = README.read_text()
    assert MARKER in text, f"README.md has no {MARKER} block"
    block = text.split(MARKER, 1)[1].split("```", 2)[1]
    lines = []
    for line in block.splitlines()[1:]:
        words = shlex.split(line, comments=True)
        if words:
            assert words[:2] == ["pip", "install"], line
            lines.append(words[2:])
    return lines


LINES = install_lines()
BACKEND_OF = {"./packages/reference": "reference", "./packages/backend-cuda": "cuda",
              "./packages/backend-ascend": "ascend"}


@pytest.fixture(scope="module")
def dependencies(tmp_path_factory):
    deps = tmp_path_factory.mktemp("readme-deps") / "deps"
    linked = _link_dependencies(deps, ["torch", "pluggy", "numpy", "tilelang"])
    assert "tilelang" in linked
    return deps


def test_the_readme_links_no_path_outside_the_repository():
    text = README.read_text()
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if "://" in target:
            continue
        resolved = (ROOT / target.split("#")[0]).resolve()
        assert resolved.is_relative_to(ROOT), f"README links outside the repository: {target}"
        assert resolved.exists(), f"README links a missing file: {target}"
    assert "docs/spec.md" in text


@pytest.mark.parametrize("arguments", LINES, ids=[" ".join(a) for a in LINES])
def test_install_line_from_a_clone(arguments, dependencies, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TILEPLUG_BACKEND", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", tmp_path / "venv"], env))
    python = tmp_path / "venv" / "bin" / "python"
    site = _ok(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env)).stdout
    (Path(site.strip()) / "_tileplug_test_deps.pth").write_text(f"{dependencies}\n")
    installed = _run([sys.executable, "-m", "pip", "--python", python, "install", *arguments], env, cwd=ROOT,
                     timeout=900)
    _ok(installed)
    assert "Downloading torch" not in installed.stdout  # torch came from the linked environment
    info = _ok(_run([tmp_path / "venv" / "bin" / "tileplug", "info"], env, cwd=tmp_path)).stdout
    listed = {line.split()[0] for line in info.split("op x backend")[0].splitlines()[2:] if line.strip()}
    expected = {BACKEND_OF[a] for a in arguments if a in BACKEND_OF}
    assert expected <= listed, info
    assert not (set(BACKEND_OF.values()) - expected) & listed, info
    if arguments == LINES[0]:
        demo = _ok(_run([tmp_path / "venv" / "bin" / "tileplug", "demo", "--tokens", "8", "--hidden", "256"], env,
                        cwd=tmp_path)).stdout
        assert "reference" in demo and "round-trip" in demo
