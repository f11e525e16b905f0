"""What a backend plugin hands to tileplug: the public plugin API.

A plugin module implements the ``tileplug_backends()`` hook (marked with
:data:`tileplug.core.plugins.hookimpl`) and returns :class:`Backend` objects. A backend
names the device types it serves, a priority, an availability probe, the sf layout traits
of its device family, and a table op name → :class:`Kernel`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tileplug.core.quant.layouts import LayoutTraits

ANY_DEVICE = "*"
"""Device-type wildcard: a backend listing it serves every device type (the reference)."""

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


@dataclass
class Backend:
    """A backend: ``name`` (unique), ``device_types`` it serves (``"*"`` for all),
    ``priority`` (higher wins), ``probe()`` → None when usable here else the reason (no
    probe: always usable),
    ``traits`` of its device family's sf layout, and ``kernels`` op name → Kernel.

    ``lower(call)`` returns the generated device source of the kernel for ``call``
    (TileLang backends); None when the backend does not generate code.
    ``layout_for`` may be given to vary layout traits by device type.
    ``capabilities()`` may return a text ``tileplug info`` prints under the matrix (what
    the backend's kernels accept, how they are checked).
    ``precompile(calls, workers)`` may compile ahead of time the kernels serving ``calls``
    (``tileplug precompile``: a warm cache at deployment) and return how many it compiled
    (the others were cached already).
    """

    name: str
    device_types: tuple[str, ...]
    priority: int
    traits: LayoutTraits
    kernels: Mapping[str, Kernel]
    probe: Callable[[], str | None] | None = lambda: None
    lower: Callable[[Any], str] | None = None
    layout_for: Callable[[str], LayoutTraits] | None = None
    capabilities: Callable[[], str] | None = None
    precompile: Callable[[Sequence[Any], int | None], int] | None = None
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
            if self.probe is None:
                reason = None
            else:
                try:
                    reason = self.probe()
                except KeyboardInterrupt:
                    raise
                except BaseException as error:  # noqa: BLE001 - a probe (even sys.exit) never takes tileplug down
                    reason = f"availability probe raised {type(error).__name__}: {error}"
                if reason is not None and not isinstance(reason, str):
                    reason = f"availability probe returned {type(reason).__name__}, not None or a str: {reason!r}"
            self._availability = (reason,)
        return self._availability[0]

    def traits_for(self, device_type: str) -> LayoutTraits:
        """Layout traits of the outputs this backend produces for ``device_type``."""
        if self.layout_for is None:
            return self.traits
        return self.layout_for(device_type)


# ---------------------------------------------------------------------- kernel cache keys


def kernel_constant_sources() -> list[Path]:
    """The core modules whose constants a backend's kernels are traced with: the quant formats, the
    scale math, the cast contract's random field widths and the SwiGLU sigmoid table. A backend that
    caches generated code keys the cache on these files as well as on its own sources, so that an
    edit of any of them misses the cache (the CUDA kernel index and compile grid, the Ascend
    lowerings). Listed here once: a module added to what kernels read is added for every backend."""
    from tileplug.core.contracts import cast
    from tileplug.core.quant import formats, sf_math
    from tileplug.core.swiglu import sigmoid_table

    return [Path(module.__file__) for module in (formats, sf_math, cast, sigmoid_table)]


# ---------------------------------------------------------------------- deferred kernels


_family_tables: dict[str, Mapping[str, Any]] = {}


def family_kernels(module: str) -> Mapping[str, Any]:
    """The kernel table of a backend's family module, imported and built once per process:
    its ``make_kernels()`` when it has one (fresh kernel objects), else its ``KERNELS``."""
    table = _family_tables.get(module)
    if table is None:
        import importlib

        imported = importlib.import_module(module)
        make = getattr(imported, "make_kernels", None)
        table = _family_tables.setdefault(module, make() if callable(make) else imported.KERNELS)
    return table


class DeferredKernel:
    """A kernel whose family module is imported on first use: ``family_kernels(module)[key]``.

    A backend hands these to its :class:`Backend` so that discovering it imports none of its
    kernel modules: the Ascend backend (whose modules import TileLang's Ascend dialect) costs
    nothing on a CUDA host, and a first call imports only its own family. The first
    ``supports`` imports the module; a module that fails to import, or has no ``key``, makes
    ``supports`` say why (the call falls to the next backend) instead of raising. Every other
    attribute (``spec``, ``lowerings``, ...) is the real kernel's.
    """

    def __init__(self, module: str, key: str) -> None:
        self.module = module
        self.key = key
        self._resolved: tuple[Any, str | None] | None = None

    def _resolve(self) -> tuple[Any, str | None]:
        """(the kernel or None, why there is none)."""
        if self._resolved is None:
            try:
                kernel = family_kernels(self.module).get(self.key)
                why = None if kernel is not None else f"{self.module} has no kernel for {self.key}"
            except KeyboardInterrupt:
                raise
            except BaseException as error:  # noqa: BLE001 - a broken kernel module harms no other backend
                kernel, why = None, f"{self.module} failed to import: {type(error).__name__}: {error}"
            self._resolved = (kernel, why)
        return self._resolved

    def exists(self) -> bool:
        """Whether the family module holds a kernel for ``key`` (imports it; an import failure
        raises, so a broken module is never mistaken for a family without that op)."""
        return family_kernels(self.module).get(self.key) is not None

    def kernel(self) -> Any:
        """The real kernel (raises ``ImportError`` saying why there is none)."""
        kernel, why = self._resolve()
        if kernel is None:
            raise ImportError(why)
        return kernel

    def supports(self, call: Any) -> str | None:
        kernel, why = self._resolve()
        return why if kernel is None else kernel.supports(call)

    def __call__(self, call: Any, inputs: Any, outputs: Any) -> None:
        self.kernel()(call, inputs, outputs)

    def prepare(self, call: Any) -> Callable[[Any, Any], None]:
        """The real kernel's launcher for ``call`` (its own ``prepare``, or its ``__call__`` bound to ``call``)."""
        kernel = self.kernel()
        prepare = getattr(kernel, "prepare", None)
        if prepare is not None:
            return prepare(call)
        return lambda inputs, outputs: kernel(call, inputs, outputs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("module", "key", "_resolved"):
            raise AttributeError(name)
        return getattr(self.kernel(), name)

    def __repr__(self) -> str:
        return f"DeferredKernel({self.module}[{self.key!r}])"


def deferred_kernel_table(package: str, families: Sequence[str] | None = None,
                          kernel_type: type[DeferredKernel] | None = None) -> dict[str, DeferredKernel]:
    """Kernel-table key -> :class:`DeferredKernel` of ``family_kernels(f"{package}.{family}")[key]``
    for every op of the op table in ``families`` (default: every family) whose family module
    ``package.<family>`` exists (located, not imported): a family the package has no module for
    has no kernels (``tileplug info`` shows '-'); an op its module lacks declines, saying so.
    ``kernel_type``: a subclass of :class:`DeferredKernel` to make them (e.g. one whose
    ``prepare`` wraps every launcher of the backend)."""
    import importlib.util

    from tileplug.core import opdefs

    present: dict[str, bool] = {}
    table = {}
    for opdef in opdefs.all_ops():
        if families is not None and opdef.family not in families:
            continue
        module = f"{package}.{opdef.family}"
        if module not in present:
            try:
                present[module] = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                present[module] = False
        if present[module]:
            table[opdef.kernel] = (kernel_type or DeferredKernel)(module, opdef.kernel)
    return table


# ---------------------------------------------------------------------- validation

NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
"""What a backend name looks like: it is typed in ``TILEPLUG_BACKEND`` (comma-separated)
and ``core.use_backend``, so no spaces, commas or other punctuation."""

RESERVED_NAMES: dict[str, str] = {
    "reference": "tileplug-reference",
    "cuda": "tileplug-backend-cuda",
    "ascend": "tileplug-backend-ascend",
}
"""Backend name → the only distribution allowed to provide a backend of that name."""

_OPTIONAL_CALLABLES = ("probe", "lower", "layout_for", "capabilities", "precompile")


def known_kernel_names() -> frozenset[str]:
    """The kernel-table keys a backend may hold: those of the op table
    (``tileplug.core.opdefs.kernel_names()``; one kernel serves an op and its variants)."""
    from tileplug.core import opdefs

    return frozenset(opdefs.kernel_names())


def _shown(value: object, limit: int = 80) -> str:
    """``type (repr)`` of a wrong value, the repr trimmed to ``limit`` characters."""
    try:
        text = repr(value)
    except Exception as error:  # noqa: BLE001 - a broken __repr__ must not hide the real fault
        text = f"<repr raised {type(error).__name__}>"
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(value).__name__} ({text})"


def canonical_distribution_name(name: str) -> str:
    """A distribution name normalised as PEP 503 does (``Tileplug_Reference`` → ``tileplug-reference``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def reserved_name_owner(name: str, distribution: str) -> str | None:
    """The distribution that owns ``name`` when ``distribution`` may not use it, else None."""
    owner = RESERVED_NAMES.get(name)
    if owner is None or canonical_distribution_name(distribution) == owner:
        return None
    return owner


def validate_backend(backend: object) -> None:
    """Check that ``backend`` is a well-formed :class:`Backend`; raise if it is not.

    Raises ``TypeError`` (a field of the wrong type, or not a Backend at all) or
    ``ValueError`` (a field of the right type with a wrong value); the message names the
    backend, the field, what was expected and what was found. Reserved names are not
    checked here (that depends on the distribution: see :func:`reserved_name_owner`).
    """
    if not isinstance(backend, Backend):
        raise TypeError(f"expected a tileplug.core.Backend, got {_shown(backend)}")
    name = backend.name
    if not isinstance(name, str):
        raise TypeError(f"backend name must be a str, got {_shown(name)}")
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"backend name must be non-empty, letters, digits, '_' or '-', starting with a letter "
            f"or '_', got {name!r}"
        )
    where = f"backend '{name}'"

    device_types = backend.device_types
    if isinstance(device_types, str):
        raise TypeError(
            f"{where}: device_types must be a tuple of device type names such as ('cpu',), got the "
            f"bare str {device_types!r} (write ({device_types!r},))"
        )
    if not isinstance(device_types, tuple):
        raise TypeError(f"{where}: device_types must be a tuple of non-empty str, got {_shown(device_types)}")
    if not device_types:
        raise ValueError(f"{where}: device_types must name at least one device type, got ()")
    for device_type in device_types:
        if not isinstance(device_type, str):
            raise TypeError(f"{where}: device_types must hold only str, got {_shown(device_type)} in {device_types!r}")
        if not device_type:
            raise ValueError(f"{where}: device_types must hold non-empty str, got '' in {device_types!r}")

    priority = backend.priority
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"{where}: priority must be an int, got {_shown(priority)}")

    if not isinstance(backend.traits, LayoutTraits):
        raise TypeError(f"{where}: traits must be a tileplug.core.LayoutTraits, got {_shown(backend.traits)}")

    kernels = backend.kernels
    if not isinstance(kernels, Mapping):
        raise TypeError(f"{where}: kernels must be a Mapping of op name to kernel, got {_shown(kernels)}")
    known = known_kernel_names()
    for op, kernel in kernels.items():
        if not isinstance(op, str) or op not in known:
            raise ValueError(
                f"{where}: kernels has an unknown op name {op!r} (known: {', '.join(sorted(known))})"
            )
        if not callable(getattr(kernel, "supports", None)):
            raise TypeError(f"{where}: kernels[{op!r}] has no callable supports(call), got {_shown(kernel)}")
        if not callable(kernel):
            raise TypeError(
                f"{where}: kernels[{op!r}] is not callable (needs __call__(call, inputs, outputs)), "
                f"got {_shown(kernel)}"
            )
        prepare = getattr(kernel, "prepare", None)
        if prepare is not None and not callable(prepare):
            raise TypeError(f"{where}: kernels[{op!r}].prepare must be callable or absent, got {_shown(prepare)}")

    for attribute in _OPTIONAL_CALLABLES:
        value = getattr(backend, attribute)
        if value is not None and not callable(value):
            raise TypeError(f"{where}: {attribute} must be callable or None, got {_shown(value)}")
    if not isinstance(backend.description, str):
        raise TypeError(f"{where}: description must be a str, got {_shown(backend.description)}")
