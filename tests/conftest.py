"""Shared pytest setup: tests of an absent device (gpu, npu) are not collected, with one summary line; nvcc tests skip without nvcc."""

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


def _multigpu_reason() -> str | None:
    import torch

    single = _cuda_reason()
    if single is not None:
        return single
    count = torch.cuda.device_count()
    if count < 2:
        return f"fewer than 2 GPUs visible ({count}); the multi-GPU tests need a host with two or more"
    low = [i for i in range(count) if torch.cuda.get_device_capability(i) < (9, 0)]
    if low:
        return f"GPU(s) {low} of compute capability below 9.0"
    return None


def _npu_reason() -> str | None:
    if not os.path.exists("/dev/davinci_manager"):
        return "no Ascend NPU here (/dev/davinci_manager absent); these tests run unchanged on an Ascend 950 host"
    try:
        import torch_npu  # noqa: F401
    except Exception as error:  # noqa: BLE001
        return f"torch_npu does not import: {error}"
    return None


def pytest_configure(config: pytest.Config) -> None:
    # the controller (or a run without xdist) fills empty compile / lowering caches from the
    # committed seed before any worker starts (tests/grid_cache.py)
    if not hasattr(config, "workerinput"):
        import grid_cache

        grid_cache.write_seeds()


DEVICE_MARKERS = {"gpu": _cuda_reason, "npu": _npu_reason}
"""Markers of tests that need a device: where it is absent they are not collected at all
(one summary line says how many and why), so a CPU run's output stays readable."""

_deselected_devices: dict[str, tuple[int, str]] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons: dict[str, str | None] = {}
    kept, dropped = [], []
    for item in items:
        absent = None
        for marker, probe in DEVICE_MARKERS.items():
            if marker in item.keywords:
                if marker not in reasons:
                    reasons[marker] = probe()
                if reasons[marker] is not None:
                    absent = marker
                    break
        if absent is None:
            kept.append(item)
        else:
            dropped.append(item)
            count, _ = _deselected_devices.get(absent, (0, ""))
            _deselected_devices[absent] = (count + 1, reasons[absent])
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    multigpu = [item for item in items if "multigpu" in item.keywords]
    if multigpu:  # they carry 'gpu' too: on a host with one GPU they are skipped with the reason
        why = _multigpu_reason()
        if why is not None:
            for item in multigpu:
                item.add_marker(pytest.mark.skip(reason=why))
    if shutil.which("nvcc") is None:  # compile-only tests: skipped (they need no device, only nvcc)
        for item in items:
            if "nvcc" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="nvcc is not on PATH"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    # an xdist worker hands its count to the controller, which prints the summary
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["tileplug_deselected_devices"] = dict(_deselected_devices)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    # every worker collects the whole suite: any one of them has the full count
    _deselected_devices.update(getattr(node, "workeroutput", {}).get("tileplug_deselected_devices", {}))


def pytest_terminal_summary(terminalreporter) -> None:
    for marker, (count, reason) in sorted(_deselected_devices.items()):
        terminalreporter.write_line(f"tileplug: {count} '{marker}' tests not collected: {reason}")
