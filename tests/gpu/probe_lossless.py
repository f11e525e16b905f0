#!/usr/bin/env python3
"""``per_block_cast_lossless`` speed on one GPU (issue: quant family extras): the CUDA kernel
against TileKernels' ``per_block_cast_lossless`` and the reference on the GPU, same inputs.

In one process, tileplug's ``median_seconds`` (CUDA events, clean L2; eager: what a call costs)
and ``graph_seconds_per_call`` (one CUDA graph over distinct inputs: the kernel alone), for an
MXFP4 activation (e2m1 in 1 × 32 groups, packed UE8M0 scales, made by ``per_token_cast``) of
T × 7168, T in {128, 4096, 65536}, re-blocked into 128 × 128 groups and into 1 × 128 groups
(column-major), both with packed UE8M0 scales; at the smallest T also the host time per call
(calls issued back to back, ``host_seconds_per_call``; TileKernels needs T % 128 == 0). GB/s = ledger bytes (xq + sf read, q + sf
written) / time; the 2 GiB copy of the same run is printed next to them. Every runner's bytes
are compared with the cuda backend's. Writes ``$OUT/lossless.json`` when ``OUT`` is set.
``--cuda-only``: the cuda backend alone (tile sweeps through ``TILEPLUG_CUDA_TILE_*``).

    . .gpu-bundle/prelude.sh && python3 tests/gpu/probe_lossless.py [--cuda-only]
"""

from __future__ import annotations

import json
import os
import sys

import torch

from tileplug import core
from tileplug.core.benchmark import copy_bandwidth, graph_seconds_per_call, host_seconds_per_call, median_seconds
from tileplug.core.quant.layouts import CUDA_LAYOUT
from tileplug.core.registry import use_backend
from tileplug.core.testing import activation

OP = "per_block_cast_lossless"
HIDDEN = 7168
TOKENS = (128, 4096, 65536)
OUTPUTS = {
    "128x128": dict(out_block_size=(128, 128), round_sf=True, use_packed_ue8m0=True),
    "1x128-col": dict(out_block_size=(1, 128), round_sf=True, use_packed_ue8m0=True,
                      use_tma_aligned_col_major_sf=True),
}


def peer():
    try:
        from tile_kernels.quant import per_block_cast_lossless
    except ImportError as error:
        print(f"tile_kernels: not importable ({error})")
        return None
    return per_block_cast_lossless


def main() -> None:
    device = torch.device("cuda")
    copy = copy_bandwidth(device)
    print(f"copy 2 GiB: {copy:.0f} GB/s")
    cuda_only = "--cuda-only" in sys.argv
    tile_kernels = None if cuda_only else peer()
    rows = []
    for tokens in TOKENS:
        x = activation(tokens, HIDDEN, torch.bfloat16, seed=tokens).to(device)
        with use_backend("cuda"):
            pair = core.ops.per_token_cast(x, "e2m1", 32, round_sf=True, use_packed_ue8m0=True)
        for label, flags in OUTPUTS.items():
            kwargs = dict(fmt="e4m3", x_block_size=(1, 32), **flags)
            call, _ = core.describe_call(OP, pair, **kwargs)
            nbytes = sum(core.opdefs.get(OP).ledger(call, CUDA_LAYOUT)[:2])
            runners = {"tileplug cuda": "cuda"} if cuda_only else {"tileplug cuda": "cuda", "tileplug reference": "reference"}
            if tile_kernels is not None:
                runners["tile_kernels"] = None
            cuda_result = None
            for name, backend in runners.items():
                fn = (lambda p: tile_kernels(p, **kwargs)) if backend is None else (
                    lambda p: core.ops.per_block_cast_lossless(p, **kwargs))
                try:
                    if backend is None:
                        seconds = median_seconds(lambda: fn(pair), device)
                        result = fn(pair)
                    else:
                        with use_backend(backend):
                            seconds = median_seconds(lambda: fn(pair), device)
                            result = fn(pair)
                except Exception as error:  # noqa: BLE001 - report and go on
                    print(json.dumps({"runner": name, "tokens": tokens, "out": label,
                                      "error": f"{type(error).__name__}: {str(error)[-300:]}"}), flush=True)
                    continue
                if backend == "cuda":
                    cuda_result = result
                same = None
                if cuda_result is not None and name != "tileplug cuda":
                    same = [torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                        b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                            and a.stride() == b.stride() for a, b in zip(result, cuda_result)]
                row = {"runner": name, "tokens": tokens, "out": label, "eager_us": seconds * 1e6,
                       "eager_GBps": nbytes / seconds / 1e9, "copy_GBps": copy, "same_bytes_as_cuda": same}
                if name != "tileplug reference" and tokens == TOKENS[0]:  # back to back, no sync: the host's part
                    if backend is None:
                        row["host_us"] = host_seconds_per_call(lambda: fn(pair), device) * 1e6
                    else:
                        with use_backend(backend):
                            row["host_us"] = host_seconds_per_call(lambda: fn(pair), device) * 1e6
                if name != "tileplug reference":
                    try:
                        if backend is None:
                            graph, calls = graph_seconds_per_call(fn, (pair,), {}, device, nbytes)
                        else:
                            with use_backend(backend):
                                graph, calls = graph_seconds_per_call(fn, (pair,), {}, device, nbytes)
                        row.update(graph_us=graph * 1e6, graph_GBps=nbytes / graph / 1e9, graph_calls=calls)
                    except Exception as error:  # noqa: BLE001 - a peer that syncs or copies host data
                        torch.cuda.synchronize()
                        row["graph_error"] = f"{type(error).__name__}: {str(error)[:160]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    if os.environ.get("OUT") and not cuda_only:
        with open(os.path.join(os.environ["OUT"], "lossless.json"), "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
