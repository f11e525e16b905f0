"""``core.lower``: the generated device source of one op specialisation, on any machine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tileplug.core.errors import TileplugError
from tileplug.core.opdefs import describe_call
from tileplug.core.registry import registry


class LoweringError(TileplugError):
    """A backend cannot produce source for a call (no ``lower``, or its kernel declines)."""


def lower(op: Callable[..., Any] | str, *args: Any, backend: str, **kwargs: Any) -> str:
    """Generated source of ``backend``'s kernel for ``op(*args, **kwargs)``.

    ``core.lower(core.ops.per_token_cast, x, backend="ascend", num_per_channels=64)`` where
    ``x`` may be a meta tensor: the backend's device need not be present. Raises
    :class:`LoweringError` when the backend does not generate code or declines the call.
    """
    call, _ = describe_call(op, *args, **kwargs)
    chosen = registry.get(backend)
    if chosen is None:
        installed = ", ".join(b.name for b in registry.backends) or "none"
        raise LoweringError(f"backend '{backend}' is not installed (installed: {installed})")
    return lower_call(chosen, call)


def lower_call(chosen: Any, call: Any) -> str:
    """Generated source of backend ``chosen``'s kernel for a described ``call`` (LoweringError
    when the backend generates no code, has no kernel for the op or declines the call)."""
    backend = chosen.name
    if chosen.lower is None:
        raise LoweringError(f"backend '{backend}' does not generate device code, so it has nothing to lower")
    kernel = chosen.kernels.get(call.op)
    if kernel is None:
        raise LoweringError(f"backend '{backend}' has no {call.name} kernel")
    why = kernel.supports(call)
    if why is not None:
        raise LoweringError(f"backend '{backend}' declines this {call.name} call: {why}")
    return chosen.lower(call)
