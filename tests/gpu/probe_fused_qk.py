#!/usr/bin/env python3
"""The fused QK path against the chain it replaces, on the GPU (a script, not a pytest test).

At H = N·D = 56 · 128 (bf16, NeoX over the whole head, int64 positions, the bench cases'
inputs) and T in {4096, 16384, 65536}: ``rms_norm_rope`` against ``rms_norm`` per head then
``apply_rotary`` on its output, and ``rms_norm_rope_per_token_cast`` (1×64 e4m3) against that
chain then ``per_token_cast``; each timed eager with ``tileplug.core.benchmark.median_seconds``
(L2 flushed, CUDA events), the fused ops also in CUDA-graph replay; the ledger ratio of chain /
fused bytes (``opdefs.unfused``) beside the time ratio, and the 2 GiB copy in the same run.
The fused results are first checked bytewise against the chain at T = 4001.

    . .gpu-bundle/prelude.sh && python3 tests/gpu/probe_fused_qk.py     # one JSON line per T
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> int:
    from tileplug.core import ops, opdefs
    from tileplug.core.benchmark import bench_cases, copy_bandwidth, graph_seconds_per_call, median_seconds
    from tileplug.core.lowering import describe_call

    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    hidden, dtype = 7168, torch.bfloat16
    cases = bench_cases()
    fused_case = cases["rms_norm_rope"]
    group = 64  # the cast bench case's groups (within a head at D = 128)

    def chain(x, weight, cache, positions=None, **kwargs):
        y = ops.rms_norm(x, weight, eps=kwargs.get("eps", 1e-6))
        ops.apply_rotary(y, cache, positions=positions)
        return y

    def chain_cast(x, weight, cache, positions=None, **kwargs):
        y = chain(x, weight, cache, positions, **kwargs)
        return ops.per_token_cast(y.view(y.shape[0], -1), num_per_channels=group)

    def fused_cast(x, weight, cache, positions=None, **kwargs):
        return ops.rms_norm_rope_per_token_cast(x, weight, cache, positions=positions, num_per_channels=group,
                                                **kwargs)

    args, kwargs = fused_case.arguments(4001, hidden, dtype, device)
    same = torch.equal(ops.rms_norm_rope(*args, **kwargs).view(torch.int16), chain(*args, **kwargs).view(torch.int16))
    q, sf = fused_cast(*args, **kwargs)
    q_chain, sf_chain = chain_cast(*args, **kwargs)
    same_cast = torch.equal(q.view(torch.uint8), q_chain.view(torch.uint8)) and torch.equal(sf, sf_chain)
    copy = copy_bandwidth(device)
    print(json.dumps({"copy_gbps": round(copy, 1), "fused_equals_chain": same, "fused_cast_equals_chain": same_cast}),
          flush=True)
    for tokens in (4096, 16384, 65536) if device.type == "cuda" else (64,):
        args, kwargs = fused_case.arguments(tokens, hidden, dtype, device)
        row = {"tokens": tokens}
        for label, op, fused, unfused in (("rope", "rms_norm_rope", ops.rms_norm_rope, chain),
                                          ("rope_cast", "rms_norm_rope_per_token_cast", fused_cast, chain_cast)):
            call, _ = describe_call(op, *args, **({"num_per_channels": group} if label == "rope_cast" else {}),
                                    **kwargs)
            opdef = opdefs.get(op)
            ledger = opdef.ledger(call, None).bytes_total
            chain_bytes = sum(step.bytes_total for _, step in opdef.unfused(call, None))
            fused_s = median_seconds(lambda: fused(*args, **kwargs), device)
            chain_s = median_seconds(lambda: unfused(*args, **kwargs), device)
            graph_s = graph_seconds_per_call(fused, args, kwargs, device, ledger)[0] if device.type == "cuda" else 0.0
            row[label] = {"fused_us": round(fused_s * 1e6, 1), "graph_us": round(graph_s * 1e6, 1),
                          "chain_us": round(chain_s * 1e6, 1), "gbps": round(ledger / fused_s / 1e9, 1),
                          "pct_of_copy": round(100 * ledger / fused_s / 1e9 / copy, 1),
                          "ledger_ratio": round(chain_bytes / ledger, 3), "time_ratio": round(chain_s / fused_s, 3)}
        print(json.dumps(row), flush=True)
    return 0 if same and same_cast else 1


if __name__ == "__main__":
    sys.exit(main())
