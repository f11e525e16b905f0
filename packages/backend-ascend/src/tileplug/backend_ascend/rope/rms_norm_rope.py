"""Ascend kernel of ``rms_norm_rope`` and ``rms_norm_rope_per_token_cast`` (one kernel-table
entry serves both; the call's cast says whether it quantizes): per-head RMSNorm, the rotation
of its rounded output and, for the quantized op, the per-token cast of the rotated token, in
one pass over each token (SPEC §6; the fusion rule of §4).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

Per vector core ``cid`` of ``T.Kernel(C)``: once, the weight factor ``float(w) + weight_offset``
in fp32 (:func:`~tileplug.backend_ascend.rows.prepare_vector`); then one
:func:`~tileplug.backend_ascend.rows.row_loop` over tokens. Per token: one strided DMA brings
all ``N`` heads of ``x`` into UB (one head per UB row) and the token's cache row comes in
(:func:`~tileplug.backend_ascend.rope.rotation.load_cache_row`); one ``T.SimdVF`` region
normalizes each head exactly as the Ascend ``rms_norm`` does a row (the same macros, the same
order: fixed-order fp32 sum over the true ``D``, correctly rounded rstd, ``y`` rounded to
``x.dtype`` and written over the head), then rotates the first ``R`` channels of the rounded
``y`` exactly as ``apply_rotary`` does (the same rotation macro; NeoX partners are the same row
``R/2`` further on); DMA of ``y`` out. The bytes are those of the Ascend chain
``apply_rotary(rms_norm(x))``, with ``y`` never leaving UB in between.

``rms_norm_rope_per_token_cast``: after the rotation, the same ``T.SimdVF`` region casts each
head row of the rotated ``y`` with the shared row cast
(:func:`tileplug.backend_ascend.quant.row_cast.row_cast`, the macros of the Ascend
``per_token_cast`` and ``rms_norm_per_token_cast``), head ``h``'s groups numbered from
``h · D / g`` as the rows of ``y.view(T, N·D)`` number them, so the bytes are those of the Ascend
chain ``per_token_cast(rms_norm_rope(x).view(T, N·D))``. ``q`` is written through its
``[T, N, D]`` view.

Served: NeoX and GPT-J with ``R`` a multiple of 128 (rotation registers then never reach past
``R``, and the NeoX second half starts on a register boundary); the cast: e4m3, groups that
divide ``D`` (no group spans two heads), plain or power-of-two fp32 scales, row- or
column-major, ``return_unquantized``.
"""

from dataclasses import dataclass

import tilelang.ascend.language as T

from tileplug.backend_ascend import gm, rows
from tileplug.backend_ascend.device import lowering_target
from tileplug.backend_ascend.kernel import SpecKernel
from tileplug.backend_ascend.quant.row_cast import cast_key, cast_tensors, fused_cast_decline, row_cast, store_cast
from tileplug.backend_ascend.rope.rotation import PAIR_BLOCK, cache_parameters, load_cache_row, rotation
from tileplug.backend_ascend.rope.spec import DTYPE_NAMES, POSITION_NAMES
from tileplug.backend_ascend.ub import LANES, PlannedInSimdUb, VERSIONS, padded, sf_rows


@dataclass(frozen=True)
class NormRopeSpec(PlannedInSimdUb):
    """What an ``rms_norm_rope`` kernel is specialised on: ``heads`` N, ``head_dim`` D,
    ``rotary_dim`` R, ``dtype`` of ``x`` / ``y``, ``weight_dtype``, ``eps``, ``weight_offset``,
    ``interleaved`` (GPT-J), ``positions`` ("int32" / "int64" / None); ``cast``: the per-token
    cast of ``rms_norm_rope_per_token_cast`` as ``(fmt, group, round_sf, clamp_min, col_major)``
    (None: ``rms_norm_rope``), ``unquantized``: ``y`` is written too."""

    heads: int
    head_dim: int
    rotary_dim: int
    dtype: str
    weight_dtype: str
    eps: float
    weight_offset: float
    interleaved: bool
    positions: str | None
    cast: tuple | None = None
    unquantized: bool = False
    vector_cores: int = 64
    num_buffers: int = VERSIONS

    @property
    def half(self) -> int:
        return self.rotary_dim // 2

    @property
    def groups(self) -> int:
        """Cast groups of a token (``N·D / g``; 0 without a cast)."""
        return self.heads * self.head_dim // self.cast[1] if self.cast is not None else 0

    @property
    def writes_y(self) -> bool:
        return self.cast is None or self.unquantized

    def plan(self):
        """UB buffers: ``x_ub`` the token's heads (one per row, ``y`` written over them),
        ``cos_ub`` / ``sin_ub`` its cache row, ``w_ub`` (and ``w_raw``) the weight factor; with a
        cast, ``q_ub`` the token's codes (one head per row) and ``sf_ub`` its group scales."""
        width, versions = padded(self.head_dim), self.num_buffers
        plan = {"x_ub": ((self.heads, width), self.dtype, versions),
                "cos_ub": ((padded(self.half),), "float32", versions),
                "sin_ub": ((padded(self.half),), "float32", versions),
                "w_ub": ((width,), "float32", 1)}
        if self.weight_dtype != "float32":
            plan["w_raw"] = ((width,), self.weight_dtype, 1)
        if self.cast is not None:
            plan["q_ub"] = ((self.heads, width), "float8_e4m3fn", versions)
            plan["sf_ub"] = ((sf_rows(self.groups),), "float32", versions)
        return plan

    @property
    def layout(self) -> str:
        return "one token per pipeline step (all its heads and its cache row in UB)"

    def describe(self) -> str:
        name = "rms_norm_rope" if self.cast is None else "rms_norm_rope_per_token_cast"
        text = (f"{name} [T, {self.heads}, {self.head_dim}] {self.dtype} R={self.rotary_dim} "
                f"weight={self.weight_dtype} {'gptj' if self.interleaved else 'neox'} positions={self.positions} "
                f"eps={self.eps!r} offset={self.weight_offset!r}")
        if self.cast is None:
            return text
        fmt, group, round_sf, clamp_min, col_major = self.cast
        return (f"{text} cast={fmt}/1x{group}{'/round_sf' if round_sf else ''}{'/col_major' if col_major else ''}"
                f"/clamp={clamp_min!r}{' +y' if self.unquantized else ''}")


def spec_of(call, target=None) -> NormRopeSpec:
    """The kernel specialisation of ``call`` on ``target`` (default: the lowering stand-in)."""
    return NormRopeSpec(
        heads=call.heads, head_dim=call.head_dim, rotary_dim=call.rotary_dim, dtype=DTYPE_NAMES[call.dtype],
        weight_dtype=DTYPE_NAMES[call.weight_dtype], eps=call.eps, weight_offset=call.weight_offset,
        interleaved=call.interleaved, positions=POSITION_NAMES[call.positions_dtype],
        cast=cast_key(call.quant) if call.quant is not None else None, unquantized=call.return_unquantized,
        vector_cores=(target or lowering_target()).vector_cores,
    )


def decline_reason(call) -> str | None:
    """Why the Ascend ``rms_norm_rope`` kernel cannot serve ``call`` (None: it can)."""
    for name, dtype in (("x", call.dtype), ("weight", call.weight_dtype)):
        if dtype not in DTYPE_NAMES:
            return f"{name} dtype {dtype} is not served on Ascend (bf16 / fp16 / fp32; falls to the reference)"
    if call.rotary_dim % PAIR_BLOCK:
        return (f"R = {call.rotary_dim}: the fused norm + rotation needs R a multiple of {PAIR_BLOCK} (its rotation "
                "registers would reach past R); falls to the reference")
    if call.quant is not None:
        if call.head_dim % call.cast.block[1]:
            return (f"num_per_channels = {call.cast.block[1]} does not divide D = {call.head_dim}: a cast group would "
                    "span two heads, which the per-head fused kernel does not form; falls to the reference")
        why = fused_cast_decline(call.quant)
        if why is not None:
            return why
    spec = spec_of(call)
    if spec.footprint > spec.budget:
        return (f"{call.heads} heads x D = {call.head_dim}: one token needs {spec.footprint} bytes of UB > "
                f"{spec.budget} per vector core; falls to the reference")
    return None


def parameters(spec: NormRopeSpec):
    """``(name, type)`` of the GM parameters in launch order, and the token count symbol."""
    tokens = T.dynamic("T")
    D, N = spec.head_dim, spec.heads
    params = [("X", gm.rows_tensor("x", D, N, spec.dtype, tokens)), ("W", T.Tensor((D,), spec.weight_dtype))]
    params += cache_parameters(spec.rotary_dim, spec.positions, False, None, None, tokens)
    if spec.writes_y:
        params.append(("Y", gm.rows_tensor("y", D, N, spec.dtype, tokens)))
    if spec.cast is not None:  # q through its [T, N, D] view; column-major scales as their [groups, T] transpose
        params += cast_tensors(tokens, (tokens, N, D), spec.groups, spec.cast[4])
    return params, tokens


def square(v):
    return T.simd.vmul(v, v)


def token_compute(spec: NormRopeSpec):
    """The per-token vector work: every head normalized in place, then rotated, then (with a
    cast) each head row cast, its groups numbered on from the previous head's."""
    D, dt, N = spec.head_dim, spec.dtype, spec.heads
    rotate = rotation(dt, spec.half, spec.interleaved, False)
    cast_row = row_cast(spec.cast, D, dt) if spec.cast is not None else None
    head_groups = D // spec.cast[1] if spec.cast is not None else 0

    @T.macro
    def compute(buffers, valid):
        x_ub, w_ub = buffers["x_ub"], buffers["w_ub"]
        with T.SimdVF():
            for h in T.serial(N):
                rstd = rows.rsqrt_plus(rows.mean_of(rows.row_sum(x_ub, dt, D, square, h), D), spec.eps)
                rstd_all = T.simd.vdupv(rstd)
                for c in T.serial(rows.registers(D)):
                    normalized = T.simd.vmul(rows.load_f32(x_ub, (h, c * LANES), dt), rstd_all)
                    rows.store_rounded(x_ub, (h, c * LANES), T.simd.vmul(normalized, T.simd.vld(w_ub[c * LANES])), dt)
            T.simd.mem_bar("VST_VLD")
            rotate.rotate_heads(x_ub, x_ub, spec.half, N, buffers["cos_ub"], buffers["sin_ub"], valid)
            if spec.cast is not None:
                T.simd.mem_bar("VST_VLD")
                for h in T.serial(N):
                    cast_row(x_ub, buffers["q_ub"], buffers["sf_ub"], h, h * head_groups)

    return compute


def build(spec: NormRopeSpec):
    """The prim_func of ``spec``; raises ``UBBudgetError`` when its plan does not fit the budget."""
    rows.check_budget(spec.footprint, spec.budget, spec.describe())
    params, tokens = parameters(spec)
    plan = spec.plan()
    names = tuple(plan)
    C, D, N = spec.vector_cores, spec.head_dim, spec.heads
    raw = "w_raw" if "w_raw" in plan else "w_ub"
    compute = token_compute(spec)
    load_cache = load_cache_row(spec.positions, False, spec.half, spec.rotary_dim)
    store_scales = store_cast(spec.groups, spec.cast[4]) if spec.cast is not None else None

    @T.macro
    def one_token(G, buffers, t):
        valid = load_cache(G, buffers["cos_ub"], buffers["sin_ub"], t, None)
        T.copy(G["X"][t, 0:N, 0:D], buffers["x_ub"][0:N, 0:D])
        compute(buffers, valid)
        if spec.writes_y:
            T.copy(buffers["x_ub"][0:N, 0:D], G["Y"][t, 0:N, 0:D])
        if spec.cast is not None:
            T.copy(buffers["q_ub"][0:N, 0:D], G["Q"][t, 0:N, 0:D])
            store_scales(G, buffers["sf_ub"], t, 0)

    def norm_rope_kernel(tensors):
        G = gm.declare(tensors)
        with T.Kernel(C) as cid:
            buffers = {name: T.alloc_shared(plan[name][0], plan[name][1]) for name in names}
            versions = {buffers[name]: plan[name][2] for name in names if plan[name][2] > 1}
            T.copy(G["W"][0:D], buffers[raw][0:D])
            rows.prepare_vector(buffers[raw], buffers["w_ub"], spec.weight_dtype, D, spec.weight_offset, 1.0)
            for it in rows.row_loop(T.ceildiv(tokens - cid, C), versions, spec.num_buffers):
                one_token(G, buffers, cid + it * C)

    return gm.prim_func(norm_rope_kernel, params)


def arguments(spec: NormRopeSpec, inputs, outputs) -> list:
    """Launch arguments in the prim_func's parameter order (an empty cache as one NaN row, as
    :func:`tileplug.backend_ascend.rope.apply_rotary.arguments` does; ``q`` as ``[T, N, D]``,
    column-major scales as their ``[groups, T]`` transpose)."""
    import torch

    cache = inputs.cos_sin_cache
    if cache.shape[0] == 0:
        cache = torch.full((1, cache.shape[1]), float("nan"), dtype=cache.dtype, device=cache.device)
    values = {"X": inputs.x, "W": inputs.weight, "CS": cache, "P": inputs.positions, "offset": inputs.seqlen_offset,
              "Y": outputs.y}
    if spec.cast is not None:
        values["Q"] = outputs.q.view(outputs.q.shape[0], spec.heads, spec.head_dim)
        values["SF"] = outputs.sf.t() if spec.cast[4] else outputs.sf
    return [values[name] for name in gm.argument_names(parameters(spec)[0])]


KERNEL = SpecKernel("rms_norm_rope", spec_of, decline_reason, build, arguments)
