"""Conformance suite: every op's cases, run on a named backend, compared bytewise with the
reference computing the same call on the CPU in the backend's own sf layout.

As a pytest plugin, for a vendor's CI::

    pytest -p tileplug.reference.conformance --pyargs tileplug.reference.conformance \
        --tileplug-backend=mybackend --tileplug-device=cpu

or from Python: ``for case in cases(): check_case(case, "cuda", "cuda")``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tileplug.core import config, ops
from tileplug.core.lowering import describe_call
from tileplug.core.registry import registry, use_backend
from tileplug.reference.testing import activation, assert_bytes_equal, assert_sf_equal, cpu_copy

SF_MODES: dict[str, dict[str, bool]] = {
    "plain": {},
    "round": {"round_sf": True},
    "ue8m0": {"round_sf": True, "use_packed_ue8m0": True},
    "e4m3sf": {"use_e4m3_sf": True},
}
"""Scale modes SPEC §2 allows (e4m3-stored sf only for per-token)."""


@dataclass(frozen=True)
class Case:
    """One conformance case: ``op`` (a ``core.ops`` name) on a [tokens, hidden] input."""

    op: str
    tokens: int
    hidden: int
    dtype: torch.dtype = torch.bfloat16
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    quantized_input: tuple[int, int] | None = None
    row_stride_pad: int = 0

    @property
    def id(self) -> str:
        flags = ",".join(f"{k}={v}" for k, v in sorted(self.kwargs.items()))
        extra = f",requant{self.quantized_input}" if self.quantized_input else ""
        pad = f",stride+{self.row_stride_pad}" if self.row_stride_pad else ""
        return f"{self.op}[T={self.tokens},H={self.hidden},{str(self.dtype)[6:]}{extra}{pad},{flags}]"

    @property
    def block(self) -> tuple[int, int]:
        if self.op.startswith("per_token"):
            return 1, self.kwargs.get("num_per_channels", 128)
        if self.op.startswith("per_block"):
            return self.kwargs.get("block_size", (128, 128))
        return self.kwargs.get("num_per_tokens", 128), 1


def cast_cases(tokens: int, hidden: int, dtype: torch.dtype = torch.bfloat16) -> Iterator[Case]:
    """Every flag combination SPEC §3 allows for the three casts at one size."""
    for fmt, group, mode, col_major in itertools.product(("e4m3", "e2m1"), (16, 32, 64, 128), SF_MODES, (False, True)):
        if fmt == "e2m1" and hidden % 2:
            continue
        flags = {"fmt": fmt, "num_per_channels": group, "use_tma_aligned_col_major_sf": col_major, **SF_MODES[mode]}
        yield Case("per_token_cast", tokens, hidden, dtype, flags)
        yield Case("per_token_cast_with_sf_only", tokens, hidden, dtype, flags)
    for fmt, block, mode, col_major in itertools.product(("e4m3", "e2m1"), ((32, 32), (128, 128)), SF_MODES, (False, True)):
        if mode == "e4m3sf" or (fmt == "e2m1" and hidden % 2):
            continue
        flags = {"fmt": fmt, "block_size": block, "use_tma_aligned_col_major_sf": col_major, **SF_MODES[mode]}
        yield Case("per_block_cast", tokens, hidden, dtype, flags)
        yield Case("per_block_cast_with_sf_only", tokens, hidden, dtype, flags)
    for fmt, group, mode in itertools.product(("e4m3", "e2m1"), (32, 128), ("plain", "round", "ue8m0")):
        if fmt == "e2m1" and hidden % 2:
            continue
        yield Case("per_channel_cast", tokens, hidden, dtype, {"fmt": fmt, "num_per_tokens": group, **SF_MODES[mode]})


def cases(tokens: tuple[int, ...] = (0, 1, 3, 129), hidden: tuple[int, ...] = (576, 2048)) -> list[Case]:
    """The suite: casts (all flags), precomputed-sf casts, re-quantization, strided rows, cast_back."""
    suite: list[Case] = []
    for t, h in itertools.product(tokens, hidden):
        suite.extend(cast_cases(t, h))
        suite.append(Case("per_token_cast", t, h, torch.float32, {"fmt": "e4m3", "num_per_channels": 64}))
        suite.append(Case("per_token_cast", t, h, torch.bfloat16, {"num_per_channels": 32}, row_stride_pad=48))
        suite.append(Case("per_token_cast_with_precomputed_sf", t, h, torch.bfloat16, {"num_per_channels": 128}))
        suite.append(Case("per_block_cast_with_precomputed_sf", t, h, torch.bfloat16, {"block_size": (128, 128)}))
        suite.append(Case("per_token_cast", t, h, torch.bfloat16, {"num_per_channels": 128}, quantized_input=(1, 32)))
        suite.append(Case("per_block_cast", t, h, torch.bfloat16, {"block_size": (128, 128)}, quantized_input=(1, 128)))
        suite.append(Case("per_channel_cast", t, h, torch.bfloat16, {"num_per_tokens": 128}, quantized_input=(1, 128)))
        for block, extra in (((1, 128), {}), ((128, 128), {"block_size": (128, 128)}), ((128, 1), {})):
            suite.append(Case("cast_back", t, h, torch.bfloat16, {"fmt": "bf16", "x_block_size": block, **extra}))
            suite.append(Case("cast_back", t, h, torch.bfloat16, {"fmt": "fp32", "x_block_size": block, **extra}))
    return suite


def _arguments(case: Case, device: torch.device) -> tuple[tuple, dict]:
    """(args, kwargs) of the case on ``device``, deterministic, made with the reference on the CPU."""
    x = activation(case.tokens, case.hidden + case.row_stride_pad, case.dtype, seed=case.tokens * 7 + case.hidden)
    x = x[:, : case.hidden]
    kwargs = dict(case.kwargs)
    with use_backend("reference"):
        if case.op == "cast_back":
            block = kwargs.pop("x_block_size")
            if block[0] == 1:
                pair = ops.per_token_cast(x, num_per_channels=block[1])
            elif block[1] == 1:
                pair = ops.per_channel_cast(x, num_per_tokens=block[0])
            else:
                pair = ops.per_block_cast(x, block_size=kwargs.pop("block_size"))
            return ((pair[0].to(device), pair[1].to(device)),), {"fmt": kwargs["fmt"], "x_block_size": block}
        if case.quantized_input is not None:
            q, sf = ops.per_token_cast(x, num_per_channels=case.quantized_input[1])
            argument_name = "num_per_channels" if case.op == "per_channel_cast" else "x_block_size"
            kwargs[argument_name] = case.quantized_input[1] if case.op == "per_channel_cast" else case.quantized_input
            return ((q.to(device), sf.to(device)),), kwargs
        if case.op.endswith("_with_precomputed_sf"):
            base = getattr(ops, case.op.replace("_with_precomputed_sf", "_with_sf_only"))
            kwargs["sf"] = base(x, **kwargs).to(device)
    return (x.to(device),), kwargs


def _outputs(result: Any) -> list[torch.Tensor]:
    return list(result) if isinstance(result, tuple) else [result]


class CaseDeclined(Exception):
    """The backend's kernel declines the case (its supports() reason is the message)."""


def check_case(
    case: Case, backend: str, device: str | torch.device, oracle_device: str | torch.device = "cpu"
) -> None:
    """Run ``case`` on ``backend`` and assert it equals the reference bytewise.

    The reference runs on ``oracle_device`` (the CPU by default; the backend's own device
    makes large cases fast where PyTorch's arithmetic there is IEEE, as on CUDA) in the
    backend's sf layout. Raises :class:`CaseDeclined` when the backend declines the call
    through ``supports()`` (a declined call falls through in normal use: not a failure).
    """
    device = torch.device(device)
    chosen = registry.get(backend)
    assert chosen is not None, f"backend '{backend}' is not installed"
    args, kwargs = _arguments(case, device)
    op = getattr(ops, case.op)
    call, _ = describe_call(op, *args, **kwargs)
    why = registry.reason_against(chosen, call.op, call)
    if why is not None:
        raise CaseDeclined(f"{backend} declines {case.id}: {why}")
    with use_backend(backend):
        actual = _outputs(op(*args, **kwargs))
    oracle = torch.device(oracle_device)
    oracle_args = tuple(tuple(t.to(oracle) for t in a) if isinstance(a, tuple) else a.to(oracle) for a in args)
    oracle_kwargs = {k: (v.to(oracle) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    with use_backend("reference"), config.host_layout(chosen.traits_for(device.type)):
        expected = [cpu_copy(t) for t in _outputs(op(*oracle_args, **oracle_kwargs))]
    for index, (have, want) in enumerate(zip(actual, expected)):
        is_sf = case.op != "cast_back" and (index == 1 or case.op.endswith("_sf_only"))
        if is_sf:
            assert_sf_equal(cpu_copy(have), want, case.block, case.tokens, case.hidden, what=f"{case.id} sf")
        else:
            assert_bytes_equal(cpu_copy(have), want, what=f"{case.id} output {index}", strides=True)


# ---------------------------------------------------------------------- pytest plugin


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("tileplug conformance")
    group.addoption("--tileplug-backend", default=None, help="backend to check against the reference")
    group.addoption("--tileplug-device", default="cpu", help="device its tensors live on")


def pytest_generate_tests(metafunc: Any) -> None:
    if "conformance_case" in metafunc.fixturenames:
        suite = cases()
        metafunc.parametrize("conformance_case", suite, ids=[c.id for c in suite])


def test_conformance(conformance_case: Case, request: Any) -> None:
    """One case of the suite (collected when this module runs as a pytest plugin + module)."""
    import pytest

    backend = request.config.getoption("--tileplug-backend", default=None)
    if backend is None:
        pytest.skip("pass --tileplug-backend=NAME to run the conformance suite")
    try:
        check_case(conformance_case, backend, request.config.getoption("--tileplug-device"))
    except CaseDeclined as declined:
        pytest.skip(str(declined))
