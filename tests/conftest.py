"""Shared pytest setup: device-gated markers skip cleanly where the device is absent."""

from __future__ import annotations

import os
import shutil

import pytest


def _cuda_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU visible (GPU tests run on the GPU host: hatch run gpu)"
    if torch.cuda.get_device_capability() < (9, 0):
        return "GPU compute capability below 9.0"
    return None


def _npu_reason() -> str | None:
    if not os.path.exists("/dev/davinci_manager"):
        return "no Ascend NPU here (/dev/davinci_manager absent); these tests run unchanged on an Ascend 950 host"
    try:
        import torch_npu  # noqa: F401
    except Exception as error:  # noqa: BLE001
        return f"torch_npu does not import: {error}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons = {
        "gpu": _cuda_reason,
        "npu": _npu_reason,
        "nvcc": lambda: None if shutil.which("nvcc") else "nvcc is not on PATH",
    }
    cached: dict[str, str | None] = {}
    for item in items:
        for marker, probe in reasons.items():
            if marker in item.keywords:
                if marker not in cached:
                    cached[marker] = probe()
                if cached[marker] is not None:
                    item.add_marker(pytest.mark.skip(reason=cached[marker]))
