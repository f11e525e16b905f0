"""Runtime switches: amax clamps, PDL, SM count, token alignment, host sf layout, finite checks.

Values are process-wide (``config.set(...)``) and can be overridden for a block of code,
per thread and per asyncio task, with ``config.override(...)`` or the narrower context
managers below. Reading the configuration in force is :func:`current`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from tileplug.core.errors import ContractError
from tileplug.core.quant.formats import QUANT_FORMATS
from tileplug.core.quant.layouts import CUDA_LAYOUT, LAYOUTS, LayoutTraits
from tileplug.core.quant.sf_math import DEFAULT_CLAMP_MIN


@dataclass(frozen=True)
class RuntimeConfig:
    """The runtime switches in force.

    - ``amax_clamps``: amax lower clamp per ``(fmt, sf stored as e4m3)`` (SPEC §2).
    - ``pdl``: launch kernels with programmatic dependent launch where the backend can.
    - ``sm_count``: number of SMs / cores a backend may use (None: all of the device's).
    - ``token_alignment_bytes``: column length alignment of column-major sf in bytes
      (None: the device family's own, 16 on CUDA, unpadded on Ascend).
    - ``host_layout``: the device family whose sf layout host devices (cpu, meta) produce,
      so that CUDA and Ascend layouts can both be made and checked on a CPU.
    - ``ascend_vector_cores``: Ascend vector-core count override (None: from the device).
    - ``check_finite``: a debug mode of the top-k gates (``topk_gate``, ``moe_topk_gate``):
      before the launch the op synchronises with the device to look for non-finite scores
      (logits, bias) and raises ContractError naming the rows. Off, such rows get index −1
      and weight 0 and nothing waits on the device.
    """

    amax_clamps: Mapping[tuple[str, bool], float] = field(default_factory=lambda: dict(DEFAULT_CLAMP_MIN))
    pdl: bool = False
    sm_count: int | None = None
    token_alignment_bytes: int | None = None
    host_layout: LayoutTraits = CUDA_LAYOUT
    ascend_vector_cores: int | None = None
    check_finite: bool = False

    def clamp_min(self, fmt: str, use_e4m3_sf: bool) -> float:
        """The amax lower clamp for ``fmt`` with or without e4m3-stored sf."""
        return self.amax_clamps[(fmt, use_e4m3_sf)]


def smallest_clamp(fmt: str, use_e4m3_sf: bool) -> float:
    """The smallest amax clamp that keeps every scale of a finite group finite and non-zero:
    ``max · 2^-9`` (the least e4m3 subnormal) for e4m3-stored sf, ``max · 2^-126`` (the
    least normal fp32) otherwise — which are the e4m3-sf and e2m1 defaults."""
    fmt_max = QUANT_FORMATS[fmt].max_value
    return fmt_max * 2.0**-9 if use_e4m3_sf else fmt_max * 2.0**-126


_process_config = RuntimeConfig()
_override: contextvars.ContextVar[RuntimeConfig | None] = contextvars.ContextVar("tileplug_config", default=None)


def current() -> RuntimeConfig:
    """The configuration in force in this thread / task."""
    return _override.get() or _process_config


def _validated(base: RuntimeConfig, changes: dict[str, Any]) -> RuntimeConfig:
    op = "config"
    known = {f.name for f in dataclasses.fields(RuntimeConfig)}
    for name, value in changes.items():
        if name not in known:
            raise ContractError(op, name, f"one of {sorted(known)}", name)
    if "amax_clamps" in changes:
        clamps = changes["amax_clamps"]
        if not isinstance(clamps, Mapping):
            raise ContractError(op, "amax_clamps", "a mapping {(fmt, use_e4m3_sf): clamp}", clamps)
        merged = dict(base.amax_clamps)
        for key, value in clamps.items():
            if key not in DEFAULT_CLAMP_MIN:
                raise ContractError(op, "amax_clamps", f"keys in {sorted(DEFAULT_CLAMP_MIN)}", key)
            smallest = smallest_clamp(*key)
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
                or value < smallest
            ):
                raise ContractError(op, "amax_clamps", f"a finite clamp >= {smallest!r} for {key}", value)
            merged[key] = float(value)
        changes["amax_clamps"] = merged
    for name in ("pdl", "check_finite"):
        if name in changes and not isinstance(changes[name], bool):
            raise ContractError(op, name, "a bool", changes[name])
    for name in ("sm_count", "token_alignment_bytes", "ascend_vector_cores"):
        value = changes.get(name)
        if value is not None and (type(value) is not int or value <= 0):
            raise ContractError(op, name, "a positive int or None", value)
    if "host_layout" in changes:
        layout = changes["host_layout"]
        if isinstance(layout, str):
            if layout not in LAYOUTS:
                raise ContractError(op, "host_layout", f"one of {sorted(LAYOUTS)}", layout)
            changes["host_layout"] = LAYOUTS[layout]
        elif not isinstance(layout, LayoutTraits):
            raise ContractError(op, "host_layout", "a LayoutTraits or a family name", layout)
    return dataclasses.replace(base, **changes)


def set(**changes: Any) -> RuntimeConfig:  # noqa: A001 - config.set reads naturally
    """Change process-wide defaults, e.g. ``config.set(pdl=True)``; returns the new config."""
    global _process_config
    _process_config = _validated(_process_config, changes)
    return _process_config


def reset() -> None:
    """Restore every process-wide default."""
    global _process_config
    _process_config = RuntimeConfig()


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[RuntimeConfig]:
    """Apply ``changes`` inside a ``with`` block (this thread / task only)."""
    token = _override.set(_validated(current(), changes))
    try:
        yield current()
    finally:
        _override.reset(token)


def amax_clamps(clamps: Mapping[tuple[str, bool], float]) -> contextlib.AbstractContextManager[RuntimeConfig]:
    """Override amax clamps, e.g. ``with config.amax_clamps({("e4m3", False): 1e-6}):``."""
    return override(amax_clamps=clamps)


def pdl(enabled: bool = True) -> contextlib.AbstractContextManager[RuntimeConfig]:
    """Enable (or disable) programmatic dependent launch inside a block."""
    return override(pdl=enabled)


def sm_count(count: int | None) -> contextlib.AbstractContextManager[RuntimeConfig]:
    """Limit the SMs / cores backends may use inside a block."""
    return override(sm_count=count)


def token_alignment(alignment_bytes: int | None) -> contextlib.AbstractContextManager[RuntimeConfig]:
    """Pad column-major sf columns to ``alignment_bytes`` inside a block."""
    return override(token_alignment_bytes=alignment_bytes)


def host_layout(family: str | LayoutTraits) -> contextlib.AbstractContextManager[RuntimeConfig]:
    """Make host devices (cpu, meta) produce ``family``'s sf layout ("cuda" or "ascend")."""
    return override(host_layout=family)


def check_finite(enabled: bool = True) -> contextlib.AbstractContextManager[RuntimeConfig]:
    """Debug mode of the top-k gates inside a block: a row with a non-finite score raises
    ContractError naming the rows instead of getting index −1 / weight 0. It costs a host
    synchronisation per call (the check reads the scores back); never enable it on a hot path.
    ``config.set(check_finite=True)`` turns it on process-wide."""
    return override(check_finite=enabled)
