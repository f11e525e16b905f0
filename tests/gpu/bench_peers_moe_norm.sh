#!/usr/bin/env bash
# MoE routing and the norm / RoPE forwards beside their peers in one process each (a script, not a test; one command
# of about six minutes on the GPU host, results under $OUT): the top-k gates and the sqrtsoftplus router at fp32
# logits beside TileKernels (the only dtype its gates take; issue #11's table), the grouped router with its masked-round
# group scores, counting and permutation, then the
# norm and RoPE forwards beside TileKernels and Liger, eager and graph (issue #10's table).
#
#   . .gpu-bundle/prelude.sh is sourced here; BUDGET (s, default 340) caps the whole command.
set -u
start=$(date +%s)
BUDGET=${BUDGET:-340}
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
cd "$(dirname "$0")/../.."
. .gpu-bundle/prelude.sh
OUT=${OUT:-.}
export PYTHONPYCACHEPREFIX=/tmp/pycache
B="python3 -m tileplug.core.cli bench --device cuda --backends cuda --no-dispatch --verbose"
# 1. the top-k gates and the sqrtsoftplus router at fp32 logits (TileKernels takes no other), T as the issue's table
echo "== moe gates, $(left) s left" | tee -a $OUT/moe.txt
timeout 150 $B --no-compile --dtype fp32 --peer tile_kernels --ops topk_gate/e64-k6,topk_gate/e256-k8,topk_gate/e384-k8,moe_topk_gate/sqrtsoftplus-shared1,moe_topk_gate/deepseek-v3 \
  --tokens 1,128,1024,4096,16384,65536 2>> $OUT/stderr.log | tee -a $OUT/moe.txt | grep -E "^(topk|moe)_"
# 1b. the grouped router with its group scores from the masked rounds (TILEPLUG_CUDA_MOE_LANE_GROUPS=0; lane by lane is the default), bf16 and fp32 logits
for dt in bf16 fp32; do
  echo "== deepseek-v3 masked group rounds, $dt, $(left) s left" | tee -a $OUT/moe.txt
  env TILEPLUG_CUDA_MOE_LANE_GROUPS=0 timeout $(( $(left) > 60 ? 60 : $(left) - 5 )) $B --no-compile --dtype $dt \
    --ops moe_topk_gate/deepseek-v3 --tokens 128,4096,16384,65536 2>> $OUT/stderr.log | tee -a $OUT/moe.txt \
    | grep -E "^moe_"
done
# 2. counting and permutation (no peer): moe_permute >= 80 % of copy at T >= 4096
echo "== moe counts / permute, $(left) s left" | tee -a $OUT/moe.txt
timeout $(( $(left) > 90 ? 90 : $(left) - 5 )) $B --no-compile --ops moe_expert_counts/e256-k8,moe_permute/e256-k8,moe_unpermute/e256-k8 \
  --tokens 128,4096,16384,65536 2>> $OUT/stderr.log | tee -a $OUT/moe.txt | grep -E "^moe_|^copy"
# 3. the norm and RoPE forwards with every peer, eager and graph
[ $(left) -gt 60 ] && timeout $(( $(left) - 10 )) $B --peer tile_kernels,liger \
  --ops rms_norm,rms_norm/residual,layer_norm,rms_norm_per_token_cast/g32,apply_rotary/neox --tokens 1,128,1024,4096,16384,65536 \
  2>> $OUT/stderr.log | tee -a $OUT/norm_rope.txt | grep -E "^(rms|layer|apply)"
echo "all done, $(left) s left"
