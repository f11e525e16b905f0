"""Ascend MoE routing kernels (SPEC §7): one module per op over the shared row macros
(:mod:`tileplug.backend_ascend.rows`)."""

from tileplug.backend_ascend.moe import topk_gate

KERNELS = {
    "topk_gate": topk_gate.KERNEL,
}
