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


class BackendLoadError(TileplugError):
    """A plugin's entry point could not be loaded (recorded, never raised at dispatch)."""


class BackendError(TileplugError, RuntimeError):
    """A backend's kernel raised while running a call that its ``supports()`` accepted.

    The message names the backend, the op and the call; the original exception is the
    ``__cause__``. tileplug never falls back to another backend here: the kernel may have
    written part of the outputs, and a silent retry would hide a backend bug.
    """

    def __init__(self, backend: str, call: object, error: BaseException) -> None:
        self.backend = backend
        self.op = getattr(call, "name", None) or getattr(call, "op", "?")
        self.call = call
        text = repr(call)
        if len(text) > 240:
            text = text[:237] + "..."
        super().__init__(f"backend '{backend}' failed running {self.op}: {type(error).__name__}: {error} (call: {text})")
