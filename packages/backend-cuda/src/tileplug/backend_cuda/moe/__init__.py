"""CUDA kernels of the MoE routing family (TileLang): the warp top-k macros (``warp_topk``)
shared by the gate ops, the expert layout kernels (``routing``) and the row kernels (``rows``)
shared by permute / unpermute; specs in ``spec``, kernel objects in ``table`` (no TileLang)."""

from tileplug.backend_cuda.moe.table import (
    ExpertCounts,
    MoeTopkGate,
    MoeTopkGateBackward,
    NormalizeWeight,
    Permute,
    TopkGate,
    Unpermute,
)


def make_kernels() -> dict:
    """op name → kernel object (fresh)."""
    kernels = (TopkGate(), NormalizeWeight(), MoeTopkGate(), MoeTopkGateBackward(), ExpertCounts(), Permute(),
               Unpermute())
    return {kernel.op: kernel for kernel in kernels}


__all__ = ["ExpertCounts", "MoeTopkGate", "MoeTopkGateBackward", "NormalizeWeight", "Permute", "TopkGate",
           "Unpermute", "make_kernels"]
