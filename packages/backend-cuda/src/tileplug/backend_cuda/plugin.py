"""Entry point of tileplug-backend-cuda: the ``cuda`` backend and its availability probe."""

from __future__ import annotations

from tileplug.core import CUDA_LAYOUT, Backend, hookimpl

PRIORITY = 100
MIN_COMPUTE_CAPABILITY = (9, 0)


def probe() -> str | None:
    """None when a GPU of compute capability ≥ 9.0 is visible and TileLang imports, else why not."""
    import torch

    if torch.version.cuda is None:
        return "this PyTorch build has no CUDA support"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    capability = torch.cuda.get_device_capability()
    if capability < MIN_COMPUTE_CAPABILITY:
        return f"GPU compute capability {capability[0]}.{capability[1]} is below 9.0"
    try:
        import tilelang  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure makes the backend unavailable
        return f"tilelang does not import: {type(error).__name__}: {error}"
    return None


def make_backend() -> Backend:
    """The CUDA backend object (its kernel table fills as kernels land)."""
    return Backend(
        name="cuda",
        device_types=("cuda",),
        priority=PRIORITY,
        traits=CUDA_LAYOUT,
        kernels={},
        probe=probe,
        description="TileLang kernels for SM90/SM100",
    )


@hookimpl
def tileplug_backends() -> list[Backend]:
    return [make_backend()]
