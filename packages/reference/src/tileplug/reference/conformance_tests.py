"""The conformance suite's test module: one test, parametrized with every case of every op
at every ``--tileplug-tokens`` count. It needs the plugin for its options::

    python -m pytest -p tileplug.reference.conformance --pyargs tileplug.reference.conformance_tests \\
        -o consider_namespace_packages=true \\
        --tileplug-backend=acme --tileplug-device=acme

(The plugin and the tests are two modules so that pytest parametrizes once: a module
given both as ``-p`` plugin and as the test module would run its hooks twice.)
"""

from __future__ import annotations

from typing import Any

from tileplug.reference import conformance


def pytest_generate_tests(metafunc: Any) -> None:
    if "conformance_case" in metafunc.fixturenames:
        conformance.parametrize(metafunc)


def test_conformance(conformance_case: Any, request: Any) -> None:
    """One case at one token count: the backend's outputs equal the reference's."""
    conformance.run_case(conformance_case, request.config)
