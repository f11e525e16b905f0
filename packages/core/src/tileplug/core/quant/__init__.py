"""Formats, cast configs, sf math and sf layouts: the numeric authority, in plain PyTorch."""

from tileplug.core.quant.configs import CastConfig
from tileplug.core.quant.formats import E2M1, E4M3, OUTPUT_DTYPES, QUANT_FORMATS, QuantFormat
from tileplug.core.quant.layouts import (
    ASCEND_LAYOUT,
    CUDA_LAYOUT,
    LAYOUTS,
    LayoutTraits,
    SfEncoding,
)
from tileplug.core.quant.sf_math import DEFAULT_CLAMP_MIN, GroupScales, compute_scales, group_amax

__all__ = [
    "ASCEND_LAYOUT",
    "CUDA_LAYOUT",
    "CastConfig",
    "DEFAULT_CLAMP_MIN",
    "E2M1",
    "E4M3",
    "GroupScales",
    "LAYOUTS",
    "LayoutTraits",
    "OUTPUT_DTYPES",
    "QUANT_FORMATS",
    "QuantFormat",
    "SfEncoding",
    "compute_scales",
    "group_amax",
]
