#!/usr/bin/env python3
"""Where the host time of one ``core.ops.per_token_cast`` call on a 1 × 7168 bf16 tensor goes
(a script for the GPU host, not a pytest test).

Each line is the host time per call of one piece, issued back to back with no sync
(``tileplug.core.benchmark.host_seconds_per_call``): torch allocations and a torch kernel
launch as the floor of this host, the contract alone, the compiled kernel's entry point
with preallocated outputs, the launcher, and the whole op. A cProfile of the whole op
follows. Writes ``$OUT/host_time.txt`` (OUT defaults to the current directory).

    . .gpu-bundle/prelude.sh && python3 tests/gpu/probe_host_time.py
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys

import torch


def main() -> int:
    import tvm_ffi

    from tileplug.core import describe_call, ops, registry
    from tileplug.core.benchmark import host_seconds_per_call

    device = torch.device("cuda")
    lines = [
        f"torch {torch.__version__}, tvm_ffi {getattr(tvm_ffi, '__version__', '?')}, "
        f"torch.Tensor.__dlpack_c_exchange_api__: {hasattr(torch.Tensor, '__dlpack_c_exchange_api__')}",
        f"device: {torch.cuda.get_device_name(0)}",
    ]
    x = torch.randn(1, 7168, device=device).to(torch.bfloat16)
    call, inputs = describe_call(ops.per_token_cast, x)
    route = registry.route(call)
    plan = route.plan
    outputs = plan.allocate(call.tokens, call.device)
    route.launch(inputs, outputs)
    launcher = route.launcher
    small = torch.empty(16, device=device)
    a, b, c = (torch.empty(16, device=device) for _ in range(3))

    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.backend_cuda import jit

    kernel = _KERNELS[call.op]
    spec = kernel.spec(call)
    compiled = jit.compiled(spec)
    entry = compiled.adapter.get_exportable_executable()

    pieces = {
        "torch.empty fp8 [1,7168] (cuda)": lambda: torch.empty((1, 7168), dtype=torch.float8_e4m3fn, device=device),
        "torch.empty x2 (q + sf)": lambda: (torch.empty((1, 7168), dtype=torch.float8_e4m3fn, device=device),
                                            torch.empty((1, 56), dtype=torch.float32, device=device)),
        "torch small.zero_() launch": lambda: small.zero_(),
        "torch.add(a, b, out=c) launch": lambda: torch.add(a, b, out=c),
        "contract (describe_call)": lambda: describe_call(ops.per_token_cast, x),
        "registry.route(call)": lambda: registry.route(call),
        "plan.allocate": lambda: plan.allocate(call.tokens, call.device),
        "tvm_ffi entry(x, q, sf), preallocated": lambda: entry(x, outputs.q, outputs.sf),
        "JITKernel(x, q, sf), preallocated": lambda: compiled(x, outputs.q, outputs.sf),
        "launcher(inputs, outputs)": lambda: launcher(inputs, outputs),
        "core.ops.per_token_cast(x)": lambda: ops.per_token_cast(x),
    }
    try:  # the same kernel through TileLang's cython execution backend, for comparison
        import tilelang

        cython_kernel = tilelang.compile(jit.prim_func(spec), target={"kind": "cuda", "arch": jit.device_arch()},
                                         execution_backend="cython", pass_configs=dict(jit.PASS_CONFIGS))
        cython_kernel(x, outputs.q, outputs.sf)
        pieces["cython JITKernel(x, q, sf), preallocated"] = lambda: cython_kernel(x, outputs.q, outputs.sf)
    except Exception as error:  # noqa: BLE001 - reported, not fatal
        lines.append(f"cython backend: {type(error).__name__}: {str(error)[:200]}")
    for name, fn in pieces.items():
        best = min(host_seconds_per_call(fn, device, calls=5000) for _ in range(3))
        lines.append(f"{name:45s} {best * 1e6:7.2f} us/call (best of 3 x 5000)")
        print(lines[-1], flush=True)

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(20000):
        ops.per_token_cast(x)
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    lines.append("\ncProfile of 20000 core.ops.per_token_cast(x) calls (tottime):\n" + text.getvalue())
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "host_time.txt"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines[-1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
