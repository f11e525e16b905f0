"""Exceptions raised by tileplug."""

from __future__ import annotations


class TileplugError(Exception):
    """Base class of every error tileplug raises on purpose."""


class ContractError(TileplugError, ValueError):
    """An argument breaks an op's contract (SPEC.md §0).

    The message always names the argument, what was expected and what was passed;
    ``argument`` holds the argument's name for programmatic use.
    """

    def __init__(self, op: str, argument: str, expected: str, got: object) -> None:
        self.op = op
        self.argument = argument
        self.expected = expected
        self.got = got
        super().__init__(f"{op}: argument '{argument}': expected {expected}, got {got}")


class NoBackendError(TileplugError, RuntimeError):
    """No installed backend accepts a call; ``reasons`` maps each candidate to why not."""

    def __init__(self, op: str, device_type: str, reasons: dict[str, str]) -> None:
        self.op = op
        self.device_type = device_type
        self.reasons = dict(reasons)
        if reasons:
            listing = "; ".join(f"{name}: {why}" for name, why in reasons.items())
        else:
            listing = "no tileplug backend is installed (pip install tileplug-reference)"
        super().__init__(f"no backend can run {op} on device '{device_type}': {listing}")


CALL_DESCRIPTION_LIMIT = 300
"""How many characters of ``repr(call)`` a :class:`BackendError` message quotes."""


class BackendError(TileplugError, RuntimeError):
    """A backend's kernel raised while running a call that its ``supports()`` accepted.

    tileplug never falls back to another backend here: the kernel may have written part of
    the outputs, and a silent retry would hide a backend bug and make results depend on
    which backend happened to work. The dispatcher raises it ``from`` the kernel's own exception, so the traceback keeps
    both. The message names the backend, the op and the call (its repr, trimmed);
    ``backend`` (name), ``op`` and ``call`` are kept for programmatic use, ``error`` is the
    original exception.
    """

    def __init__(self, backend: str, call: object, error: BaseException) -> None:
        self.backend = backend
        self.call = call
        self.error = error
        self.op = getattr(call, "name", None) or getattr(call, "op", None) or type(call).__name__
        try:
            summary = getattr(call, "summary", None)
            described = summary() if callable(summary) else repr(call)
        except Exception as repr_error:  # noqa: BLE001 - a broken repr must not mask the kernel's error
            described = f"<{type(call).__name__}: repr raised {type(repr_error).__name__}>"
        if len(described) > CALL_DESCRIPTION_LIMIT:
            described = described[: CALL_DESCRIPTION_LIMIT - 3] + "..."
        super().__init__(
            f"backend '{backend}' failed running {self.op}: {type(error).__name__}: {error} (call: {described})"
        )
