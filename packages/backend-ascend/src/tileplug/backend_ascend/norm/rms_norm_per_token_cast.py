"""Ascend kernel of ``rms_norm_per_token_cast``: RMSNorm and the per-token cast of its output
in one pass over each row (SPEC §5; the fusion rule of §4).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

The pipelined row kernel of :mod:`.row_kernel` with, per row, the vector work of
:mod:`.rms_norm` (``y`` rounded to ``x.dtype``, written over the row of ``x``) and then one
``T.SimdVF`` region of the shared row cast (:func:`tileplug.backend_ascend.quant.row_cast.row_cast`,
over the macros the Ascend ``per_token_cast`` runs) over that rounded ``y``: per 1 x g group,
amax on the bits of ``|y|``, the scale math, ``q = saturate(y · inv)`` as e4m3. The same macros on the
same rounded values: the bytes equal the Ascend chain ``per_token_cast(rms_norm(x))``. The row
never leaves UB between the two steps (the unfused chain writes and re-reads ``y``).

Served: 2-D ``x``, e4m3, groups 16 / 32 / 64 / 128, plain or power-of-two fp32 scales, row-
or column-major; ``return_unquantized`` writes ``y`` too.
"""

import tilelang.ascend.language as T

from tileplug.backend_ascend.norm import rms_norm, row_kernel
from tileplug.backend_ascend.norm.spec import NormSpec
from tileplug.backend_ascend.quant.row_cast import row_cast


def cast_compute(spec: NormSpec):
    """The per-row cast of the rounded ``y`` in ``x_ub``: a macro over the UB buffers."""
    cast_row = row_cast(spec.cast, spec.hidden, spec.in_dtype)

    @T.macro
    def compute(buffers):
        with T.SimdVF():
            cast_row(buffers["x_ub"], buffers["q_ub"], buffers["sf_ub"], None, 0)

    return compute


def row_compute(spec: NormSpec):
    """RMSNorm of the row (:func:`.rms_norm.row_compute`), then its cast."""
    norm = rms_norm.row_compute(spec)
    cast = cast_compute(spec)

    @T.macro
    def compute(buffers):
        norm(buffers)
        cast(buffers)

    return compute


def build(spec: NormSpec):
    """The prim_func of ``spec`` (UB budget checked)."""
    return row_kernel.build(spec, row_compute)


KERNEL = row_kernel.kernel("rms_norm_per_token_cast", build)
