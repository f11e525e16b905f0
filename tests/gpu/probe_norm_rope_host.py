#!/usr/bin/env python3
"""Host time of the fused QK ops at T = 1 on the GPU (a script, not a pytest test): µs per call
back to back (``tileplug.core.benchmark.host_seconds_per_call``) of ``rms_norm_rope``, its fused
per-token cast and ``per_token_cast`` of the same row, then a cProfile of the fused cast's calls
(the 25 functions with the most own time).

    . .gpu-bundle/prelude.sh && python3 tests/gpu/probe_norm_rope_host.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys

import torch


def main() -> int:
    from tileplug.core import ops
    from tileplug.core.benchmark import bench_cases, host_seconds_per_call

    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")  # cpu: a smoke run on the reference
    args, kwargs = bench_cases()["rms_norm_rope"].arguments(1, 7168, torch.bfloat16, device)
    row = args[0].reshape(1, -1)
    calls = {
        "rms_norm_rope": lambda: ops.rms_norm_rope(*args, **kwargs),
        "rms_norm_rope_per_token_cast": lambda: ops.rms_norm_rope_per_token_cast(*args, num_per_channels=64, **kwargs),
        "per_token_cast 1x64": lambda: ops.per_token_cast(row, num_per_channels=64),
    }
    for name, call in calls.items():
        call()
        print(f"{name}: {host_seconds_per_call(call, device) * 1e6:.1f} us a call", flush=True)
    cast = calls["rms_norm_rope_per_token_cast"]
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(3000 if device.type == "cuda" else 20):
        cast()
    profile.disable()
    if device.type == "cuda":
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
