#!/usr/bin/env python3
"""Host time per call of every bench case at T = 1, split into its pieces (a script for the
GPU host, not a pytest test), with the device kernels one call launches.

Pieces, each issued back to back with no sync (``host_seconds_per_call``, best of 3):
the contract (``OpDef.contract``: the memoised check), the cached route lookup, the
allocation plan, the route's launcher into preallocated outputs, and the whole public call.
Then ``torch.profiler`` lists the CUDA kernels of one call, and cProfile the top functions
of the slowest case. Writes ``$OUT/host_cases.txt``.

    . .gpu-bundle/prelude.sh && python3 tests/gpu/probe_host_cases.py
    HOST_CASES=per_token_cast,cast_back python3 tests/gpu/probe_host_cases.py   # those bench cases only
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys

import torch


def main() -> int:
    from tileplug.core import opdefs, registry
    from tileplug.core.benchmark import bench_cases, host_seconds_per_call

    device = torch.device("cuda")
    lines = []
    slowest = (0.0, None)
    wanted = [name for name in os.environ.get("HOST_CASES", "").split(",") if name]  # empty: every bench case
    for name, case in bench_cases().items():
        if wanted and name not in wanted:
            continue
        opdef = opdefs.get(case.op)
        args, kwargs = case.arguments(1, 7168, torch.bfloat16, device)
        call, inputs = opdef.contract(*args, **kwargs)
        route = registry.route(call)
        outputs = route.plan.allocate(call.tokens, call.device)
        launcher = route.launcher or route.prepare()
        launcher(inputs, outputs)
        pieces = {
            "contract": lambda: opdef.contract(*args, **kwargs),
            "route": lambda: registry.route(call),
            "allocate": lambda: route.plan.allocate(call.tokens, call.device),
            "launcher": lambda: launcher(inputs, outputs),
            "whole call": lambda: opdef.function(*args, **kwargs),
        }
        times = {piece: min(host_seconds_per_call(fn, device, calls=3000) for _ in range(3)) * 1e6
                 for piece, fn in pieces.items()}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            opdef.function(*args, **kwargs)
            torch.cuda.synchronize()
        kernels = [event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]
        lines.append(f"{name:28s} " + "  ".join(f"{k} {v:6.2f}" for k, v in times.items())
                     + f"  kernels: {kernels}")
        print(lines[-1], flush=True)
        if times["whole call"] > slowest[0]:
            slowest = (times["whole call"], (name, opdef, args, kwargs))
    name, opdef, args, kwargs = slowest[1]
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5000):
        opdef.function(*args, **kwargs)
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    lines.append(f"\ncProfile of 5000 calls of {name} (tottime):\n" + text.getvalue())
    with open(os.path.join(os.environ.get("OUT", "."), "host_cases.txt"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
