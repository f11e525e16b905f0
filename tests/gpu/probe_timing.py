#!/usr/bin/env python3
"""How the timing method moves the measured bandwidth of the CUDA quant kernels and of the
copy they are compared with (a script for the GPU host, not a pytest test).

For each bench case at T in {8192, 16384, 65536} (H = 7168, bf16, the default
specialisation, launched directly) and for a device copy moving the same number of bytes
(``ledger / 2`` read + ``ledger / 2`` written), three methods:

- ``zero-flush``: ``triton.testing.do_bench`` — before each call L2 is flushed by zeroing a
  256 MB buffer, which leaves L2 full of dirty lines the timed kernel must write back;
- ``read-flush``: ``tileplug.core.benchmark.median_seconds`` (what ``tileplug bench`` does):
  event timing after an L2 flush that reads 256 MB (clean lines);
- ``graph``: 20 calls back to back in a CUDA graph, no flush (steady state: each call
  evicts the previous call's dirty output).

Median µs and GB/s for each; the 2 GiB copy (``tileplug bench``'s ceiling) is printed first.
Writes ``$OUT/timing.txt``.

    . .gpu-bundle/prelude.sh && python3 tests/gpu/probe_timing.py
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import sweep_tiles  # noqa: E402  (same directory: the cases and their inputs)

TOKENS = (8192, 16384, 65536)


def graph_seconds(fn, calls: int = 20, reps: int = 15) -> float:
    """Seconds per call of ``calls`` back-to-back calls replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3 / calls)
    return statistics.median(samples)


def methods(fn, do_bench) -> dict[str, float]:
    from tileplug.core.benchmark import median_seconds

    return {
        "zero-flush": do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e-3,
        "read-flush": median_seconds(fn, torch.device("cuda")),  # what tileplug bench does
        "graph": graph_seconds(fn),
    }


def main() -> int:
    import triton.testing

    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.quant.kernels import make_launcher
    from tileplug.core import CUDA_LAYOUT

    do_bench = triton.testing.do_bench
    lines = []

    def say(text: str) -> None:
        lines.append(text)
        print(text, flush=True)

    big = 1 << 30
    src = torch.ones(big, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for name, seconds in methods(lambda: dst.copy_(src), do_bench).items():
        say(f"copy 2 GiB {name:10s}: {2 * big / seconds / 1e9:7.0f} GB/s")
    del src, dst
    cases = [c for c in os.environ.get("CASES", ",".join(sweep_tiles.CASES)).split(",") if c]
    specs = {}
    for case in cases:
        kernel, call, _ = sweep_tiles.describe(case, 4, torch.device("meta"))
        specs[case] = kernel.spec(call)
    jit.precompile(list(specs.values()))
    say(f"{'case':18s} {'T':>6s} {'method':10s} {'op us':>8s} {'op GB/s':>8s} {'copy us':>8s} {'copy GB/s':>9s} {'op/copy':>7s}")
    for case in cases:
        launch = make_launcher(specs[case], jit.entry(specs[case]))
        for tokens in TOKENS:
            _, call, inputs = sweep_tiles.describe(case, tokens, torch.device("cuda"))
            outputs = call.allocate(CUDA_LAYOUT)
            ledger = call.ledger(CUDA_LAYOUT).bytes_total
            src = torch.ones(ledger // 2, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            op_times = methods(lambda: launch(inputs, outputs), do_bench)
            copy_times = methods(lambda: dst.copy_(src), do_bench)
            for name in op_times:
                op_s, copy_s = op_times[name], copy_times[name]
                say(f"{case:18s} {tokens:6d} {name:10s} {op_s * 1e6:8.1f} {ledger / op_s / 1e9:8.0f} "
                    f"{copy_s * 1e6:8.1f} {2 * (ledger // 2) / copy_s / 1e9:9.0f} {copy_s / op_s * 100:6.1f}%")
            del src, dst, outputs, inputs
            torch.cuda.empty_cache()
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "timing.txt"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
