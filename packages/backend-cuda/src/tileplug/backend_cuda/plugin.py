"""Entry point of tileplug-backend-cuda: the ``cuda`` backend and its availability probe."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tileplug.core import CUDA_LAYOUT, Backend, DeferredKernel, deferred_kernel_table, hookimpl
from tileplug.backend_cuda.devices import MIN_COMPUTE_CAPABILITY, launcher_for

PRIORITY = 100


def probe() -> str | None:
    """None when a GPU of compute capability ≥ 9.0 is visible and TileLang is installed, else
    why not. TileLang is located, not imported: its import costs half a second and a warm
    first call loads kernels from the index without it (a TileLang that is installed but
    broken surfaces when a kernel is first compiled, as a BackendError naming the backend)."""
    import importlib.util

    import torch

    if torch.version.cuda is None:
        return "this PyTorch build has no CUDA support"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    capability = torch.cuda.get_device_capability()
    if capability < MIN_COMPUTE_CAPABILITY:
        return f"GPU compute capability {capability[0]}.{capability[1]} is below 9.0"
    for module in ("tilelang", "tvm_ffi"):
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError) as error:
            return f"{module} cannot be located: {type(error).__name__}: {error}"
        if found is None:
            return f"{module} is not installed (pip install tilelang)"
    return None


def _target_arch() -> str:
    """The architecture code is generated for: ``TILEPLUG_CUDA_ARCH``, else the visible GPU's,
    else ``sm_90`` (no GPU needed to lower or precompile)."""
    from tileplug.backend_cuda import jit

    forced = os.environ.get("TILEPLUG_CUDA_ARCH")
    if forced:
        return forced
    return jit.device_arch() if probe() is None else jit.DEFAULT_ARCH


def lower(call: Any) -> str:
    """Generated CUDA source of the kernel serving ``call`` (works without a GPU: the arch is
    the device's when one is visible, else ``sm_90``; ``TILEPLUG_CUDA_ARCH`` overrides)."""
    kernel = _KERNELS.get(call.op)
    if kernel is None:
        raise ValueError(f"the cuda backend has no {call.op} kernel")
    return kernel.source(call, _target_arch())


def capabilities() -> str:
    """What the CUDA kernels accept and how they are checked (``tileplug info``)."""
    return (
        "per_token_cast (groups 16/32/64/128), per_block_cast (sides 16/32/64/128), per_channel_cast\n"
        "  (32/128, UE8M0 packed along tokens), cast_back (bf16/fp32); e4m3/e2m1; fp32, e4m3-stored and packed\n"
        "  UE8M0 (4 per int32) sf, row- or TMA-aligned column-major; sf-only, precomputed sf (any encoding, read\n"
        "  by strides), re-quantized (xq, sf) inputs; bf16/fp32 input, any row stride (128-bit loads when rows are\n"
        "  16-byte aligned, scalar loads otherwise); T and H dynamic: one kernel per configuration.\n"
        "  stochastic_rounding=True on per_token_cast / per_block_cast: the tile's own quantize step rounds each\n"
        "  x*inv with its Philox word (a thread's 128-bit chunk is whole Philox blocks), e4m3 and e2m1 alike.\n"
        "  Declined: H not a multiple of 16 (falls through to the reference).\n"
        "per_token_cast_and_cast_back (fake quant in place): the per-token tile's fake-quant mode (scale kept in\n"
        "  registers, x written over), bytewise equal to the reference on an H200 (every op-table case);\n"
        "per_block_cast_lossless (e2m1 pair, fp32 or packed UE8M0 input sf, any input and output groups): the\n"
        "  tile's lossless mode: each element keyed by its input scale's exponent (from the fp32 bits), the group\n"
        "  scale 2^max(e_max - 6, -127) from the largest key (no division); per-token tile for 1 x bn groups,\n"
        "  16-warp block / channel tiles (half-width up to 2048 rows); bytewise equal to the reference on an H200.\n"
        "transpose_weight_sf (block sizes 16/32/64/128, [R, C] or stacked [G, R, C] scales, sf1 either view,\n"
        "  out= reuse): one launch per scale tensor writes both outputs, a CTA per 1024 integers of an output row,\n"
        "  each thread one packed UE8M0 integer (its four bytes from the scales' bit patterns) stored 128 bits wide;\n"
        "  the tensors taken as the op returns them (no host-side view); G, R and C dynamic: one kernel per block\n"
        "  size, stacked or not, sf1 view.\n"
        "stochastic_cast (fp32 -> bf16, fp32 -> e4m3, bf16 -> e4m3): fill_rand's Philox words (same kernel macro),\n"
        "  element i rounded with word i >> 8 in the reference's exact fixed point (fp32 pattern arithmetic for bf16,\n"
        "  power-of-two scaling into e4m3's binade for e4m3), offset advanced by the last CTA (one launch); each thread\n"
        "  16 bytes of result (128-bit loads and stores when x and result are 16-byte aligned, checked per call);\n"
        "  any element count (int64).\n"
        "rms_norm, layer_norm (weight/bias any of bf16/fp16/fp32, residual add with residual_out, in place\n"
        "  through out=x / residual_out=residual, weight_offset, out_scale, rstd / mean+rstd), rms_norm_per_token_cast\n"
        "  (every sf option of per_token_cast, bytewise equal to rms_norm then per_token_cast on this backend);\n"
        "  2-D [T, D] and per-head 3-D [T, N, D]; bf16/fp16/fp32 (cast: bf16/fp32); any row strides (128-bit loads\n"
        "  and stores when every row is 16-byte aligned and D a multiple of 8 bf16 / 4 fp32, per element\n"
        "  otherwise); the row stays in registers (one read of x), fp32 statistics added in the reference's pairwise\n"
        "  order (register folds, then shared memory): the reference's bytes, batch-invariant; T dynamic, one\n"
        "  kernel per D and configuration.\n"
        "  Declined: fp64 (gradcheck dtype), rows longer than 16 warps x 8 vectors (bf16 D > 32768, fp32 D > 16384),\n"
        "  rows above 12288 values without an exact tile (> 48 KB of shared memory), 3-D casts whose D is not a\n"
        "  multiple of the group.\n"
        "rms_norm_backward, layer_norm_backward: grad_x as the reference's (same row tile and order), grad_weight\n"
        "  and grad_bias deterministic and batch-invariant: fixed blocks of rows add into per-CTA partial rows, a\n"
        "  second kernel adds the partials of each column in order (no atomics; never depends on the SM count).\n"
        "apply_rotary: query and key in one launch, 3-D/4-D, NeoX/GPT-J, conjugate, implicit/int32/int64 positions\n"
        "  + seqlen_offset, any even R <= D (channels past R never touched), bf16/fp16/fp32, any strides (QKV views);\n"
        "  128-bit loads when R/2 is a multiple of 16 bytes of values and pointers/strides are 16-byte aligned (checked\n"
        "  per call; scalar loads otherwise); cos/sin row kept in registers across a token's heads; T, heads, D, strides,\n"
        "  cache length and offset dynamic. Declined: rotary widths needing more than 1024 threads per head\n"
        "  (R/2 over the largest power of two <= 16 bytes of values dividing it; never below R = 2048).\n"
        "rms_norm_rope, rms_norm_rope_per_token_cast: the rms_norm kernel's own per-head norm (same tile and\n"
        "  reduction), the apply_rotary rotation and (cast) the per-token groups reduced on chip from the rotated\n"
        "  values, in one pass: bytewise equal to rms_norm -> apply_rotary (-> per_token_cast) on this backend;\n"
        "  NeoX pairs exchanged through shared memory, GPT-J pairs in registers; every sf layout of per_token_cast;\n"
        "  any x row strides (128-bit rows when aligned, checked per call). Declined: casts whose group does not\n"
        "  divide D (a group would straddle two heads), fp64 weights, heads too long for rms_norm's tile.\n"
        "topk_gate, moe_topk_gate (softmax / sigmoid / sqrtsoftplus, selection bias, num_groups / topk_groups,\n"
        "  renormalize, routed_scaling_factor, shared-expert slots, mask, scores), moe_topk_gate_backward: one warp\n"
        "  per row, E <= 1024 (any E, 128-bit loads when E is a multiple of 16 bytes of values and rows are aligned),\n"
        "  k (+ shared slots) <= 32, groups <= 32; bf16/fp32 logits; indices by k rounds of a warp max then a min\n"
        "  over the indices holding it (ties to the smaller index); a non-finite or masked row gets -1 / 0, no\n"
        "  device assert; a group's score lane by lane where a group spans a power of two of lanes (each lane's\n"
        "  two largest merged by shuffles; TILEPLUG_CUDA_MOE_LANE_GROUPS=0: two masked warp rounds a group).\n"
        "  normalize_weight: K <= 64. Declined (to the\n"
        "  reference): E > 1024, k + shared > 32,\n"
        "  fp64 logits / scores (gradcheck dtype), > 32 groups.\n"
        "moe_expert_counts, moe_permute (bf16/fp16/fp32 or e4m3 / packed e2m1 rows with their sf rows),\n"
        "  moe_unpermute: no atomics; fixed chunks of 2048 (token, slot) pairs counted per expert, one scan CTA,\n"
        "  each pair's row placed by its expert's thread in token order (stable, deterministic); padding rows\n"
        "  zeroed; unpermute in fp32 in slot order, rounded once. Declined: E > 1024, K > 2048, rows over 8192\n"
        "  elements (64 per thread of 128 in registers).\n"
        "swiglu, swiglu_per_token_cast, swiglu_backward: the norm family's row tile over x viewed as [N, 2, H]\n"
        "  (gate and up values of a column in one thread, one read of x), routed weights x routed_scaling_factor,\n"
        "  clamp, expert_ends (a row's expert by binary search; padding rows never read, written as zeros, zero\n"
        "  scales); for fp32 results (fp32 y, the cast, fp32 gradients) the sigmoid in fp64 rounded once (the\n"
        "  reference's correctly rounded value: the reference's bits), for bf16 results an fp32 one within 1 ulp\n"
        "  (where x is bf16, but for a bf16 y, read from a table of every bf16 gate's value, the reference's,\n"
        "  copied into shared memory once a CTA; TILEPLUG_CUDA_SWIGLU_SIGMOID_TABLE=0 evaluates it per value);\n"
        "  products in the reference's order, no FMA contraction; the cast is the norm cast's register cast (every sf layout of\n"
        "  per_token_cast, bytewise equal to swiglu(fp32) -> per_token_cast on this backend); grad_topk_weights\n"
        "  summed in the reference's pairwise order. bf16/fp32 x and outputs, any row stride (128-bit when aligned\n"
        "  and H a multiple of 16 bytes of values). Declined: fp64 (gradcheck dtype), H over the norm tile's\n"
        "  registers (bf16 > 32768, fp32 > 16384), a weighted backward whose row sum needs > 48 KB of shared memory.\n"
        "fill_rand, fill_randn: Philox4x32-10 in TileLang integer arithmetic (32x32->64 products), seed and offset\n"
        "  read from the generator's device tensors and the offset advanced by the draw's last CTA (an arrival count)\n"
        "  (graph replays draw fresh numbers); each thread 32 bytes of consecutive values (128-bit stores when the\n"
        "  values are 16-byte aligned, checked per call); uniform bytewise the reference's, Box-Muller in fp64 from\n"
        "  exact inputs (a few fp64 FMAs a function on reduced arguments; TILEPLUG_CUDA_RANDN_BOX_MULLER=library\n"
        "  takes CUDA's log1p / sqrt / sinpi / cospi), rounded once: the reference's values but for a near-tie.\n"
        "  fp32 / bf16 / fp16, any element count (int64).\n"
        "  Kernel cache: compiled modules are indexed next to TileLang's cache ($TILELANG_CACHE_DIR/tileplug-index,\n"
        "  TILEPLUG_CUDA_KERNEL_INDEX=DIR|off) and loaded without importing TileLang; `tileplug precompile` fills it.\n"
        "  Status: every specialisation of the CI grid lowers for sm_90 and compiles with nvcc; bit-exactness vs\n"
        "  the reference is checked on the GPU host (tests/gpu/test_cuda_*.py, -m gpu).\n"
        "  Not honoured: config.pdl (TileLang 0.1.15's tvm_ffi launcher sets no programmatic-dependent-launch\n"
        "  attribute) and config.sm_count (one tile per CTA, grids sized by T and H, no persistent loop)."
    )


def precompile(calls: Sequence[Any], workers: int | None = None) -> int:
    """Compile the specialisations serving ``calls`` that the kernel index lacks, in parallel
    processes, for this host's GPU (``TILEPLUG_CUDA_ARCH`` or ``sm_90`` without one); returns
    how many were compiled."""
    from tileplug.backend_cuda import jit

    arch = _target_arch()
    specs = []
    for call in calls:
        kernel = _KERNELS.get(call.op)
        if kernel is not None and kernel.supports(call) is None:
            specs.extend(kernel.specs(call))
    return jit.precompile(specs, arch=arch, workers=workers, load=False)


class DeviceKernel(DeferredKernel):
    """A kernel of this backend: its launchers run on their tensors' device
    (``devices.launcher_for``: the kernel's own launcher on a one-GPU host)."""

    def prepare(self, call: Any):
        return launcher_for(super().prepare, call)


_KERNELS = deferred_kernel_table("tileplug.backend_cuda", kernel_type=DeviceKernel)
"""Op -> kernel of every family (``<family>.make_kernels()``), each family's modules imported at
its first use: a first call imports its own family only."""


def make_backend() -> Backend:
    """The CUDA backend object."""
    return Backend(
        name="cuda",
        device_types=("cuda",),
        priority=PRIORITY,
        traits=CUDA_LAYOUT,
        kernels=_KERNELS,
        probe=probe,
        lower=lower,
        capabilities=capabilities,
        precompile=precompile,
        description="TileLang kernels for SM90/SM100",
    )


@hookimpl
def tileplug_backends() -> list[Backend]:
    return [make_backend()]
