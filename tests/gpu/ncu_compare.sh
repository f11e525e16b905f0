#!/usr/bin/env bash
# Hardware counters of tileplug vs TileKernels for a few bench cases (GPU host, ncu with --clock-control none).
. .gpu-bundle/prelude.sh >/dev/null 2>&1
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_registers,sm__maximum_warps_per_active_cycle_pct,smsp__average_warp_latency_issue_stalled_long_scoreboard,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__inst_executed.sum,lts__t_sectors_op_write.sum,lts__t_sectors_op_read.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,smsp__cycles_active.avg,sm__cycles_elapsed.max
for c in "per_channel_cast 128" "per_block_cast 128" "cast_back 128" "per_token_cast 65536" "per_channel_cast 65536"; do
  echo "=== $c"; timeout 100 ncu --clock-control none --metrics $M -c 6 python3 tests/gpu/probe_ncu_target.py $c 2>&1 | grep -v "INFO\|Warning\|PROF\|----\|Section\|Metric Name"
done
