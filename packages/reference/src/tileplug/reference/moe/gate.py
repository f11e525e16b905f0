"""Reference top-k gates: ``topk_gate``, ``normalize_weight``, ``moe_topk_gate`` and its backward.

Selection is a stable descending sort (ties to the smaller index), scores and weights follow
:mod:`tileplug.core.moe.formulas` step for step; each kernel writes the outputs the core
allocated.
"""

from __future__ import annotations

from tileplug.core.contracts.moe import (
    MoeGateBackwardCall,
    MoeGateBackwardInputs,
    MoeGateBackwardOutputs,
    MoeGateCall,
    MoeGateInputs,
    MoeGateOutputs,
    NormalizeWeightCall,
    NormalizeWeightInputs,
    NormalizeWeightOutputs,
    TopkGateCall,
    TopkGateInputs,
    TopkGateOutputs,
)
from tileplug.core.moe import formulas


def topk_gate(call: TopkGateCall, inputs: TopkGateInputs, outputs: TopkGateOutputs) -> None:
    outputs.topk_idx.copy_(formulas.topk(inputs.scores, call.num_topk))


def normalize_weight(call: NormalizeWeightCall, inputs: NormalizeWeightInputs, outputs: NormalizeWeightOutputs) -> None:
    denominator, normalized = formulas.normalize(inputs.topk_weights)
    outputs.denominator.copy_(denominator)
    outputs.normalized.copy_(normalized)


def moe_topk_gate(call: MoeGateCall, inputs: MoeGateInputs, outputs: MoeGateOutputs) -> None:
    topk_idx, weights, scores = formulas.gate(
        inputs.logits, call.num_topk, call.scoring, inputs.bias, call.num_groups, call.topk_groups, call.renormalize,
        call.routed_scaling_factor, call.num_shared_experts, inputs.mask)
    outputs.topk_idx.copy_(topk_idx)
    outputs.topk_weights.copy_(weights)
    if outputs.scores is not None:
        outputs.scores.copy_(scores)


def moe_topk_gate_backward(call: MoeGateBackwardCall, inputs: MoeGateBackwardInputs,
                           outputs: MoeGateBackwardOutputs) -> None:
    outputs.grad_logits.copy_(formulas.gate_backward(
        inputs.scores, inputs.topk_idx, inputs.grad_topk_weights, call.scoring, call.renormalize,
        call.routed_scaling_factor, inputs.mask))
