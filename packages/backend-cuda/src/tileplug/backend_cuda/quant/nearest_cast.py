"""CUDA ``nearest_cast`` (docs/spec.md §10.2): any pair of fp32 / bf16 / e4m3, round to nearest
even, e4m3 saturating at ±448 (the conversion instruction's ``satfinite``: an infinity gives
±448, only NaN gives NaN); the shared element-wise pass is ``element_cast``, the TileLang
kernel ``element_kernels``."""

from __future__ import annotations

from tileplug.backend_cuda.quant.element_cast import ElementCast


class NearestCast(ElementCast):
    op = "nearest_cast"
