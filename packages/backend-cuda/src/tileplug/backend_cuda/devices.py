"""Which GPU a launch runs on, on hosts with several.

A route (core's cache of one call signature) serves every device: a ``Call`` compares on
neither the device index nor the device's model. On a host with one visible GPU a route's
launcher is the kernel's own, unchanged (:func:`launcher_for` returns it). With several:

- the kernel is prepared once per device index, with that device current, so the compiled
  modules it binds are for that device's architecture (``jit.device_arch`` reads the current
  device; modules are cached by ``(spec, arch)``: GPUs of one model share them, a host mixing
  models compiles once per model), and a device below compute capability 9.0 is refused by
  name;
- each launch runs with its tensors' device current and the caller's current device restored
  afterwards. The generated host code sets the device of its first tensor
  (``__tvm_set_device``, a ``cudaSetDevice``) and never sets it back, which would leave a
  caller on ``cuda:0`` silently allocating on ``cuda:1`` after one call. The stream is that
  device's current torch stream (``tvm_ffi`` asks torch for the stream of the first GPU
  tensor's device), so ``torch.cuda.stream(s)`` on any device orders the launch.

Nothing here imports TileLang.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

MIN_COMPUTE_CAPABILITY = (9, 0)

Launcher = Callable[[Any, Any], None]

_device_count: list[int] = []


def visible_device_count() -> int:
    """``torch.cuda.device_count()``, read once per process (CUDA fixes it at initialisation)."""
    if not _device_count:
        _device_count.append(torch.cuda.device_count())
    return _device_count[0]


def first_device_index(values: Iterable[Any]) -> int | None:
    """Device index of the first CUDA tensor in ``values`` (nested tuples and lists searched in
    order), or None when there is none."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.is_cuda:
                return value.get_device()
        elif isinstance(value, (tuple, list)):
            index = first_device_index(value)
            if index is not None:
                return index
    return None


def launcher_for(prepare: Callable[[Any], Launcher], call: Any) -> Launcher:
    """The launcher of ``call``: ``prepare(call)`` itself on a one-GPU host, else a launcher
    that prepares ``call`` once per device and runs each launch on its tensors' device (see the
    module docstring)."""
    if visible_device_count() <= 1:
        return prepare(call)
    return DeviceLauncher(prepare, call)


class DeviceLauncher:
    """A launcher per device index for one call signature, prepared on first use of each
    device (thread-safe), each launch with its device current and the caller's restored."""

    __slots__ = ("prepare", "call", "launchers", "lock")

    def __init__(self, prepare: Callable[[Any], Launcher], call: Any) -> None:
        self.prepare = prepare
        self.call = call
        self.launchers: dict[int, Launcher] = {}
        self.lock = threading.Lock()

    def __call__(self, inputs: Any, outputs: Any) -> None:
        index = first_device_index(inputs)
        if index is None:
            index = first_device_index(outputs if isinstance(outputs, (tuple, list)) else (outputs,))
        if index is None:
            raise RuntimeError(f"no CUDA tensor among the arguments of {self.call.op}")
        launcher = self.launchers.get(index)
        if launcher is None:
            launcher = self.prepared(index)
        previous = torch.cuda._exchange_device(index)
        try:
            launcher(inputs, outputs)
        finally:
            torch.cuda._maybe_exchange_device(previous)

    def prepared(self, index: int) -> Launcher:
        """The launcher of device ``index``, prepared with that device current (once)."""
        with self.lock:
            launcher = self.launchers.get(index)
            if launcher is None:
                capability = torch.cuda.get_device_capability(index)
                if capability < MIN_COMPUTE_CAPABILITY:
                    raise RuntimeError(
                        f"cuda:{index} ({torch.cuda.get_device_name(index)}) has compute capability "
                        f"{capability[0]}.{capability[1]}; the cuda backend's kernels need 9.0 or above"
                    )
                with torch.cuda.device(index):
                    launcher = self.launchers[index] = self.prepare(self.call)
            return launcher
