#!/usr/bin/env python3
"""Device time of each kernel one norm backward call launches (torch.profiler, the median of 20 calls per kernel),
at the row block and tile the environment sets (a script for the GPU host, not a test):

    TILEPLUG_CUDA_NORM_BACKWARD_ROW_BLOCK=32 python3 tests/gpu/probe_norm_backward_kernels.py 1024,2048,4096
"""

from __future__ import annotations

import statistics
import sys

import torch


def main() -> int:
    from tileplug.core import ops

    hidden = 7168
    for tokens in [int(t) for t in sys.argv[1].split(",")]:
        generator = torch.Generator(device="cuda").manual_seed(tokens)
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
        grad_y = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
        weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
        bias = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
        _, rms_rstd = ops.rms_norm(x, weight, return_rstd=True)
        _, mean, rstd = ops.layer_norm(x, weight, bias, return_stats=True)
        calls = {"rms_norm_backward": lambda: ops.rms_norm_backward(grad_y, x, weight, rms_rstd),
                 "layer_norm_backward": lambda: ops.layer_norm_backward(grad_y, x, weight, mean, rstd)}
        for name, call in calls.items():
            call()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
                for _ in range(20):
                    call()
                torch.cuda.synchronize()
            times: dict[str, list[float]] = {}
            for event in profile.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    times.setdefault(event.name, []).append(event.device_time)
            parts = "  ".join(f"{kernel[:60]} {statistics.median(values):.1f}" for kernel, values in times.items())
            print(f"{name} T={tokens}: {parts}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
