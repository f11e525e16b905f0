"""Entry point of tileplug-backend-template: the ``tileplug_backends()`` hook.

tileplug imports this module when it discovers backends (once per process, lazily, at the
first op call or ``tileplug info``). Keep the import cheap and free of side effects: do not
initialise a device, compile kernels or import a heavy vendor runtime here — do that in
the probe or on the first kernel call. An exception raised at import is recorded against
this plugin (``core.registry.records``, ``tileplug info``) and harms no other backend.
"""

from __future__ import annotations

import os

from tileplug.core import CUDA_LAYOUT, Backend, hookimpl

from .kernels import KERNELS  # relative: the module keeps working after you rename the package

NAME = "template"
"""What users type in ``TILEPLUG_BACKEND`` / ``core.use_backend``. VENDOR: your backend's name."""

DEVICE_TYPES = ("cpu",)
"""``torch.device.type`` values this backend serves. VENDOR: e.g. ("cuda",), ("npu",), or
the device type your torch extension registers (PrivateUse1 renamed, e.g. "xpu")."""

PRIORITY = 10
"""Higher is tried first. Conventions: the reference is -1000 (the last resort); device
backends shipped by tileplug are 100. The template sits at 10: above the reference, below
a real device backend. VENDOR: 100 for your device's main backend."""

DISABLE_VARIABLE = "TILEPLUG_TEMPLATE_DISABLE"


def probe() -> str | None:
    """None when the backend can run on this machine, else why not.

    Called at most once per discovery (the answer is cached on the Backend object), the
    first time selection, ``core.registry.explain`` or ``tileplug info`` reaches this
    backend. An unavailable backend is skipped and its reason is shown by
    ``tileplug info`` and in ``NoBackendError``. It must not raise (if it does, tileplug
    records the exception as the reason), and should be cheap.

    VENDOR: replace the variable check with the real questions, most likely in this order:
    does the vendor runtime import (``import torch_xyz`` inside this function, not at module
    top), is a device visible, is it a supported generation, does the compiler import.
    Keep an opt-out variable like this one: it is how users route around a faulty backend.
    """
    if os.environ.get(DISABLE_VARIABLE) == "1":
        return f"{DISABLE_VARIABLE}=1 is set"
    return None


def make_backend() -> Backend:
    """The backend object this plugin provides."""
    return Backend(
        name=NAME,
        device_types=DEVICE_TYPES,
        priority=PRIORITY,
        # Layout traits of the scale factors this backend writes: UE8M0 pack factor (4
        # bytes per int32 on CUDA, 2 per int16 on Ascend) and the column alignment of
        # column-major sf (16 bytes on CUDA, 1 = unpadded on Ascend). Outputs are allocated
        # with these, so they must be what your kernels write and what your users' next
        # kernel reads. VENDOR: use CUDA_LAYOUT / ASCEND_LAYOUT, or a LayoutTraits of your
        # own; pass ``layout_for=`` instead if it differs per device type.
        traits=CUDA_LAYOUT,
        kernels=KERNELS,
        probe=probe,
        # VENDOR (code-generating backends, e.g. TileLang): lower=lambda call: "<source>"
        # returns the generated device source of the kernel for ``call`` (shown by
        # ``core.lower`` and ``tileplug lower``); ``call`` may describe a meta tensor, so
        # lowering must not need the device. This template generates no code.
        lower=None,
        description="template of a third-party backend: CPU kernels that delegate to the reference",
    )


@hookimpl
def tileplug_backends() -> list[Backend]:
    # Return an iterable of Backend objects (a list, even of one). A plugin may provide
    # several backends, e.g. one per device generation, each with its own unique name.
    return [make_backend()]
