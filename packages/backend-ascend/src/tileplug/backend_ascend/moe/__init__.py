"""Ascend MoE routing kernels (SPEC §7): one module per op over the shared row macros
(:mod:`tileplug.backend_ascend.rows`)."""

from tileplug.backend_ascend.moe import (
    expert_counts,
    gate_backward,
    moe_topk_gate,
    normalize_weight,
    permute,
    topk_gate,
    unpermute,
)

KERNELS = {
    "topk_gate": topk_gate.KERNEL,
    "normalize_weight": normalize_weight.KERNEL,
    "moe_topk_gate": moe_topk_gate.KERNEL,
    "moe_topk_gate_backward": gate_backward.KERNEL,
    "moe_expert_counts": expert_counts.KERNEL,
    "moe_permute": permute.KERNEL,
    "moe_unpermute": unpermute.KERNEL,
}
