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
"${PYTHON:-python3}" tests/gpu/precompile_bench.py
"${PYTHON:-python3}" -m tileplug.core.cli bench --device cuda --tokens 1,16,128,1024,4096,8192,16384,65536 --hidden 7168 \
    --json "$OUT/bench.json" --verbose
