"""What a backend plugin hands to tileplug: the public plugin API.

A plugin module implements the ``tileplug_backends()`` hook (marked with
:data:`tileplug.core.plugins.hookimpl`) and returns :class:`Backend` objects. A backend
names the device types it serves, a priority, an availability probe, the sf layout traits
of its device family, and a table op name → :class:`Kernel`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tileplug.core.quant.layouts import LayoutTraits

ANY_DEVICE = "*"
"""Device-type wildcard: a backend listing it serves every device type (the reference)."""

QUANT_OPS = ("per_token_cast", "per_block_cast", "per_channel_cast", "cast_back")
"""Op names a backend's kernel table may hold (one kernel serves an op and its variants)."""


@runtime_checkable
class Kernel(Protocol):
    """One op of one backend.

    ``supports(call)`` returns None when the kernel accepts the call, else a short reason
    (shown by ``tileplug info`` and in NoBackendError). Its answer may depend only on the
    call's compared fields (everything but the token count and device index): selection
    is cached on them. ``__call__(call, inputs, outputs)`` writes ``outputs`` in place and
    returns nothing; it is never called with zero tokens.
    """

    def supports(self, call: Any) -> str | None: ...

    def __call__(self, call: Any, inputs: Any, outputs: Any) -> None: ...


class PreparedKernel(Kernel, Protocol):
    """A kernel that can bind itself to a call signature once: ``prepare(call)`` returns
    ``launch(inputs, outputs)``, which the dispatcher caches per signature and calls instead
    of ``kernel(call, inputs, outputs)`` (compile, argument order and lookups done once)."""

    def prepare(self, call: Any) -> Callable[[Any, Any], None]: ...


@dataclass
class Backend:
    """A backend: ``name`` (unique), ``device_types`` it serves (``"*"`` for all),
    ``priority`` (higher wins), ``probe()`` → None when usable here else the reason,
    ``traits`` of its device family's sf layout, and ``kernels`` op name → Kernel.

    ``lower(call)`` returns the generated device source of the kernel for ``call``
    (TileLang backends); None when the backend does not generate code.
    ``layout_for`` may be given to vary layout traits by device type.
    ``capabilities()`` may return a text ``tileplug info`` prints under the matrix (what
    the backend's kernels accept, how they are checked).
    """

    name: str
    device_types: tuple[str, ...]
    priority: int
    traits: LayoutTraits
    kernels: Mapping[str, Kernel]
    probe: Callable[[], str | None] = lambda: None
    lower: Callable[[Any], str] | None = None
    layout_for: Callable[[str], LayoutTraits] | None = None
    capabilities: Callable[[], str] | None = None
    description: str = ""
    # Filled in by the registry from the plugin's distribution.
    distribution: str = field(default="", compare=False)
    version: str = field(default="", compare=False)
    _availability: tuple[str | None] | None = field(default=None, init=False, repr=False, compare=False)

    def serves(self, device_type: str) -> bool:
        """Whether this backend serves tensors of ``device_type``."""
        return device_type in self.device_types or ANY_DEVICE in self.device_types

    def unavailable_reason(self) -> str | None:
        """None if usable on this machine, else why not (probed once, then cached)."""
        if self._availability is None:
            try:
                reason = self.probe()
            except Exception as error:  # a probe must never take tileplug down
                reason = f"availability probe raised {type(error).__name__}: {error}"
            self._availability = (reason,)
        return self._availability[0]

    def traits_for(self, device_type: str) -> LayoutTraits:
        """Layout traits of the outputs this backend produces for ``device_type``."""
        if self.layout_for is None:
            return self.traits
        return self.layout_for(device_type)
