"""The tileplug command: info, demo, bench (JSON), lower, ledger — run as a user would."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def tileplug(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tileplug.core.cli", *args], capture_output=True, text=True, timeout=600, env=env
    )


def test_info_shows_device_backends_installed_and_unavailable_with_reason():
    result = tileplug("info")
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert "tileplug-backend-cuda" in lines["cuda"] and "unavailable:" in lines["cuda"]
    assert "tileplug-backend-ascend" in lines["ascend"]
    assert "/dev/davinci_manager does not exist" in lines["ascend"]
    assert "available" in lines["reference"] and "unavailable" not in lines["reference"]
    assert "op x backend" in result.stdout
    assert any(line.startswith("per_token_cast") for line in result.stdout.splitlines())


def test_demo_reports_error_and_bandwidth_for_every_quant_op():
    result = tileplug("demo", "--tokens", "8", "--hidden", "576")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("per_")]
    assert len(rows) == 5
    for row in rows:
        fields = row.split()
        assert "reference" in fields
    errors = [float(word) for row in rows for word in row.split() if word.startswith("0.0")]
    assert errors and all(error < 0.3 for error in errors)


def test_bench_writes_json_with_copy_ceiling_and_dispatch(tmp_path):
    path = tmp_path / "bench.json"
    result = tileplug("bench", "--tokens", "1,3", "--hidden", "576", "--ops", "per_token_cast,cast_back",
                      "--no-compile", "--json", str(path))
    assert result.returncode == 0, result.stderr
    report = json.loads(path.read_text())
    assert report["device"] == "cpu" and report["copy_gbps"] > 0
    runners = {(row["case"], row["tokens"], row["runner"]) for row in report["rows"]}
    assert ("per_token_cast", 1, "reference") in runners and ("cast_back", 3, "reference") in runners
    measured = [row for row in report["rows"] if row["runner"] == "reference"]
    assert all(row["gbps"] > 0 and row["ledger_bytes"] > 0 for row in measured)
    assert measured[0]["host_us"] > 0
    assert report["dispatch"]["backend"] == "reference"
    assert report["dispatch"]["core_call_us"] > 0
    assert "copy ceiling" in result.stdout


def test_bench_rejects_unknown_op():
    result = tileplug("bench", "--ops", "per_token_kast")
    assert result.returncode == 2
    assert "unknown op case" in result.stderr


def test_ledger_counts_bytes():
    result = tileplug("ledger", "per_token_cast", "--tokens", "4", "--hidden", "256")
    assert result.returncode == 0, result.stderr
    ledger = json.loads(result.stdout)
    # read 4*256 bf16, write 4*256 e4m3 + 4*2 fp32 scales
    assert ledger["bytes_read"] == 4 * 256 * 2
    assert ledger["bytes_written"] == 4 * 256 + 4 * 2 * 4


def test_lower_without_codegen_is_a_clear_error():
    result = tileplug("lower", "per_token_cast", "--backend", "reference")
    assert result.returncode == 1
    assert "does not generate device code" in result.stderr


@pytest.mark.parametrize("option", ["num_per_channels=48", "fmt=e5m2"])
def test_lower_contract_errors_name_the_argument(option):
    result = tileplug("lower", "per_token_cast", "--backend", "reference", "-o", option)
    assert result.returncode == 1
    assert f"'{option.split('=')[0]}'" in result.stderr
