"""``core.lower``: the generated device source of one op specialisation, on any machine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tileplug.core.errors import ContractError, TileplugError
from tileplug.core.ops.quant import capture_calls
from tileplug.core.registry import registry


class LoweringError(TileplugError):
    """A backend cannot produce source for a call (no ``lower``, or its kernel declines)."""


def describe_call(op: Callable[..., Any] | str, *args: Any, **kwargs: Any):
    """Check ``op``'s contract for these arguments and return ``(call, inputs)`` without running.

    ``x`` may be a ``meta`` tensor, so calls for any device can be described anywhere.
    """
    from tileplug.core import ops

    function = getattr(ops, op, None) if isinstance(op, str) else op
    if not callable(function) or getattr(function, "__module__", "") != "tileplug.core.ops.quant":
        raise ContractError("lower", "op", f"a tileplug.core.ops function or its name", op)
    with capture_calls() as captured:
        function(*args, **kwargs)
    return captured[0]


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
    if chosen.lower is None:
        raise LoweringError(f"backend '{backend}' does not generate device code, so it has nothing to lower")
    kernel = chosen.kernels.get(call.op)
    if kernel is None:
        raise LoweringError(f"backend '{backend}' has no {call.op} kernel")
    why = kernel.supports(call)
    if why is not None:
        raise LoweringError(f"backend '{backend}' declines this {call.op} call: {why}")
    return chosen.lower(call)
