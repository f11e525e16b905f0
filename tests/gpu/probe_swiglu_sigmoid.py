#!/usr/bin/env python3
"""The CUDA SwiGLU sigmoids over dense grids of gate values, against the reference (a script,
not a pytest test: each variant is a fresh process, since the variant is read from the
environment when a call's kernel is chosen).

``y = swiglu([g | 1])`` is ``g · sigmoid(g)`` rounded once, so a sigmoid that differs from the
reference's correctly rounded one shows in ``y``'s bits:

- fp32 x, fp32 y (the ``exact`` sigmoid, also the fused cast's and the fp32 backward's):
  2^24 gate values spread over [−120, 40], plus the values around fp32's subnormal results
  (g in [−104, −87]) and the special values; every variant of ``TILEPLUG_CUDA_SWIGLU_FP64_SIGMOID``;
- bf16 x, bf16 y (the ``guarded`` / ``branchless`` / ``accurate`` sigmoids): every bf16 bit pattern.

For each variant: values whose bits differ from the reference's, the largest distance in ulps
(NaN against NaN counts as equal), and the same against the first variant of its dtype.

    . .gpu-bundle/prelude.sh && python3 tests/gpu/probe_swiglu_sigmoid.py   # $OUT/swiglu_sigmoid.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

FP32_VARIANTS = {"library": {"TILEPLUG_CUDA_SWIGLU_FP64_SIGMOID": "library"},
                 "reduced": {"TILEPLUG_CUDA_SWIGLU_FP64_SIGMOID": "reduced"}}
BF16_VARIANTS = {name: {"TILEPLUG_CUDA_SWIGLU_BF16_SIGMOID": name} for name in ("guarded", "branchless", "accurate")}
HIDDEN = 4096


def gate_values(dtype):
    """The grid of gate values of ``dtype`` (a 1-D CPU tensor, a multiple of ``HIDDEN`` long)."""
    import torch

    if dtype == torch.bfloat16:
        values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    else:
        spread = torch.linspace(-120.0, 40.0, 1 << 24, dtype=torch.float64).to(torch.float32)
        subnormal = torch.linspace(-104.0, -87.0, 1 << 20, dtype=torch.float64).to(torch.float32)
        special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-30, -1e-30, 80.0, -80.0,
                                -87.33654, 110.0, -110.0, 1e30, -1e30], dtype=torch.float32)
        values = torch.cat([spread, subnormal, special])
    pad = -values.numel() % HIDDEN
    return torch.cat([values, torch.zeros(pad, dtype=dtype)])


def swiglu_of(values, backend: str):
    """``swiglu([g | 1])`` of ``values`` on the GPU by ``backend`` (flat, on the CPU)."""
    import torch

    from tileplug.core import ops
    from tileplug.core.registry import use_backend

    gates = values.view(-1, HIDDEN).cuda()
    x = torch.cat([gates, torch.ones_like(gates)], dim=1)
    with use_backend(backend):
        y = ops.swiglu(x, out_dtype=values.dtype)
    return y.flatten().cpu()


def child(dtype_name: str, path: str) -> None:
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    torch.save(swiglu_of(gate_values(dtype), "cuda"), path)


def distance(a, b) -> tuple[int, int]:
    """(values that differ, largest ulp distance) of two same-dtype tensors; NaN = NaN, +0 = −0."""
    import torch

    from tileplug.core.testing import ulp_distance

    gap = ulp_distance(a, b)
    gap[torch.isnan(a.float()) & torch.isnan(b.float())] = 0
    return int((gap != 0).sum()), int(gap.max())


def main() -> None:
    import torch

    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for dtype_name, variants in (("fp32", FP32_VARIANTS), ("bf16", BF16_VARIANTS)):
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
            grid = gate_values(dtype)
            reference = swiglu_of(grid, "reference")
            first = None
            for name, env in variants.items():
                path = os.path.join(scratch, f"{dtype_name}-{name}.pt")
                done = subprocess.run([sys.executable, __file__, "--child", dtype_name, path],
                                      env={**os.environ, **env, "TILEPLUG_CUDA_KERNEL_INDEX": "off"},
                                      capture_output=True, text=True)
                if done.returncode:
                    results[f"{dtype_name}/{name}"] = {"error": done.stderr[-2000:]}
                    continue
                y = torch.load(path)
                differ, worst = distance(y, reference)
                entry = {"values": grid.numel(), "differ_from_reference": differ, "max_ulp": worst}
                if first is None:
                    first = (name, y)
                else:
                    entry[f"differ_from_{first[0]}"] = distance(y, first[1])[0]
                results[f"{dtype_name}/{name}"] = entry
                print(f"{dtype_name}/{name}: {entry}", flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "swiglu_sigmoid.json"), "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
