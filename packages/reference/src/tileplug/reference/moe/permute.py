"""Reference counting and permutation: ``moe_expert_counts``, ``moe_permute``, ``moe_unpermute``.

The layout is :func:`tileplug.core.moe.formulas.expert_layout` (a stable sort by expert:
token order within an expert, deterministic on every device); rows are copied byte for byte,
padding rows are zero; the weighted sum back is accumulated in fp32 in slot order.
"""

from __future__ import annotations

from tileplug.core.contracts.moe import (
    ExpertCountsCall,
    ExpertCountsInputs,
    ExpertCountsOutputs,
    PermuteCall,
    PermuteInputs,
    PermuteOutputs,
    UnpermuteCall,
    UnpermuteInputs,
    UnpermuteOutputs,
)
from tileplug.core.moe import formulas


def moe_expert_counts(call: ExpertCountsCall, inputs: ExpertCountsInputs, outputs: ExpertCountsOutputs) -> None:
    counts, ends, _ = formulas.expert_layout(inputs.topk_idx, call.num_experts, call.alignment)
    outputs.counts.copy_(counts)
    outputs.expert_ends.copy_(ends)


def moe_permute(call: PermuteCall, inputs: PermuteInputs, outputs: PermuteOutputs) -> None:
    _, ends, permutation = formulas.expert_layout(inputs.topk_idx, call.num_experts, call.alignment)
    rows = outputs.x_expanded.shape[0]
    outputs.x_expanded.copy_(formulas.permute_rows(inputs.x, permutation, rows))
    if outputs.x_sf_expanded is not None:
        outputs.x_sf_expanded.copy_(formulas.permute_rows(inputs.x_sf, permutation, rows))
    outputs.permutation.copy_(permutation)
    outputs.expert_ends.copy_(ends)


def moe_unpermute(call: UnpermuteCall, inputs: UnpermuteInputs, outputs: UnpermuteOutputs) -> None:
    outputs.y.copy_(formulas.unpermute(inputs.y_expanded, inputs.permutation, inputs.topk_weights))
