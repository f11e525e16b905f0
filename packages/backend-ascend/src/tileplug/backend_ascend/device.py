"""Device-derived constants of the Ascend kernels, and the stand-ins used to lower without an NPU.

Every kernel is specialised on a :class:`DeviceTarget` (vector-core count and UB bytes per
vector core); its values become compile-time constants of the generated Ascend C.

* On an NPU (``__call__``): :func:`dispatch_target` reads the device once per device index:
  vector cores = 2 x cube cores (``torch.npu.get_device_properties(i).cube_core_num``; an
  Ascend 950 AI core pairs one cube (AIC) with two vector (AIV) cores), unless
  ``tileplug.core.config.current().ascend_vector_cores`` overrides it.
* Without an NPU (``core.lower``): :func:`lowering_target`, an explicit stand-in of
  :data:`STAND_IN_VECTOR_CORES` = 64 vector cores (the same override applies), stated in the
  header of every lowered source.

UB budget per vector core: 248 KiB when the kernel is pure SIMD, 216 KiB when it has a
``T.SimtVF`` region (the SIMT context reserves 32 KiB; TileLang's own Ascend auto-scheduler
uses the same two limits; ``TileSpec.budget`` picks one). TileLang does not reject a plan over
the budget, so the kernel builder checks every plan with :func:`check_budget` before tracing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from tileplug.core import config

KIB = 1024
UB_BYTES_SIMD = 248 * KIB
"""UB per vector core available to a kernel without SIMT regions (Ascend 950)."""
UB_BYTES_SIMT = 216 * KIB
"""UB per vector core when a ``T.SimtVF`` region is present (32 KiB go to the SIMT context)."""
STAND_IN_VECTOR_CORES = 64
"""Vector cores assumed when lowering without an NPU (a stand-in, not a measured value)."""


class UBBudgetError(ValueError):
    """A kernel plan needs more UB than one vector core has."""


@dataclass(frozen=True)
class DeviceTarget:
    """What a kernel is specialised on from the device: ``vector_cores`` and where they came from."""

    vector_cores: int
    source: str  # "device", "config override", or "stand-in (no NPU)"


def lowering_target() -> DeviceTarget:
    """Stand-in constants for lowering on a machine without an NPU (config override honoured)."""
    override = config.current().ascend_vector_cores
    if override is not None:
        return DeviceTarget(override, "config override (ascend_vector_cores)")
    return DeviceTarget(STAND_IN_VECTOR_CORES, f"stand-in: {STAND_IN_VECTOR_CORES} vector cores (no NPU queried)")


_device_cores: dict[int, int] = {}
_lock = threading.Lock()


def device_vector_cores(index: int) -> int:
    """2 x cube cores of NPU ``index`` (read once per index; needs torch_npu)."""
    cores = _device_cores.get(index)
    if cores is not None:
        return cores
    import torch
    import torch_npu  # noqa: F401  - registers torch.npu; imported only here, never at module import

    props = torch.npu.get_device_properties(index)
    cube = getattr(props, "cube_core_num", None)
    if not cube:
        raise RuntimeError(f"torch.npu.get_device_properties({index}) has no cube_core_num: {props}")
    with _lock:
        _device_cores[index] = 2 * int(cube)
    return 2 * int(cube)


def dispatch_target(device) -> DeviceTarget:
    """The constants of the NPU a call runs on (config override honoured)."""
    override = config.current().ascend_vector_cores
    if override is not None:
        return DeviceTarget(override, "config override (ascend_vector_cores)")
    index = device.index if device is not None and device.index is not None else 0
    return DeviceTarget(device_vector_cores(index), "device")


def check_budget(footprint: int, budget: int, what: str) -> None:
    """Raise :class:`UBBudgetError` when ``footprint`` bytes exceed ``budget``."""
    if footprint > budget:
        raise UBBudgetError(f"{what}: UB plan needs {footprint} bytes > {budget} bytes per vector core")
