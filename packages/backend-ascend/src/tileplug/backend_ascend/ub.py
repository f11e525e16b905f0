"""How the Ascend kernels of every family lay out UB (the vector core's unified buffer).

A kernel's *plan* is ``{buffer name: (shape, dtype, versions)}``: exactly the
``T.alloc_shared`` buffers it allocates, each with the number of versions it is annotated
with (``T.annotate_buffer_versions``). :func:`footprint` sums a plan the way TileLang's
Ascend UB merge lays it out (each version of each buffer starts 32-byte aligned); the
lowering check compares that number with the compiler's and the traced prim_func's.
"""

from __future__ import annotations

from collections.abc import Callable

import math

from tileplug.backend_ascend.device import UB_BYTES_SIMD
from tileplug.core.quant.sf_math import align

LANES = 64
"""fp32 lanes of one 256-byte vector register."""
UB_ALIGN = 32
"""Each version of each UB buffer starts 32-byte aligned (TileLang's Ascend UB merge)."""
ITEMSIZE = {
    "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "uint32": 4,
    "int64": 8,
}
VERSIONS = 2
"""Buffer versions of every buffer that crosses pipeline stages (double buffering)."""

Plan = dict[str, tuple[tuple[int, ...], str, int]]


def footprint(plan: Plan) -> int:
    """UB bytes of a plan: each version of each buffer 32-byte aligned."""
    total = 0
    for shape, dtype, versions in plan.values():
        total += versions * align(math.prod(shape) * ITEMSIZE[dtype], UB_ALIGN)
    return total


def padded(columns: int) -> int:
    """``columns`` rounded up to whole 64-lane registers (a UB row's allocated width)."""
    return align(max(columns, 1), LANES)


def sf_rows(groups: int) -> int:
    """Allocated fp32 elements of one row's group scales in UB (whole 32-byte blocks, at least one)."""
    return max(8, align(groups, 8))


def widest_tile(columns: int, max_tile: int, fits: Callable[[int], bool], unit: int = LANES) -> int:
    """The widest column tile for rows of ``columns``: the whole row when it is at most
    ``max_tile`` and ``fits(columns)``, else the widest multiple of ``unit`` (a multiple of
    :data:`LANES`; at most ``max_tile``, at least ``unit``) that ``fits`` (a tile width → whether
    its plan is within the budget)."""
    if columns <= max_tile and fits(columns):
        return columns
    width = min(max_tile, columns) // unit * unit
    while width > unit and not fits(width):
        width -= unit
    return width


class PlannedInSimdUb:
    """Mixin of a kernel spec whose UB buffers are its ``plan()``, held against the SIMD
    vector unit's UB: the ``footprint`` and ``budget`` the lowering checks compare."""

    @property
    def footprint(self) -> int:
        return footprint(self.plan())

    @property
    def budget(self) -> int:
        return UB_BYTES_SIMD
