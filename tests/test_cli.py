"""The tileplug command: info, demo, bench (JSON, dry run), lower, ledger — run as a user would.

Every command is derived from the op table, so the op lists asserted here come from
``opdefs`` too. Bad input of any kind is one line on stderr and exit status 2.
"""

from __future__ import annotations

import re

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tileplug.core import cli, config, opdefs
from tileplug.core.opdefs import describe_call
from tileplug.core.quant.layouts import LAYOUTS


def tileplug(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tileplug.core.cli", *args], capture_output=True, text=True, timeout=600, env=env
    )


def in_process(capsys, *args: str) -> tuple[int, str, str]:
    status = cli.main(list(args))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def direct_ledger(op: str, tokens: int, hidden: int, kwargs: dict, inputs: dict, layout: str = "cuda"):
    """The ledger of the same call computed from the op table, not through the CLI."""
    opdef = opdefs.get(op)
    with config.host_layout(layout):
        args, op_kwargs = opdef.arguments(tokens, hidden, torch.bfloat16, kwargs, inputs, torch.device("meta"), 0)
        call, _ = describe_call(op, *args, **op_kwargs)
    return opdef.ledger(call, LAYOUTS[layout])


# ---------------------------------------------------------------------- info, version


def test_info_shows_device_backends_installed_and_unavailable_with_reason():
    result = tileplug("info")
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert "tileplug-backend-cuda" in lines["cuda"] and "unavailable:" in lines["cuda"]
    assert "tileplug-backend-ascend" in lines["ascend"]
    assert "/dev/davinci_manager does not exist" in lines["ascend"]
    assert "available" in lines["reference"] and "unavailable" not in lines["reference"]
    assert "op x backend" in result.stdout


def test_info_matrix_has_a_row_per_declared_op(capsys):
    status, out, err = in_process(capsys, "info")
    assert status == 0, err
    matrix = out[out.index("op x backend"):].splitlines()
    # cells may hold spaces (a decline reason): cut the rows at the columns the dashes mark
    spans = [(m.start(), m.end()) for m in re.finditer(r"-+", matrix[2])]
    header = [matrix[1][a:b].strip() for a, b in spans]
    reference = header.index("reference")
    for name in opdefs.names():
        row = next(([line[a:b].strip() for a, b in spans] for line in matrix[3:] if line.split()[:1] == [name]), None)
        assert row is not None, f"no info row for {name}"
        assert row[reference] == "yes", row


def test_version_prints_core_and_backend_versions():
    from tileplug.core import __version__ as core_version

    result = tileplug("--version")
    assert result.returncode == 0, result.stderr
    assert f"tileplug-core {core_version}" in result.stdout
    assert "reference 0.1.0 (tileplug-reference)" in result.stdout


def test_info_says_a_forced_backend_is_not_installed():
    result = tileplug("info", env={**os.environ, "TILEPLUG_BACKEND": "doesnotexist"})
    assert result.returncode == 0, result.stderr
    assert "forced backend 'doesnotexist' is not installed" in result.stdout
    assert "Traceback" not in result.stderr


def test_help_documents_the_exit_status_rule():
    result = tileplug("--help")
    assert result.returncode == 0
    assert "exit status" in result.stdout and "2  the command as typed cannot be done" in result.stdout


def test_closed_pipe_exits_quietly():
    result = subprocess.run(["bash", "-c", f"'{sys.executable}' -m tileplug.core.cli info | head -1"],
                            capture_output=True, text=True, timeout=600)
    assert result.stdout == "tileplug backends (entry-point group 'tileplug.backends')\n"
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr


def test_reader_gone_before_the_first_write_exits_quietly():
    """Deterministic broken pipe: the read end is closed before the command writes at all."""
    process = subprocess.Popen([sys.executable, "-m", "tileplug.core.cli", "info"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()
    _, stderr = process.communicate(timeout=600)
    assert process.returncode in (0, 141), stderr
    assert b"Traceback" not in stderr and b"BrokenPipe" not in stderr, stderr


# ---------------------------------------------------------------------- demo, bench


def test_demo_reports_error_and_bandwidth_for_every_quant_op():
    result = tileplug("demo", "--tokens", "8", "--hidden", "576")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("per_")]
    assert [row.split()[0] for row in rows] == [case.name for case in cli.demo_cases()]
    assert len(rows) == 7  # per_token_cast x3, per_block_cast, per_channel_cast, the two stochastic casts
    for row in rows:
        fields = row.split()
        assert "reference" in fields
    errors = [float(word) for row in rows for word in row.split() if word.startswith("0.0")]
    assert len(errors) >= 5 and all(error < 0.3 for error in errors)
    # the attention step: the fused QK-norm + RoPE + cast against the chain it fuses
    assert "attention step: QK-norm + RoPE (NeoX) + per-token e4m3 cast of [8, 32, 128] bf16" in result.stdout
    assert "fused == chain bytewise: yes" in result.stdout
    fused, chain = (line.split() for line in result.stdout.splitlines()
                    if line.startswith(("rms_norm_rope_per_token_cast ", "rms_norm -> ")))
    assert fused[1] == "reference" and float(fused[2]) < float(chain[6]) / 3  # ledger MB: fused < a third
    # the MoE step: each routing op timed on its backend, the layer against a token-by-token loop
    assert "MoE step: route [8, 256] fp32 logits (top-8, 8 groups, best 4, sigmoid + bias, x2.5)" in result.stdout
    routing = {line.split()[0]: line.split() for line in result.stdout.splitlines()
               if line.startswith(cli.DEMO_MOE_STEP)}
    assert list(routing) == list(cli.DEMO_MOE_STEP)
    assert all(row[1] == "reference" and float(row[3]) > 0 for row in routing.values())
    # the experts' activation goes through the op table's swiglu (padding rows of the expert layout zero)
    assert "experts in torch with swiglu, unpermute" in result.stdout
    swiglu_rows = [line.split() for line in result.stdout.splitlines() if line.startswith("swiglu ")]
    assert len(swiglu_rows) == 1 and swiglu_rows[0][1] == "reference" and float(swiglu_rows[0][3]) > 0
    error = float(result.stdout.split("token-by-token torch loop: rel err ")[1].split()[0])
    assert error < 8e-3  # bf16 outputs: within about one rounding of the sum


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
    # both default dispatch cases, each through the launcher of its route
    assert set(report["dispatch"]) == {"per_token_cast", "cast_back"}
    for name, cost in report["dispatch"].items():
        assert cost["backend"] == "reference", cost
        assert cost["core_call_us"] > 0 and cost["direct_kernel_us"] > 0 and cost["direct_kernel_fresh_outputs_us"] > 0
    assert report["dispatch"]["cast_back"]["op"] == "cast_back"
    assert "copy ceiling" in result.stdout
    assert "dispatch cost, per_token_cast" in result.stdout and "dispatch cost, cast_back" in result.stdout


def test_bench_dry_run_lists_every_bench_case_with_ledger_bytes(capsys):
    status, out, err = in_process(capsys, "bench", "--dry-run", "--tokens", "1,5", "--hidden", "576")
    assert status == 0, err
    assert "nothing is timed" in out and "copy ceiling" not in out
    rows = [line.split() for line in out.splitlines()]
    expected = [case for opdef in opdefs.all_ops() for case in opdef.bench()]
    assert expected
    for case in expected:
        for tokens in (1, 5):
            for runner in ("reference", "torch.compile(reference)"):
                row = next((r for r in rows if r[:5] == [case.name, case.op, str(tokens), "576", runner]), None)
                assert row is not None, (case.name, tokens, runner)
                with config.host_layout("cuda"):
                    args, kwargs = case.arguments(tokens, 576, torch.bfloat16, torch.device("meta"))
                    call, _ = describe_call(case.op, *args, **kwargs)
                assert int(row[5]) == opdefs.get(case.op).ledger(call, LAYOUTS["cuda"]).bytes_total
    assert "dispatch cost would be measured for per_token_cast, cast_back" in out


def test_bench_rejects_unknown_op():
    result = tileplug("bench", "--ops", "per_token_kast")
    assert result.returncode == 2
    assert "unknown op case" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------- ledger, lower


def test_ledger_counts_bytes():
    result = tileplug("ledger", "per_token_cast", "--tokens", "4", "--hidden", "256")
    assert result.returncode == 0, result.stderr
    ledger = json.loads(result.stdout)
    # read 4*256 bf16, write 4*256 e4m3 + 4*2 fp32 scales
    assert ledger["bytes_read"] == 4 * 256 * 2
    assert ledger["bytes_written"] == 4 * 256 + 4 * 2 * 4


LEDGER_CALLS = [
    # (op, -o options, -i options, bytes_read, bytes_written) at T=4, H=256, cuda layout
    ("cast_back", {}, {}, 4 * 256 + 4 * 2 * 4, 4 * 256 * 2),
    ("cast_back", {"fmt": "fp32", "x_block_size": (1, 32)}, {"input_fmt": "e2m1", "input_sf": "ue8m0"},
     4 * 128 + 4 * 2 * 4, 4 * 256 * 4),  # e2m1 two per byte; 8 UE8M0 per row packed 4 per int32
    ("per_token_cast_with_precomputed_sf", {}, {}, 4 * 256 * 2 + 4 * 2 * 4, 4 * 256),
    ("per_token_cast_with_precomputed_sf", {"fmt": "e2m1"}, {"input_sf": "ue8m0"}, 4 * 256 * 2 + 4 * 1 * 4,
     4 * 128),
    ("per_block_cast_with_precomputed_sf", {}, {}, 4 * 256 * 2 + 1 * 2 * 4, 4 * 256),
    ("per_block_cast_with_precomputed_sf", {"block_size": (32, 32)}, {"input_sf": "ue8m0", "input_col_major": True},
     4 * 256 * 2 + 1 * 2 * 4, 4 * 256),  # 1 x 8 groups, 8 UE8M0 packed 4 per int32
]


def _flags(flag: str, options: dict) -> list[str]:
    parts = []
    for key, value in options.items():
        text = value if isinstance(value, str) else json.dumps(list(value) if isinstance(value, tuple) else value)
        parts += [flag, f"{key}={text}"]
    return parts


@pytest.mark.parametrize(("op", "kwargs", "inputs", "read", "written"), LEDGER_CALLS)
def test_ledger_of_cast_back_and_precomputed_sf_equals_the_op_table(capsys, op, kwargs, inputs, read, written):
    status, out, err = in_process(capsys, "ledger", op, "--tokens", "4", "--hidden", "256",
                                  *_flags("-o", kwargs), *_flags("-i", inputs))
    assert status == 0, err
    ledger = json.loads(out)
    direct = direct_ledger(op, 4, 256, kwargs, inputs)
    assert (ledger["bytes_read"], ledger["bytes_written"], ledger["flops"]) == tuple(direct)
    assert ledger["bytes_total"] == direct.bytes_total
    assert (ledger["bytes_read"], ledger["bytes_written"]) == (read, written)
    assert ledger["op"] == op and ledger["inputs"] == {k: v for k, v in inputs.items()}


def test_ledger_layout_changes_packed_sf_bytes(capsys):
    """Ascend packs UE8M0 two per int16, CUDA four per int32: same bytes, shape from the layout."""
    for layout in ("cuda", "ascend"):
        status, out, err = in_process(capsys, "ledger", "per_token_cast", "--tokens", "3", "--hidden", "576",
                                      "-o", "round_sf=true", "-o", "use_packed_ue8m0=true", "--layout", layout)
        assert status == 0, err
        ledger = json.loads(out)
        direct = direct_ledger("per_token_cast", 3, 576, {"round_sf": True, "use_packed_ue8m0": True}, {}, layout)
        assert ledger["bytes_written"] == direct.bytes_written


needs_tilelang = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang not installed")


@needs_tilelang
@pytest.mark.parametrize(("op", "args", "expected"), [
    ("cast_back", ["-o", "fmt=fp32"], "cast_back_cast_back_e4m3_in1x128fp32"),
    ("per_token_cast_with_precomputed_sf", ["-i", "input_sf=ue8m0", "-o", "fmt=e2m1", "-o", "num_per_channels=32"],
     "per_token_precomputed_sf_bfloat16_g1x32_e2m1_givenue8m0"),
    ("per_block_cast_with_precomputed_sf", [], "per_block_precomputed_sf_bfloat16_g128x128_e4m3_givenfp32"),
])
def test_lower_cast_back_and_precomputed_sf_on_cuda(op, args, expected):
    result = tileplug("lower", op, "--backend", "cuda", "--hidden", "256", *args)
    assert result.returncode == 0, result.stderr
    assert "__global__" in result.stdout and expected in result.stdout


def test_lower_without_codegen_is_a_clear_error():
    result = tileplug("lower", "per_token_cast", "--backend", "reference")
    assert result.returncode == 2
    assert "does not generate device code" in result.stderr


@pytest.mark.parametrize("option", ["num_per_channels=48", "fmt=e5m2"])
def test_lower_contract_errors_name_the_argument(option):
    result = tileplug("lower", "per_token_cast", "--backend", "reference", "-o", option)
    assert result.returncode == 2
    assert f"'{option.split('=')[0]}'" in result.stderr


# ---------------------------------------------------------------------- bad input: one line, exit 2


BAD_INPUT = [
    (["lower", "per_token_cast", "--backend", "reference", "-o", "fmt=foo"], "'fmt'"),
    (["ledger", "per_token_cast", "-o", "fmt=foo"], "'fmt'"),
    (["ledger", "per_token_cast", "-o", "nonsense=1"], "unknown option 'nonsense'"),
    (["lower", "per_token_cast", "--backend", "reference", "-o", "nonsense=1"], "unknown option 'nonsense'"),
    (["ledger", "per_token_cast", "-o", "badformat"], "expected key=value"),
    (["ledger", "per_token_cast", "-i", "bogus=1"], "unknown input option 'bogus'"),
    (["ledger", "per_token_cast_with_precomputed_sf", "-i", "input_sf=bogus"], "input_sf"),
    (["ledger", "cast_back", "-o", "x_block_size=5"], "x_block_size"),
    (["ledger", "per_token_cast", "--tokens", "-1"], "--tokens"),
    (["ledger", "per_token_cast", "--hidden", "0"], "--hidden"),
    (["ledger", "per_token_cast", "--layout", "nvidia"], "--layout"),
    (["ledger", "per_token_kast"], "unknown op 'per_token_kast'"),
    (["lower", "per_token_kast", "--backend", "reference"], "unknown op 'per_token_kast'"),
    (["lower", "per_token_cast", "--backend", "nosuchbackend"], "unknown backend 'nosuchbackend'"),
    (["bench", "--tokens", "1,a"], "--tokens"),
    (["bench", "--tokens", "1,-4"], "--tokens"),
    (["bench", "--backends", "nosuchbackend", "--dry-run"], "unknown backend 'nosuchbackend'"),
    (["bench", "--dispatch-cases", "nosuchcase", "--dry-run"], "unknown dispatch case"),
    (["demo", "--device", "doesnotexist"], "unknown device 'doesnotexist'"),
    (["demo", "--tokens", "x"], "--tokens"),
    (["nosuchcommand"], "invalid choice"),
    ([], "required"),
]
if not torch.cuda.is_available():
    BAD_INPUT += [(["demo", "--device", "cuda"], "'cuda' is not available"),
                  (["bench", "--device", "cuda"], "'cuda' is not available")]


@pytest.mark.parametrize(("argv", "says"), BAD_INPUT, ids=[" ".join(a) or "nothing" for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, says):
    status, out, err = in_process(capsys, *argv)
    assert status == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert says in lines[0], lines[0]
    assert "Traceback" not in err and lines[0].startswith("tileplug")


@pytest.mark.parametrize("argv", [["ledger", "per_token_cast", "-o", "nonsense=1"], ["bench", "--tokens", "1,a"],
                                  ["demo", "--device", "cuda:99"]])
def test_bad_input_in_a_real_process_has_no_traceback(argv):
    result = tileplug(*argv)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr


def test_option_values_parse_as_json_else_strings():
    assert cli.parse_value("true") is True
    assert cli.parse_value("48") == 48
    assert cli.parse_value("[32, 32]") == (32, 32)
    assert cli.parse_value("[[1, 2], [3]]") == ((1, 2), (3,))
    assert cli.parse_value("null") is None
    assert cli.parse_value("e2m1") == "e2m1"
    assert cli.parse_value("") == ""


def test_keyword_options_come_from_the_signature():
    assert cli.keyword_options(opdefs.get("per_token_cast_with_precomputed_sf")) == [
        "fmt", "num_per_channels", "x_block_size"]  # sf is a tensor input, out is not an option
    assert "x_block_size" in cli.keyword_options(opdefs.get("cast_back"))


@pytest.mark.parametrize(("value", "says"), [("input_sf=bogus", "inputs.input_sf"),
                                             ("input_col_major=1", "inputs.input_col_major"),
                                             ("row_stride_pad=-2", "inputs.row_stride_pad")])
def test_bad_input_option_values_name_the_option(value, says, capsys):
    from tileplug.core import cli

    status = cli.main(["ledger", "per_token_cast_with_precomputed_sf", "-i", value])
    err = capsys.readouterr().err
    assert status == 2 and says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
