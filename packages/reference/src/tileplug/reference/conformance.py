"""Conformance suite: every case of every op in the op table (``tileplug.core.opdefs``), run
on a named backend and compared with the reference computing the same call in the
backend's own layout. Nothing here names an op: an op declared in core is in the suite.

As a pytest plugin, for a vendor's CI (``pip install "tileplug-reference[conformance]"``)::

    python -m pytest -p tileplug.reference.conformance --pyargs tileplug.reference.conformance_tests \\
        -o consider_namespace_packages=true \\
        --tileplug-backend=acme --tileplug-device=acme

This module is the plugin (options and the suite's parametrization);
:mod:`tileplug.reference.conformance_tests` holds the one test function. Options:

- ``--tileplug-backend=NAME`` (required): the backend to check; it is forced, so nothing
  falls through to another backend.
- ``--tileplug-device=TYPE`` (default ``cpu``): where the inputs live.
- ``--tileplug-tokens=0,1,3,129`` (default): the token counts every case runs at.
- ``--tileplug-oracle-device=TYPE`` (default ``cpu``): where the reference runs.
- ``--tileplug-allow-declined``: a case the backend's kernel declines through
  ``supports()`` is skipped instead of failed (a backend claiming conformance accepts
  every case; this is for one that does not, yet).

From Python: ``for case, tokens in cases(): check_case(case, tokens, "acme", "acme")``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tileplug.core import config, opdefs
from tileplug.core.opdefs import Case, describe_call
from tileplug.core.registry import registry, use_backend
from tileplug.core.testing import assert_bytes_equal, cpu_copy, moved, require

TOKENS: tuple[int, ...] = (0, 1, 3, 129)
"""Token counts every case runs at by default (0: empty; 1, 3: tails; 129: more than a 128-row block)."""

__all__ = ["TOKENS", "CaseDeclined", "cases", "check_case", "parse_tokens"]


def cases(tokens: Sequence[int] = TOKENS) -> list[tuple[Case, int]]:
    """``(case, tokens)`` for every op in the table, every case of its grid and every token count."""
    return [(case, t) for opdef in opdefs.all_ops() for case in opdef.cases() for t in tokens]


def parse_tokens(text: str) -> tuple[int, ...]:
    """``"1,3"`` → ``(1, 3)`` (the ``--tileplug-tokens`` option)."""
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        counts = ()
    if not counts or any(t < 0 for t in counts):
        raise ValueError(f"--tileplug-tokens: expected comma-separated token counts >= 0, got {text!r}")
    return counts


class CaseDeclined(Exception):
    """The backend's kernel declines the case (its ``supports()`` reason is the message)."""


def check_case(
    case: Case,
    tokens: int,
    backend: str,
    device: str | torch.device,
    oracle_device: str | torch.device = "cpu",
) -> None:
    """Run ``case`` at ``tokens`` on ``backend`` and raise ``AssertionError`` unless its
    outputs equal the reference's as the op's ``compare`` says (bytewise, strides
    included, when the op declares no ``compare``).

    Inputs are made on the CPU by the reference in the backend's layout
    (``config.host_layout(backend.traits_for(device.type))``), then moved to ``device``
    with their strides. The reference runs on ``oracle_device`` (the CPU by default; the
    backend's own device makes large cases fast where PyTorch's arithmetic there is IEEE,
    as on CUDA) in the same layout. Raises :class:`CaseDeclined` when the backend's kernel
    declines the call through ``supports()``.
    """
    device = torch.device(device)
    oracle = torch.device(oracle_device)
    chosen = registry.get(backend)
    require(chosen is not None, f"backend '{backend}' is not installed (known: "
                                f"{', '.join(b.name for b in registry.backends) or 'none'})")
    opdef = opdefs.get(case.op)
    traits = chosen.traits_for(device.type)
    with config.host_layout(traits):
        with use_backend("reference"):
            args, kwargs = case.arguments(tokens, "cpu")
        args, kwargs = moved(args, device), moved(kwargs, device)
        call, _ = describe_call(case.op, *args, **kwargs)
        why = registry.reason_against(chosen, call.op, call)
        if why is not None:
            raise CaseDeclined(f"{backend} declines {case.id} at T={tokens}: {why}")
        # The oracle's own copies, made before the backend runs (an in-place op writes its inputs).
        oracle_args, oracle_kwargs = moved(args, oracle, fresh=True), moved(kwargs, oracle, fresh=True)
        with use_backend(backend):
            result = opdef.function(*args, **kwargs)
            actual = [cpu_copy(t) for t in opdef.produced(result, *args, **kwargs)]
        with use_backend("reference"):
            result = opdef.function(*oracle_args, **oracle_kwargs)
            expected = [cpu_copy(t) for t in opdef.produced(result, *oracle_args, **oracle_kwargs)]
        if opdef.compare is not None:  # (in the backend's layout: a compare may run a chain of ops)
            opdef.compare(case, tokens, actual, expected)
            return
    require(len(actual) == len(expected), f"{case.id} T={tokens}: {len(actual)} outputs, expected {len(expected)}")
    for index, (have, want) in enumerate(zip(actual, expected)):
        assert_bytes_equal(have, want, what=f"{case.id} T={tokens} output {index}", strides=True)


# ---------------------------------------------------------------------- pytest plugin


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("tileplug conformance")
    group.addoption("--tileplug-backend", default=None, help="backend to check against the reference (required)")
    group.addoption("--tileplug-device", default="cpu", help="device type its inputs live on (default: cpu)")
    group.addoption("--tileplug-tokens", default=",".join(map(str, TOKENS)),
                    help=f"comma-separated token counts every case runs at (default: {','.join(map(str, TOKENS))})")
    group.addoption("--tileplug-oracle-device", default="cpu", help="device the reference runs on (default: cpu)")
    group.addoption("--tileplug-allow-declined", action="store_true", default=False,
                    help="skip, instead of fail, the cases the backend declines through supports()")


def parametrize(metafunc: Any) -> None:
    """Parametrize ``conformance_case`` with the suite at ``--tileplug-tokens`` (called by
    :mod:`tileplug.reference.conformance_tests`, once, for its own test)."""
    import pytest

    try:
        text = metafunc.config.getoption("--tileplug-tokens")
    except ValueError:  # the options are not registered
        raise pytest.UsageError("the conformance suite needs its plugin: -p tileplug.reference.conformance") from None
    if metafunc.config.getoption("--tileplug-backend") is None:
        raise pytest.UsageError("the conformance suite needs --tileplug-backend=NAME (the backend to check)")
    try:
        tokens = parse_tokens(text)
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    suite = cases(tokens)
    metafunc.parametrize("conformance_case", suite, ids=[f"{case.id}-T={t}" for case, t in suite])


def run_case(conformance_case: tuple[Case, int], config_: Any) -> None:
    """The body of the suite's test: a declined case fails (or is skipped with
    ``--tileplug-allow-declined``)."""
    import pytest

    backend = config_.getoption("--tileplug-backend")
    case, tokens = conformance_case
    try:
        check_case(case, tokens, backend, config_.getoption("--tileplug-device"),
                   config_.getoption("--tileplug-oracle-device"))
    except CaseDeclined as declined:
        if config_.getoption("--tileplug-allow-declined"):
            pytest.skip(str(declined))
        pytest.fail(f"{declined} (a conforming backend accepts every case; --tileplug-allow-declined skips them)",
                    pytrace=False)
