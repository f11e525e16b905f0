#!/usr/bin/env bash
# What waited on a GPU (a script, not a test; results under $OUT). The twenty-third session made the SwiGLU sigmoid
# table and the reduced Box-Muller defaults after their GPU runs; steps 1 and 2 ran on an H100 in the twenty-fourth
# (docs/benchmarks/h100-randn-split-lane-groups-2026-12-06-s24.txt) and became defaults; they stay as before / after:
#   1. the norm backwards' split path (TILEPLUG_CUDA_NORM_BACKWARD_SPLIT_BELOW, 64 by default): tests/gpu/probe_norm_backward_split.py
#      (its bytes against the fused path's, the reference comparison), then both backwards at split 0 / 64 beside
#      TileKernels (the first) at short and long T;
#   2. the MoE gate's lane group scores (TILEPLUG_CUDA_MOE_LANE_GROUPS, 1 by default): its GPU test (the masked rounds'
#      bytes), then the DeepSeek-V3 router with it off / on;
#   3. the SwiGLU and random GPU modules at the new defaults, and the compile / CUDA-graph module (the sigmoid table is
#      built at a kernel's first call, before the capture);
#   4. the host time per call of the norm, SwiGLU and quant bench cases (the launchers' stride fix-up changed on the
#      CPU in the twenty-third session): tests/gpu/probe_host_cases.py.
# The twenty-fifth session (CPU only after its GPU time) added steps 5 and 6; they ran on an H100 in the twenty-sixth
# (docs/benchmarks/h100-moe-score-math-batched-layout-2026-12-06-s26.txt) and became defaults (the tables for the
# sqrtsoftplus gate only: TILEPLUG_CUDA_MOE_SCORE_MATH=auto); they stay as before / after:
#   5. the MoE gates' exp / log1p from backend_cuda/fp32_math.py (TILEPLUG_CUDA_MOE_SCORE_MATH=library / tables): the
#      gate tests against the reference and the two forms' bytes, then the sqrtsoftplus and DeepSeek-V3 routers at fp32
#      logits in both forms, the second beside TileKernels;
#   6. the layout kernels' batched form (TILEPLUG_CUDA_MOE_BATCHED_LAYOUT, 1 by default: warp-match ranks, batched scan
#      loads): its GPU test (the walk's bytes), then counting and permutation with it off / on.
# The twenty-sixth session added step 7, ran it on an H100 the same day
# (docs/benchmarks/h100-moe-lane-heads-host-2026-12-06-s26.txt) and made it the default (with
# TILEPLUG_CUDA_MOE_GATE_CTAS_PER_SM=10); it stays as before / after:
#   7. the gates' rounds over the lanes' two heads (TILEPLUG_CUDA_MOE_LANE_HEADS, 1 by default): their GPU test (the
#      default rounds' bytes), then topk_gate and the sqrtsoftplus / DeepSeek-V3 routers at fp32 logits with it off /
#      on, beside TileKernels.
# The twenty-seventh session ran its two gate forms on H100s the same day and made them the defaults (the full-warp
# width, the unrolled rounds; docs/benchmarks/h100-moe-gate-forms-2026-12-06-s27.txt), and added step 8 (CPU only):
#   8. the lanes' heads kept in place (TILEPLUG_CUDA_MOE_GATE_FIXED_HEADS, 0 by default): the gate forms' GPU test (the
#      moving heads' bytes), then topk_gate and the two routers at fp32 logits with it off / on, twice, beside
#      TileKernels.
# The twenty-eighth session's step 9 (the norm backwards' row loop two iterations ahead) ran on an H100 the same day
# and was dropped, no faster (docs/benchmarks/h100-norm-backward-gate-heads-2026-12-06-s28.txt). Step 8's timing ran
# there too (the fixed heads equal or faster), but its byte test did not finish (the module's up-front compile took
# its 300 s): it now runs only the fixed heads' cases, each kernel compiled on its first call (TILEPLUG_GPU_PRECOMPILE=0);
# the bench part can be skipped (STEPS=8 BUDGET=200) — the default follows from the bytes.
# It added step 10 (CPU only); the twenty-ninth session added the paired sums to it and ran it on an H100 the same
# day (docs/benchmarks/h100-norm-backward-tree-forms-2026-12-06-s29.txt): both became the defaults; it stays as
# before / after:
#  10. the norm backwards' rows added in the warp-subtree form (TILEPLUG_CUDA_NORM_BACKWARD_SUBTREES, 1 by default)
#      and layer_norm_backward's two row sums paired in one pass of the tree (TILEPLUG_CUDA_NORM_BACKWARD_PAIRED_SUMS,
#      1 by default): their GPU test (the level-per-barrier tree's bytes, -k tree_forms), then both backwards at
#      subtrees 0 / 1, twice, beside TileKernels and Liger (tileplug.core.peers.liger), then layer_norm_backward with
#      the subtrees at paired 0 / 1, twice, beside Liger.
# Step 8's byte test ran there too: 157 of 158 cases passed; the 158th failed on a test defect (the spec the test
# named was that of 3 rows, not of the one row it ran), mended; its bytes are still to be compared before the
# fixed heads become the default.
#  12. (twenty-ninth session, CPU only) the norm kernels' long rows on 4 warps of 7 vectors a lane
#      (TILEPLUG_CUDA_NORM_CHUNKS=7, TileKernels' shape for D = 7168; default 4: 7 warps of 4), and (thirtieth) on 14
#      warps of 2 (=2: the backwards' rows at 72 / 120 registers, against 125 / 191 — rms_norm_backward two CTAs of
#      14 warps an SM): the GPU test of their bytes (-k wider_lanes, the backwards too), then the fused cast 1×32
#      and both backwards at 4 / 7 / 2 / 4 beside TileKernels (ncu at T = 4096 on an H100: the
#      fused cast 36.0 µs at the default tile, TileKernels 30.6).
#  13. (not an opt-in) the norm backwards' row block 16 / 32 (TILEPLUG_CUDA_NORM_BACKWARD_ROW_BLOCK) at the
#      twenty-ninth session's defaults, T = 256 … 65536, twice, beside TileKernels: 32 halves the partial rows (117 MB
#      each way at T = 65536, ~85 µs of the gap to TileKernels by the twenty-eighth session's ncu) and was faster
#      from T = 4096 up before the split path existed (1070.1 → 1035.6 µs at 65536); the split path now serves the
#      grids it would leave short (below 64 CTAs: T < 2048 at 32).
#  14. (not an opt-in) the norm GPU module's backward tests at the twenty-ninth session's defaults (subtrees, paired
#      sums): its up-front compile took more than 250 s on a fresh H100, so this step gives it 420 s.
#  15. (thirtieth session) the backwards' block of 32 (TILEPLUG_CUDA_NORM_BACKWARD_ROW_BLOCK=32: 7-20 % faster from
#      T = 4096 on an H100, 2.3-3.4x slower at 1024 on the split path) with the half path for short batches
#      (TILEPLUG_CUDA_NORM_BACKWARD_HALF_PATH=1: each block over two CTAs, the second writing its rows' terms as
#      one-row partials, now in 128-bit stores; its one-value stores took 96.4 µs at T = 1024): the split / half /
#      fused bytes at blocks 16 / 32 (-k split_path), both backwards at 16 / 32 beside TileKernels and Liger, each
#      kernel's time, then the norm module's backward tests at 32 with the half path (the bench first: a short
#      machine still times both blocks). If 32 with the half path is
#      no slower at T = 1024 … 2048 than 16, both become the defaults.
#  16. (thirty-first session) the fused norm cast 1×32 with its registers capped, index off, at chunks:CTAs an SM
#      4:0 (ptxas' choice), 4:5 (56 registers, 40 bytes spilled), 7:5 (TileKernels' shape at 96 registers, 16 spilled;
#      beside TileKernels), 4:0 again — now written with the cap's knob TILEPLUG_CUDA_NORM_CAST_THREADS_PER_SM (0 /
#      1120 / 640 / 0; it ran as the first form, a CTA count).
#      Ran on an H100 in the thirty-first session: 4:5 faster from T = 4096 (518.3 → 486.5 µs at 65536), 7:5 slower
#      (669.2): the cap became the default rule (spec.CAST_THREADS_PER_SM = 1120, no residual).
#      Step 15 ran there too (bench and 5 of 6 byte cases at 32): 32 + half path 4-19 % faster from T = 4096, 13-99 %
#      slower at T ≤ 2048: 16 stays.
#  17. (thirty-first session, CPU only) the fused cast's cap at D = 4096 / 2048 / 5120 (0 / 1120 threads an SM, index
#      off; 8 / 8 / 7 CTAs: 64 / 48 / 56 registers), then rms_norm's new knob (TILEPLUG_CUDA_RMS_NORM_THREADS_PER_SM
#      0 / 896 / 1120: with a residual 96 → 72 registers at 896, 24 bytes spilled; without 72 → 56 at 1120, 16 bytes),
#      beside TileKernels.
#  18. (thirty-first session) the backwards' block of 32 with the half path: the split / half / fused byte test at 32
#      to the end (its sixth case never finished within a cap), then the norm module's backward tests at 32 + half.
#  19. (thirty-first session, CPU only) the fused QK kernels (rms_norm_rope, with and without the cast) at 8 CTAs an
#      SM (TILEPLUG_CUDA_NORM_ROPE_CTAS_PER_SM, index off: 78–80 → 64 registers, 24 → 32 warps an SM; 12 bytes spilled
#      with the cast): their GPU tests under the cap, then 0 / 8 / 0 (rms_norm_rope_per_token_cast stood at 2.13–2.36×
#      its chain against the goal's 2.84× on the H200).
#  20. (thirty-second session) the rest of #11's goals where an H200 comes: the softmax and grouped sigmoid gates beside
#      bench's torch.compile of the reference (fp32 and bf16 logits), then moe_permute's share of copy at T = 4096 … 65536.
#  21. (thirty-second session) #9's table: the six quant bench cases beside TileKernels at T = 1 … 65536, eager and
#      graph, with the host time per call (the last full run on an H200 was the ninth session's).
#  22. (thirty-second session) the norm / RoPE kernels' bf16 word reads: the rms_norm_rope GPU tests (74, their bytes
#      against the unfused chain on every pairing, exchange and scalar path), one process after the module's up-front
#      compile (under xdist, -n 8 and -n 15, they gave no result within 200 s on an H100: the module ignored
#      TILEPLUG_GPU_PRECOMPILE=0 then, so every worker compiled all of its ~90 specialisations in its own process
#      pool; it honours the variable now), then the norm module's forward tests to the end (480 of 554 passed before
#      the time ran out) and the fused QK probe.
#  23. (thirty-third session) old / new in one command: OLD (the src folder of an older copy of the CUDA backend,
#      e.g. `git archive <commit> packages/backend-cuda/src | tar -x -C DIR`, DIR carried) first on PYTHONPATH, index
#      off: the fused QK probe (its bytes against the chain at T = 4001, then fused / chain times), then the norm and
#      fused QK bench cases, old / new. The session's changes: a 16-bit weight's + 0 on its packed words
#      (norm.rows.plus_zero) and, at R = D, an outside token's NaN through its rstd (no NaN moves).
#      Ran on an H100 the same day with old = 1876a1f (docs/benchmarks/h100-norm-rope-weight-words-nan-rows-2026-12-06-
#      s33.txt): the fused QK kernels 1.3-1.8 % slower from T = 16384, the NaN rstd taken back (the cache loads
#      serialized); what stays (plus_zero, over_width: 688 / 952 SASS against 728 / 984) is still to be timed the
#      same way (OLD = a copy of 1876a1f's backend), with the rope tests whose -x run stopped at a test defect.
#  24. (thirty-third session, CPU only) the fused QK kernels at 64 values a thread (TILEPLUG_CUDA_NORM_ROPE_VALUES=64,
#      index off: 2 lanes a head of 128; nvcc 13.0: 1520 / 1112 SASS instructions for 64 values against 952 / 688 for
#      32 — with the cast 23.8 a value against 29.8 — at 142-143 registers, 3 CTAs of 4 warps an SM instead of 6): the
#      fused-equals-chain tests under it, then the fused QK probe at 32 / 64 / 32 values.
#  25. (thirty-fourth session) the stochastic element casts on random fields (16 / 8 bits an element for fp32 → bf16 /
#      bf16 → e4m3) where an H200 comes: their GPU tests, then tests/gpu/probe_cast.py (on an H100 the same day,
#      docs/benchmarks/h100-stochastic-fields-host-2026-12-07-s34.txt: bf16 → e4m3 86.6 % of the deterministic cast
#      at T = 65536, fp32 → bf16 memory-bound either way there; the H200 had fp32 → bf16 at 70.2 % issue-bound).
#      Ran on the H200 (2026-12-07, thirty-fifth session, main at 9003638: 184 passed; fp32 → bf16 99.6 %,
#      bf16 → e4m3 71.4 %, fp32 → e4m3 69.2 % of the deterministic cast at T = 65536; docs/benchmarks/
#      h200-quant-casts-norm-moe-2026-12-07-s35.txt). Run it again for a903796: fp32 → e4m3 on 16-bit fields
#      (a Philox block per 8 elements) and the carry rounding of both e4m3 pairs (744 → 600 SASS, 70 → 53
#      registers for fp32 → e4m3), bytes and bandwidth not yet seen on a GPU.
#  26. (thirty-fifth session) old / new for the packed-sf hand-off (f8d2499: the int32 sf as allocated, the kernels
#      writing its bytes through an alias, no host view): OLD = a copy of 291011b's CUDA backend src (as step 23),
#      the bench's per_token_cast (control) and its UE8M0 column-major form at T = 1, 4096, 16384, 65536, host
#      column included. On the H200 the same day the column-major form ran at 96.7 % of copy at T = 65536 (99.7 %
#      in the ninth session) and its host time fell below per_token's; this separates the two.
#      Ran on an H100 (2026-12-07, thirty-seventh session): the same kernel times old and new (UE8M0 column-major
#      101.7 / 101.8 % of copy at T = 65536), host time at T = 1 17.4 -> 12.9 us for it (per_token 11.9 / 12.4).
#  11. (not an opt-in) #11's table where an H200 comes: topk_gate (64, 6) / (256, 8) / (384, 8) and the sqrtsoftplus
#      router at fp32 logits, T = 1 … 65536, beside TileKernels, one process (the unrolled gates compile ~20 s each).
#  27. (thirty-sixth session) the stochastic per-token / per-block casts on 16-bit fields (two a word, a Philox block
#      per 8 elements; e4m3 by the element casts' carry rounding, the split product): their GPU tests (every op-table
#      case of stochastic_rounding=True at six token counts, bytewise against the reference), then
#      tests/gpu/probe_stochastic_quant.py old / new (OLD = the src folder of a copy of the CUDA backend before the
#      change, as step 23; the old kernel takes a word an element, so only its time means anything).
#      Ran on an H100 (2026-12-07, thirty-seventh session): 96 passed (with TILEPLUG_GPU_PRECOMPILE=0; the
#      up-front compile of the quant grid had taken the first try's 120 s); per-token 1 x 128 e4m3 864 -> 659 us,
#      per-block 128 x 128 862 -> 634, e2m1 1 x 16 1006 -> 879 at T = 65536 (docs/benchmarks/
#      h100-stochastic-quant-casts-per-channel-2026-12-07-s37.txt).
#  28. (thirty-sixth session) #9's per_channel_cast (0.87-0.95 of TileKernels from T = 1024 on the H200, 95.3 % of
#      copy at T = 65536 against 100.8 %): the tile swept through TILEPLUG_CUDA_TILE_PER_CHANNEL (warps, rows a thread,
#      CTAs an SM; today 8,16,1) at T = 4096, 16384, 65536, index off, TileKernels beside the last value.
#      Ran on an H100 (2026-12-07, thirty-seventh session): 8,16,1 the best of the five at every T (93.7 / 98.0 /
#      97.8 % of copy; TileKernels 106.5 / 102.7 / 101.6 %); the next best 16,8,2 (85.9 / 96.1 / 97.4 %).
#  29. (thirty-seventh session) moe_permute's row kernel: the padding rows' zeros in the copy's launch (the CTAs
#      after the T copying ones: one launch fewer) and a group of 8 slots' expanded rows loaded together with the
#      row, before the first store (a slot at a time waited for each): the MoE GPU tests of the layout ops (bytes
#      against the reference, padding rows included), then old / new twice (OLD = the src folder of a copy of the
#      CUDA backend before the change, as step 23) at T = 1024, 4096, 16384, 65536.
#      Ran on an H100 the same day (87 tests passed; 4096: 206.4-207.2 -> 206.3 us, 1024: 62.6-62.9 -> 61.7-61.8,
#      the same from 16384 on).
#  30. (thirty-seventh session) the short carry of the stochastic e4m3 rounding (a Philox block whose values all lie
#      on e4m3's normal steps skips the offset and the NaN test: 3 instructions a value for 10): the stochastic
#      per-token / per-block and element-cast GPU tests, then tests/gpu/probe_stochastic_quant.py and
#      tests/gpu/probe_cast.py old / new (OLD = the src folder of a copy of the CUDA backend before the change).
#      Ran on an H100 the same day, twice (280 tests passed each time): per-token 1 x 128 e4m3 658 -> 547 us at
#      T = 65536, per-block 633 -> 564; the element casts slower with it (bf16 -> e4m3 467 -> 520: their inputs
#      put a value under 2^-6 in nearly every warp), so it left them (0eeb0cb); then e2m1 by the same carry
#      (4d26ec5): 878 -> 735 us.
#  31. (thirty-seventh session) the stochastic per-block 128 x 128 cast reached 80 % of the deterministic one at
#      T = 65536 but 55 % at 4096 (per-token 83 / 66 %): its tile (TILEPLUG_CUDA_TILE_PER_BLOCK: warps, rows a
#      thread, CTAs an SM; today 16,8,2) swept at T = 4096 and 65536 through tests/gpu/probe_stochastic_quant.py,
#      index off (the deterministic form takes the same tile: its column is the control).
#      Ran on an H100 the same day: today's tile the best at both T (stochastic 54.5-54.9 / 564.8-566.8 us at
#      4096 / 65536, twice); 8,16,2 59.9 / 603.4, 8,16,1 60.3 / 604.9, 32,4,1 58.8 / 719.1 (the deterministic form
#      slower with each too). The gap at 4096 is not the tile's shape.
#  32. (thirty-seventh session) e2m1's stochastic codes read off the carry's pattern (no fp32 value, no encoder
#      between; SASS per-token bf16 1 x 16 1496 -> 1328 at 96 -> 125 registers, per-block 32 x 32 1184 -> 1048): the
#      stochastic quant GPU tests, then tests/gpu/probe_stochastic_quant.py old / new at T = 4096 and 65536.
#      Ran on an H100 the same day: 96 passed; e2m1 1 x 16 734.9 -> 658.9 us at T = 65536, 54.6 -> 49.8 at 4096.
#  33. (thirty-eighth session) per_channel_cast's tile with fewer lanes a row (KernelSpec.lanes_per_row 4 / 8 / 16:
#      a warp's slot is 8 / 4 / 2 rows of 32 / 64 / 128 columns; a 1- or 2-warp CTA needs no partner at its barrier):
#      tests/gpu/sweep_tiles.py --cases per_channel,cast_back --peer at T = 128 ... 65536 (every candidate's bytes
#      against the oracle's at 4001 and at each timed T), then ncu at T = 4096 of the default tile and of
#      TILEPLUG_CUDA_TILE_PER_CHANNEL=2,0,1 TILEPLUG_CUDA_LANES_PER_ROW_PER_CHANNEL=4, TileKernels' kernel beside each.
#  34. (thirty-eighth session) the draws' offset advanced by their own last CTA (an arrival counter; fill_rand,
#      fill_randn, stochastic_cast: one launch instead of two): the random and element-cast GPU tests (graph replay
#      drawing fresh numbers, the offset's count), then tests/gpu/probe_cast.py old / new (OLD = the src folder of a
#      copy of the CUDA backend before 17e0c98, as step 23).
#  35. (thirty-eighth session) the stochastic quant tiles' Philox products as one mul.wide.u32 each
#      (TILEPLUG_CUDA_PHILOX_WIDE_PER_TOKEN / _PER_BLOCK = 0 / 1, index off; ~5-6 % fewer SASS instructions):
#      tests/gpu/probe_stochastic_quant.py at T = 4096 and 65536 with each.
#      Steps 34 and 35 ran in the thirty-ninth session (H100, docs/benchmarks/h100-in-kernel-advance-2026-12-07-s39.txt)
#      with the count acquire-release: the tests passed; T = 128 eager gained (bf16 -> e4m3 8.58 -> 6.62 us) but the
#      graph replay lost (4.58 -> 5.09) and large calls lost 5-10 % (bf16 -> e4m3 466.8 -> 514.9 us at 65536): the
#      add compiled to MEMBAR.ALL.GPU + CCTL.IVALL at every CTA's end. philox_wide: 2-6 % faster at 4096 and 65536
#      in all three quant cases (e2m1 859.9 -> 823.5 us at 65536), not yet through the GPU tests.
#  36. (thirty-ninth session) the count relaxed (b915176: no fence), the stochastic per-token / per-block casts
#      advancing in their own launch too (42649b9) and taking the wide Philox products by default (quant.kernels.
#      PHILOX_WIDE; the same mul.wide.u32 helper the draws run): the random, element-cast and stochastic quant GPU
#      tests, the same quant tests with the split products (TILEPLUG_CUDA_PHILOX_WIDE_*=0, index off), then
#      tests/gpu/probe_stochastic_quant.py (T = 128, 4096, 65536) old / new / split and tests/gpu/probe_cast.py old / new;
#      OLD_QUANT = colon-separated absolute src folders of core, reference and backend-cuda before 42649b9 (the
#      two-launch quant casts), OLD = the CUDA backend before 17e0c98 (the two-launch element casts), as step 34.
#  37. (fortieth session, not an opt-in) compute-sanitizer --tool memcheck over tests/gpu/sanitize_tails.py (every
#      norm / RoPE op-table case at T = 3 and 37 through the conformance check; its kernels precompiled first, in
#      parallel, outside the sanitizer): the last clean memcheck (112 case runs) predates the norms' register tree,
#      the two-stage column sums, the split / half paths and the packed-bf16 RoPE.
#      Steps 36, 37 and 33 ran in the fortieth session (H100, docs/benchmarks/h100-relaxed-count-lanes-memcheck-
#      2026-12-07-s40.txt): the tests passed, memcheck 0 errors; the relaxed count at the CTA's end won at T = 128 and
#      lost at T = 65536 (e2m1 643.3 -> 768.8 us); the 4 / 8 lanes per-channel tiles were slower than the default.
#  38. (fortieth session) the draws' CTAs counted at their start (f6f622e: thread 0 reads the offset into shared memory
#      and counts the CTA before the work; the last CTA to count advances at its end; no barrier ends a CTA): the
#      random, element-cast and stochastic quant GPU tests, then tests/gpu/probe_stochastic_quant.py (T = 128, 4096,
#      65536) new / two launches (OLD_QUANT as step 36) and tests/gpu/probe_cast.py new / two launches (OLD as 34).
#      Step 38 ran in the fortieth session (H100, same table, run 3): 353 tests passed; against two launches in
#      the same run the count at the start wins at T = 128 and 4096 (per-token, per-block), is level per-block at
#      65536 and loses 3.7 % per-token, 12.4 % e2m1 there. The e2m1 1 x 16 stochastic tile holds 164 registers
#      (3 CTAs of 128 threads an SM) against 125 (4 CTAs) in the two-launch form of 39c3da9 (nvcc 13.0, sm_90).
#  39. (fortieth session, not an opt-in: an existing tuning variable) the stochastic per-token tiles with their
#      registers capped for more CTAs an SM: TILEPLUG_CUDA_TILE_PER_TOKEN=4,1,4 (123 registers for e2m1 1 x 16, 85
#      for e4m3 1 x 128, no spills) and =4,1,8 (e4m3 1 x 128: 63 registers, no spills): the stochastic quant GPU
#      tests with 4,1,4, then tests/gpu/probe_stochastic_quant.py (T = 4096, 65536) at the default, 4,1,4, 4,1,8
#      and two launches (OLD_QUANT as step 36). If a cap wins, it becomes the stochastic per-token tiles' rule.
#  40. (forty-first session) the quant tiles' offset read and count behind the loads and the last CTA's advance
#      before the draws (no code after the last store: e2m1 1 x 16 164 -> 120 registers, e4m3 1 x 128 85 -> 90,
#      both wide; nvcc 13.0, sm_90): the stochastic quant GPU tests, then tests/gpu/probe_stochastic_quant.py
#      (T = 128, 4096, 65536) new, the count at the start (OLD = the CUDA backend src of 9e72de5), new at
#      TILEPLUG_CUDA_TILE_PER_TOKEN=4,1,6 (at least 6 CTAs an SM: e4m3 1 x 128 72 registers, e2m1 1 x 16 73, no
#      spills) and two launches (OLD_QUANT as step 36).
#  41. (forty-second session, not an opt-in: a spec change) 8-bit random fields for every e4m3 / e2m1 target (spec
#      §10.2: a Philox block per 16 elements; the lanes of a tile sharing a block draw one each and exchange their
#      parts by shuffles; SASS per-token 1 x 128 1296 -> 1216, e2m1 1 x 16 1288 -> 1224 at 120 -> 94 registers,
#      per-block 2480 -> 2352, the fp32 -> e4m3 cast 616 -> 520; nvcc 13.0, sm_90): the element-cast and stochastic
#      quant GPU tests (the new bytes against the reference), then tests/gpu/probe_stochastic_quant.py (T = 128, 4096,
#      65536) new, with 16-bit fields (OLD_W16 = core, reference and backend-cuda src of f002c8d) and two launches
#      (OLD_QUANT as step 36), then tests/gpu/probe_cast.py new and with 16-bit fields.
#      Ran on an H100 the same day (docs/benchmarks/h100-stochastic-byte-fields-2026-12-07-s42.txt): 289 passed,
#      the new form faster in every cell (T = 65536: per-token 530.1 us, e2m1 580.7, per-block 484.1); with it step 24
#      (64 values a lane: slower everywhere, the default stays 32) and TILEPLUG_CUDA_TILE_PER_TOKEN=4,1,6 (per-token
#      e4m3 507.7 us, 90.2 %: the stochastic e4m3 per-token rule since 4b3169f).
#  42. (forty-third session) e2m1's stochastic code from ``a + max(a, 1)`` rounded toward zero (no select on a < 1:
#      per-token bf16 1 x 16 1088 -> 1016 SASS with fp32 scales, 1224 -> 1152 with e4m3 ones; nvcc 13.0, sm_90) and
#      the stochastic per-token e2m1 tiles of a bf16 input at 6 CTAs an SM (77 / 78 registers, no spills): the
#      stochastic e2m1 GPU tests (the e4m3 kernels' code did not change), then tests/gpu/probe_stochastic_quant.py (T = 128, 4096, 65536) new, new without
#      the cap (TILEPLUG_CUDA_TILE_PER_TOKEN=4,1,1, which uncaps e4m3 too) and old (OLD_QUANT = colon-separated
#      absolute src folders of core, reference and backend-cuda of 3b411bd).
#      Ran on an H100 (2026-12-08, forty-third session, probes first, docs/benchmarks/h100-e2m1-carry-2026-12-08-s43.txt):
#      27 e2m1 tests passed; e2m1 1 x 16 at T = 65536 584.2 -> 561.2 us (the carry) -> 550.3 (the cap; 79.1 % of the
#      deterministic cast), e4m3 unchanged.
#
#   . .gpu-bundle/prelude.sh is sourced here; BUDGET (s, default 400) caps the whole command and STEPS (default
#   "1 2 3 4") picks the steps, so that one machine can take them in two commands.
set -u
start=$(date +%s)
BUDGET=${BUDGET:-400}
STEPS=" ${STEPS:-1 2 3 4 5 6 7 8 10} "
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
want() { [[ "$STEPS" == *" $1 "* ]]; }
cd "$(dirname "$0")/../.."
. .gpu-bundle/prelude.sh
OUT=${OUT:-.}
export PYTHONPYCACHEPREFIX=/tmp/pycache
P="python3 -m pytest -m gpu -q -p no:cacheprovider"
# alternate VARIABLE "VALUES" PEERS FILE CAP BENCH_ARGS...: one bench process per value (in that order), the peers
# beside the last value's form, the table into $OUT/FILE, each process capped at CAP s (less when time runs out)
alternate() {
  local variable=$1 values=$2 peers=$3 file=$4 cap=$5 last=${2##* }
  shift 5
  for value in $values; do
    [ $(left) -gt 50 ] || break
    extra=$([ $value = $last ] && echo "--peer $peers" || echo "")
    echo "== $variable=$value, $(left) s left" | tee -a $OUT/$file
    env $variable=$value timeout $(( $(left) > cap + 10 ? cap : $(left) - 10 )) $BENCH $extra "$@" 2>> $OUT/stderr.log \
      | tee -a $OUT/$file | grep -E "^[a-z_]+(/[a-z0-9-]+)? +[0-9]+ +[0-9]+ +[a-z_]+ +[0-9]"
  done
}
# variant_runs VARIABLE "VALUES" FILE CAP COMMAND...: COMMAND once per value of VARIABLE (in that order, the kernel
# index off: its key does not see a tuning variable), its output into $OUT/FILE and on, each run capped at CAP s
variant_runs() {
  local variable=$1 values=$2 file=$3 cap=$4
  shift 4
  for value in $values; do
    [ $(left) -gt 40 ] || break
    echo "== $variable=$value, $(left) s left" | tee -a $OUT/$file
    env TILEPLUG_CUDA_KERNEL_INDEX=off $variable=$value timeout $(( $(left) > cap + 10 ? cap : $(left) - 10 )) "$@" \
      2>> $OUT/stderr.log | tee -a $OUT/$file
  done
}
# backward_module_at_32 FILE: the norm module's backward tests at the block of 32 with the half path, into $OUT/FILE
backward_module_at_32() {
  TILEPLUG_CUDA_NORM_BACKWARD_HALF_PATH=1 TILEPLUG_CUDA_NORM_BACKWARD_ROW_BLOCK=32 TILEPLUG_GPU_PRECOMPILE=0 \
    timeout $(( $(left) - 10 )) $P -n 15 -k "backward or column_sums" tests/gpu/test_cuda_norm.py > $OUT/$1 2>&1
  tail -3 $OUT/$1
}
BENCH="python3 -m tileplug.core.cli bench --device cuda --backends cuda --no-compile --no-dispatch --verbose"
# old_new_bench LABEL OPS TOKENS FILE: the bench cases OPS at TOKENS with OLD's CUDA backend first on PYTHONPATH,
# then with this tree's, index off, each under the time left; the tables appended to $OUT/FILE, their rows shown.
old_new_bench() {
  for form in old new; do
    [ $(left) -gt 40 ] || break
    path=$([ $form = old ] && echo "$PWD/$OLD:" || echo "")
    echo "== $1 $form, $(left) s left" | tee -a $OUT/$4
    env TILEPLUG_CUDA_KERNEL_INDEX=off PYTHONPATH="$path$PYTHONPATH" timeout $(( $(left) > 100 ? 90 : $(left) - 10 )) \
      $BENCH --ops $2 --tokens $3 2>> $OUT/stderr.log | tee -a $OUT/$4 \
      | grep -E "^[a-z_]+(/[a-z0-9-]+)? +[0-9]+ +[0-9]+ +[a-z_]+ +[0-9]"
  done
}
# old_new_probe LABEL FILE CAP SCRIPT: python3 SCRIPT with OLD's CUDA backend first on PYTHONPATH (when OLD is set),
# then with this tree's, index off, each capped at CAP s; its output appended to $OUT/FILE and passed on.
old_new_probe() {
  for form in ${OLD:+old} new; do
    [ $(left) -gt 40 ] || break
    path=$([ $form = old ] && echo "$PWD/$OLD:" || echo "")
    echo "== $1 $form, $(left) s left" | tee -a $OUT/$2
    env TILEPLUG_CUDA_KERNEL_INDEX=off PYTHONPATH="$path$PYTHONPATH" timeout $(( $(left) > $3 + 10 ? $3 : $(left) - 10 )) \
      python3 $4 2>> $OUT/stderr.log | tee -a $OUT/$2
  done
}
# 1. the split path: bytes first, then time (a variable setting a process)
if want 1; then
  timeout 150 python3 tests/gpu/probe_norm_backward_split.py > $OUT/split.txt 2>&1
  grep -v "^ok" $OUT/split.txt | tail -12; echo "$(grep -c '^ok' $OUT/split.txt) checks ok"
  for split in 0 64; do
    [ $(left) -gt 60 ] || break
    extra=$([ $split = 0 ] && echo "--peer tile_kernels" || echo "")
    echo "== split_below $split, $(left) s left" | tee -a $OUT/norm_backward.txt
    env TILEPLUG_CUDA_NORM_BACKWARD_SPLIT_BELOW=$split timeout 70 $BENCH $extra \
      --ops rms_norm_backward,layer_norm_backward --tokens 1,32,128,1024,4096,65536 2>> $OUT/stderr.log \
      | tee -a $OUT/norm_backward.txt | grep -E "^(rms|layer)_norm_backward +[0-9]+ +[0-9]+ +(cuda|tile_kernels)"
  done
fi
# 2. the lane group scores: bytes, then time
if want 2 && [ $(left) -gt 60 ]; then
  timeout 120 $P -x -k lane_group tests/gpu/test_cuda_moe.py > $OUT/lane.txt 2>&1; tail -3 $OUT/lane.txt
  for lanes in 0 1; do
    [ $(left) -gt 50 ] || break
    echo "== lane groups $lanes, $(left) s left" | tee -a $OUT/lane_bench.txt
    env TILEPLUG_CUDA_MOE_LANE_GROUPS=$lanes timeout 50 $BENCH --ops moe_topk_gate/deepseek-v3 \
      --tokens 128,4096,16384,65536 2>> $OUT/stderr.log | tee -a $OUT/lane_bench.txt | grep -E "^moe_"
  done
fi
# 3. the modules at the new defaults
if want 3 && [ $(left) -gt 90 ]; then
  timeout 100 $P tests/gpu/test_cuda_compile_graph.py > $OUT/graph.txt 2>&1; tail -2 $OUT/graph.txt
  timeout 100 $P -s tests/gpu/test_cuda_random.py > $OUT/random.txt 2>&1; grep -E "randn|passed|failed" $OUT/random.txt | tail -8
  [ $(left) -gt 60 ] && timeout $(( $(left) - 30 )) $P -n 8 tests/gpu/test_cuda_swiglu.py > $OUT/swiglu.txt 2>&1
  tail -3 $OUT/swiglu.txt
fi
# 4. host time per call (writes $OUT/host_cases.txt)
if want 4 && [ $(left) -gt 60 ]; then
  HOST_CASES=rms_norm,layer_norm,rms_norm_backward,layer_norm_backward,swiglu,swiglu_backward,per_token_cast,per_channel_cast \
    timeout $(( $(left) - 10 )) python3 tests/gpu/probe_host_cases.py 2>> $OUT/stderr.log | cut -c1-160
fi
# 5. the gates' fp32_math: bytes against the reference, then time beside TileKernels
if want 5 && [ $(left) -gt 90 ]; then
  timeout 300 $P -n 12 -k "score_math or (moe_topk_gate and matches_reference)" tests/gpu/test_cuda_moe.py > $OUT/gate.txt 2>&1
  tail -2 $OUT/gate.txt
  for math in library tables; do
    [ $(left) -gt 50 ] || break
    extra=$([ $math = tables ] && echo "--peer tile_kernels" || echo "")
    echo "== score math $math, $(left) s left" | tee -a $OUT/gate_bench.txt
    env TILEPLUG_CUDA_MOE_SCORE_MATH=$math timeout $(( $(left) > 110 ? 100 : $(left) - 10 )) $BENCH --dtype fp32 $extra \
      --ops moe_topk_gate/sqrtsoftplus-shared1,moe_topk_gate/deepseek-v3 --tokens 1,128,1024,4096,16384,65536 \
      2>> $OUT/stderr.log | tee -a $OUT/gate_bench.txt | grep -E "^moe_"
  done
fi
# 6. the batched layout kernels: bytes, then time (a variable setting a process)
if want 6 && [ $(left) -gt 60 ]; then
  timeout 150 $P -n 8 -k batched_layout tests/gpu/test_cuda_moe.py > $OUT/match.txt 2>&1; tail -2 $OUT/match.txt
  for batched in 0 1; do
    [ $(left) -gt 50 ] || break
    echo "== batched layout $batched, $(left) s left" | tee -a $OUT/match_bench.txt
    env TILEPLUG_CUDA_MOE_BATCHED_LAYOUT=$batched timeout 60 $BENCH --ops moe_expert_counts/e256-k8,moe_permute/e256-k8 \
      --tokens 128,4096,16384,65536 2>> $OUT/stderr.log | tee -a $OUT/match_bench.txt | grep -E "^moe_"
  done
fi
# 7. the lanes' heads: bytes, then time beside TileKernels
if want 7 && [ $(left) -gt 60 ]; then
  timeout 300 $P -n 12 -k "lane_heads or (matches_reference and gate)" tests/gpu/test_cuda_moe.py > $OUT/heads.txt 2>&1
  tail -2 $OUT/heads.txt
  for heads in 0 1; do
    [ $(left) -gt 50 ] || break
    extra=$([ $heads = 1 ] && echo "--peer tile_kernels" || echo "")
    echo "== lane heads $heads, $(left) s left" | tee -a $OUT/heads_bench.txt
    env TILEPLUG_CUDA_MOE_LANE_HEADS=$heads timeout $(( $(left) > 110 ? 100 : $(left) - 10 )) $BENCH --dtype fp32 $extra \
      --ops topk_gate/e256-k8,moe_topk_gate/sqrtsoftplus-shared1,moe_topk_gate/deepseek-v3 --tokens 128,4096,16384,65536 \
      2>> $OUT/stderr.log | tee -a $OUT/heads_bench.txt | grep -E "^(moe_|topk_)"
  done
fi
if want 8 && [ $(left) -gt 60 ]; then
  TILEPLUG_GPU_PRECOMPILE=0 timeout 300 $P -n 15 -k "gate_forms and fixed_heads" tests/gpu/test_cuda_moe.py > $OUT/fixed.txt 2>&1
  tail -2 $OUT/fixed.txt
  alternate TILEPLUG_CUDA_MOE_GATE_FIXED_HEADS "0 1 0 1" tile_kernels fixed_bench.txt 150 --dtype fp32 \
    --ops topk_gate/e64-k6,topk_gate/e256-k8,moe_topk_gate/sqrtsoftplus-shared1,moe_topk_gate/deepseek-v3 \
    --tokens 128,4096,16384,65536
fi
if want 10 && [ $(left) -gt 60 ]; then
  TILEPLUG_GPU_PRECOMPILE=0 timeout 240 $P -n 15 -k "tree_forms" tests/gpu/test_cuda_norm.py > $OUT/subtrees.txt 2>&1
  tail -2 $OUT/subtrees.txt
  TILEPLUG_CUDA_NORM_BACKWARD_PAIRED_SUMS=0 alternate TILEPLUG_CUDA_NORM_BACKWARD_SUBTREES "0 1 0 1" \
    tile_kernels,liger subtrees_bench.txt 100 --ops rms_norm_backward,layer_norm_backward --tokens 1024,4096,16384,65536
  TILEPLUG_CUDA_NORM_BACKWARD_SUBTREES=1 alternate TILEPLUG_CUDA_NORM_BACKWARD_PAIRED_SUMS "0 1 0 1" liger \
    paired_bench.txt 80 --ops layer_norm_backward --tokens 1024,4096,16384,65536
fi
if want 12 && [ $(left) -gt 60 ]; then
  TILEPLUG_GPU_PRECOMPILE=0 timeout 150 $P -n 12 -k "wider_lanes" tests/gpu/test_cuda_norm.py > $OUT/wider.txt 2>&1
  tail -2 $OUT/wider.txt
  alternate TILEPLUG_CUDA_NORM_CHUNKS "4 7 2 4" tile_kernels chunks_bench.txt 100 \
    --ops rms_norm_per_token_cast/g32,rms_norm_backward,layer_norm_backward --tokens 1024,4096,16384,65536
fi
if want 13 && [ $(left) -gt 60 ]; then
  alternate TILEPLUG_CUDA_NORM_BACKWARD_ROW_BLOCK "16 32 16 32" tile_kernels row_block_bench.txt 100 \
    --ops rms_norm_backward,layer_norm_backward --tokens 256,1024,2048,4096,16384,65536
fi
if want 14 && [ $(left) -gt 120 ]; then
  timeout $(( $(left) > 430 ? 420 : $(left) - 10 )) $P -n 15 -k "backward or column_sums" tests/gpu/test_cuda_norm.py \
    > $OUT/norm_backward_module.txt 2>&1
  tail -3 $OUT/norm_backward_module.txt
fi
if want 15 && [ $(left) -gt 60 ]; then
  TILEPLUG_CUDA_NORM_BACKWARD_HALF_PATH=1 alternate TILEPLUG_CUDA_NORM_BACKWARD_ROW_BLOCK "16 32" tile_kernels,liger \
    half_bench.txt 170 --ops rms_norm_backward,layer_norm_backward --tokens 256,512,1024,2048,4096,16384,65536
  for blocks in 32 16; do
    [ $(left) -gt 40 ] || break
    TILEPLUG_CUDA_NORM_BACKWARD_ROW_BLOCK=$blocks TILEPLUG_GPU_PRECOMPILE=0 \
      timeout $(( $(left) > 160 ? 150 : $(left) - 10 )) $P -n 6 -k "split_path" tests/gpu/test_cuda_norm.py \
      > $OUT/split_half_$blocks.txt 2>&1
    tail -2 $OUT/split_half_$blocks.txt
  done
  for blocks in 16 32; do
    [ $(left) -gt 70 ] || break
    TILEPLUG_CUDA_NORM_BACKWARD_HALF_PATH=1 TILEPLUG_CUDA_NORM_BACKWARD_ROW_BLOCK=$blocks timeout 60 \
      python3 tests/gpu/probe_norm_backward_kernels.py 512,1024,2048,4096 2>&1 | grep "T=" | sed "s/^/block $blocks: /" \
      | tee -a $OUT/half_kernels.txt
  done
  [ $(left) -gt 60 ] && backward_module_at_32 norm_backward_module.txt
fi
if want 16 && [ $(left) -gt 60 ]; then
  # chunks:threads an SM (the cap's knob since; it ran as TILEPLUG_CUDA_NORM_CAST_CTAS_PER_SM=0 / 5 / 5 / 0)
  for pair in 4:0 4:1120 7:640 4:0; do
    [ $(left) -gt 40 ] || break
    extra=$([ $pair = 7:640 ] && echo "--peer tile_kernels" || echo "")
    echo "== chunks:threads $pair, $(left) s left" | tee -a $OUT/cast_ctas_bench.txt
    env TILEPLUG_CUDA_KERNEL_INDEX=off TILEPLUG_CUDA_NORM_CHUNKS=${pair%:*} TILEPLUG_CUDA_NORM_CAST_THREADS_PER_SM=${pair#*:} \
      timeout $(( $(left) > 70 ? 60 : $(left) - 10 )) $BENCH $extra --ops rms_norm_per_token_cast/g32 \
      --tokens 1024,4096,16384,65536 2>> $OUT/stderr.log | tee -a $OUT/cast_ctas_bench.txt \
      | grep -E "^rms_norm_per_token_cast/g32 +[0-9]+ +[0-9]+ +[a-z_]+ +[0-9]"
  done
fi
if want 17 && [ $(left) -gt 60 ]; then
  # the fused cast's register cap at the widths the rule reaches untimed, then rms_norm's knob (index off)
  for hidden in 4096 2048 5120; do
    for threads in 0 1120; do
      [ $(left) -gt 40 ] || break
      extra=$([ $threads = 1120 ] && echo "--peer tile_kernels" || echo "")
      echo "== D=$hidden cast threads/SM $threads, $(left) s left" | tee -a $OUT/cast_widths_bench.txt
      env TILEPLUG_CUDA_KERNEL_INDEX=off TILEPLUG_CUDA_NORM_CAST_THREADS_PER_SM=$threads \
        timeout $(( $(left) > 70 ? 60 : $(left) - 10 )) $BENCH $extra --hidden $hidden --ops rms_norm_per_token_cast/g32 \
        --tokens 1024,4096,16384,65536 2>> $OUT/stderr.log | tee -a $OUT/cast_widths_bench.txt \
        | grep -E "^rms_norm_per_token_cast/g32 +[0-9]+ +[0-9]+ +[a-z_]+ +[0-9]"
    done
  done
  for threads in 0 896 1120; do
    [ $(left) -gt 40 ] || break
    extra=$([ $threads = 0 ] && echo "--peer tile_kernels" || echo "")
    echo "== rms_norm threads/SM $threads, $(left) s left" | tee -a $OUT/rms_threads_bench.txt
    env TILEPLUG_CUDA_KERNEL_INDEX=off TILEPLUG_CUDA_RMS_NORM_THREADS_PER_SM=$threads \
      timeout $(( $(left) > 70 ? 60 : $(left) - 10 )) $BENCH $extra --ops rms_norm,rms_norm/residual \
      --tokens 1024,4096,16384,65536 2>> $OUT/stderr.log | tee -a $OUT/rms_threads_bench.txt \
      | grep -E "^rms_norm(/residual)? +[0-9]+ +[0-9]+ +[a-z_]+ +[0-9]"
  done
fi
if want 18 && [ $(left) -gt 60 ]; then
  # the backwards' block of 32 with the half path (128-bit stores): every byte test, no time cap but the budget's
  TILEPLUG_CUDA_NORM_BACKWARD_ROW_BLOCK=32 TILEPLUG_GPU_PRECOMPILE=0 timeout $(( $(left) - 10 )) \
    $P -n 6 -k "split_path" tests/gpu/test_cuda_norm.py > $OUT/split_half_full_32.txt 2>&1
  tail -2 $OUT/split_half_full_32.txt
  [ $(left) -gt 120 ] && backward_module_at_32 norm_backward_module_32.txt
fi
if want 19 && [ $(left) -gt 60 ]; then
  # the fused QK kernels at 8 CTAs an SM (index off): their GPU tests under the cap, then the bench beside the chains
  TILEPLUG_CUDA_KERNEL_INDEX=off TILEPLUG_CUDA_NORM_ROPE_CTAS_PER_SM=8 TILEPLUG_GPU_PRECOMPILE=0 \
    timeout $(( $(left) > 160 ? 150 : $(left) - 10 )) $P -n 15 -k "rms_norm_rope" tests/gpu/test_cuda_rope.py \
    > $OUT/norm_rope_ctas_tests.txt 2>&1
  tail -2 $OUT/norm_rope_ctas_tests.txt
  variant_runs TILEPLUG_CUDA_NORM_ROPE_CTAS_PER_SM "0 8 0" norm_rope_ctas_bench.txt 60 \
    $BENCH --ops rms_norm_rope,rms_norm_rope_per_token_cast --tokens 1024,4096,16384,65536 \
    | grep -E "^(==|rms_norm_rope[a-z_]* +[0-9]+ +[0-9]+ +[a-z_]+ +[0-9])"
fi
if want 11 && [ $(left) -gt 120 ]; then
  nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/table_gpu.txt
  timeout $(( $(left) - 10 )) $BENCH --dtype fp32 --peer tile_kernels \
    --ops topk_gate/e64-k6,topk_gate/e256-k8,topk_gate/e384-k8,moe_topk_gate/sqrtsoftplus-shared1 \
    --tokens 1,128,1024,4096,16384,65536 > $OUT/moe_table.txt 2>> $OUT/stderr.log
  grep -E "^(topk_gate|moe_topk_gate)/" $OUT/moe_table.txt | tail -36
fi
if want 20 && [ $(left) -gt 120 ]; then
  for dtype in fp32 bf16; do
    [ $(left) -gt 60 ] || break
    timeout $(( $(left) - 10 )) python3 -m tileplug.core.cli bench --device cuda --backends cuda --no-dispatch --verbose \
      --dtype $dtype --ops moe_topk_gate/softmax-e64-k6,moe_topk_gate/deepseek-v3 \
      --tokens 1,128,1024,4096,16384,65536 > $OUT/moe_compile_$dtype.txt 2>> $OUT/stderr.log
    grep -E "^moe_topk_gate/" $OUT/moe_compile_$dtype.txt | tail -36
  done
  [ $(left) -gt 40 ] && timeout $(( $(left) - 10 )) $BENCH --ops moe_permute/e256-k8,moe_unpermute/e256-k8 \
    --tokens 1024,4096,16384,65536 > $OUT/moe_permute.txt 2>> $OUT/stderr.log
  grep -E "^moe_(un)?permute/" $OUT/moe_permute.txt
fi
if want 21 && [ $(left) -gt 120 ]; then
  nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/quant_gpu.txt
  timeout $(( $(left) - 10 )) $BENCH --peer tile_kernels \
    --ops per_token_cast,per_token_cast/ue8m0-col,per_token_cast/e2m1-g16,per_block_cast,per_channel_cast,cast_back \
    --tokens 1,128,1024,4096,8192,16384,65536 > $OUT/quant_table.txt 2>> $OUT/stderr.log
  grep -E "^(per_|cast_back)" $OUT/quant_table.txt | tail -100
fi
if want 22 && [ $(left) -gt 60 ]; then
  timeout $(( $(left) > 330 ? 300 : $(left) - 30 )) $P -x -k "rms_norm_rope" tests/gpu/test_cuda_rope.py \
    > $OUT/rope_words_tests.txt 2>&1; tail -3 $OUT/rope_words_tests.txt
  TILEPLUG_GPU_PRECOMPILE=0 timeout $(( $(left) - 40 )) $P -n 15 -k "not backward" tests/gpu/test_cuda_norm.py \
    > $OUT/norm_words_tests.txt 2>&1; tail -2 $OUT/norm_words_tests.txt
  [ $(left) -gt 40 ] && timeout $(( $(left) - 10 )) python3 tests/gpu/probe_fused_qk.py | tee $OUT/fused_qk_words.txt
fi
if want 23 && [ -n "${OLD:-}" ] && [ $(left) -gt 60 ]; then
  for form in old new; do
    [ $(left) -gt 40 ] || break
    path=$([ $form = old ] && echo "$PWD/$OLD:" || echo "")
    echo "== fused QK $form, $(left) s left" | tee -a $OUT/old_new.txt
    env TILEPLUG_CUDA_KERNEL_INDEX=off PYTHONPATH="$path$PYTHONPATH" timeout $(( $(left) > 100 ? 90 : $(left) - 10 )) \
      python3 tests/gpu/probe_fused_qk.py 2>> $OUT/stderr.log | tee -a $OUT/old_new.txt
  done
  old_new_bench norms rms_norm,rms_norm/residual,rms_norm_per_token_cast/g32,rms_norm_rope,rms_norm_rope_per_token_cast \
    4096,16384,65536 old_new.txt
fi
if want 24 && [ $(left) -gt 60 ]; then
  TILEPLUG_CUDA_KERNEL_INDEX=off TILEPLUG_CUDA_NORM_ROPE_VALUES=64 TILEPLUG_GPU_PRECOMPILE=0 \
    timeout $(( $(left) > 160 ? 150 : $(left) - 10 )) $P -n 8 -k "rms_norm_rope and chain" tests/gpu/test_cuda_rope.py \
    > $OUT/norm_rope_values64_tests.txt 2>&1
  tail -2 $OUT/norm_rope_values64_tests.txt
  variant_runs TILEPLUG_CUDA_NORM_ROPE_VALUES "32 64 32" norm_rope_values.txt 60 python3 tests/gpu/probe_fused_qk.py
fi
if want 25 && [ $(left) -gt 60 ]; then
  TILEPLUG_GPU_PRECOMPILE=0 timeout $(( $(left) > 130 ? 120 : $(left) - 10 )) $P -n 8 tests/gpu/test_cuda_stochastic_cast.py \
    > $OUT/stochastic_fields_tests.txt 2>&1; tail -2 $OUT/stochastic_fields_tests.txt
  [ $(left) -gt 40 ] && timeout $(( $(left) - 10 )) python3 tests/gpu/probe_cast.py 2>> $OUT/stderr.log \
    | tee $OUT/stochastic_fields_probe.txt | grep -E '"tokens": 65536' | grep -v tile_kernels | cut -c1-200
fi
if want 26 && [ -n "${OLD:-}" ] && [ $(left) -gt 60 ]; then
  old_new_bench "packed sf" per_token_cast,per_token_cast/ue8m0-col 1,4096,16384,65536 packed_sf_old_new.txt
fi
if want 27 && [ $(left) -gt 60 ]; then  # (precompiling the whole quant grid took more than 120 s on an H100)
  TILEPLUG_GPU_PRECOMPILE=0 timeout $(( $(left) > 250 ? 240 : $(left) - 10 )) $P -n 12 tests/gpu/test_cuda_quant.py -k stochastic \
    > $OUT/stochastic_quant_tests.txt 2>&1; tail -2 $OUT/stochastic_quant_tests.txt
  old_new_probe "stochastic quant" stochastic_quant.txt 90 tests/gpu/probe_stochastic_quant.py | cut -c1-400
fi
if want 28 && [ $(left) -gt 60 ]; then
  variant_runs TILEPLUG_CUDA_TILE_PER_CHANNEL "32,4,1 16,8,1 16,8,2 4,32,1 8,16,1" per_channel_tiles.txt 60 \
    $BENCH --ops per_channel_cast --tokens 4096,16384,65536 > /dev/null
  grep -E "^== |^per_channel_cast +[0-9]+ +[0-9]+ +cuda" $OUT/per_channel_tiles.txt
  [ $(left) -gt 60 ] && timeout 60 $BENCH --peer tile_kernels --ops per_channel_cast --tokens 4096,16384,65536 2>> $OUT/stderr.log \
    | tee -a $OUT/per_channel_tiles.txt | grep -E "^per_channel_cast +[0-9]+ +[0-9]+ +[a-z_]+ +[0-9]"
fi
if want 29 && [ $(left) -gt 60 ]; then
  TILEPLUG_GPU_PRECOMPILE=0 timeout $(( $(left) > 160 ? 150 : $(left) - 10 )) $P -n 12 \
    -k "moe_permute or moe_expert_counts or layout" tests/gpu/test_cuda_moe.py > $OUT/permute_tests.txt 2>&1
  tail -2 $OUT/permute_tests.txt
  if [ -n "${OLD:-}" ]; then
    for round in 1 2; do
      old_new_bench "permute round $round" moe_permute/e256-k8 1024,4096,16384,65536 permute_old_new.txt
    done
  fi
fi
if want 30 && [ $(left) -gt 60 ]; then
  TILEPLUG_GPU_PRECOMPILE=0 timeout $(( $(left) > 250 ? 240 : $(left) - 10 )) $P -n 12 tests/gpu/test_cuda_quant.py \
    tests/gpu/test_cuda_stochastic_cast.py -k "stochastic" > $OUT/short_carry_tests.txt 2>&1
  tail -2 $OUT/short_carry_tests.txt
  old_new_probe "short carry" short_carry.txt 90 tests/gpu/probe_stochastic_quant.py | cut -c1-300
  old_new_probe "short carry (element casts)" short_carry.txt 120 tests/gpu/probe_cast.py \
    | grep -E '"runner": "stochastic_cast"' | cut -c1-200
fi
if want 31 && [ $(left) -gt 60 ]; then
  TOKENS=4096,65536 variant_runs TILEPLUG_CUDA_TILE_PER_BLOCK "16,8,2 8,16,2 8,16,1 32,4,1 16,8,2" per_block_tiles.txt 60 \
    python3 tests/gpu/probe_stochastic_quant.py | grep -E '^== |"per_block' | cut -c1-330
fi
if want 32 && [ $(left) -gt 60 ]; then
  TILEPLUG_GPU_PRECOMPILE=0 timeout $(( $(left) > 160 ? 150 : $(left) - 10 )) $P -n 12 tests/gpu/test_cuda_quant.py \
    -k "stochastic" > $OUT/e2m1_codes_tests.txt 2>&1
  tail -2 $OUT/e2m1_codes_tests.txt
  TOKENS=4096,65536 old_new_probe "e2m1 codes" e2m1_codes.txt 60 tests/gpu/probe_stochastic_quant.py \
    | grep -E '^== |"case"' | cut -c1-330
fi
# (step 34 before 33: its tests check a default)
if want 34 && [ $(left) -gt 60 ]; then
  TILEPLUG_GPU_PRECOMPILE=0 timeout $(( $(left) > 130 ? 120 : $(left) - 10 )) $P -n 8 tests/gpu/test_cuda_random.py \
    tests/gpu/test_cuda_stochastic_cast.py > $OUT/advance_tests.txt 2>&1
  tail -2 $OUT/advance_tests.txt
  old_new_probe "advance in the draw" advance_cast.txt 100 tests/gpu/probe_cast.py | grep -E '^== |stochastic' | cut -c1-200
fi
if want 33 && [ $(left) -gt 60 ]; then
  timeout $(( $(left) > 310 ? 300 : $(left) - 10 )) python3 tests/gpu/sweep_tiles.py --cases per_channel,cast_back \
    --tokens 128,1024,4096,16384,65536 --peer > $OUT/lanes_sweep.txt 2>> $OUT/stderr.log
  sed -n '/^== per_channel/,/^best/p' $OUT/lanes_sweep.txt
  for tile in "8,0,1 32" "2,0,1 4"; do
    set -- $tile
    [ $(left) -gt 60 ] || break
    TILEPLUG_CUDA_KERNEL_INDEX=off TILEPLUG_CUDA_TILE_PER_CHANNEL=$1 TILEPLUG_CUDA_LANES_PER_ROW_PER_CHANNEL=$2 \
      timeout $(( $(left) > 100 ? 90 : $(left) - 10 )) ncu --clock-control none --section SpeedOfLight \
      --section WarpStateStats --section Occupancy -k regex:"per_channel" -c 6 \
      python3 tests/gpu/probe_ncu_target.py per_channel_cast 4096 > $OUT/ncu_per_channel_$1_$2.txt 2>&1
    grep -E "per_channel|Duration|DRAM Throughput|Achieved Occupancy" $OUT/ncu_per_channel_$1_$2.txt | head -24
  done
fi
if want 35 && [ $(left) -gt 60 ]; then
  for wide in 0 1; do
    [ $(left) -gt 40 ] || break
    echo "== philox_wide $wide, $(left) s left" | tee -a $OUT/philox_wide.txt
    env TILEPLUG_CUDA_KERNEL_INDEX=off TILEPLUG_CUDA_PHILOX_WIDE_PER_TOKEN=$wide TILEPLUG_CUDA_PHILOX_WIDE_PER_BLOCK=$wide \
      TOKENS=4096,65536 timeout $(( $(left) > 100 ? 90 : $(left) - 10 )) python3 tests/gpu/probe_stochastic_quant.py \
      2>> $OUT/stderr.log | tee -a $OUT/philox_wide.txt | cut -c1-330
  done
fi
if want 36 && [ $(left) -gt 60 ]; then
  TILEPLUG_GPU_PRECOMPILE=0 timeout $(( $(left) > 130 ? 120 : $(left) - 10 )) $P -n 12 tests/gpu/test_cuda_random.py \
    tests/gpu/test_cuda_stochastic_cast.py tests/gpu/test_cuda_quant.py -k "stochastic or random" > $OUT/relaxed_tests.txt 2>&1
  tail -2 $OUT/relaxed_tests.txt
  env TILEPLUG_CUDA_KERNEL_INDEX=off TILEPLUG_CUDA_PHILOX_WIDE_PER_TOKEN=0 TILEPLUG_CUDA_PHILOX_WIDE_PER_BLOCK=0 \
    TILEPLUG_GPU_PRECOMPILE=0 timeout $(( $(left) > 100 ? 90 : $(left) - 10 )) $P -n 12 tests/gpu/test_cuda_quant.py \
    -k stochastic > $OUT/split_tests.txt 2>&1
  tail -2 $OUT/split_tests.txt
  for form in ${OLD_QUANT:+old} new split; do
    [ $(left) -gt 40 ] || break
    path=$([ $form = old ] && echo "$OLD_QUANT:" || echo "")
    wide=$([ $form = split ] && echo 0 || echo 1)
    echo "== quant casts' advance $form, $(left) s left" | tee -a $OUT/relaxed_quant.txt
    env TILEPLUG_CUDA_KERNEL_INDEX=off PYTHONPATH="$path$PYTHONPATH" TILEPLUG_CUDA_PHILOX_WIDE_PER_TOKEN=$wide \
      TILEPLUG_CUDA_PHILOX_WIDE_PER_BLOCK=$wide TOKENS=128,4096,65536 timeout $(( $(left) > 70 ? 60 : $(left) - 10 )) \
      python3 tests/gpu/probe_stochastic_quant.py 2>> $OUT/stderr.log | tee -a $OUT/relaxed_quant.txt | cut -c1-330
  done
  old_new_probe "relaxed advance in the draw" relaxed_cast.txt 100 tests/gpu/probe_cast.py | grep -E '^== |stochastic' | cut -c1-200
fi
if want 37 && [ $(left) -gt 120 ]; then
  timeout $(( $(left) - 90 )) python3 -m tileplug.core.cli precompile --device cuda \
    --ops $(python3 tests/gpu/sanitize_tails.py --ops) > $OUT/sanitize_precompile.txt 2>&1
  tail -2 $OUT/sanitize_precompile.txt
  timeout $(( $(left) - 10 )) compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/gpu/sanitize_tails.py \
    > $OUT/memcheck.txt 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|checked|declined" $OUT/memcheck.txt | tail -4
fi
if want 38 && [ $(left) -gt 60 ]; then
  TILEPLUG_GPU_PRECOMPILE=0 timeout $(( $(left) > 110 ? 100 : $(left) - 10 )) $P -n 14 tests/gpu/test_cuda_random.py \
    tests/gpu/test_cuda_stochastic_cast.py tests/gpu/test_cuda_quant.py -k "stochastic or random" > $OUT/start_count_tests.txt 2>&1
  tail -2 $OUT/start_count_tests.txt
  for form in new ${OLD_QUANT:+old}; do
    [ $(left) -gt 40 ] || break
    path=$([ $form = old ] && echo "$OLD_QUANT:" || echo "")
    echo "== quant casts' count at the start: $form, $(left) s left" | tee -a $OUT/start_count_quant.txt
    env TILEPLUG_CUDA_KERNEL_INDEX=off PYTHONPATH="$path$PYTHONPATH" TOKENS=128,4096,65536 \
      timeout $(( $(left) > 70 ? 60 : $(left) - 10 )) python3 tests/gpu/probe_stochastic_quant.py 2>> $OUT/stderr.log \
      | tee -a $OUT/start_count_quant.txt | cut -c1-330
  done
  old_new_probe "count at the start in the draw" start_count_cast.txt 100 tests/gpu/probe_cast.py | grep -E '^== |stochastic' | cut -c1-200
fi
if want 39 && [ $(left) -gt 60 ]; then
  env TILEPLUG_CUDA_TILE_PER_TOKEN=4,1,4 TILEPLUG_GPU_PRECOMPILE=0 timeout $(( $(left) > 100 ? 90 : $(left) - 10 )) \
    $P -n 14 tests/gpu/test_cuda_quant.py -k "stochastic and per_token" > $OUT/capped_tests.txt 2>&1
  tail -2 $OUT/capped_tests.txt
  for tile in default 4,1,4 4,1,8 ${OLD_QUANT:+old}; do
    [ $(left) -gt 40 ] || break
    path=$([ $tile = old ] && echo "$OLD_QUANT:" || echo "")
    knob=$([ $tile = default ] || [ $tile = old ] && echo "" || echo "TILEPLUG_CUDA_TILE_PER_TOKEN=$tile")
    echo "== stochastic per-token tile $tile, $(left) s left" | tee -a $OUT/capped_quant.txt
    env $knob TILEPLUG_CUDA_KERNEL_INDEX=off PYTHONPATH="$path$PYTHONPATH" TOKENS=4096,65536 \
      timeout $(( $(left) > 70 ? 60 : $(left) - 10 )) python3 tests/gpu/probe_stochastic_quant.py 2>> $OUT/stderr.log \
      | tee -a $OUT/capped_quant.txt | grep per_token | cut -c1-330
  done
fi
if want 40 && [ $(left) -gt 60 ]; then
  TILEPLUG_GPU_PRECOMPILE=0 timeout $(( $(left) > 100 ? 90 : $(left) - 10 )) $P -n 14 tests/gpu/test_cuda_quant.py \
    -k "stochastic" > $OUT/advance_before_draws_tests.txt 2>&1
  tail -2 $OUT/advance_before_draws_tests.txt
  for form in new ${OLD:+start} 4,1,6 ${OLD_QUANT:+two}; do
    [ $(left) -gt 40 ] || break
    path=$(case $form in start) echo "$OLD:";; two) echo "$OLD_QUANT:";; *) echo "";; esac)
    knob=$([ $form = 4,1,6 ] && echo "TILEPLUG_CUDA_TILE_PER_TOKEN=$form" || echo "")
    echo "== stochastic quant casts, $form, $(left) s left" | tee -a $OUT/advance_before_draws.txt
    env $knob TILEPLUG_CUDA_KERNEL_INDEX=off PYTHONPATH="$path$PYTHONPATH" TOKENS=128,4096,65536 \
      timeout $(( $(left) > 70 ? 60 : $(left) - 10 )) python3 tests/gpu/probe_stochastic_quant.py 2>> $OUT/stderr.log \
      | tee -a $OUT/advance_before_draws.txt | cut -c1-330
  done
fi
if want 41 && [ $(left) -gt 60 ]; then
  TILEPLUG_GPU_PRECOMPILE=0 timeout $(( $(left) > 160 ? 150 : $(left) - 10 )) $P -n 14 tests/gpu/test_cuda_stochastic_cast.py \
    tests/gpu/test_cuda_quant.py -k "stochastic" > $OUT/byte_fields_tests.txt 2>&1
  tail -2 $OUT/byte_fields_tests.txt
  for form in new ${OLD_W16:+w16} ${OLD_QUANT:+two}; do
    [ $(left) -gt 40 ] || break
    path=$(case $form in w16) echo "$OLD_W16:";; two) echo "$OLD_QUANT:";; *) echo "";; esac)
    echo "== stochastic quant casts, $form, $(left) s left" | tee -a $OUT/byte_fields.txt
    env TILEPLUG_CUDA_KERNEL_INDEX=off PYTHONPATH="$path$PYTHONPATH" TOKENS=128,4096,65536 \
      timeout $(( $(left) > 70 ? 60 : $(left) - 10 )) python3 tests/gpu/probe_stochastic_quant.py 2>> $OUT/stderr.log \
      | tee -a $OUT/byte_fields.txt | cut -c1-330
  done
  for form in new ${OLD_W16:+w16}; do
    [ $(left) -gt 40 ] || break
    path=$([ $form = w16 ] && echo "$OLD_W16:" || echo "")
    echo "== element casts, $form, $(left) s left" | tee -a $OUT/byte_fields_casts.txt
    env TILEPLUG_CUDA_KERNEL_INDEX=off PYTHONPATH="$path$PYTHONPATH" timeout $(( $(left) > 70 ? 60 : $(left) - 10 )) \
      python3 tests/gpu/probe_cast.py 2>> $OUT/stderr.log | tee -a $OUT/byte_fields_casts.txt \
      | grep -E '"tokens": 65536' | grep -v tile_kernels | cut -c1-200
  done
fi
if want 42 && [ $(left) -gt 60 ]; then
  TILEPLUG_GPU_PRECOMPILE=0 timeout $(( $(left) > 160 ? 150 : $(left) - 10 )) $P -n 14 tests/gpu/test_cuda_stochastic_cast.py \
    tests/gpu/test_cuda_quant.py -k "stochastic and e2m1" > $OUT/e2m1_carry_tests.txt 2>&1
  tail -2 $OUT/e2m1_carry_tests.txt
  for form in new uncapped ${OLD_QUANT:+old}; do
    [ $(left) -gt 40 ] || break
    path=$([ $form = old ] && echo "$OLD_QUANT:" || echo "")
    tile=$([ $form = uncapped ] && echo "4,1,1" || echo "")
    echo "== stochastic quant casts, $form, $(left) s left" | tee -a $OUT/e2m1_carry.txt
    env TILEPLUG_CUDA_KERNEL_INDEX=off PYTHONPATH="$path$PYTHONPATH" ${tile:+TILEPLUG_CUDA_TILE_PER_TOKEN=$tile} \
      TOKENS=128,4096,65536 timeout $(( $(left) > 70 ? 60 : $(left) - 10 )) python3 tests/gpu/probe_stochastic_quant.py \
      2>> $OUT/stderr.log | tee -a $OUT/e2m1_carry.txt | cut -c1-330
  done
fi
echo "all done, $(left) s left"
