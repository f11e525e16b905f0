"""Ascend MoE routing kernels (SPEC §7): one module per op over the shared row macros
(:mod:`tileplug.backend_ascend.rows`)."""

from tileplug.backend_ascend.moe import moe_topk_gate, topk_gate

KERNELS = {
    "topk_gate": topk_gate.KERNEL,
    "moe_topk_gate": moe_topk_gate.KERNEL,
}
