"""CUDA ``stochastic_cast`` (docs/spec.md §10.2): fp32 → bf16, fp32 → e4m3, bf16 → e4m3 with the
words of one Philox draw (``fill_rand``'s), its last CTA advancing the offset; the
shared element-wise pass is ``element_cast``, the TileLang kernel ``element_kernels``."""

from __future__ import annotations

from tileplug.backend_cuda.quant.element_cast import ElementCast


class StochasticCast(ElementCast):
    op = "stochastic_cast"
    advances = True
