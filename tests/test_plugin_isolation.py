"""Plugin isolation: every plugin fault is recorded with its cause, shown by ``tileplug
info``, and harms no other backend.

A module-scoped fixture builds one wheel of ``tests/fixtures/faulty-plugins`` (one entry
point per fault, each off unless ``TILEPLUG_TEST_FAULTS`` names it), pip-installs it into
the running environment and uninstalls it at teardown. Each test turns faults on through
the variable and re-discovers: the plugins are found the way a user's would be, nothing
here patches entry points.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from install_helpers import pip
import torch

from tileplug import core
from tileplug.core.backend import known_kernel_names, validate_backend
from tileplug.core.registry import PluginRecord

ROOT = Path(__file__).resolve().parents[1]
FAULTY_DIR = ROOT / "tests" / "fixtures" / "faulty-plugins"
DISTRIBUTION = "tileplug-faulty-plugins"
PACKAGE = "tileplug_faulty_plugins"
VARIABLE = "TILEPLUG_TEST_FAULTS"
CONTROL_VARIABLES = (VARIABLE, "TILEPLUG_BACKEND")
TILEPLUG = Path(sys.executable).with_name("tileplug")
GENUINE = {"reference": "tileplug-reference", "cuda": "tileplug-backend-cuda", "ascend": "tileplug-backend-ascend"}

# entry point -> the one fault recorded against it when its fault is on.
FAULTS = {
    "priority_str": "refused: backend 'fixture-priority': priority must be an int, got str ('high')",
    "kernels_none": "refused: backend 'fixture-kernels': kernels must be a Mapping of op name to kernel, "
    "got NoneType (None)",
    "device_types_str": "refused: backend 'fixture-devices': device_types must be a tuple of device type names "
    "such as ('cpu',), got the bare str 'cpu' (write ('cpu',))",
    "exit_at_import": "SystemExit: 3 (at ",
    "hook_none": "tileplug_faulty_plugins.hook_none: tileplug_backends() returned None",
    "hook_exit": "SystemExit: 4 (at ",
    "reserved_reference": "refused: backend 'reference': name 'reference' is reserved for tileplug-reference",
    "reserved_cuda": "refused: backend 'cuda': name 'cuda' is reserved for tileplug-backend-cuda",
    "unknown_kernel": "refused: backend 'fixture-unknown-op': kernels has an unknown op name 'per_token_kast'",
    "kernel_no_supports": "refused: backend 'fixture-no-supports': kernels['per_token_cast'] has no callable "
    "supports(call)",
}
# Faults whose hook hands back a valid sibling next to the bad backend: it must still load.
WITH_SIBLING = ("priority_str", "kernels_none", "device_types_str", "reserved_reference", "reserved_cuda",
                "unknown_kernel", "kernel_no_supports")
# Faults of the whole plugin (the import or the hook), not of one backend.
WHOLE_PLUGIN = ("exit_at_import", "hook_none", "hook_exit")
PROBE_EXIT_REASON = "availability probe raised SystemExit: 5"
DUP_REFUSAL = "refused: backend 'fixture-dup': name 'fixture-dup' is already taken by tileplug-faulty-plugins"


def activate(faults: str) -> None:
    """Turn ``faults`` on (comma-separated entry-point names, "all" or "") and re-discover.

    The fixture's modules are dropped from ``sys.modules`` first, so a module that checks
    the variable at import (``exit_at_import``) sees the new value.
    """
    os.environ[VARIABLE] = faults
    for module in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[module]
    core.registry.reload()


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The faulty-plugins wheel, installed for real with every fault off; yields the wheel."""
    saved = {name: os.environ.pop(name) for name in CONTROL_VARIABLES if name in os.environ}
    directory = tmp_path_factory.mktemp("faulty-wheel")
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(directory), str(FAULTY_DIR))
    (wheel,) = directory.glob("*.whl")
    try:
        pip("install", "--no-deps", "--force-reinstall", str(wheel))
        activate("")
        yield wheel
    finally:
        pip("uninstall", "--yes", DISTRIBUTION)
        os.environ.pop(VARIABLE, None)
        os.environ.update(saved)
        core.registry.reload()


@pytest.fixture
def faults(installed):
    """``faults(names)`` turns the named faults on; every fault is off again afterwards."""
    yield activate
    activate("")


def fixture_records() -> dict[str, PluginRecord]:
    records = {r.name: r for r in core.registry.records if r.distribution == DISTRIBUTION}
    assert set(records) == set(FAULTS) | {"probe_exit", "dup_first", "dup_second", "hook_interrupt"}, records
    return records


def assert_genuine_backends_work() -> None:
    """The project's own backends are registered from their own distributions, and an op on
    a CPU tensor runs on the genuine reference (every fixture kernel raises if it runs)."""
    for name, distribution in GENUINE.items():
        backend = core.registry.get(name)
        assert backend is not None, f"{name} is not registered"
        assert backend.distribution == distribution, (name, backend.distribution)
    x = torch.randn(2, 128)
    call, _ = core.describe_call(core.ops.per_token_cast, x)
    assert core.registry.select(call.op, call)[0] is core.registry.get("reference")
    q, sf = core.ops.per_token_cast(x)
    assert q.shape == (2, 128) and q.dtype == torch.float8_e4m3fn and sf.shape == (2, 1)
    torch.testing.assert_close(q.float() * sf, x, rtol=0.07, atol=1e-4)


def tileplug_info(faults: str) -> str:
    """``tileplug info``'s output, run as this environment's command with ``faults`` on."""
    env = {k: v for k, v in os.environ.items() if k not in CONTROL_VARIABLES}
    env[VARIABLE] = faults
    result = subprocess.run([str(TILEPLUG), "info"], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"tileplug info exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def failed_table(info: str) -> str:
    assert "\nplugins that failed to load" in info, info
    return info.split("\nplugins that failed to load", 1)[1].split("\nop x backend", 1)[0]


# ---------------------------------------------------------------------- discovery


def test_installed_with_every_fault_off_the_fixture_is_harmless(faults):
    records = fixture_records()
    assert all(r.faults == [] and r.error is None for r in records.values())
    assert (records["priority_str"].version, records["priority_str"].value) == (
        "0.0.2", "tileplug_faulty_plugins.priority_str")
    assert_genuine_backends_work()


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_fault_alone_is_recorded_with_its_cause_and_harms_no_other(faults, fault):
    faults(fault)
    records = fixture_records()
    record = records[fault]
    assert len(record.faults) == 1, record.faults
    assert FAULTS[fault] in record.faults[0], record.faults
    assert record.error == record.faults[0]
    if fault in WHOLE_PLUGIN:
        assert record.load_error == record.faults[0] and record.refused == []
        assert record.backends == []
    else:
        assert record.load_error is None and record.refused == record.faults
    if fault in WITH_SIBLING:  # the plugin's valid backend still loads
        sibling = core.registry.get(f"fixture-ok-{fault.replace('_', '-')}")
        assert sibling is not None and record.backends == [sibling]
        assert sibling.distribution == DISTRIBUTION
    others = {name: r.faults for name, r in records.items() if name != fault and r.faults}
    assert others == {}
    assert not {b.name for b in core.registry.backends} & {
        "fixture-priority", "fixture-kernels", "fixture-devices", "fixture-unknown-op", "fixture-no-supports"}
    assert_genuine_backends_work()
    table = failed_table(tileplug_info(fault))
    assert fault in table and DISTRIBUTION in table and "0.0.2" in table
    assert FAULTS[fault] in table


def test_all_faults_together_are_each_recorded_and_harm_no_other(faults):
    faults("all")
    records = fixture_records()
    for fault, expected in FAULTS.items():
        assert len(records[fault].faults) == 1 and expected in records[fault].faults[0], (fault, records[fault])
    assert records["dup_second"].faults == [DUP_REFUSAL]
    assert records["probe_exit"].faults == [] and records["dup_first"].faults == []
    assert core.registry.get("fixture-probe-exit").unavailable_reason() == PROBE_EXIT_REASON
    for fault in WITH_SIBLING:
        assert core.registry.get(f"fixture-ok-{fault.replace('_', '-')}") is not None, fault
    assert_genuine_backends_work()
    info = tileplug_info("all")
    table = failed_table(info)
    for fault, expected in FAULTS.items():
        assert expected in table, fault
    assert DUP_REFUSAL in table
    assert f"unavailable: {PROBE_EXIT_REASON}" in info
    lines = [line for line in table.splitlines() if line.startswith(tuple(FAULTS) + ("dup_second",))]
    assert len(lines) == len(FAULTS) + 1  # one row per fault


def test_reserved_reference_from_another_distribution_is_refused_and_the_genuine_one_runs(faults):
    faults("reserved_reference")
    (impostor,) = [r for r in core.registry.records if r.name == "reserved_reference"]
    assert impostor.refused == [FAULTS["reserved_reference"]]
    # The impostor's distribution sorts before tileplug-reference: without the reservation
    # it would have been loaded first and taken the name.
    names = [r.distribution for r in core.registry.records]
    assert names.index(DISTRIBUTION) < names.index("tileplug-reference")
    reference = core.registry.get("reference")
    assert reference.distribution == "tileplug-reference"
    assert type(reference.kernels["per_token_cast"]).__name__ == "ReferenceKernel"
    x = torch.randn(2, 128)
    expected = core.ops.per_token_cast(x)
    with core.use_backend("reference"):
        call, _ = core.describe_call(core.ops.per_token_cast, x)
        assert core.registry.select(call.op, call)[0] is reference
        q, sf = core.ops.per_token_cast(x)  # a fixture kernel raises ImpostorRan if it runs
    assert torch.equal(q.view(torch.uint8), expected[0].view(torch.uint8)) and torch.equal(sf, expected[1])
    assert "name 'reference' is reserved for tileplug-reference" in failed_table(tileplug_info("reserved_reference"))


def test_reserved_cuda_after_the_genuine_one_is_refused_as_reserved_not_as_taken(faults):
    faults("reserved_cuda")
    names = [r.distribution for r in core.registry.records]
    assert names.index("tileplug-backend-cuda") < names.index(DISTRIBUTION)
    (impostor,) = [r for r in core.registry.records if r.name == "reserved_cuda"]
    assert impostor.refused == [FAULTS["reserved_cuda"]]
    cuda = core.registry.get("cuda")
    assert cuda.distribution == "tileplug-backend-cuda" and cuda.device_types == ("cuda",)


def test_system_exit_in_a_probe_makes_the_backend_unavailable(faults):
    faults("probe_exit")
    backend = core.registry.get("fixture-probe-exit")
    assert backend is not None and backend.distribution == DISTRIBUTION
    assert backend.unavailable_reason() == PROBE_EXIT_REASON
    x = torch.randn(2, 128)
    call, _ = core.describe_call(core.ops.per_token_cast, x)
    assert core.registry.explain(call.op, call)["fixture-probe-exit"] == f"unavailable: {PROBE_EXIT_REASON}"
    assert_genuine_backends_work()


def test_duplicate_names_first_entry_point_in_sorted_order_wins(faults):
    faults("dup")
    records = fixture_records()
    winner = core.registry.get("fixture-dup")
    assert winner.description == "from dup_first" and records["dup_first"].backends == [winner]
    assert records["dup_second"].backends == [] and records["dup_second"].faults == [DUP_REFUSAL]
    assert DUP_REFUSAL in failed_table(tileplug_info("dup"))


def test_entry_points_are_loaded_in_distribution_then_name_order(faults):
    order = [(r.distribution, r.name) for r in core.registry.records]
    assert order == sorted(order)
    assert len(order) == len(importlib.metadata.entry_points(group="tileplug.backends"))


def test_keyboard_interrupt_in_a_hook_propagates(faults):
    with pytest.raises(KeyboardInterrupt):
        faults("hook_interrupt")
    faults("")
    assert_genuine_backends_work()


# ---------------------------------------------------------------------- Backend validation in-process


def make_backend(**fields) -> core.Backend:
    reference = core.registry.get("reference")
    values = dict(name="fixture-inprocess", device_types=("cpu",), priority=-5000, traits=core.CUDA_LAYOUT,
                  kernels={"per_token_cast": reference.kernels["per_token_cast"]})
    values.update(fields)
    return core.Backend(**values)


class NoCall:
    def supports(self, call):
        return None


BAD_FIELDS = [
    (dict(name=""), ValueError, "backend name must be non-empty"),
    (dict(name="two words"), ValueError, "got 'two words'"),
    (dict(name=3), TypeError, "backend name must be a str, got int (3)"),
    (dict(device_types="cpu"), TypeError, "got the bare str 'cpu'"),
    (dict(device_types=["cpu"]), TypeError, "device_types must be a tuple of non-empty str, got list (['cpu'])"),
    (dict(device_types=()), ValueError, "device_types must name at least one device type"),
    (dict(device_types=("cpu", "")), ValueError, "device_types must hold non-empty str"),
    (dict(device_types=("cpu", 1)), TypeError, "device_types must hold only str, got int (1)"),
    (dict(priority="high"), TypeError, "priority must be an int, got str ('high')"),
    (dict(priority=True), TypeError, "priority must be an int, got bool (True)"),
    (dict(priority=1.5), TypeError, "priority must be an int, got float (1.5)"),
    (dict(traits=None), TypeError, "traits must be a tileplug.core.LayoutTraits, got NoneType (None)"),
    (dict(kernels=None), TypeError, "kernels must be a Mapping of op name to kernel, got NoneType (None)"),
    (dict(kernels=[("per_token_cast", None)]), TypeError, "kernels must be a Mapping"),
    (dict(kernels={"rms_nrom": None}), ValueError, "kernels has an unknown op name 'rms_nrom' (known: "),
    (dict(kernels={"per_token_cast": lambda c, i, o: None}), TypeError,
     "kernels['per_token_cast'] has no callable supports(call)"),
    (dict(kernels={"per_token_cast": NoCall()}), TypeError, "kernels['per_token_cast'] is not callable"),
    (dict(probe="yes"), TypeError, "probe must be callable or None, got str ('yes')"),
    (dict(lower=3), TypeError, "lower must be callable or None"),
    (dict(layout_for=core.CUDA_LAYOUT), TypeError, "layout_for must be callable or None"),
    (dict(capabilities="text"), TypeError, "capabilities must be callable or None"),
    (dict(description=None), TypeError, "description must be a str"),
]


# ids without object addresses: every xdist worker must collect the same names
@pytest.mark.parametrize(("fields", "error", "message"), BAD_FIELDS,
                         ids=[re.sub(r" at 0x[0-9a-f]+", "", str(f)) for f, _, _ in BAD_FIELDS])
def test_register_refuses_a_malformed_backend_naming_the_field(fields, error, message):
    backend = make_backend(**fields)
    try:
        with pytest.raises(error) as caught:
            core.registry.register(backend)
        assert message in str(caught.value)
        with pytest.raises(error):
            validate_backend(backend)
        assert core.registry.get("fixture-inprocess") is None
    finally:
        core.registry.unregister("fixture-inprocess")  # a wrongly accepted backend must not leak


def test_register_refuses_reserved_and_taken_names():
    with pytest.raises(ValueError, match="backend 'reference': name 'reference' is reserved for tileplug-reference"):
        core.registry.register(make_backend(name="reference"))
    with pytest.raises(ValueError, match="name 'ascend' is reserved for tileplug-backend-ascend"):
        core.registry.register(make_backend(name="ascend"))
    assert core.registry.get("reference").distribution == "tileplug-reference"
    core.registry.register(make_backend())
    try:
        with pytest.raises(ValueError, match="name 'fixture-inprocess' is already taken by"):
            core.registry.register(make_backend())
    finally:
        core.registry.unregister("fixture-inprocess")


def test_the_genuine_reference_may_be_registered_again():
    reference = core.registry.get("reference")
    core.registry.unregister("reference")
    try:
        core.registry.register(reference)  # its distribution is tileplug-reference
        assert core.registry.get("reference") is reference
    finally:
        core.registry.reload()


def test_valid_backends_pass_validation():
    for backend in core.registry.backends:
        validate_backend(backend)
    validate_backend(make_backend(probe=None, kernels={}))
    assert make_backend(probe=None).unavailable_reason() is None


def test_known_kernel_names_are_the_op_table():
    names = known_kernel_names()
    assert {"per_token_cast", "per_block_cast", "per_channel_cast", "cast_back"} <= names
    assert all(isinstance(n, str) and n for n in names)


def test_probe_keyboard_interrupt_propagates_other_exits_are_contained():
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        make_backend(probe=interrupted).unavailable_reason()
    assert make_backend(probe=lambda: sys.exit("bye")).unavailable_reason() == (
        "availability probe raised SystemExit: bye")
    assert make_backend(probe=lambda: True).unavailable_reason() == (
        "availability probe returned bool, not None or a str: True")


# ---------------------------------------------------------------------- BackendError


@dataclasses.dataclass(frozen=True)
class FakeCall:
    op: str
    padding: str = ""


def test_backend_error_names_backend_op_and_call():
    cause = RuntimeError("device lost")
    call = FakeCall("per_token_cast", "x" * 500)
    error = core.BackendError("cuda", call, cause)
    assert isinstance(error, core.TileplugError) and isinstance(error, RuntimeError)
    assert (error.backend, error.op, error.call) == ("cuda", "per_token_cast", call)
    message = str(error)
    assert message.startswith("backend 'cuda' failed running per_token_cast: RuntimeError: device lost (call: ")
    assert "FakeCall(op='per_token_cast', padding='xxx" in message
    assert message.endswith("...)") and len(message) < 420


@dataclasses.dataclass(frozen=True)
class Named:
    name: str
    op: str


def test_backend_error_prefers_the_call_name():
    error = core.BackendError("ascend", Named("rms_norm", "norm"), ValueError("bad"))
    assert error.op == "rms_norm" and "failed running rms_norm: ValueError: bad (call: Named(" in str(error)


class ExplodingKernels(dict):
    """A kernels Mapping whose iteration exits the interpreter."""

    def items(self):
        sys.exit("kernels exploded")


def test_a_backend_whose_checking_raises_is_refused_not_fatal():
    refusal = core.registry._refusal(make_backend(kernels=ExplodingKernels()), "some-distribution")
    assert refusal.startswith("backend 'fixture-inprocess': checking it raised SystemExit: kernels exploded (at ")
