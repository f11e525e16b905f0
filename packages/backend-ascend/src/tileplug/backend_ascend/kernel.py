"""The kernel object of an Ascend row-kernel op (norm and RoPE families): declines,
``core.lower`` / lowering-grid access, launching on an NPU (one compiled kernel per
specialisation).

A family supplies, per op: ``spec_of(call, target)`` (a frozen, hashable specialisation with
``describe()``, ``footprint``, ``budget``, ``num_buffers`` and ``layout``, a one-line summary of
how rows map to pipeline steps), ``decline_reason(call)``, ``build(spec)`` (the prim_func,
UB budget checked) and ``arguments(spec, inputs, outputs)`` (the launch arguments in the
prim_func's parameter order).
"""

from __future__ import annotations

from typing import Any, Callable

from tileplug.backend_ascend.device import DeviceTarget, dispatch_target, lowering_target
from tileplug.backend_ascend.lowering import CheckedLowering, CompileCache, lower_cached


def header(spec: Any, target: DeviceTarget) -> str:
    """Comment lines heading the Ascend C ``core.lower`` returns: lowered, not verified; the
    specialisation, the device constants and where they came from, the UB plan."""
    return "\n".join([
        "// tileplug-backend-ascend: LOWERED to Ascend C by TileLang's Ascend pipeline on a machine",
        "// without an NPU. Not compiled with bisheng, never executed: lowered, not verified.",
        f"// specialisation: {spec.describe()}",
        f"// device constants: vector cores = {spec.vector_cores} ({target.source}); "
        f"UB budget = {spec.budget} bytes per vector core "
        f"({'SIMT regions present' if getattr(spec, 'uses_simt', False) else 'pure SIMD'})",
        f"// {spec.layout}; UB plan {spec.footprint} bytes, {spec.num_buffers} buffer versions",
        "",
    ])


def checked_lowering(spec: Any, build: Callable[[Any], Any], target: DeviceTarget) -> CheckedLowering:
    """``spec`` lowered (disk-cached; ``build(spec)`` traces it) with its UB plan, budget and header."""
    lowered = lower_cached(spec, lambda: build(spec))
    return CheckedLowering(spec.describe(), lowered, spec.footprint, spec.budget, header(spec, target))


class SpecKernel:
    """A tileplug Kernel of one op over a family's specialisation and prim_func builder."""

    def __init__(self, op: str, spec_of: Callable[..., Any], decline_reason: Callable[[Any], str | None],
                 build: Callable[[Any], Any], arguments: Callable[[Any, Any, Any], list]) -> None:
        self.op = op
        self.spec_of = spec_of
        self.decline_reason = decline_reason
        self.build = build
        self.arguments = arguments
        self.compiled = CompileCache(lambda spec: self.build(spec))

    def supports(self, call) -> str | None:
        if call.op != self.op:
            return f"this kernel serves {self.op}, not {call.op}"
        return self.decline_reason(call)

    def describe(self, call) -> str:
        """The specialisation ``call`` lowers to (with the lowering stand-ins), as one line."""
        return self.spec_of(call).describe()

    def lowering(self, call) -> CheckedLowering:
        """``call`` lowered with the stand-ins (disk-cached), for the checks and ``core.lower``."""
        target = lowering_target()
        return checked_lowering(self.spec_of(call, target), self.build, target)

    def lowerings(self, call) -> list[CheckedLowering]:
        """Every kernel ``call`` launches, lowered (one here; an op of several kernels says more)."""
        return [self.lowering(call)]

    def __call__(self, call, inputs, outputs) -> None:
        spec = self.spec_of(call, dispatch_target(call.device))
        self.compiled.get(spec)(*self.arguments(spec, inputs, outputs))
