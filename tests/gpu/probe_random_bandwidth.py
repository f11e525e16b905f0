#!/usr/bin/env python3
"""randn / rand bandwidth on one GPU (issue: SwiGLU + RNG, goal: ``randn`` fp32 of 2^28 values
at >= 90 % of the write bandwidth of a ``fill_`` of the same bytes and >= ``torch.randn``).

In one process, with tileplug's own ``median_seconds`` (CUDA events, clean L2): ``values.fill_``,
``torch.randn(out=values)``, ``torch.rand(out=values)``, tileplug's ``fill_randn`` / ``fill_rand``
(the op table's CUDA kernels, eager: what a user's call costs) and the same tileplug draw
replayed from a CUDA graph (the kernels alone), for fp32 and bf16. GB/s = bytes written /
median time. Writes ``$OUT/random_bandwidth.json`` when ``OUT`` is set.

    . .gpu-bundle/prelude.sh && python3 tests/gpu/probe_random_bandwidth.py [log2 count]
"""

from __future__ import annotations

import json
import os
import sys

import torch

from tileplug.core.benchmark import median_seconds
from tileplug.core.ops import fill_rand, fill_randn
from tileplug.core.random import Generator
from tileplug.core.registry import use_backend


def graph_seconds(fn, repeats: int = 20) -> float:
    """Median time of ``fn`` replayed from a CUDA graph (CUDA events around each replay)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    device = torch.device("cuda")
    count = 1 << int(sys.argv[1] if len(sys.argv) > 1 else 28)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        values = torch.empty(count, dtype=dtype, device=device)
        generator = Generator(device, 1234)
        nbytes = count * values.element_size()
        runners = {
            "fill_": lambda: values.fill_(1.0),
            "torch.randn": lambda: torch.randn(count, dtype=dtype, device=device, out=values),
            "torch.rand": lambda: torch.rand(count, dtype=dtype, device=device, out=values),
            "tileplug fill_randn": lambda: fill_randn(values, generator.seed_state, generator.offset_state),
            "tileplug fill_rand": lambda: fill_rand(values, generator.seed_state, generator.offset_state),
        }
        with use_backend("cuda"):
            for name, fn in runners.items():
                seconds = median_seconds(fn, device)
                row = {"dtype": str(dtype), "count": count, "runner": name, "eager_us": seconds * 1e6,
                       "eager_GBps": nbytes / seconds / 1e9}
                if name.startswith("tileplug") or name == "torch.randn":
                    graph = graph_seconds(fn)
                    row.update(graph_us=graph * 1e6, graph_GBps=nbytes / graph / 1e9)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "random_bandwidth.json"), "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
