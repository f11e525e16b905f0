"""``tileplug precompile``: compile ahead of time every kernel a backend would serve for the
op table's case and bench grids, so a deployment's first calls find a warm cache.

The grid is the op table's own: every ``OpDef.cases()`` entry and every bench case (at
``[1, hidden]``), described on meta tensors under the backend's layout for the device type
(no data, no device needed), then handed to the backend's ``precompile`` hook, which
compiles what its cache lacks (the CUDA backend: a spawned process pool).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tileplug.core import config, opdefs
from tileplug.core.errors import TileplugError


@dataclass
class PrecompileReport:
    """What one ``precompile`` run did: calls described, calls the backend serves (the rest
    fall through to another backend), kernels compiled, seconds."""

    backend: str
    calls: int
    compiled: int
    seconds: float


def grid_calls(backend: Any, device_type: str, ops: Sequence[str] | None = None, hidden: int = 7168) -> list[Any]:
    """Calls of every case and bench case of ``ops`` (default: every declared op), described
    on meta under ``backend``'s layout for ``device_type``, re-homed to ``device_type``."""
    traits = backend.traits_for(device_type)
    calls: list[Any] = []
    names = list(ops) if ops else opdefs.names()
    meta = torch.device("meta")
    for name in names:
        opdef = opdefs.get(name)
        makers = [(case.arguments, (3, "meta")) for case in opdef.cases()]
        makers += [(bench.arguments, (1, hidden, torch.bfloat16, meta)) for bench in opdef.bench()]
        with config.host_layout(traits):
            for make, arguments in makers:
                try:
                    args, kwargs = make(*arguments)
                    call, _ = opdefs.describe_call(opdef.name, *args, **kwargs)
                except TileplugError:
                    continue  # a case another layout makes (its quantized input) is not this backend's
                calls.append(dataclasses.replace(call, device_type=device_type))
    return list(dict.fromkeys(calls))


def precompile(backend: Any, device_type: str, ops: Sequence[str] | None = None, workers: int | None = None,
               hidden: int = 7168) -> PrecompileReport:
    """Compile what ``backend`` lacks for the grid of ``ops`` on ``device_type``."""
    if backend.precompile is None:
        raise TileplugError(f"backend '{backend.name}' compiles nothing ahead of time (it has no precompile hook)")
    calls = grid_calls(backend, device_type, ops, hidden)
    started = time.perf_counter()
    compiled = backend.precompile(calls, workers)
    return PrecompileReport(backend.name, len(calls), int(compiled), time.perf_counter() - started)
