#!/usr/bin/env bash
# Issue 3 benchmark on the GPU host (after `. .gpu-bundle/prelude.sh`; PYTHON overrides python3): effective GB/s of every quant op of the cuda backend
# at H = 7168, next to the device copy and torch.compile(reference) measured in the same
# run, plus the host time per call at T = 1 (the "dispatch" section of the report).
#
#   OUT=/some/dir tests/gpu/bench_cuda.sh            # writes $OUT/bench.json (default: .)
#
# The bench cases' kernels are compiled first (in parallel, into TileLang's disk cache), so
# no compilation happens inside a timed region.
set -euo pipefail
OUT=${OUT:-.}
cd "$(dirname "$0")/../.."
"${PYTHON:-python3}" - <<'PY'
import torch
from tileplug.backend_cuda.plugin import _KERNELS
from tileplug.backend_cuda.quant import jit
from tileplug.core.benchmark import bench_cases
from tileplug.core.lowering import describe_call

specs = []
for case in bench_cases().values():
    for dtype in (torch.bfloat16,):
        x = torch.randn(4, 7168, dtype=dtype)
        args, kwargs = case.make_args(x)
        call, _ = describe_call(case.op, *args, **kwargs)
        kernel = _KERNELS[call.op]
        if kernel.supports(call) is None:
            specs.append(kernel.spec(call))
jit.precompile(specs)
print(f"precompiled {len(specs)} bench specialisations")
PY
"${PYTHON:-python3}" -m tileplug.core.cli bench --device cuda --tokens 1,16,128,1024,4096,16384,65536 --hidden 7168 \
    --json "$OUT/bench.json" --verbose
