"""The CUDA backend's device handling on hosts with several GPUs (``backend_cuda.devices``), on
the CPU: torch.cuda's current-device calls replaced by a model of one host with two GPUs of
different models, tensors by a subclass that reports a CUDA device index. The same behaviour on
real GPUs: tests/gpu/test_cuda_multigpu.py (-m multigpu)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from tileplug.backend_cuda import devices, jit
from tileplug.backend_cuda.plugin import _KERNELS, DeviceKernel
from tileplug.core import DeferredKernel, deferred_kernel_table


class OnGpu(torch.Tensor):
    """A CPU tensor that says it lives on ``cuda:<index>``."""

    index = 0

    @property
    def is_cuda(self) -> bool:
        return True

    def get_device(self) -> int:
        return self.index


def on_gpu(index: int) -> torch.Tensor:
    tensor = torch.Tensor._make_subclass(OnGpu, torch.zeros(4))
    tensor.index = index
    return tensor


class TwoGpuHost:
    """torch.cuda's device state on a host with an H200 (cuda:0) and a B200 (cuda:1), or
    ``capabilities`` given; ``current`` is the thread's current device."""

    def __init__(self, capabilities=((9, 0), (10, 0))) -> None:
        self.capabilities = capabilities
        self.current = 0
        self.switches: list[int] = []

    def exchange(self, index: int) -> int:
        previous, self.current = self.current, index
        self.switches.append(index)
        return previous

    def capability(self, index: int | None = None) -> tuple[int, int]:
        return self.capabilities[self.current if index is None else index]

    @contextlib.contextmanager
    def device(self, index: int):
        previous = self.exchange(index)
        try:
            yield
        finally:
            self.exchange(previous)


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> TwoGpuHost:
    model = TwoGpuHost()
    monkeypatch.setattr(devices, "_device_count", [2])
    monkeypatch.setattr(torch.cuda, "_exchange_device", model.exchange)
    monkeypatch.setattr(torch.cuda, "_maybe_exchange_device", model.exchange)
    monkeypatch.setattr(torch.cuda, "get_device_capability", model.capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: f"model of cuda:{index}")
    monkeypatch.setattr(torch.cuda, "device", model.device)
    monkeypatch.delenv("TILEPLUG_CUDA_ARCH", raising=False)
    return model


class Call:
    op = "per_token_cast"


class Kernel:
    """A kernel whose prepare records the current device and the architecture jit would
    compile for, and whose launcher records the device current during each launch."""

    def __init__(self, host: TwoGpuHost) -> None:
        self.host = host
        self.prepared: list[tuple[int, str]] = []
        self.launched: list[int] = []
        self.fail = False

    def prepare(self, call):
        self.prepared.append((self.host.current, jit.device_arch()))

        def launch(inputs, outputs):
            self.launched.append(self.host.current)
            if self.fail:
                raise ValueError("the kernel failed")

        return launch


def test_one_gpu_host_gets_the_kernels_own_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_device_count", [1])

    def launch(inputs, outputs):
        pass

    assert devices.launcher_for(lambda call: launch, Call()) is launch


def test_a_launch_on_cuda1_runs_with_cuda1_current_and_restores_cuda0(host: TwoGpuHost) -> None:
    kernel = Kernel(host)
    launcher = devices.launcher_for(kernel.prepare, Call())
    assert kernel.prepared == []  # prepared on first use of each device
    launcher((on_gpu(1), on_gpu(1)), (on_gpu(1),))
    assert kernel.prepared == [(1, "sm_100")]  # prepared with cuda:1 current: its own architecture
    assert kernel.launched == [1]
    assert host.current == 0
    launcher((on_gpu(1),), ())
    launcher((on_gpu(0),), ())
    launcher((on_gpu(1),), ())
    assert kernel.prepared == [(1, "sm_100"), (0, "sm_90")]  # once per device
    assert kernel.launched == [1, 1, 0, 1]
    assert host.current == 0


def test_the_callers_current_device_is_kept_whatever_it_is(host: TwoGpuHost) -> None:
    kernel = Kernel(host)
    launcher = devices.launcher_for(kernel.prepare, Call())
    host.current = 1
    launcher((on_gpu(0),), ())
    assert kernel.launched == [0] and host.current == 1


def test_a_failing_launch_still_restores_the_current_device(host: TwoGpuHost) -> None:
    kernel = Kernel(host)
    kernel.fail = True
    launcher = devices.launcher_for(kernel.prepare, Call())
    with pytest.raises(ValueError, match="the kernel failed"):
        launcher((on_gpu(1),), ())
    assert host.current == 0


def test_the_device_is_that_of_the_first_gpu_tensor_nested_or_in_the_outputs(host: TwoGpuHost) -> None:
    kernel = Kernel(host)
    launcher = devices.launcher_for(kernel.prepare, Call())
    launcher((None, 3, ((on_gpu(1), on_gpu(1)),)), ())  # a quantized (xq, sf) pair
    launcher((None, torch.zeros(2)), [on_gpu(1)])  # no GPU input (a fill): the outputs decide
    assert kernel.launched == [1, 1]
    assert devices.first_device_index([torch.zeros(1), [None, (on_gpu(0),)], on_gpu(1)]) == 0
    assert devices.first_device_index([torch.zeros(1), None]) is None
    with pytest.raises(RuntimeError, match="no CUDA tensor among the arguments of per_token_cast"):
        launcher((torch.zeros(1),), (torch.zeros(1),))


def test_a_gpu_below_compute_capability_9_is_refused_by_name(host: TwoGpuHost) -> None:
    host.capabilities = ((9, 0), (8, 0))
    kernel = Kernel(host)
    launcher = devices.launcher_for(kernel.prepare, Call())
    with pytest.raises(RuntimeError, match=r"cuda:1 \(model of cuda:1\) has compute capability 8\.0"):
        launcher((on_gpu(1),), ())
    assert kernel.prepared == [] and host.current == 0
    launcher((on_gpu(0),), ())
    assert kernel.launched == [0]


def test_concurrent_first_launches_prepare_each_device_once(host: TwoGpuHost) -> None:
    kernel = Kernel(host)
    prepare = kernel.prepare

    def slow_prepare(call):
        time.sleep(0.05)  # every thread arrives while the first prepares
        return prepare(call)

    launcher = devices.launcher_for(slow_prepare, Call())
    start = threading.Barrier(8)

    def first_launch() -> None:
        start.wait()
        launcher((on_gpu(1),), ())

    threads = [threading.Thread(target=first_launch) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(kernel.prepared) == 1 and len(kernel.launched) == 8


def test_every_cuda_kernel_runs_through_the_device_launcher() -> None:
    assert _KERNELS and all(type(kernel) is DeviceKernel for kernel in _KERNELS.values())
    table = deferred_kernel_table("tileplug.backend_cuda", families=("quant",))
    assert table and all(type(kernel) is DeferredKernel for kernel in table.values())


def test_device_kernel_prepares_the_real_kernel_on_each_device(host: TwoGpuHost, monkeypatch) -> None:
    kernel = Kernel(host)
    wrapped = DeviceKernel("tileplug.backend_cuda.quant", "per_token_cast")
    monkeypatch.setattr(wrapped, "_resolved", (kernel, None))
    launcher = wrapped.prepare(Call())
    launcher((on_gpu(1),), ())
    assert kernel.prepared == [(1, "sm_100")] and kernel.launched == [1] and host.current == 0
