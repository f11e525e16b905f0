"""Reference per_channel_cast (groups g × 1, UE8M0 packed along tokens)."""

from __future__ import annotations

from tileplug.reference.quant.grouped_cast import grouped_cast

per_channel_cast = grouped_cast
