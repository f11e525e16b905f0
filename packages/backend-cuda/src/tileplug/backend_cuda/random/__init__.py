"""CUDA kernels of the random-number ops (TileLang): Philox4x32-10 and the offset's advance in
``philox``, one module per op (``fill_rand``, ``fill_randn``), launchers in ``table``."""

from tileplug.backend_cuda.random.table import RandomKernel


def make_kernels() -> dict:
    """op name → kernel object (fresh)."""
    return {"fill_rand": RandomKernel("fill_rand"), "fill_randn": RandomKernel("fill_randn")}


__all__ = ["RandomKernel", "make_kernels"]
