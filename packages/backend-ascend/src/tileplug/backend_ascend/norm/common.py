"""The kernel object of each Ascend norm op: declines, ``core.lower`` / lowering-grid access,
and launching on an NPU (one compiled kernel per specialisation)."""

from __future__ import annotations

from typing import Any, Callable

from tileplug.backend_ascend.device import DeviceTarget, dispatch_target, lowering_target
from tileplug.backend_ascend.lowering import CheckedLowering, CompileCache, lower_cached
from tileplug.backend_ascend.norm.spec import NormSpec, decline_reason, spec_of

_ARGUMENTS = {
    "X": lambda inputs, outputs: inputs.x,
    "W": lambda inputs, outputs: inputs.weight,
    "B": lambda inputs, outputs: inputs.bias,
    "R": lambda inputs, outputs: inputs.residual,
    "Y": lambda inputs, outputs: outputs.y,
    "RO": lambda inputs, outputs: outputs.residual_out,
    "MEAN": lambda inputs, outputs: outputs.mean,
    "RSTD": lambda inputs, outputs: outputs.rstd,
}


def header(spec: NormSpec, target: DeviceTarget) -> str:
    """Comment lines heading the Ascend C ``core.lower`` returns: lowered, not verified; the
    specialisation, the device constants and where they came from, the UB plan."""
    return "\n".join([
        "// tileplug-backend-ascend: LOWERED to Ascend C by TileLang's Ascend pipeline on a machine",
        "// without an NPU. Not compiled with bisheng, never executed: lowered, not verified.",
        f"// specialisation: {spec.describe()}",
        f"// device constants: vector cores = {spec.vector_cores} ({target.source}); "
        f"UB budget = {spec.budget} bytes per vector core (pure SIMD)",
        f"// one row per pipeline step, whole in UB; UB plan {spec.footprint} bytes, {spec.num_buffers} buffer versions",
        "",
    ])


class NormKernel:
    """A tileplug Kernel of one forward norm op over :mod:`.row_kernel` (``build(spec)`` makes
    the op's prim_func)."""

    def __init__(self, op: str, build: Callable[[NormSpec], Any]) -> None:
        self.op = op
        self.build = build
        self.compiled = CompileCache(build)

    def supports(self, call) -> str | None:
        if call.op != self.op:
            return f"this kernel serves {self.op}, not {call.op}"
        return decline_reason(call)

    def describe(self, call) -> str:
        """The specialisation ``call`` lowers to (with the lowering stand-ins), as one line."""
        return spec_of(call).describe()

    def lowering(self, call) -> CheckedLowering:
        """``call`` lowered with the stand-ins (disk-cached), for the checks and ``core.lower``."""
        target = lowering_target()
        spec = spec_of(call, target)
        lowered = lower_cached(spec, lambda: self.build(spec))
        return CheckedLowering(spec.describe(), lowered, spec.footprint, spec.budget, header(spec, target))

    def __call__(self, call, inputs, outputs) -> None:
        from tileplug.backend_ascend.gm import argument_names
        from tileplug.backend_ascend.norm.row_kernel import parameters

        spec = spec_of(call, dispatch_target(call.device))
        kernel = self.compiled.get(spec)
        names = argument_names(parameters(spec)[0])
        kernel(*(_ARGUMENTS[name](inputs, outputs) for name in names))
