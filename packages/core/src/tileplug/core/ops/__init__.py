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
    per_token_cast_with_precomputed_sf,
    per_token_cast_with_sf_only,
)
from tileplug.core.ops.rope import apply_rotary

__all__ = [
    "apply_rotary",
    "cast_back",
    "per_block_cast",
    "per_block_cast_with_precomputed_sf",
    "per_block_cast_with_sf_only",
    "per_channel_cast",
    "per_token_cast",
    "per_token_cast_with_precomputed_sf",
    "per_token_cast_with_sf_only",
]
