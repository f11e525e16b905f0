"""Lowering a :class:`TileSpec` through TileLang's Ascend pipeline.

:func:`lower_spec` returns a :class:`Lowered`: the Ascend C and the two UB byte counts the UB
check compares with the plan (the compiler's merged UB size and the traced prim_func's
``alloc_shared`` buffers x versions).
"""

from __future__ import annotations

from dataclasses import dataclass

from tileplug.backend_ascend.quant.spec import TileSpec, Tiling


@dataclass(frozen=True)
class Lowered:
    """What TileLang's Ascend pipeline made of one specialisation: its Ascend C (``source``),
    the compiler's merged UB bytes (``dyn_shared_memory_buf``) and the traced prim_func's UB
    bytes (``alloc_shared`` x annotated versions, each 32-byte aligned)."""

    source: str
    compiler_ub_bytes: int
    primfunc_ub_bytes: int


def lower_prim_func(prim_func):
    """TileLang's Ascend lowering of ``prim_func``, inside the Ascend target context (SIMT
    regions need it): the lowered artifact (``.kernel_source``, ``.device_mod``)."""
    import tilelang
    from tilelang.backend.target import determine_target

    target = determine_target("ascend", return_object=True)
    with target:
        return tilelang.lower(prim_func, target=target)


def lower_uncached(spec: TileSpec, tiling: Tiling) -> Lowered:
    """Trace ``spec`` tiled by ``tiling`` (UB budget checked) and lower it."""
    from tileplug.backend_ascend.lowering_checks import compiler_ub_bytes, primfunc_ub_bytes
    from tileplug.backend_ascend.quant.tile_kernel import build

    prim_func = build(spec, tiling)
    artifact = lower_prim_func(prim_func)
    return Lowered(artifact.kernel_source, compiler_ub_bytes(artifact), primfunc_ub_bytes(prim_func))


def lower_spec(spec: TileSpec) -> tuple[Lowered, Tiling]:
    """``spec`` lowered with the budget's tiling."""
    tiling = Tiling(spec)
    return lower_uncached(spec, tiling), tiling
