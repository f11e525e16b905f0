#!/usr/bin/env python3
"""``transpose_weight_sf`` speed on one GPU (issue: quant family extras, goal: at least as fast
as TileKernels' ``batched_transpose_weight_sf`` on the same shapes).

In one process, tileplug's ``median_seconds`` (CUDA events, clean L2; eager: what a call costs)
and ``graph_seconds_per_call`` (one CUDA graph over distinct inputs: the kernels alone), for
weights of T × 7168 at bs 128 (scales [T/128, 56]), T in {128, 4096, 65536}, one weight and eight
weights in one call: the cuda backend, the reference on the GPU and TileKernels. GB/s = ledger
bytes (scales read + every packed integer written) / time; the 2 GiB copy of the same run is
printed next to them; at the smallest T also the host time per call (back to back, no sync). Writes ``$OUT/weight_scales.json`` when ``OUT`` is set.

    . .gpu-bundle/prelude.sh && python3 tests/gpu/probe_weight_scales.py
"""

from __future__ import annotations

import json
import os

import torch

from tileplug import core
from tileplug.core.benchmark import copy_bandwidth, graph_seconds_per_call, host_seconds_per_call, median_seconds
from tileplug.core.quant.layouts import CUDA_LAYOUT
from tileplug.core.registry import use_backend

HIDDEN = 7168
BLOCK = 128
TOKENS = (128, 4096, 65536)


def peer():
    try:
        from tile_kernels.quant import batched_transpose_weight_sf
    except ImportError:
        try:
            from tile_kernels.quant.batched_transpose_weight_sf import batched_transpose_weight_sf
        except ImportError as error:
            print(f"tile_kernels: not importable ({error})")
            return None
    return batched_transpose_weight_sf


def main() -> None:
    device = torch.device("cuda")
    copy = copy_bandwidth(device)
    print(f"copy 2 GiB: {copy:.0f} GB/s")
    batched = peer()
    rows = []
    for weights in (1, 8):
        for tokens in TOKENS:
            generator = torch.Generator().manual_seed(tokens + weights)
            shape = (tokens // BLOCK, HIDDEN // BLOCK)
            sf = tuple(torch.ldexp(torch.ones(shape), torch.randint(-30, 11, shape, generator=generator).float())
                       .to(device) for _ in range(weights))
            call, _ = core.describe_call("transpose_weight_sf", sf, BLOCK)
            nbytes = sum(core.opdefs.get("transpose_weight_sf").ledger(call, CUDA_LAYOUT)[:2])
            runners = {"tileplug cuda": ("cuda", lambda: core.ops.transpose_weight_sf(sf, BLOCK)),
                       "tileplug reference": ("reference", lambda: core.ops.transpose_weight_sf(sf, BLOCK))}
            if batched is not None:
                flags, outs = [False] * weights, [None] * weights
                runners["tile_kernels"] = (None, lambda: batched(list(sf), BLOCK, flags, outs))
            reference_bytes = None
            for name, (backend, fn) in runners.items():
                try:
                    if backend is None:
                        seconds = median_seconds(fn, device)
                        result = [t for pair in fn() for t in pair]
                    else:
                        with use_backend(backend):
                            seconds = median_seconds(fn, device)
                            result = list(fn())
                except Exception as error:  # noqa: BLE001 - report and go on
                    print(json.dumps({"runner": name, "tokens": tokens, "weights": weights,
                                      "error": f"{type(error).__name__}: {str(error)[-300:]}"}), flush=True)
                    continue
                if backend == "cuda":
                    reference_bytes = result
                same = None
                if reference_bytes is not None and name != "tileplug cuda":
                    same = all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(result, reference_bytes))
                row = {"runner": name, "tokens": tokens, "weights": weights, "eager_us": seconds * 1e6,
                       "eager_GBps": nbytes / seconds / 1e9, "copy_GBps": copy, "same_bytes_as_cuda": same}
                if name != "tileplug reference" and tokens == TOKENS[0]:  # back to back, no sync: the host's part
                    if backend is None:
                        row["host_us"] = host_seconds_per_call(fn, device) * 1e6
                    else:
                        with use_backend(backend):
                            row["host_us"] = host_seconds_per_call(fn, device) * 1e6
                if name != "tileplug reference":
                    try:
                        if backend is None:
                            graph, calls = graph_seconds_per_call(lambda s: batched(list(s), BLOCK, flags, outs),
                                                                  (sf,), {}, device, nbytes)
                        else:
                            with use_backend(backend):
                                graph, calls = graph_seconds_per_call(core.ops.transpose_weight_sf, (sf, BLOCK), {},
                                                                      device, nbytes)
                        row.update(graph_us=graph * 1e6, graph_GBps=nbytes / graph / 1e9, graph_calls=calls)
                    except Exception as error:  # noqa: BLE001 - TileKernels copies host tensors: not capturable
                        torch.cuda.synchronize()
                        row["graph_error"] = f"{type(error).__name__}: {str(error)[:160]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "weight_scales.json"), "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
