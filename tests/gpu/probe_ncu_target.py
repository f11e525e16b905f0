#!/usr/bin/env python3
"""A profiling target (run under ``ncu``; a script, not a test): one bench case at one T,
called a few times by tileplug and, when importable, by TileKernels.

    ncu --clock-control none -k regex:per_block python3 tests/gpu/probe_ncu_target.py per_block_cast 128
    ncu --clock-control none -k regex:gate python3 tests/gpu/probe_ncu_target.py moe_topk_gate/deepseek-v3 65536 fp32

The optional third argument is the input dtype (``bf16`` by default, ``fp32``, ``fp16``), as ``tileplug bench --dtype``.
"""

from __future__ import annotations

import sys

import torch


def main() -> int:
    from tileplug.core import opdefs
    from tileplug.core.benchmark import bench_cases, peer_arguments

    name, tokens = sys.argv[1], int(sys.argv[2])
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[sys.argv[3] if len(sys.argv) > 3 else "bf16"]
    case = bench_cases()[name]
    args, kwargs = case.arguments(tokens, 7168, dtype, torch.device("cuda"))
    function = opdefs.get(case.op).function
    runners = [("tileplug", function, args, kwargs)]
    try:
        import tileplug.core.peers.tile_kernels as peer

        theirs = getattr(peer, case.op)
        runners.append(("tile_kernels", theirs, *peer_arguments(function, theirs, args, kwargs)))
    except Exception as error:  # noqa: BLE001
        print(f"tile_kernels not importable: {error}")
    for label, run, run_args, run_kwargs in runners:
        for _ in range(3):
            run(*run_args, **run_kwargs)
        torch.cuda.synchronize()
        print(f"{label}: ran {name} at T={tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
