"""Backend discovery through entry points, and backend selection per call.

Discovery loads each entry point of the group ``tileplug.backends`` on its own, in the
order (distribution, entry-point name): a plugin that fails to import, whose hook raises
(``SystemExit`` included) or returns something else than Backends, is recorded with its
error and harms no other. Each backend handed back is checked (see
:func:`tileplug.core.backend.validate_backend`); a malformed one, one claiming a name
reserved for another distribution, or one whose name is already taken is refused and
recorded, and the plugin's other backends still load.
Selection walks the backends serving the call's device type in priority order (or the
ones forced with ``TILEPLUG_BACKEND`` / :func:`use_backend`, in the order given) and
takes the first that is available here and whose kernel accepts the call. The answer is
cached per call signature, so the hot path is one dictionary lookup.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.metadata
import os
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tileplug.core.backend import (
    Backend,
    Kernel,
    canonical_distribution_name,
    reserved_name_owner,
    validate_backend,
)
from tileplug.core.errors import NoBackendError
from tileplug.core.plugins import ENTRY_POINT_GROUP, new_plugin_manager

BACKEND_ENV_VARIABLE = "TILEPLUG_BACKEND"

_forced: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("tileplug_forced", default=None)


@dataclass
class PluginRecord:
    """One entry point of the group and what came of loading it.

    ``load_error`` says why the plugin as a whole gave nothing (its import, its hook, or
    what the hook returned failed); ``refused`` holds one reason per backend it handed back
    that was not registered (malformed, a reserved or already-taken name). ``backends`` are
    the ones that were registered.
    """

    name: str
    value: str
    distribution: str
    version: str
    backends: list[Backend] = field(default_factory=list)
    load_error: str | None = None
    refused: list[str] = field(default_factory=list)

    @property
    def faults(self) -> list[str]:
        """Everything that went wrong with this entry point, one line each (empty: nothing)."""
        return ([self.load_error] if self.load_error is not None else []) + list(self.refused)

    @property
    def error(self) -> str | None:
        """:attr:`faults` joined into one line, or None when the plugin loaded cleanly."""
        faults = self.faults
        return "; ".join(faults) if faults else None


class Route:
    """The cached answer for one call signature: the chosen backend and kernel, the op's
    declaration, the output allocation plan for the backend's layout (config in force is
    part of the call, so the plan is fixed per route) and the kernel's launcher.

    A kernel may offer ``prepare(call) -> launcher(inputs, outputs)`` (compile, bind, look
    up once per signature); the launcher is made on the first launch and kept here (the
    one launcher cache).
    """

    __slots__ = ("backend", "kernel", "opdef", "traits", "plan", "result", "launcher", "_call", "_lock")

    def __init__(self, backend: Backend, kernel: Kernel, call: Any) -> None:
        from tileplug.core import opdefs

        self.backend = backend
        self.kernel = kernel
        self.opdef = opdefs.get(call.name)
        self.traits = backend.traits_for(call.device_type)
        self.plan = self.opdef.outputs(call, self.traits)
        self.result = self.opdef.result
        self._call = call
        self.launcher: Callable[[Any, Any], None] | None = None  # set by prepare(), on first launch
        self._lock = threading.Lock()

    def check_out(self, call: Any, out: Any, inputs: Any) -> Any:
        """The caller's ``out=`` checked against this route's plan (ContractError naming ``out``)."""
        from tileplug.core.call import check_out

        expected = self.plan.allocate(call.tokens, torch.device("meta"))
        slots = check_out(call.name, expected, out, call.device, [t for t in inputs if isinstance(t, torch.Tensor)])
        return type(expected)(*slots)

    def launch(self, inputs: Any, outputs: Any) -> None:
        """Run the kernel (its launcher prepared on first use, thread-safe)."""
        (self.launcher or self.prepare())(inputs, outputs)

    def prepare(self) -> Callable[[Any, Any], None]:
        """The launcher of this signature, made once (the hot path reads ``self.launcher``)."""
        with self._lock:
            if self.launcher is None:
                prepare = getattr(self.kernel, "prepare", None)
                if prepare is not None:
                    self.launcher = prepare(self._call)
                else:
                    kernel, call = self.kernel, self._call
                    self.launcher = lambda inputs, outputs: kernel(call, inputs, outputs)
            return self.launcher


def _entry_point_order(entry_point: importlib.metadata.EntryPoint) -> tuple[str, str]:
    """Sort key of entry points: (canonical distribution name, entry-point name)."""
    distribution, _ = _distribution_of(entry_point)
    return canonical_distribution_name(distribution), entry_point.name


def _distribution_of(entry_point: importlib.metadata.EntryPoint) -> tuple[str, str]:
    """(name, version) of the distribution declaring ``entry_point`` ("?" where unknown)."""
    dist = getattr(entry_point, "dist", None)
    if dist is None:
        return "?", "?"
    return dist.name or "?", dist.version or "?"


class _HookResultError(TypeError):
    """What a plugin's hook returned is not an iterable of backends (raised by discovery
    itself, so its message carries no source location)."""


def _describe_failure(error: BaseException) -> str:
    """``Type: message (at file:line)`` of an exception, the line being where it was raised."""
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - a plugin's exception with a broken __str__
        text = "<its message could not be printed>"
    if isinstance(error, _HookResultError):
        return f"TypeError: {text}"
    last = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(error).__name__}: {text}{where}"


def _call_hook(entry_point: importlib.metadata.EntryPoint) -> list[object]:
    """Import the plugin of ``entry_point`` and return what its ``tileplug_backends()`` hook
    handed back, as a list (not yet checked); raises on any failure, with the cause."""
    plugin = entry_point.load()
    manager = new_plugin_manager()
    manager.register(plugin, name=entry_point.name)
    implementations = [
        impl
        for impl in manager.hook.tileplug_backends.get_hookimpls()
        if not (impl.hookwrapper or getattr(impl, "wrapper", False))
    ]
    if not implementations:
        raise _HookResultError(f"{entry_point.value} implements no tileplug_backends() hook")
    results = manager.hook.tileplug_backends()
    if len(results) < len(implementations):  # pluggy drops None results
        raise _HookResultError(
            f"{entry_point.value}: tileplug_backends() returned None "
            "(it must return an iterable of tileplug.core.Backend)"
        )
    provided: list[object] = []
    for returned in results:
        if isinstance(returned, (Backend, str, bytes, Mapping)) or not isinstance(returned, Iterable):
            raise _HookResultError(
                f"{entry_point.value}: tileplug_backends() must return an iterable of "
                f"tileplug.core.Backend, not {type(returned).__name__}"
            )
        provided.extend(returned)
    return provided


def _parse_names(text: str | None) -> tuple[str, ...] | None:
    if not text:
        return None
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    return names or None


class Registry:
    """Installed backends and the selection cache."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._loaded = False
        self._records: list[PluginRecord] = []
        self._backends: dict[str, Backend] = {}
        self._cache: dict[tuple[Any, tuple[str, ...] | None], Route] = {}
        self._env_forced: tuple[str, ...] | None = None

    # ------------------------------------------------------------------ discovery
    def load(self) -> None:
        """Discover plugins once (thread-safe); later calls do nothing.

        Entry points are loaded in the order (distribution name, entry-point name), so which
        of two plugins claiming one backend name wins does not depend on ``sys.path``.
        """
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            self._env_forced = _parse_names(os.environ.get(BACKEND_ENV_VARIABLE))
            found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
            for entry_point in sorted(found, key=_entry_point_order):
                self._records.append(self._load_entry_point(entry_point))
            self._loaded = True

    def reload(self) -> None:
        """Forget everything and discover again (re-reads ``TILEPLUG_BACKEND``)."""
        with self._lock:
            self._loaded = False
            self._records = []
            self._backends = {}
            self._cache = {}
            importlib.invalidate_caches()
            self.load()

    def _load_entry_point(self, entry_point: importlib.metadata.EntryPoint) -> PluginRecord:
        """Import one plugin, call its hook, and register each valid backend it hands back.

        Nothing a plugin does escapes (``SystemExit`` included) but ``KeyboardInterrupt``:
        every failure ends up in the returned record.
        """
        distribution, version = _distribution_of(entry_point)
        record = PluginRecord(entry_point.name, entry_point.value, distribution, version)
        try:
            provided = _call_hook(entry_point)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # noqa: BLE001 - a plugin must never break discovery
            record.load_error = _describe_failure(error)
            return record
        for backend in provided:
            why = self._refusal(backend, distribution)
            if why is not None:
                record.refused.append(f"refused: {why}")
                continue
            backend.distribution = distribution
            backend.version = version
            self._backends[backend.name] = backend
            record.backends.append(backend)
        return record

    def _refusal(self, backend: object, distribution: str) -> str | None:
        """Why ``backend`` from ``distribution`` may not be registered (None: it may)."""
        if not isinstance(backend, Backend):
            return f"tileplug_backends() returned {type(backend).__name__}, not a tileplug.core.Backend"
        try:
            validate_backend(backend)
        except (TypeError, ValueError) as error:
            return str(error)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # noqa: BLE001 - e.g. a Mapping whose iteration raises
            name = backend.__dict__.get("name")
            label = f"backend '{name}'" if isinstance(name, str) and type(name) is str else "a backend"
            return f"{label}: checking it raised {_describe_failure(error)}"
        return self._name_conflict(backend.name, distribution)

    def _name_conflict(self, name: str, distribution: str) -> str | None:
        """Why a backend called ``name`` from ``distribution`` may not take that name (None: it may)."""
        owner = reserved_name_owner(name, distribution)
        if owner is not None:
            return f"backend '{name}': name '{name}' is reserved for {owner}"
        taken = self._backends.get(name)
        if taken is not None:
            return f"backend '{name}': name '{name}' is already taken by {taken.distribution or 'another plugin'}"
        return None

    def register(self, backend: Backend) -> None:
        """Add a backend from code (no entry point): for embedding and experiments.

        The backend is checked as a plugin's would be; raises ``TypeError`` or
        ``ValueError`` saying which field is wrong, or that the name is reserved or taken.
        """
        self.load()
        validate_backend(backend)
        with self._lock:
            distribution = backend.distribution or "(registered in-process)"
            conflict = self._name_conflict(backend.name, distribution)
            if conflict is not None:
                raise ValueError(conflict)
            backend.distribution = distribution
            self._backends[backend.name] = backend
            self._cache = {}

    def unregister(self, name: str) -> None:
        """Remove a backend (until the next :meth:`reload`)."""
        self.load()
        with self._lock:
            self._backends.pop(name, None)
            self._cache = {}

    @property
    def records(self) -> list[PluginRecord]:
        """Every entry point found, with its backends or its load error."""
        self.load()
        return list(self._records)

    @property
    def backends(self) -> list[Backend]:
        """Every loaded backend, highest priority first."""
        self.load()
        return sorted(self._backends.values(), key=lambda b: (-b.priority, b.name))

    def get(self, name: str) -> Backend | None:
        """The backend called ``name``, or None."""
        self.load()
        return self._backends.get(name)

    def forced(self) -> tuple[str, ...] | None:
        """Backend names forced by :func:`use_backend` or ``TILEPLUG_BACKEND`` (None: free choice)."""
        self.load()
        return _forced.get() or self._env_forced

    # ------------------------------------------------------------------ selection
    def route(self, call: Any) -> Route:
        """The :class:`Route` that runs ``call`` (cached on the call's signature: one hash)."""
        hit = self._cache.get((call, _forced.get()))
        if hit is not None:
            return hit
        return self._route_uncached(call)

    def select(self, op: str, call: Any) -> tuple[Backend, Kernel]:
        """The backend and kernel that run ``call`` (cached on the call's signature)."""
        route = self.route(call)
        return route.backend, route.kernel

    def _route_uncached(self, call: Any) -> Route:
        self.load()
        key = (call, _forced.get())
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                return hit
            choice, reasons = self._walk(call.op, call, stop_at_first=True)
            if choice is None:
                raise NoBackendError(call.op, call.device_type, reasons)
            backend, kernel = choice
            route = Route(backend, kernel, call)
            self._cache[key] = route
            return route

    def explain(self, op: str, call: Any) -> dict[str, str | None]:
        """For every candidate, None if it would accept ``call``, else why not."""
        self.load()
        _, reasons = self._walk(op, call, stop_at_first=False)
        return reasons

    def candidates(self, device_type: str) -> list[Backend]:
        """Backends considered for ``device_type``, in the order they are tried."""
        forced = self.forced()
        if forced is not None:
            return [self._backends[n] for n in forced if n in self._backends]
        return [b for b in self.backends if b.serves(device_type)]

    def _walk(self, op: str, call: Any, stop_at_first: bool):
        device_type = call.device_type
        forced = self.forced()
        reasons: dict[str, str | None] = {}
        for backend in self.candidates(device_type):
            why = self.reason_against(backend, op, call)
            reasons[backend.name] = why
            if why is None and stop_at_first:
                return (backend, backend.kernels[op]), reasons
        for backend in self.backends:
            if backend.name not in reasons and not backend.serves(device_type):
                reasons[backend.name] = f"does not serve device type '{device_type}'"
        if forced is not None:
            for name in forced:
                if name not in self._backends:
                    reasons[name] = f"is not installed ({BACKEND_ENV_VARIABLE} or use_backend asked for it)"
            skipped = [b.name for b in self.backends if b.serves(device_type) and b.name not in forced]
            for name in skipped:
                reasons[name] = f"not tried: only {', '.join(forced)} allowed ({BACKEND_ENV_VARIABLE} / use_backend)"
        for record in self._records:
            if record.error is not None:
                verb = "failed to load" if not record.backends else "partly failed to load"
                reasons[f"plugin '{record.name}' ({record.distribution})"] = f"{verb}: {record.error}"
        return None, reasons

    @staticmethod
    def reason_against(backend: Backend, op: str, call: Any) -> str | None:
        """Why ``backend`` cannot run ``call`` (None if it can)."""
        if not backend.serves(call.device_type):
            return f"does not serve device type '{call.device_type}'"
        why = backend.unavailable_reason()
        if why is not None:
            return f"unavailable: {why}"
        kernel = backend.kernels.get(op)
        if kernel is None:
            return f"has no {op} kernel"
        try:
            why = kernel.supports(call)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # noqa: BLE001 - a faulty supports() (even sys.exit) declines, never crashes
            return f"supports() raised {type(error).__name__}: {error}"
        if why is not None and not isinstance(why, str):
            return f"supports() returned {type(why).__name__}, not None or a reason string"
        return why


registry = Registry()
"""The process-wide registry."""


@contextlib.contextmanager
def use_backend(*names: str) -> Iterator[None]:
    """Run only the named backends (tried in the order given) inside a ``with`` block.

    ``with core.use_backend("reference"): ...`` — same effect as ``TILEPLUG_BACKEND``,
    for this thread / task only; it takes precedence over the variable.
    """
    if not names or not all(isinstance(n, str) and n for n in names):
        from tileplug.core.errors import ContractError

        raise ContractError("use_backend", "names", "one or more backend names", names)
    token = _forced.set(tuple(names))
    try:
        yield
    finally:
        _forced.reset(token)
