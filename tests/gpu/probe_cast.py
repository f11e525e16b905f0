#!/usr/bin/env python3
"""Element-wise cast bandwidth on one GPU (issue: quant family extras, goal: the stochastic casts
>= 90 % of the deterministic cast's bandwidth and >= TileKernels' on the same shapes).

In one process, tileplug's own ``median_seconds`` (CUDA events, clean L2) and
``graph_seconds_per_call`` (one CUDA graph over distinct inputs whose working set exceeds L2:
the kernels alone), H = 7168, T in {128, 4096, 65536}, for fp32 → bf16, fp32 → e4m3 and
bf16 → e4m3: the deterministic ``core.ops.cast`` (torch's conversion under a saturating
clamp for e4m3; eager and graph), the stochastic ``core.ops.cast(..., stochastic_rounding=True)``
(eager: what a user's call costs) and the op it runs, ``stochastic_cast`` (eager and graph),
and TileKernels' ``cast(x, dtype, stochastic_rounding)`` both ways (eager and graph; it draws
its bits itself, without a generator argument). GB/s = (x bytes + result bytes) /
median time; the 2 GiB copy of the same run is printed next to them. Writes
``$OUT/cast_bandwidth.json`` when ``OUT`` is set.

    . .gpu-bundle/prelude.sh && python3 tests/gpu/probe_cast.py
"""

from __future__ import annotations

import json
import os
import time

import torch

from tileplug.core import ops
from tileplug.core.benchmark import copy_bandwidth, graph_seconds_per_call, median_seconds
from tileplug.core.random import Generator
from tileplug.core.registry import use_backend

HIDDEN = 7168
TOKENS = (128, 4096, 65536)
PAIRS = [(torch.float32, torch.bfloat16), (torch.float32, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e4m3fn)]


def peer_cast():
    """TileKernels' ``cast(x, dtype, stochastic_rounding=False)``, or None without TileKernels."""
    try:
        from tile_kernels.quant import cast
    except ImportError as error:
        print(f"tile_kernels: not importable ({error})")
        return None
    return cast


def warm_up(device: torch.device, seconds: float = 0.5) -> None:
    """Every pair's casts called for ``seconds`` before anything is timed: the first pair timed
    in a fresh process measured 8.1 µs eager and 40 µs of host time per call at T = 128, against
    5.4 and 21.6 µs once the process had run a while (H200 host, 2026-12-04)."""
    inputs = [(torch.randn(128, HIDDEN, device=device).to(source), target) for source, target in PAIRS]
    generator = Generator(device, 1)
    started = time.perf_counter()
    with use_backend("cuda"):
        while time.perf_counter() - started < seconds:
            for x, target in inputs:
                ops.cast(x, target)
                ops.cast(x, target, stochastic_rounding=True, generator=generator)
    torch.cuda.synchronize(device)


def main() -> None:
    device = torch.device("cuda")
    copy = copy_bandwidth(device)
    print(f"copy 2 GiB: {copy:.0f} GB/s")
    peer = peer_cast()
    warm_up(device)
    rows = []
    failed = set()  # (pair, runner) whose first try raised: not tried again at the next T
    for source, target in PAIRS:
        for tokens in TOKENS:
            x = torch.randn(tokens, HIDDEN, device=device).to(source)
            result = torch.empty(tokens, HIDDEN, dtype=target, device=device)
            nbytes = x.numel() * (x.element_size() + result.element_size())
            generator = Generator(device, 1234)
            state = (generator.seed_state, generator.offset_state)
            runners = {
                "cast (deterministic)": lambda: ops.cast(x, target),
                "cast (stochastic)": lambda: ops.cast(x, target, stochastic_rounding=True, generator=generator),
                "stochastic_cast": lambda: ops.stochastic_cast(result, x, *state),
            }
            if peer is not None:
                runners["tile_kernels cast (deterministic)"] = lambda: peer(x, target)
                runners["tile_kernels cast (stochastic)"] = lambda: peer(x, target, stochastic_rounding=True)
            with use_backend("cuda"):
                for name, fn in runners.items():
                    if (source, target, name) in failed:
                        continue
                    try:
                        seconds = median_seconds(fn, device)
                    except Exception as error:  # noqa: BLE001 - a peer kernel this GPU cannot build
                        print(json.dumps({"pair": f"{source} -> {target}", "tokens": tokens, "runner": name,
                                          "error": f"{type(error).__name__}: {str(error)[-300:]}"}), flush=True)
                        failed.add((source, target, name))
                        continue
                    row = {"pair": f"{source} -> {target}", "tokens": tokens, "runner": name,
                           "eager_us": seconds * 1e6, "eager_GBps": nbytes / seconds / 1e9, "copy_GBps": copy}
                    graphed = {"stochastic_cast": (ops.stochastic_cast, (result, x, *state)),
                               "cast (deterministic)": (ops.cast, (x, target)),
                               "tile_kernels cast (deterministic)": (peer, (x, target)),
                               "tile_kernels cast (stochastic)": (peer, (x, target, True))}.get(name)
                    if graphed is not None:
                        graph, calls = graph_seconds_per_call(*graphed, {}, device, nbytes)
                        row.update(graph_us=graph * 1e6, graph_GBps=nbytes / graph / 1e9, graph_calls=calls)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "cast_bandwidth.json"), "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
