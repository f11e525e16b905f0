#!/usr/bin/env bash
# ncu of the MoE gate kernels (fp32 logits, T=65536) in each score math, and TileKernels' sqrtsoftplus gate (GPU host; results under $OUT).
cd "$(dirname "$0")/../.."
. .gpu-bundle/prelude.sh >/dev/null 2>&1
export PYTHONPYCACHEPREFIX=/tmp/pycache
OUT=${OUT:-.}
S="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis"
M="--metrics smsp__inst_executed_pipe_fp64.sum,smsp__inst_executed_pipe_lsu.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__data_pipe_lsu_wavefronts.sum,smsp__inst_executed.sum,sm__pipe_fp64_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_op_shfl.sum"
# precompile both forms (not profiled)
for math in library tables; do TILEPLUG_CUDA_MOE_SCORE_MATH=$math timeout 200 python3 tests/gpu/probe_ncu_target.py moe_topk_gate/sqrtsoftplus-shared1 1024 fp32 >/dev/null 2>&1; done
TILEPLUG_CUDA_MOE_SCORE_MATH=library timeout 200 python3 tests/gpu/probe_ncu_target.py moe_topk_gate/deepseek-v3 1024 fp32 >/dev/null 2>&1
echo "precompiled at $(date +%T)"
for run in "library moe_topk_gate/sqrtsoftplus-shared1" "tables moe_topk_gate/sqrtsoftplus-shared1" "library moe_topk_gate/deepseek-v3"; do
  set -- $run
  f=$OUT/ncu_$1_${2##*/}.txt
  TILEPLUG_CUDA_MOE_SCORE_MATH=$1 timeout 150 ncu --clock-control none $S $M -k regex:"gate|topk|softplus|route" -c 4 \
    python3 tests/gpu/probe_ncu_target.py $2 65536 fp32 > $f 2>&1
  echo "== $run: $(grep -c 'Duration' $f) kernels"; grep -E "^  [a-z_].*\(|Duration|fp64|Issue Slots Busy|Registers Per|Achieved Occupancy|wavefronts|Theoretical Occ|Executed Ipc A|shfl" $f | head -60
done
echo "done $(date +%T)"
