"""Reference per_block_cast (groups bm × bn) and its sf-only / precomputed-sf variants."""

from __future__ import annotations

from tileplug.reference.quant.grouped_cast import grouped_cast

per_block_cast = grouped_cast
