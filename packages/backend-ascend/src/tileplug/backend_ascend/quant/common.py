"""Shared machinery of the Ascend quant kernels: call -> specialisation, declines, the
per-specialisation kernel cache (thread-safe), ``Backend.lower`` (Ascend C with a header), and
launching. Lowering itself, memoised on disk, is :mod:`tileplug.backend_ascend.quant.lowered` over
:mod:`tileplug.backend_ascend.lowering`."""

from __future__ import annotations

from dataclasses import replace

import torch

from tileplug.backend_ascend.device import DeviceTarget, UBBudgetError, dispatch_target, lowering_target
from tileplug.backend_ascend.lowering import CheckedLowering, CompileCache
from tileplug.backend_ascend.quant.spec import TileSpec, Tiling
from tileplug.core.call import QuantMode
from tileplug.core.contracts.quant_reblock import LOSSLESS

KIND_OF_OP = {"per_token_cast": "token", "per_block_cast": "block", "per_channel_cast": "channel", "cast_back": "back",
              "per_token_cast_and_cast_back": "token"}
DTYPE_NAMES = {
    torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float8_e4m3fn: "float8_e4m3fn", torch.int8: "int8",
}
DENORMAL_SCALE_LIMIT = 2.0**-126
ASCEND_SF_PACK = 2


def _sf_kind(encoding) -> str | None:
    """'fp32' / 'ue8m0' for the encodings these kernels read, None for others."""
    if encoding.kind == "fp32":
        return "fp32"
    if encoding.kind == "ue8m0" and encoding.pack_factor == ASCEND_SF_PACK:
        return "ue8m0"
    return None


def kind_of(call) -> str | None:
    """The tile kind of ``call``'s op (None: no Ascend kernel). ``per_block_cast_lossless`` takes
    the tile of its output groups ``(bm, bn)``: per token for ``1 x bn``, per channel for
    ``bm x 1`` (packed UE8M0 pairs two row groups), per block otherwise."""
    if call.op == LOSSLESS:
        bm, bn = call.cast.block
        return "token" if bm == 1 else "channel" if bn == 1 else "block"
    return KIND_OF_OP.get(call.op)


def decline_reason(call) -> str | None:
    """Why the Ascend kernels cannot serve ``call`` (None: they can). Compared fields only."""
    kind = kind_of(call)
    if kind is None:
        return f"no Ascend kernel for {call.op}"
    if call.hidden % 16:
        return f"hidden size must be a multiple of 16 (got {call.hidden})"
    cast = call.cast
    if cast is not None:
        if cast.use_e4m3_sf and call.mode is not QuantMode.CAST_AND_CAST_BACK:  # (fake quant stores no sf)
            return "e4m3-stored scale factors are not produced on Ascend (use round_sf / packed UE8M0 or fp32 sf)"
        if cast.stochastic and (kind not in ("token", "block") or call.mode is not QuantMode.CAST):
            return (f"stochastic rounding is served on the main per_token_cast / per_block_cast only (not {call.op} "
                    f"in {call.mode.value} mode); falls to the reference")
        if cast.clamp_min < cast.fmt.max_value * DENORMAL_SCALE_LIMIT:
            return (
                f"clamp_min {cast.clamp_min!r} allows denormal scales (< {cast.fmt.name} max x 2^-126); the vector "
                "divide and exponent-bit scale math here assume normal scales"
            )
    qin = call.quantized_input
    if qin is not None and _sf_kind(qin.sf_encoding) is None:
        return (
            f"quantized input scales stored as {qin.sf_encoding.kind}"
            f"{'x' + str(qin.sf_encoding.pack_factor) if qin.sf_encoding.kind == 'ue8m0' else ''} are not an Ascend "
            "layout (fp32 or UE8M0 two per int16)"
        )
    if call.given_sf is not None and _sf_kind(call.given_sf.encoding) is None:
        return "given scales must be fp32 or UE8M0 two per int16 (the Ascend layouts)"
    try:
        Tiling(spec_of(call))
    except UBBudgetError as error:
        return str(error)
    return None


def spec_of(call, target: DeviceTarget | None = None) -> TileSpec:
    """The kernel specialisation of ``call`` on ``target`` (vector cores; default: the
    lowering stand-in)."""
    kind = kind_of(call)
    cores = (target or lowering_target()).vector_cores
    mode = call.mode
    qin = None
    if call.quantized_input is not None:
        q = call.quantized_input
        qin = (q.fmt.name, q.block[0], q.block[1], _sf_kind(q.sf_encoding), bool(q.sf_col_major))
    if kind == "back":
        return TileSpec(
            kind="back", hidden=call.hidden, block=qin[1:3], fmt=None, mode=mode,
            in_dtype=DTYPE_NAMES[call.input_dtype], qin=qin, out_dtype=DTYPE_NAMES[call.output_dtype],
            vector_cores=cores,
        )
    cast = call.cast
    given = None
    if call.given_sf is not None:
        given = (_sf_kind(call.given_sf.encoding), bool(call.given_sf.col_major))
    fake_quant = mode is QuantMode.CAST_AND_CAST_BACK  # x dequantized into itself
    lossless = call.op == LOSSLESS
    spec = TileSpec(
        kind=kind, hidden=call.hidden, block=tuple(cast.block), fmt=cast.fmt.name, mode=mode,
        in_dtype=DTYPE_NAMES[call.input_dtype],
        round_sf=cast.round_sf and not lossless,  # a lossless scale is a power of two either way: one kernel
        packed=cast.use_packed_ue8m0, col_major=cast.col_major_sf, clamp_min=cast.clamp_min, qin=qin, given=given,
        out_dtype=DTYPE_NAMES[call.input_dtype] if fake_quant else None,
        stochastic=bool(cast.stochastic), e4m3_sf=fake_quant and cast.use_e4m3_sf, lossless=lossless,
        vector_cores=cores,
    )
    if lossless and qin[0] == "e2m1" and qin[2] > 1 and not _fits(spec):
        # bf16 decoded values and one fp32 input scale per input group (TileSpec.compact_decode),
        # only where the per-element plan does not fit: the other specialisations keep their code
        spec = replace(spec, compact_decode=True)
    return spec


def _fits(spec: TileSpec) -> bool:
    """Whether some tile width of ``spec`` fits the UB budget."""
    try:
        spec.width()
    except UBBudgetError:
        return False
    return True


# ---------------------------------------------------------------------- Backend.lower


def header(spec: TileSpec, tiling: Tiling, target: DeviceTarget) -> str:
    """Comment lines that head the Ascend C ``core.lower`` returns: lowered, not verified; the
    specialisation, the device constants and where they came from, the tile and its UB plan."""
    budget = tiling.budget
    lines = [
        "// tileplug-backend-ascend: LOWERED to Ascend C by TileLang's Ascend pipeline on a machine",
        "// without an NPU. Not compiled with bisheng, never executed: lowered, not verified.",
        f"// specialisation: {spec.describe()}",
        f"// device constants: vector cores = {spec.vector_cores} ({target.source}); "
        f"UB budget = {budget} bytes per vector core ({'SIMT regions present' if spec.uses_simt else 'pure SIMD'})",
        f"// tile: {spec.rows} row(s) x {tiling.width} columns ({tiling.full} full tile(s) per row tile"
        f"{f', last tile {tiling.tail} columns' if tiling.tail else ''}); UB plan {tiling.footprint} bytes, "
        f"{spec.num_buffers} buffer versions",
        "",
    ]
    return "\n".join(lines)


def checked_lowering(call) -> CheckedLowering:
    """``call``'s specialisation with the lowering stand-ins, lowered (disk-cached), with its
    UB plan, budget and ``core.lower`` header."""
    from tileplug.backend_ascend.quant.lowered import lower_spec

    target = lowering_target()
    spec = spec_of(call, target)
    lowered, tiling = lower_spec(spec)
    return CheckedLowering(spec.describe(), lowered, tiling.footprint, tiling.budget, header(spec, tiling, target))


# ---------------------------------------------------------------------- running (NPU only)


def _trace(spec: TileSpec):
    from tileplug.backend_ascend.quant.tile_kernel import build

    return build(spec, Tiling(spec))


compiled = CompileCache(_trace)


def _sf_arg(sf: torch.Tensor, col_major: bool) -> torch.Tensor:
    # column-major scales are passed as their (cols, rows) transpose, unit last stride
    return sf.t() if col_major else sf


class GroupedKernel:
    """A tileplug Kernel over the shared tile kernel (one per op, see the op modules)."""

    op = ""

    def supports(self, call) -> str | None:
        if call.op != self.op:
            return f"this kernel serves {self.op}, not {call.op}"
        return decline_reason(call)

    def describe(self, call) -> str:
        """The specialisation ``call`` lowers to (with the lowering stand-ins), as one line."""
        return spec_of(call).describe()

    def lowering(self, call) -> CheckedLowering:
        """``call`` lowered with the stand-ins, for the lowering checks and ``core.lower``."""
        return checked_lowering(call)

    def lowerings(self, call) -> list[CheckedLowering]:
        """Every kernel ``call`` launches, lowered: the one tile kernel."""
        return [checked_lowering(call)]

    def spec_for_device(self, call) -> TileSpec:
        return spec_of(call, dispatch_target(call.device))

    def __call__(self, call, inputs, outputs) -> None:
        spec = self.spec_for_device(call)
        kernel = compiled.get(spec)
        args = [inputs.x]
        if spec.qin is not None:
            args.append(_sf_arg(inputs.input_sf, spec.qin[4]))
        if spec.given is not None:
            args.append(_sf_arg(inputs.given_sf, spec.given[1]))
        if spec.writes_q and not spec.fake_quant:  # (fake quant writes x itself)
            args.append(outputs.q)
        if spec.writes_sf:
            args.append(_sf_arg(outputs.sf, spec.col_major))
        if spec.stochastic:  # the generator's state as int32 words, read only by the kernel
            args += [inputs.seed.view(torch.int32), inputs.offset.view(torch.int32)]
        kernel(*args)
        if spec.stochastic:  # same stream, after every block of the draw read the offset
            inputs.offset.add_(1)
