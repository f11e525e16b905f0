#!/usr/bin/env python3
"""Dispatch cost alone (a script, not a test): a no-op CPU backend registered in-process at
the highest priority, so ``core.ops`` calls cost the contract, the route, the allocation and
a launch that does nothing. Host µs per call, best of 7 × 20000; ``torch.empty x2`` is the
allocation floor. Runs against whichever tree ``PYTHONPATH`` points at (same API before and
after the op table).

    python3 tests/gpu/probe_noop_dispatch.py [label]
"""
import time, sys
import torch
from tileplug import core

class Noop:
    def supports(self, call): return None
    def __call__(self, call, inputs, outputs): pass

core.registry.register(core.Backend(name="noop", device_types=("cpu",), priority=10**6, traits=core.CUDA_LAYOUT,
                                    kernels={"per_token_cast": Noop(), "cast_back": Noop(), "per_block_cast": Noop(),
                                             "per_channel_cast": Noop()}))
def per_call(fn, calls=20000, rounds=7):
    for _ in range(2000): fn()
    best = 1e9
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls): fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6
x = torch.randn(1, 7168).to(torch.bfloat16)
q = torch.empty(1, 7168, dtype=torch.float8_e4m3fn); sf = torch.ones(1, 56)
res = {}
res["per_token_cast"] = per_call(lambda: core.ops.per_token_cast(x))
res["per_block_cast"] = per_call(lambda: core.ops.per_block_cast(x, block_size=(128, 128)))
res["per_channel_cast"] = per_call(lambda: core.ops.per_channel_cast(x, num_per_tokens=128))
res["cast_back"] = per_call(lambda: core.ops.cast_back((q, sf), "bf16", x_block_size=(1, 128)))
p = torch.nn.Parameter(x, requires_grad=False)
res["per_token_cast(Parameter)"] = per_call(lambda: core.ops.per_token_cast(p))
res["torch.empty x2"] = per_call(lambda: (torch.empty((1, 7168), dtype=torch.float8_e4m3fn), torch.empty((1, 56))))
print(sys.argv[1] if len(sys.argv) > 1 else "", {k: round(v, 2) for k, v in res.items()})
