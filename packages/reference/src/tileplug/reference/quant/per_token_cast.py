"""Reference per_token_cast (groups 1 × g) and its sf-only / precomputed-sf variants."""

from __future__ import annotations

from tileplug.reference.quant.grouped_cast import grouped_cast

per_token_cast = grouped_cast
