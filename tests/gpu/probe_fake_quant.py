#!/usr/bin/env python3
"""``per_token_cast_and_cast_back`` on the GPU (a script, not a pytest test: a first check small
enough for a short device run): every op-table case at T in {1, 3, 1031, 4001}, the cuda
backend against the reference on the CPU (the conformance check, bytewise), its
specialisations compiled first in parallel; then GB/s at T = 4096 / 65536, H = 7168, beside
the two-op chain it replaces (per_token_cast, then cast_back into x).

    . .gpu-bundle/prelude.sh && python3 tests/gpu/probe_fake_quant.py      # $OUT/fake_quant.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch


def main() -> int:
    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.backend_cuda.quant import per_token_cast

    per_token_cast.FAKE_QUANT_VERIFIED = True  # this probe is the verification: run the kernel
    from tileplug.core import config, describe_call, opdefs, ops
    from tileplug.core.benchmark import copy_bandwidth, median_seconds
    from tileplug.reference.conformance import CaseDeclined, check_case

    opdef = opdefs.get("per_token_cast_and_cast_back")
    specs = {}
    for case in opdef.cases():
        with config.host_layout("cuda"):
            args, kwargs = case.arguments(3, torch.device("meta"))
            call, _ = describe_call(case.op, *args, **kwargs)
        call = dataclasses.replace(call, device_type="cuda")
        kernel = _KERNELS[call.op]
        if kernel.supports(call) is None:
            specs.update(dict.fromkeys(kernel.specs(call)))
    jit.precompile(list(specs))
    report = {"specialisations": len(specs), "checked": 0, "declined": 0, "failures": []}
    for case in opdef.cases():
        for tokens in (1, 3, 1031, 4001):
            try:
                check_case(case, tokens, "cuda", "cuda", oracle_device="cpu")
                report["checked"] += 1
            except CaseDeclined:
                report["declined"] += 1
            except AssertionError as error:
                report["failures"].append(f"{case.id} T={tokens}: {str(error)[:300]}")
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}), len(report["failures"]), "failures",
          flush=True)
    for line in report["failures"][:10]:
        print("  ", line)
    device = torch.device("cuda")
    report["copy_gbps"] = copy = copy_bandwidth(device)
    for tokens in (4096, 65536):
        x = torch.randn(tokens, 7168, device=device).to(torch.bfloat16)
        ledger = opdef.ledger(describe_call(ops.per_token_cast_and_cast_back, x)[0], None).bytes_total
        fused = median_seconds(lambda: ops.per_token_cast_and_cast_back(x), device)
        chain = median_seconds(lambda: x.copy_(ops.cast_back(ops.per_token_cast(x), "bf16", (1, 128))), device)
        row = {"tokens": tokens, "fused_us": fused * 1e6, "chain_us": chain * 1e6, "gbps": ledger / fused / 1e9}
        row["pct_of_copy"] = 100 * row["gbps"] / copy
        report.setdefault("speed", []).append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "fake_quant.json"), "w") as handle:
        json.dump(report, handle, indent=1)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
