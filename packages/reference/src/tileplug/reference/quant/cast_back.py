"""Reference cast_back: dequantize any (q, sf) layout to bf16 / fp32."""

from __future__ import annotations

from tileplug.reference.quant.grouped_cast import cast_back

__all__ = ["cast_back"]
