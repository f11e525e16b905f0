#!/usr/bin/env python3
"""Stochastic per-token / per-block cast bandwidth on one GPU (issue: quant family extras, goal: the
stochastic casts >= 90 % of the deterministic cast's bandwidth).

In one process, tileplug's own ``median_seconds`` (CUDA events, clean L2) and
``graph_seconds_per_call`` (one CUDA graph over distinct inputs whose working set exceeds L2: the
kernels alone), H = 7168, bf16 input, T in TOKENS: each case of :data:`CASES` deterministic and with
``stochastic_rounding=True`` (the generator's offset advanced on the device; a graph replay draws
fresh bits), GB/s = the case's ledger bytes (x read, q and sf written) / median time, the 2 GiB copy
of the same run beside them, and the stochastic form's share of the deterministic one's bandwidth.
TileKernels' stochastic per-token cast does not build for sm_90 (2026-12-07), so it has no column.
Writes ``$OUT/stochastic_quant.json`` when ``OUT`` is set; ``TOKENS=128,4096`` narrows the counts.

    . .gpu-bundle/prelude.sh && python3 tests/gpu/probe_stochastic_quant.py
"""

from __future__ import annotations

import json
import os

import torch

from tileplug.core import ops
from tileplug.core.benchmark import copy_bandwidth, graph_seconds_per_call, median_seconds
from tileplug.core.random import Generator
from tileplug.core.registry import use_backend

HIDDEN = 7168
TOKENS = tuple(int(t) for t in os.environ.get("TOKENS", "128,4096,65536").split(","))
CASES = {
    "per_token 1x128 e4m3": (ops.per_token_cast, {"fmt": "e4m3", "num_per_channels": 128}),
    "per_token 1x16 e2m1": (ops.per_token_cast, {"fmt": "e2m1", "num_per_channels": 16}),
    "per_block 128x128 e4m3": (ops.per_block_cast, {"fmt": "e4m3", "block_size": (128, 128)}),
}


def ledger_bytes(x: torch.Tensor, outputs: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Bytes a cast moves: ``x`` read, ``q`` and ``sf`` written (their storage, padding included)."""
    return x.numel() * x.element_size() + sum(t.untyped_storage().nbytes() for t in outputs)


def main() -> None:
    device = torch.device("cuda")
    copy = copy_bandwidth(device)
    print(f"copy 2 GiB: {copy:.0f} GB/s")
    rows = []
    with use_backend("cuda"):
        for name, (op, kwargs) in CASES.items():
            for tokens in TOKENS:
                x = torch.randn(tokens, HIDDEN, device=device).to(torch.bfloat16)
                generator = Generator(device, 1234)
                nbytes = ledger_bytes(x, op(x, **kwargs))
                forms = {"deterministic": {}, "stochastic": {"stochastic_rounding": True, "generator": generator}}
                row = {"case": name, "tokens": tokens, "copy_GBps": round(copy, 1)}
                for form, extra in forms.items():
                    op(x, **kwargs, **extra)  # compiled and warm before timing
                    eager = median_seconds(lambda: op(x, **kwargs, **extra), device)
                    graph, _ = graph_seconds_per_call(op, (x,), {**kwargs, **extra}, device, nbytes)
                    row[form] = {"eager_us": round(eager * 1e6, 2), "graph_us": round(graph * 1e6, 2),
                                 "eager_GBps": round(nbytes / eager / 1e9, 1),
                                 "graph_GBps": round(nbytes / graph / 1e9, 1)}
                for timing in ("eager_us", "graph_us"):
                    row[f"stochastic_share_{timing[:-3]}"] = round(
                        100 * row["deterministic"][timing] / row["stochastic"][timing], 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "stochastic_quant.json"), "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
