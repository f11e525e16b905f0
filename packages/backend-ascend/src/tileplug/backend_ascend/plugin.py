"""Entry point of tileplug-backend-ascend: the ``ascend`` backend and its availability probe.

``torch_npu`` is imported only inside :func:`probe`, never at module import: it needs the
vendor's CANN stack, which most machines do not have.
"""

from __future__ import annotations

import os

from tileplug.core import ASCEND_LAYOUT, Backend, hookimpl

PRIORITY = 100
DEVICE_MANAGER = "/dev/davinci_manager"


def probe() -> str | None:
    """None when the Ascend driver is present and torch_npu imports, else why not."""
    if not os.path.exists(DEVICE_MANAGER):
        return f"{DEVICE_MANAGER} does not exist (no Ascend driver on this machine)"
    try:
        import torch_npu  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure makes the backend unavailable
        return f"torch_npu does not import: {type(error).__name__}: {error}"
    return None


def make_backend() -> Backend:
    """The Ascend backend object (its kernel table fills as kernels land)."""
    return Backend(
        name="ascend",
        device_types=("npu",),
        priority=PRIORITY,
        traits=ASCEND_LAYOUT,
        kernels={},
        probe=probe,
        description="TileLang Ascend-dialect kernels for Ascend 950",
    )


@hookimpl
def tileplug_backends() -> list[Backend]:
    return [make_backend()]
