"""Installing real distributions into the running environment, for the tests that need a
plugin found the way a user's would be (discovery, plugin isolation, the vendor path)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def pip(*args: str) -> None:
    """Run this interpreter's pip; a failure is an AssertionError with pip's output."""
    result = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args],
                            capture_output=True, text=True)
    if result.returncode:
        raise AssertionError(f"pip {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")


def build_wheels(directory: Path, *projects: Path) -> list[Path]:
    """Wheels of ``projects`` built into ``directory`` (no isolation, no dependencies)."""
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(directory), *map(str, projects))
    return sorted(directory.glob("*.whl"))
