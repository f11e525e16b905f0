"""Lowering a quant :class:`TileSpec` through TileLang's Ascend pipeline, memoised on disk
(the shared machinery is :mod:`tileplug.backend_ascend.lowering`).

:func:`lower_spec` returns the :class:`Lowered` Ascend C and UB byte counts of a
specialisation and the budget's :class:`Tiling` it was traced with."""

from __future__ import annotations

from tileplug.backend_ascend.lowering import Lowered, lower_cached, lower_prim_func  # noqa: F401 - re-exported
from tileplug.backend_ascend.quant.spec import TileSpec, Tiling


def lower_uncached(spec: TileSpec, tiling: Tiling) -> Lowered:
    """Trace ``spec`` tiled by ``tiling`` (UB budget checked) and lower it."""
    from tileplug.backend_ascend.lowering import lower_uncached as lower_traced
    from tileplug.backend_ascend.quant.tile_kernel import build

    return lower_traced(build(spec, tiling))


def lower_spec(spec: TileSpec) -> tuple[Lowered, Tiling]:
    """``spec`` lowered with the budget's tiling (from the disk cache when stored there)."""
    from tileplug.backend_ascend.quant.tile_kernel import build

    tiling = Tiling(spec)
    return lower_cached(spec, lambda: build(spec, tiling)), tiling
