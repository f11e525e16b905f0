"""An op declared once, in this test, reaches every generic consumer of the op table.

``toy_scale(x, factor)`` (y = x * factor) is declared here with its own Call subclass,
contract, outputs plan, result, ledger, cases, bench cases and arguments; an in-process
backend ``toy`` serves it (and generates "source"), and the reference backend gets a kernel
for it for the duration of the module. Nothing in core names the op, yet it shows in
``tileplug info``, ``lower``, ``ledger``, ``bench`` (dry run and timed) and dispatch, and
its cases are reachable the way the conformance suite reaches every op's cases.

The CLI runs in process (``cli.main``): the toy op lives only in this process.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import pytest
import torch

from tileplug import core
from tileplug.core import cli, opdefs
from tileplug.core.call import call_type
from tileplug.core.errors import ContractError
from tileplug.core.registry import registry
from tileplug.core.testing import activation, assert_bytes_equal

OP = "toy_scale"
BACKEND = "toy"
MAX_FACTOR = 8


@call_type
class ToyCall(core.Call):
    """The toy op's call: H, factor, dtype (``op``, ``device_type``, ``name`` come from core.Call)."""

    hidden: int
    factor: int
    dtype: torch.dtype


class ToyOutputs(NamedTuple):
    y: torch.Tensor


class ToyPlan:
    def __init__(self, call: ToyCall) -> None:
        self.hidden, self.dtype = call.hidden, call.dtype

    def allocate(self, tokens: int, device: torch.device | None) -> ToyOutputs:
        return ToyOutputs(torch.empty(tokens, self.hidden, dtype=self.dtype, device=device))


def toy_contract(x: Any, factor: Any = 2) -> tuple[ToyCall, tuple[torch.Tensor]]:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ContractError(OP, "x", "a 2-D tensor [T, H]", type(x).__name__)
    if type(factor) is not int or factor < 1:
        raise ContractError(OP, "factor", "a positive int", factor)
    call = ToyCall(OP, x.device.type, name=OP, hidden=x.shape[1], factor=factor, dtype=x.dtype,
                   tokens=x.shape[0], device=x.device, empty=x.numel() == 0)
    return call, (x,)


def toy_scale(x: torch.Tensor, factor: int = 2) -> torch.Tensor:
    """y = x * factor, [T, H] → [T, H]."""
    call, inputs = toy_contract(x, factor)
    return opdefs.run(call, inputs)


def toy_ledger(call: ToyCall, traits: Any) -> core.Ledger:
    size = call.tokens * call.hidden * call.dtype.itemsize
    return core.Ledger(size, size, call.tokens * call.hidden)


def toy_cases() -> list[core.Case]:
    return [core.Case.of(OP, 48, torch.float32, factor=3), core.Case.of(OP, 64, torch.bfloat16)]


def toy_bench() -> list[core.BenchCase]:
    return [core.BenchCase.of("toy_scale/x3", OP, factor=3)]


def toy_arguments(tokens: int, hidden: int, dtype: torch.dtype, kwargs: dict, inputs: dict, device: torch.device,
                  seed: int) -> tuple[tuple, dict]:
    if device.type == "meta":
        x = torch.empty(tokens, hidden, dtype=dtype, device=device)
    else:
        x = activation(tokens, hidden, dtype, seed=seed).to(device)
    return (x,), dict(kwargs)


class ToyKernel:
    def supports(self, call: ToyCall) -> str | None:
        return None if call.factor <= MAX_FACTOR else f"factor above {MAX_FACTOR}"

    def __call__(self, call: ToyCall, inputs: Any, outputs: ToyOutputs) -> None:
        torch.mul(inputs[0], call.factor, out=outputs.y)


class ToyReferenceKernel:
    def supports(self, call: ToyCall) -> str | None:
        return None

    def __call__(self, call: ToyCall, inputs: Any, outputs: ToyOutputs) -> None:
        outputs.y.copy_(inputs[0] * call.factor)


def toy_lower(call: ToyCall) -> str:
    return f"// toy source\nvoid toy_scale_h{call.hidden}_x{call.factor}(const float* x, float* y);"


@pytest.fixture(scope="module")
def toy():
    """Declare the op, register the toy backend, give the reference a kernel; undo it all after."""
    opdef = core.declare(core.OpDef(
        name=OP, function=toy_scale, contract=toy_contract, outputs=lambda call, traits: ToyPlan(call),
        result=lambda call, outputs: outputs.y, ledger=toy_ledger, cases=toy_cases, bench=toy_bench,
        arguments=toy_arguments, family="toy",
    ))
    backend = core.Backend(name=BACKEND, device_types=("cpu",), priority=50, traits=core.CUDA_LAYOUT,
                           kernels={OP: ToyKernel()}, lower=toy_lower, description="toy test backend")
    reference = registry.get("reference")
    assert reference is not None, "the toy test needs tileplug-reference installed"
    reference.kernels[OP] = ToyReferenceKernel()
    registry.register(backend)  # (also clears the selection cache)
    try:
        yield opdef
    finally:
        reference.kernels.pop(OP, None)
        registry.unregister(BACKEND)
        opdefs.undeclare(OP)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# ---------------------------------------------------------------------- op table, dispatch


def test_the_op_is_in_the_table_and_dispatches(toy):
    assert OP in opdefs.names() and toy in opdefs.all_ops()
    assert opdefs.get(OP) is toy and toy.kernel == OP
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    expected = torch.arange(12, dtype=torch.float32).reshape(3, 4) * 3
    assert torch.equal(opdefs.get(OP).function(x, 3), expected)  # chosen: the toy backend (priority 50)
    assert registry.select(OP, toy_contract(x, 3)[0])[0].name == BACKEND
    with core.use_backend("reference"):
        assert torch.equal(toy.function(x, factor=3), expected)
    assert torch.equal(toy.function(x, MAX_FACTOR + 1), x * (MAX_FACTOR + 1))  # toy declines: reference runs
    assert torch.equal(torch.ops.tileplug.toy_scale(x, 3), expected)  # the custom op from the declaration
    with pytest.raises(ContractError, match="'factor'"):
        toy.function(x, 0)


def test_every_case_of_the_op_matches_the_reference_bytewise(toy):
    """What the conformance suite does for every op of the table, done here for the toy op."""
    cases = [case for opdef in opdefs.all_ops() if opdef.name == OP for case in opdef.cases()]
    assert cases == toy_cases()
    for case in cases:
        for tokens in (0, 1, 3, 129):
            args, kwargs = case.arguments(tokens, "cpu")
            call, _ = core.describe_call(OP, *args, **kwargs)
            assert registry.reason_against(registry.get(BACKEND), call.op, call) is None
            with core.use_backend(BACKEND):
                actual = toy.function(*args, **kwargs)
            with core.use_backend("reference"):
                expected = toy.function(*args, **kwargs)
            assert_bytes_equal(actual, expected, what=f"{case.id} T={tokens}", strides=True)
            assert_bytes_equal(actual, args[0] * dict(case.kwargs).get("factor", 2), what=case.id)


def test_conformance_suite_runs_the_toy_cases(toy):
    """The conformance suite finds the toy op through the op table (conformance.py names no
    op) and checks the toy backend against the reference on every case and token count."""
    from tileplug.reference import conformance

    toy_suite = [(case, tokens) for case, tokens in conformance.cases() if case.op == OP]
    assert toy_suite and {tokens for _, tokens in toy_suite} == set(conformance.TOKENS)
    assert len(toy_suite) == len(core.opdefs.get(OP).cases()) * len(conformance.TOKENS)
    for case, tokens in toy_suite:
        conformance.check_case(case, tokens, BACKEND, "cpu")


# ---------------------------------------------------------------------- the CLI


def test_info_has_a_row_for_the_toy_op(toy, capsys):
    status, out, err = run_cli(capsys, "info")
    assert status == 0, err
    matrix = out[out.index("op x backend"):].splitlines()
    header = matrix[1].split()
    row = next(line.split() for line in matrix if line.split()[:1] == [OP])
    assert row[header.index(BACKEND)] == "yes" and row[header.index("reference")] == "yes"
    if "cuda" in header:
        assert row[header.index("cuda")] == "-"  # no kernel for the op
    assert "toy_scale/x3" in " ".join(row)  # the call asked about: the first bench case


def test_lower_prints_the_backends_source(toy, capsys):
    status, out, err = run_cli(capsys, "lower", OP, "--backend", BACKEND, "--hidden", "64", "-o", "factor=3")
    assert status == 0, err
    assert out == toy_lower(ToyCall(OP, "cpu", name=OP, hidden=64, factor=3, dtype=torch.bfloat16)) + "\n"


@pytest.mark.parametrize(("argv", "says"), [
    (["-o", "factor=0"], "'factor'"),  # the toy contract's ContractError
    (["-o", "factor=9"], "declines"),  # the toy kernel's supports()
    (["-o", "scale=2"], "unknown option 'scale'"),  # not in the signature
    (["-i", "row_stride_pad=8"], "unknown input option"),  # the toy family takes none
])
def test_lower_bad_input_is_one_line(toy, capsys, argv, says):
    status, _, err = run_cli(capsys, "lower", OP, "--backend", BACKEND, *argv)
    assert status == 2 and len(err.strip().splitlines()) == 1 and says in err, err


def test_ledger_gives_the_toy_numbers(toy, capsys):
    status, out, err = run_cli(capsys, "ledger", OP, "--tokens", "4", "--hidden", "64", "--dtype", "fp32",
                               "-o", "factor=5")
    assert status == 0, err
    ledger = json.loads(out)
    assert (ledger["bytes_read"], ledger["bytes_written"], ledger["flops"]) == (4 * 64 * 4, 4 * 64 * 4, 4 * 64)
    assert ledger["bytes_total"] == 2 * 4 * 64 * 4 and ledger["options"] == {"factor": 5}


def test_bench_dry_run_and_timed_run_of_the_toy_case(toy, capsys, tmp_path):
    status, out, err = run_cli(capsys, "bench", "--dry-run", "--ops", "toy_scale/x3", "--tokens", "1,4",
                               "--hidden", "64")
    assert status == 0, err
    rows = [line.split() for line in out.splitlines() if line.startswith("toy_scale/x3")]
    rows = [row for row in rows if row[4] in (BACKEND, "reference")]  # other installed backends may list too
    runners = {(row[2], row[4]) for row in rows}
    assert {("1", BACKEND), ("4", BACKEND), ("1", "reference"), ("4", "reference")} <= runners
    assert all(row[5] == str(2 * int(row[2]) * 64 * 2) for row in rows)  # bf16 read + write
    path = tmp_path / "bench.json"
    status, out, err = run_cli(capsys, "bench", "--ops", "toy_scale/x3", "--tokens", "1,4", "--hidden", "64",
                               "--no-compile", "--backends", f"{BACKEND},reference",
                               "--dispatch-cases", "toy_scale/x3", "--json", str(path))
    assert status == 0, err
    report = json.loads(path.read_text())
    timed = {(row["tokens"], row["runner"]): row for row in report["rows"]}
    assert timed[(4, BACKEND)]["gbps"] > 0 and timed[(4, "reference")]["ledger_bytes"] == 2 * 4 * 64 * 2
    assert report["dispatch"]["toy_scale/x3"]["backend"] == BACKEND
    assert report["dispatch"]["toy_scale/x3"]["direct_kernel_us"] > 0
