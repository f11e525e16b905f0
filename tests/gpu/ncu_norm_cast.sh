#!/usr/bin/env bash
# Where the fused rms_norm + per-token cast (1x32 e4m3) and rms_norm spend their time beside TileKernels'
# norm kernels, T = 4096, D = 7168 bf16 (GPU host; results under $OUT): warp-state and occupancy sections, and
# each kernel's SASS with its stall samples (the report exported as CSV).
#   . .gpu-bundle/prelude.sh && bash tests/gpu/ncu_norm_cast.sh
set -u
cd "$(dirname "$0")/../.."
for case in rms_norm_per_token_cast/g32 rms_norm; do
  tag=${case%%/*}
  timeout 150 ncu --clock-control none --import-source no --section WarpStateStats --section Occupancy \
    --section LaunchStats --section SpeedOfLight --section SourceCounters -k regex:"norm" -c 6 \
    -o $OUT/ncu_$tag python3 tests/gpu/probe_ncu_target.py $case 4096 > $OUT/ncu_${tag}_run.txt 2>&1
  timeout 60 ncu -i $OUT/ncu_$tag.ncu-rep --print-details all > $OUT/ncu_${tag}_details.txt 2>&1
  timeout 60 ncu -i $OUT/ncu_$tag.ncu-rep --page source --csv --print-source sass > $OUT/ncu_${tag}_sass.csv 2>&1
  grep -E "^  [a-z_]+.*\(|Duration|Warp Cycles Per Issued|Stall|Registers Per|Achieved Occ|DRAM Through" \
    $OUT/ncu_${tag}_details.txt | head -80
  xz -f $OUT/ncu_${tag}_sass.csv; rm -f $OUT/ncu_$tag.ncu-rep
done
