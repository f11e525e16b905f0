"""Tuning variables of the CUDA kernels' geometry and forms (``TILEPLUG_CUDA_*``).

Each knob has a default chosen by GPU sweeps; an environment variable overrides it for tuning on
a GPU host without editing code (read when a call signature is first seen, so set it before the
first call, with the kernel index off or one of its own: the index key does not see it). A value
the knob cannot take is a ValueError naming the variable and what it takes, raised where the
kernel is chosen, never a bare assert inside a kernel build."""

from __future__ import annotations

import os


def tuning_override(variable: str, default: int, allowed: tuple[int, ...] = ()) -> int:
    """``default``, or the integer the environment variable ``variable`` holds (unset or empty:
    ``default``); not an integer, or not one of ``allowed`` where given: a ValueError naming the
    variable."""
    text = os.environ.get(variable)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{variable}={text!r}: expected an integer") from None
    if allowed and value not in allowed:
        raise ValueError(f"{variable}={text!r}: expected one of {', '.join(map(str, allowed))}")
    return value


def tuning_choice(variable: str, default: str, allowed: tuple[str, ...]) -> str:
    """``default``, or the one of ``allowed`` the environment variable ``variable`` names (a knob
    choosing a kernel's form); anything else is a ValueError naming the variable."""
    chosen = os.environ.get(variable, default)
    if chosen not in allowed:
        raise ValueError(f"{variable}={chosen!r}: expected one of {', '.join(allowed)}")
    return chosen


def tuning_flag(variable: str, default: bool) -> bool:
    """A knob that is on or off: ``variable`` = ``0`` / ``1`` (unset or empty: ``default``);
    anything else is a ValueError naming the variable."""
    text = os.environ.get(variable)
    if not text:
        return default
    if text not in ("0", "1"):
        raise ValueError(f"{variable}={text!r}: expected 0 or 1")
    return text == "1"


def tuning_tuple(variable: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """``default``, or the comma-separated integers ``variable`` holds, its leading entries
    replacing ``default``'s (``8`` → ``(8, *default[1:])``); more entries than ``default`` has, or
    one that is not an integer, is a ValueError naming the variable."""
    text = os.environ.get(variable)
    if not text:
        return default
    try:
        values = tuple(int(entry) for entry in text.split(","))
    except ValueError:
        raise ValueError(f"{variable}={text!r}: expected up to {len(default)} comma-separated integers") from None
    if len(values) > len(default):
        raise ValueError(f"{variable}={text!r}: expected up to {len(default)} comma-separated integers")
    return values + default[len(values):]
