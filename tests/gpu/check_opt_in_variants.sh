#!/usr/bin/env bash
# The opt-in CUDA variants that wait for a GPU, and the measurements that decide their defaults (a script, not a test;
# one command of about six minutes on the GPU host, results under $OUT):
#   1. the SwiGLU sigmoid table (TILEPLUG_CUDA_SWIGLU_SIGMOID_TABLE): its GPU tests, then the fused cast and the
#      backward with it off / on, TileKernels and Liger beside the second run;
#   2. the reduced Box-Muller (TILEPLUG_CUDA_RANDN_BOX_MULLER=reduced): its GPU test, then 2^28 values beside fill_
#      and torch.randn, library / reduced;
#   3. with time left, the SwiGLU module's fused = unfused, bit-exact and invariance tests on the table kernels;
#   4. the norm backwards' split path (TILEPLUG_CUDA_NORM_BACKWARD_SPLIT_BELOW): tests/gpu/probe_norm_backward_split.py;
#   5. the norm backwards at split 0 / 64 and row block 16 / 32, TileKernels beside the first;
#   6. the MoE gate's lane group scores (TILEPLUG_CUDA_MOE_LANE_GROUPS): its GPU test (the default kernel's bytes).
#
#   . .gpu-bundle/prelude.sh is sourced here; BUDGET (s, default 400) caps the whole command and STEPS (default
#   "1 2 3 4 5 6") picks the steps, so that one machine can take them in two commands.
set -u
start=$(date +%s)
BUDGET=${BUDGET:-400}
STEPS=" ${STEPS:-1 2 3 4 5 6} "
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
want() { [[ "$STEPS" == *" $1 "* ]]; }
cd "$(dirname "$0")/../.."
. .gpu-bundle/prelude.sh
OUT=${OUT:-.}
export PYTHONPYCACHEPREFIX=/tmp/pycache
# 1. the table's own GPU tests (every bf16 gate vs the reference at 1 / 3 / 8 row tiles a CTA; table = default bytes),
#    then the fused cast and the backward with and without the table, TileKernels and Liger beside the table run
if want 1; then
timeout 170 python3 -m pytest tests/gpu/test_cuda_swiglu.py -m gpu -q -x -k "table" -p no:cacheprovider \
  > $OUT/table_tests.txt 2>&1; tail -15 $OUT/table_tests.txt
BENCH="python3 -m tileplug.core.cli bench --device cuda --backends cuda --no-compile --no-dispatch --verbose --ops swiglu_per_token_cast,swiglu_per_token_cast/moe,swiglu_backward,swiglu_backward/weighted"
for v in 0 1; do
  echo "== table $v, $(left) s left" | tee -a $OUT/table_bench.txt
  extra=$([ $v = 1 ] && echo "--peer tile_kernels,liger" || echo "")
  env TILEPLUG_CUDA_SWIGLU_SIGMOID_TABLE=$v timeout $(( $(left) > 80 ? 80 : $(left) - 5 )) $BENCH $extra \
    --tokens 1,128,1024,4096,16384,65536 2>> $OUT/stderr.log | tee -a $OUT/table_bench.txt | grep -E "^swiglu|^copy"
done
fi
# 2. randn: the reduced Box–Muller's GPU test, then 2^28 values at library / reduced beside fill_ and torch.randn
if want 2 && [ $(left) -gt 100 ]; then
timeout 90 python3 -m pytest tests/gpu/test_cuda_random.py -m gpu -q -x -k "reduced" -s -p no:cacheprovider \
  > $OUT/randn_tests.txt 2>&1; tail -8 $OUT/randn_tests.txt
for v in library reduced; do
  echo "== box_muller $v, $(left) s left" | tee -a $OUT/randn_bench.txt
  env TILEPLUG_CUDA_RANDN_BOX_MULLER=$v OUT= timeout 60 python3 tests/gpu/probe_random_bandwidth.py 28 \
    2>> $OUT/stderr.log | tee -a $OUT/randn_bench.txt | grep -E "float32"
done
fi
# 3. with time left: the whole SwiGLU module on the table kernels (fused ≡ unfused, bit-exact, invariance)
if want 3 && [ $(left) -gt 120 ]; then
  env TILEPLUG_CUDA_SWIGLU_SIGMOID_TABLE=1 timeout $(( $(left) - 100 )) python3 -m pytest tests/gpu/test_cuda_swiglu.py \
    -m gpu -q -n 8 -k "fused or bit_exact or invariance" -p no:cacheprovider > $OUT/table_module.txt 2>&1
  tail -8 $OUT/table_module.txt
fi
# 4. session 21's split path (norm backwards at short T), if time is left
if want 4 && [ $(left) -gt 90 ]; then
  timeout $(( $(left) - 20 )) python3 tests/gpu/probe_norm_backward_split.py > $OUT/split.txt 2>&1; grep -v "^ok" $OUT/split.txt | tail -30
fi
# 5. the norm backwards at short and long T: split off / below 64, row block 16 / 32 (TileKernels beside the first)
NB="python3 -m tileplug.core.cli bench --device cuda --backends cuda --no-compile --no-dispatch --verbose --ops rms_norm_backward,layer_norm_backward"
for cfg in "0 16" "64 16" "64 32"; do
  set -- $cfg
  want 5 && [ $(left) -gt 60 ] || break
  extra=$([ "$1 $2" = "0 16" ] && echo "--peer tile_kernels" || echo "")
  echo "== split_below $1, row_block $2, $(left) s left" | tee -a $OUT/norm_backward.txt
  env TILEPLUG_CUDA_NORM_BACKWARD_SPLIT_BELOW=$1 TILEPLUG_CUDA_NORM_BACKWARD_ROW_BLOCK=$2 \
    timeout $(( $(left) > 70 ? 70 : $(left) - 5 )) $NB $extra --tokens 128,1024,4096,16384,65536 2>> $OUT/stderr.log \
    | tee -a $OUT/norm_backward.txt | grep -E "^(rms|layer)_norm_backward +[0-9]+ +[0-9]+ +(cuda|tile_kernels)"
done
# 6. the MoE gate's lane group scores (TILEPLUG_CUDA_MOE_LANE_GROUPS): the grouped gates' bytes against the default's
if want 6 && [ $(left) -gt 60 ]; then
  timeout $(( $(left) - 10 )) python3 -m pytest tests/gpu/test_cuda_moe.py -m gpu -q -x -k "lane_group" \
    -p no:cacheprovider > $OUT/moe_lane_groups.txt 2>&1; tail -5 $OUT/moe_lane_groups.txt
fi
echo "all done, $(left) s left"
