"""The public ops: ``core.ops.per_token_cast(x)`` runs on the backend installed for ``x.device``.

Importing this package declares every op in the op table (``tileplug.core.opdefs``); each
is also ``torch.ops.tileplug.<name>``.
"""

from tileplug.core.ops.quant import (
    cast_back,
    per_block_cast,
    per_block_cast_with_precomputed_sf,
    per_block_cast_with_sf_only,
    per_channel_cast,
    per_token_cast,
    per_token_cast_and_cast_back,
    per_token_cast_with_precomputed_sf,
    per_token_cast_with_sf_only,
)
from tileplug.core.ops.quant_reblock import per_block_cast_lossless, transpose_weight_sf
from tileplug.core.ops.norm import (
    layer_norm,
    layer_norm_backward,
    rms_norm,
    rms_norm_backward,
    rms_norm_per_token_cast,
)
from tileplug.core.ops.rope import apply_rotary, rms_norm_rope, rms_norm_rope_per_token_cast
from tileplug.core.ops.moe import (
    moe_expert_counts,
    moe_permute,
    moe_topk_gate,
    moe_topk_gate_backward,
    moe_unpermute,
    normalize_weight,
    topk_gate,
)
from tileplug.core.ops.random import fill_rand, fill_randn
from tileplug.core.ops.cast import cast, nearest_cast, stochastic_cast
from tileplug.core.ops.swiglu import swiglu, swiglu_backward, swiglu_per_token_cast

__all__ = [
    "apply_rotary",
    "cast",
    "cast_back",
    "fill_rand",
    "fill_randn",
    "layer_norm",
    "layer_norm_backward",
    "moe_expert_counts",
    "moe_permute",
    "moe_topk_gate",
    "moe_topk_gate_backward",
    "moe_unpermute",
    "nearest_cast",
    "normalize_weight",
    "per_block_cast",
    "per_block_cast_lossless",
    "per_block_cast_with_precomputed_sf",
    "per_block_cast_with_sf_only",
    "per_channel_cast",
    "per_token_cast",
    "per_token_cast_and_cast_back",
    "per_token_cast_with_precomputed_sf",
    "per_token_cast_with_sf_only",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_per_token_cast",
    "rms_norm_rope",
    "rms_norm_rope_per_token_cast",
    "stochastic_cast",
    "swiglu",
    "swiglu_backward",
    "swiglu_per_token_cast",
    "topk_gate",
    "transpose_weight_sf",
]
