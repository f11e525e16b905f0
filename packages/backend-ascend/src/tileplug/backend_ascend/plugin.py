"""Entry point of tileplug-backend-ascend: the ``ascend`` backend and its availability probe.

``torch_npu`` is imported only inside :func:`probe`, never at module import: it needs the
vendor's CANN stack, which most machines do not have.
"""

from __future__ import annotations

import os

from tileplug.core import ASCEND_LAYOUT, Backend, deferred_kernel_table, hookimpl

PRIORITY = 100
DEVICE_MANAGER = "/dev/davinci_manager"


def probe() -> str | None:
    """None when the Ascend driver is present and torch_npu imports, else why not."""
    if not os.path.exists(DEVICE_MANAGER):
        return f"{DEVICE_MANAGER} does not exist (no Ascend driver on this machine)"
    try:
        import torch_npu  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure makes the backend unavailable
        return f"torch_npu does not import: {type(error).__name__}: {error}"
    return None


def kernel_table() -> dict:
    """Op (kernel-table key) -> Ascend kernel, every family, each family's module imported at
    its first use (most import TileLang's Ascend dialect at module scope: a CUDA host, where
    this backend serves nothing, never pays for it)."""
    return deferred_kernel_table("tileplug.backend_ascend")


def lower(call) -> str:
    """Ascend C of ``call`` (lowered with stand-in device constants; no NPU needed), headed by
    comment lines naming the specialisation, the stand-ins and the UB plan; an op that launches
    several kernels (the norm backward: rows, then the column sum) gives each in launch order."""
    return "\n".join(lowering.header + lowering.lowered.source for lowering in kernel_table()[call.op].lowerings(call))


def capabilities() -> str:
    """What ``tileplug info`` says about this backend: what lowers, how CI checks it, never "verified"."""
    lines = [
        "per_token_cast (groups 16/32/64/128), per_block_cast (sides 16/32/64/128), per_channel_cast",
        "  (32/128, UE8M0 packed along tokens), cast_back (bf16/fp32); e4m3/e2m1; plain, round_sf, packed UE8M0",
        "  (2 per int16), column-major sf; sf-only, precomputed sf, re-quantized (xq, sf) inputs; bf16/fp32 input;",
        "  dynamic T, any row stride, H a multiple of 16. Declined: e4m3-stored sf, non-Ascend sf layouts as input,",
        "  a UB plan over budget even at the narrowest tile (per-block re-quantization of a UE8M0-scaled 1x128 input).",
        "  stochastic_rounding=True on per_token_cast / per_block_cast (e4m3 / e2m1, the sf options and re-quantized",
        "  inputs above): per tile fill_rand's Philox words, four 8-bit fields a word (element i = t*H + h: field",
        "  i % 4 of word i // 4, T*H < 2**36), the stochastic cast's grid rounding. Lowered, never run on an NPU.",
        "per_token_cast_and_cast_back (fake quant in place: the per-token tile quantizes and dequantizes each",
        "  register, float(q) * sf rounded once to x's dtype, written over x; no q / sf in GM, pure SIMD): e4m3 /",
        "  e2m1 (codes' values rebuilt arithmetically), groups 16/32/64/128, plain, round_sf and e4m3-rounded",
        "  scales (use_e4m3_sf: nothing is stored), bf16/fp32, any row stride. Lowered, never run on an NPU.",
        "per_block_cast_lossless (e2m1 (xq, sf) -> e4m3, fp32 / UE8M0 input scales row- or column-major, output",
        "  groups of sides 1/16/32/64/128 with fp32 or packed UE8M0 sf, row- or column-major): the re-quantization",
        "  above in a lossless mode, each element keyed by its input scale's UE8M0 byte (transpose_weight_sf's byte",
        "  rule), the same integer group max, sf = 2^max(e_max - 6, -127) from exponent bits (+inf / 0xFF and inv 0",
        "  when not finite), q = e4m3(x * (sf_in * inv)); the tile of the output groups (per token 1 x bn, per",
        "  channel bm x 1, per block). Where per-element fp32 decoded values and input scales are over the UB",
        "  budget (128-row groups whose tile spans 256 columns, packed 128 x 1 groups from a UE8M0-scaled input:",
        "  15 of the 68 op-table cases), the decoded values are held in bf16 (exact) and the input scales one per",
        "  input group, broadcast on load; same fp32 products. Every op-table case served. Lowered, never run on",
        "  an NPU.",
        "rms_norm (weight optional, residual + residual_out, in place, weight_offset, out_scale, rstd), layer_norm",
        "  (weight / bias optional, residual, mean + rstd): bf16/fp16/fp32, [T, D] or per-head [T, N, D], any D,",
        "  any strides; one row per pipelined step, whole in UB, fp32 statistics in a fixed order over the true D.",
        "  Declined: fp64 (the reference serves gradcheck), a row too wide for UB (no split-row form).",
        "apply_rotary (NeoX / GPT-J, in place, query + key, [T, N, D] / [B, S, N, D] views, positions None /",
        "  int32 / int64 + seqlen_offset, conjugate, any even R <= D; out-of-range positions -> NaN rows).",
        "  Declined: one token's heads x R over UB.",
        "rms_norm_rope (per-head RMSNorm + RoPE of the rounded y in one pass, NeoX / GPT-J, R a multiple of 128)",
        "  and rms_norm_rope_per_token_cast (the same pass, then each rotated head cast, groups numbered over N·D);",
        "  rms_norm_per_token_cast (2-D). Both casts: e4m3, groups 16/32/64/128, fp32 sf row- or column-major,",
        "  round_sf, +y. Declined (reference): R not a multiple of 128, a group spanning two heads, 3-D input of",
        "  rms_norm_per_token_cast, e2m1, packed UE8M0.",
        "rms_norm_backward / layer_norm_backward (weight optional, grad_residual_out, weight_offset, out_scale,",
        "  [T, D] / [T, N, D], bf16/fp16/fp32, any D that fits UB): grad_x per pipelined row; weight / bias",
        "  gradients deterministic and batch-invariant: row r adds into partial r % 64 (a constant, not the core",
        "  count) in row order, then a column sum in partial order, no atomics. Declined: fp64, a row too wide for UB.",
        "topk_gate (fp32 scores, any E up to 16384 incl. non-multiples of 64, k <= 32, any row stride): one row per",
        "  pipelined step, k rounds of a vmax / vcmax row max then the smallest index holding it (ties to the smaller",
        "  index), the taken column -> -inf; a row holding inf / NaN -> -1 in every slot. Declined: k > 32.",
        "moe_topk_gate (bf16 / fp32 logits; softmax / sigmoid / sqrtsoftplus in fp32; selection on u + bias;",
        "  renormalize (+1e-20), routed_scaling_factor, shared-expert slots, mask, return_scores; non-finite rows",
        "  -> -1 / 0); group-limited routing (each group's top-two sum, the topk_groups best, the rest -inf).",
        "  Declined (reference): more than 64 groups, fp64 logits, k + S > 32.",
        "moe_topk_gate_backward (fp32 scores, int32 / int64 topk_idx, E <= 16384, K <= 64, softmax / sigmoid /",
        "  sqrtsoftplus, renormalize, routed_scaling_factor, mask): one row per pipelined step; slot sums in slot",
        "  order, an expert named twice receives both, the softmax dot product in a fixed lane order (not the",
        "  reference's pairwise tree: within the 1e-5 allowed). Declined: fp64 (the reference serves gradcheck),",
        "  K > 64.",
        "normalize_weight (fp32 [T, K], K <= 1024, any row stride): one row per pipelined step, the slot-order sum",
        "  exact (each slot taken out of its register, added to a running -0.0), one correctly rounded division.",
        "  Declined: K > 1024.",
        "moe_expert_counts (int32 / int64 topk_idx, E <= 8192, K <= 64, any alignment < 2**22): 64 blocks (a",
        "  constant) count their rows' pairs into partial counts in a GM workspace, then one block adds them in",
        "  partial order and scans the aligned ends; no atomics; fp32 integers, exact below 2**24 expanded rows (past",
        "  that the launch runs the reference's formula). Declined: E > 8192, K > 64.",
        "moe_permute (bf16 / fp16 / fp32 rows, e4m3 / packed e2m1 rows with fp32 / e4m3 / UE8M0 int32 / int16 scale",
        "  rows; int32 / int64 topk_idx, E <= 8192, K <= 64): expanded tensors zeroed, then one block walks topk_idx",
        "  twice (count, aligned scan, then each pair's row from its expert's cursor, token order within an expert),",
        "  then C cores copy each row (and scale row) as int32 words to its pairs' rows. Declined: rows or scale rows",
        "  not whole 4-byte aligned words, E > 8192, K > 64.",
        "moe_unpermute (bf16 / fp16 / fp32 y_expanded, any row stride, int32 / int64 permutation, K <= 32): one",
        "  (token, column tile) per pipelined step, the slots' rows DMA'd by their GM row index; fp32 products and",
        "  sums in slot order, rounded once; a slot outside [0, R) reads row 0 and discards it.",
        "  Declined: K > 32, K = 0.",
        "swiglu (bf16 / fp32 x, bf16 / fp32 y), swiglu_per_token_cast, swiglu_backward (grad_x over the x tiles,",
        "  grad_topk_weights in a fixed lane order carried across tiles): topk_weights x routed_scaling_factor,",
        "  clamp_value, expert_ends (padding rows read as +0, written as zeros, q and sf included); any H, rows too",
        "  wide for UB in column tiles; dynamic N, any row stride; the cast with every per_token_cast option the",
        "  Ascend quant kernel serves (e4m3 / e2m1, groups 16-128, round_sf, packed UE8M0, column-major). Sigmoid of",
        "  a bf16 x with an fp32 y / the cast: the reference's, gathered from a 32 KiB table in UB by the gate's bits;",
        "  otherwise on the vector exp (1 ulp), not correctly rounded. Declined: fp64 (the reference serves gradcheck), the cast's",
        "  own declines (e4m3-stored sf, H not a multiple of 16), expert ends too many for UB.",
        "fill_rand / fill_randn (fp32 / bf16 / fp16 values, any element count < 2**31 - 4096): Philox4x32-10 with",
        "  vmull / vxor / vadds on uint32 lanes, 64 blocks per register, tiles of 4096 elements over the vector cores;",
        "  seed and offset DMA'd from their device tensors, offset += 1 queued on the stream after the draw (graph",
        "  replay draws new numbers). rand exact; randn Box-Muller with vln, a double-float radius and octant-reduced",
        "  sine / cosine polynomials (within 2 ulp of the reference in CPU emulation). Lowered, never run on an NPU.",
        "stochastic_cast (fp32 -> bf16, fp32 -> e4m3, bf16 -> e4m3, any element count < 2**31 - 4096): the draw",
        "  kernel's tiles, Philox words and state DMA (element i rounds with field i % k of fill_rand's word i // k:",
        "  two 16-bit fields a word to bf16, four 8-bit fields to e4m3), x DMA'd in per tile; integer rounding on the",
        "  fp32 patterns (carry out of bit 24, e4m3 codes from exponent and steps, saturating at 448, NaN kept);",
        "  offset += 1 queued after the kernel. Bytewise equal to the reference in CPU emulation, edge inputs and",
        "  every bf16 pattern included. Lowered, never run on an NPU.",
        "nearest_cast (every pair of fp32 / bf16 / e4m3, any element count < 2**31 - 4096): the stochastic cast's",
        "  tiles and x DMA without generator state; integer conversion on the fp32 patterns (bf16: RNE bias 0x7FFF",
        "  plus the kept last bit; e4m3: saturating at 448, steps rounded to nearest even by adding 2**23, subnormals",
        "  in steps of 2**-9, NaN kept; e4m3 decoded exactly), no fp8 vcvt. Bytewise equal to the reference in CPU",
        "  emulation, every bf16 pattern, every e4m3 code and the ties included. Lowered, never run on an NPU.",
        "transpose_weight_sf (fp32 scales [R, C] / [G, R, C], block 16 / 32 / 64 / 128, any number of weights,",
        "  transpose_sf1): UE8M0 packed 2 per int16 (the Ascend layout); per weight shape an sf0 kernel (one item per",
        "  scale row: bytes, vdintlv into column pairs, a [P0, bs] tile expanded by a vselr gather, one strided DMA)",
        "  and an sf1 kernel (one item per pair of scale rows, the output row of C*bs int16 in one DMA); byte rule on",
        "  the fp32 patterns ((b + 0x7FFFFF) >> 23 above 2**-127's pattern, 0 at or below, -0 as +0, 0xFF above the",
        "  largest finite pattern); R, C, bs compile-time, G dynamic. Declined (the reference serves it): a block",
        "  size outside 16 / 32 / 64 / 128, an sf1 row over UB (C*bs above about 48 000 at bs 16, 61 000 at 128).",
        "  Bytewise equal to the reference in CPU emulation, special scales included. Lowered, never run on an NPU.",
        "  Status: LOWERED to Ascend C with TileLang (CPU, stand-in constants), source-checked; never run on an NPU",
        "  (not verified).",
        "  The CI lowering grid (tests/test_ascend_lowering.py, hatch run ascend-lower) checks that each of its",
        "  specialisations lowers to Ascend C and that every kernel it launches passes three checks: UB within the",
        "  per-vector-core budget (compiler, traced prim_func and plan agree), every row loop pipelined with >1 buffer",
        "  version, and a SIMD hot loop (no scalar UB access, no PIPE_S); the norm backward and expert-count kernels",
        "  also: no store-mode atomics and the same Ascend C for 64 and 40 vector cores.",
    ]
    return "\n".join(lines)


def make_backend() -> Backend:
    """The Ascend backend object."""
    return Backend(
        name="ascend",
        device_types=("npu",),
        priority=PRIORITY,
        traits=ASCEND_LAYOUT,
        kernels=kernel_table(),
        probe=probe,
        lower=lower,
        capabilities=capabilities,
        description="TileLang Ascend-dialect kernels for Ascend 950 (lowered, not verified on an NPU)",
    )


@hookimpl
def tileplug_backends() -> list[Backend]:
    return [make_backend()]
