#!/usr/bin/env python3
"""Dispatch cost of ``per_token_cast`` [1, 7168] and ``cast_back`` of its result (a script,
not a pytest test): host µs per call through ``core.ops`` against the selected backend's
kernel called directly (``kernel.prepare(call)`` once, then the launcher on fresh
``torch.empty`` outputs each call), issued back to back with no sync, best of 10 × 3000.

Written against the API both before and after the op table (``core.describe_call``,
``registry.select``, ``kernel.prepare``, ``call.allocate``), so one script measures both
trees: point ``PYTHONPATH`` at the older tree's ``packages/*/src`` to measure it.

    python3 tests/gpu/probe_dispatch_cost.py [--device cuda|cpu] [--label after] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def per_call(fn, calls: int = 3000, rounds: int = 10, sync=lambda: None) -> float:
    for _ in range(100):
        fn()
    sync()
    best = float("inf")
    for _ in range(rounds):
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - begin) / calls)
        sync()
    return best * 1e6


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--label", default="")
    parser.add_argument("--json")
    args = parser.parse_args()
    from tileplug import core

    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    x = torch.randn(1, 7168, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(device)
    pair = core.ops.per_token_cast(x)
    results = {"label": args.label, "device": str(device), "torch": torch.__version__,
               "tileplug_core": core.__file__}
    for name, op, op_args, op_kwargs in (
        ("per_token_cast", core.ops.per_token_cast, (x,), {}),
        ("cast_back", core.ops.cast_back, (pair,), {"fmt": "bf16", "x_block_size": (1, 128)}),
    ):
        call, inputs = core.describe_call(op, *op_args, **op_kwargs)
        backend, kernel = core.registry.select(call.op, call)
        traits = backend.traits_for(call.device_type)
        prepare = getattr(kernel, "prepare", None)
        launch = prepare(call) if prepare is not None else (lambda i, o: kernel(call, i, o))
        plan = call.allocation_plan(traits)

        def direct():
            launch(inputs, plan.allocate(call.tokens, call.device))

        through_core = per_call(lambda: op(*op_args, **op_kwargs), sync=sync)
        kernel_direct = per_call(direct, sync=sync)
        results[name] = {"backend": backend.name, "core_us": through_core, "direct_us": kernel_direct,
                         "dispatch_overhead_us": through_core - kernel_direct}
        print(f"{args.label} {name} on {device} via {backend.name}: core {through_core:.2f} us, "
              f"kernel directly {kernel_direct:.2f} us, dispatch {through_core - kernel_direct:.2f} us", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
