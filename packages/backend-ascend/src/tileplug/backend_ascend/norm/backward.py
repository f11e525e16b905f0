"""The two kernels both norm backward ops run (``rms_norm_backward.py``, ``layer_norm_backward.py``
supply the per-row vector work), their specialisations, and what they decline.

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

**Row kernel** (:func:`build_rows`). ``T.Kernel(PARTIALS)``: block ``p`` takes the rows
``p, p + PARTIALS, p + 2·PARTIALS, ...`` of the ``rows`` (``T`` or ``T·N``, ``T`` dynamic) in
one :func:`~tileplug.backend_ascend.rows.row_loop` (pipelined, cross-stage buffers double
buffered): DMA the rows of ``grad_y``, ``x`` (the forward's normalized input ``s``),
``grad_residual_out`` and the row's ``rstd`` (and ``mean``) GM -> UB; one ``T.SimdVF`` region
computes ``grad_x`` (written over the ``grad_y`` row) and adds the row's weight / bias gradient
terms into fp32 accumulators that stay in UB for the whole loop; DMA ``grad_x`` out. After the
loop the block writes its accumulators as row ``p`` of the partial sums ``[PARTIALS, D]``.

**Column sum** (:func:`build_column_sum`). ``T.Kernel(ceil(D / W))``, ``W = min(COLUMN_BLOCK, D)``:
block ``b`` adds the ``PARTIALS`` partial rows of its ``W`` columns in partial order (a
pipelined loop over the partials) and writes the ``[D]`` gradient. The last block starts at
``D − W`` so that every DMA has the static width ``W``; columns two blocks share are computed
identically by both (the same values added in the same order) and written with the same bytes.

Deterministic and batch-invariant: ``PARTIALS`` is a constant of this module, not the device's
core count, and no atomics are used, so each gradient element is the sum of its rows' terms in
an order fixed by ``T`` alone (row order within a partial, then partial order) on every
device and run; ``grad_x`` of a row depends on that row alone. (The reference adds the rows in
a pairwise tree; the orders agree within SPEC §5's relative 1e-5.)

GM parameters of the row kernel, in order (those the call has): ``GY``, ``X``, ``W``, ``GR``,
``MEAN``, ``RSTD``, ``GX``, ``PW``, ``PB``; row tensors take their strides as dynamic symbols.
"""

from dataclasses import dataclass

import tilelang.ascend.language as T

from tileplug.backend_ascend import gm, rows
from tileplug.backend_ascend.device import DeviceTarget, dispatch_target, lowering_target
from tileplug.backend_ascend.kernel import SpecKernel, checked_lowering
from tileplug.backend_ascend.lowering import CompileCache
from tileplug.backend_ascend.norm.spec import DTYPE_NAMES
from tileplug.backend_ascend.ub import LANES, Plan, PlannedInSimdUb, VERSIONS, padded

PARTIALS = 64
"""Partial-sum rows of the weight / bias gradients: row ``r`` of the input adds into partial
``r % PARTIALS``. A constant (one wave on a 64-vector-core part), never the core count."""
COLUMN_BLOCK = 512
"""fp32 columns one block of the column sum adds (2 KiB per partial row)."""
KIND_OF_OP = {"rms_norm_backward": "rms", "layer_norm_backward": "layer"}


@dataclass(frozen=True)
class BackwardSpec(PlannedInSimdUb):
    """What a norm backward row kernel is specialised on: ``kind`` "rms" / "layer", ``hidden``
    D, ``heads`` N of a 3-D input (None: 2-D), ``in_dtype`` of ``grad_y`` / ``x`` / ``grad_x``,
    ``weight_dtype`` (None: no weight, no weight gradient), ``grad_residual`` (``grad_residual_out``
    added), ``weight_offset`` / ``out_scale`` (RMSNorm; rounded to fp32 in the kernel).
    ``vector_cores`` only heads the lowered source: the row split is :data:`PARTIALS`."""

    kind: str
    hidden: int
    heads: int | None
    in_dtype: str
    weight_dtype: str | None
    grad_residual: bool
    weight_offset: float = 0.0
    out_scale: float = 1.0
    vector_cores: int = 64
    num_buffers: int = VERSIONS

    @property
    def reduced(self) -> tuple:
        """The gradients summed over rows, as ``(partials parameter, accumulator, output field)``."""
        out = []
        if self.weight_dtype is not None:
            out.append(("PW", "gw_acc", "grad_weight"))
        if self.kind == "layer":
            out.append(("PB", "gb_acc", "grad_bias"))
        return tuple(out)

    def plan(self) -> Plan:
        """UB buffers: ``gy_ub`` a row of ``grad_y``, then ``grad_x`` written over it; ``x_ub`` a
        row of ``x``; ``gr_ub`` a row of ``grad_residual_out``; ``rstd_ub`` / ``mean_ub`` the
        row's statistics; ``w_ub`` the fp32 weight factor prepared once per block (``w_raw`` the
        weight as given, when it is not fp32); ``gw_acc`` / ``gb_acc`` the block's partial sums."""
        width, versions = padded(self.hidden), self.num_buffers
        plan: Plan = {"gy_ub": ((width,), self.in_dtype, versions), "x_ub": ((width,), self.in_dtype, versions)}
        if self.grad_residual:
            plan["gr_ub"] = ((width,), self.in_dtype, versions)
        if self.kind == "layer":
            plan["mean_ub"] = ((8,), "float32", versions)
        plan["rstd_ub"] = ((8,), "float32", versions)
        if self.weight_dtype is not None:
            plan["w_ub"] = ((width,), "float32", 1)
            if self.weight_dtype != "float32":
                plan["w_raw"] = ((width,), self.weight_dtype, 1)
        for _, accumulator, _ in self.reduced:
            plan[accumulator] = ((width,), "float32", 1)
        return plan

    @property
    def layout(self) -> str:
        return (f"one row per pipeline step, whole in UB; row r adds into partial r % {PARTIALS} "
                f"({PARTIALS} blocks, a constant)")

    def describe(self) -> str:
        shape = f"[T, {self.heads}, {self.hidden}]" if self.heads is not None else f"[T, {self.hidden}]"
        bits = [f"{self.kind}_norm_backward", shape, self.in_dtype, f"weight={self.weight_dtype}"]
        if self.grad_residual:
            bits.append("grad_residual")
        if self.weight_offset != 0.0 or self.out_scale != 1.0:
            bits.append(f"offset={self.weight_offset!r} scale={self.out_scale!r}")
        return " ".join(bits)


@dataclass(frozen=True)
class ColumnSumSpec(PlannedInSimdUb):
    """The column sum of ``partials`` fp32 ``[PARTIALS, hidden]`` into ``[hidden]``."""

    hidden: int
    vector_cores: int = 64
    num_buffers: int = VERSIONS

    @property
    def width(self) -> int:
        """Columns of one block (every DMA's static width)."""
        return min(COLUMN_BLOCK, self.hidden)

    @property
    def blocks(self) -> int:
        return -(-self.hidden // self.width)

    def plan(self) -> Plan:
        """UB buffers: ``part_ub`` one partial row's columns, ``sum_ub`` their running sum."""
        return {"part_ub": ((padded(self.width),), "float32", self.num_buffers),
                "sum_ub": ((padded(self.width),), "float32", 1)}

    @property
    def layout(self) -> str:
        return f"{self.blocks} block(s) of {self.width} columns, one partial row per pipeline step"

    def describe(self) -> str:
        return f"norm_column_sum [{PARTIALS}, {self.hidden}] float32"


def spec_of(call, target: DeviceTarget = None) -> BackwardSpec:
    """The row kernel's specialisation of a backward ``call`` (default target: the stand-in)."""
    return BackwardSpec(
        kind=KIND_OF_OP[call.op], hidden=call.hidden, heads=call.heads, in_dtype=DTYPE_NAMES[call.input_dtype],
        weight_dtype=DTYPE_NAMES.get(call.weight_dtype), grad_residual=call.grad_residual,
        weight_offset=call.weight_offset, out_scale=call.out_scale,
        vector_cores=(target or lowering_target()).vector_cores,
    )


def decline_reason(call):
    """Why the Ascend norm backward kernels cannot serve ``call`` (None: they can)."""
    for name, dtype in (("x", call.input_dtype), ("weight", call.weight_dtype)):
        if dtype is not None and dtype not in DTYPE_NAMES:
            return f"{name} dtype {dtype} is not served on Ascend (bf16 / fp16 / fp32; fp64 falls to the reference)"
    spec = spec_of(call)
    if spec.footprint > spec.budget:
        return (f"D = {call.hidden}: the backward row kernel needs {spec.footprint} bytes of UB > {spec.budget} per "
                "vector core (no split-row form on Ascend); falls to the reference")
    return None


# ---------------------------------------------------------------------- the row kernel


@T.macro
def store_partial(accumulator, partials, block, width):
    """Row ``block`` of ``partials`` := the block's accumulator (a plain store: each block owns its
    row). Looked up at trace time; tests/ascend_bad_kernels.py replaces it with an atomic add
    into one shared row to show the determinism check failing."""
    T.copy(accumulator[0:width], partials[block, 0:width])


def parameters(spec: BackwardSpec):
    """``(name, tensor type)`` of the row kernel's GM tensors, in launch order."""
    Tn = T.dynamic("T")
    D, N, dt = spec.hidden, spec.heads, spec.in_dtype
    stat_shape = (Tn,) if N is None else (Tn, N)
    params = [("GY", gm.rows_tensor("gy", D, N, dt, Tn)), ("X", gm.rows_tensor("x", D, N, dt, Tn))]
    if spec.weight_dtype is not None:
        params.append(("W", T.Tensor((D,), spec.weight_dtype)))
    if spec.grad_residual:
        params.append(("GR", gm.rows_tensor("gr", D, N, dt, Tn)))
    if spec.kind == "layer":
        params.append(("MEAN", T.Tensor(stat_shape, "float32")))
    params.append(("RSTD", T.Tensor(stat_shape, "float32")))
    params.append(("GX", gm.rows_tensor("gx", D, N, dt, Tn)))
    for partials, _, _ in spec.reduced:
        params.append((partials, T.Tensor((PARTIALS, D), "float32")))
    return params, Tn


def build_rows(spec: BackwardSpec, row_compute):
    """The row kernel of ``spec``, its per-row vector work made by ``row_compute(spec)`` (a macro
    ``compute(buffers)`` over the UB buffers by plan name); raises ``UBBudgetError`` when the
    plan does not fit the budget."""
    rows.check_budget(spec.footprint, spec.budget, spec.describe())
    params, Tn = parameters(spec)
    plan = spec.plan()
    names = tuple(plan)
    D, N = spec.hidden, spec.heads
    count = Tn if N is None else Tn * N
    has_w = spec.weight_dtype is not None
    raw = "w_raw" if "w_raw" in plan else "w_ub"
    offset, scale = (spec.weight_offset, spec.out_scale) if spec.kind == "rms" else (None, None)
    accumulators = [accumulator for _, accumulator, _ in spec.reduced]
    compute = row_compute(spec)

    @T.macro
    def prepare(G, buffers):
        if has_w:
            T.copy(G["W"][0:D], buffers[raw][0:D])
            rows.prepare_vector(buffers[raw], buffers["w_ub"], spec.weight_dtype, D, offset, scale)
        with T.SimdVF():
            for accumulator in accumulators:
                for c in T.serial(rows.registers(D)):
                    T.simd.vsts(buffers[accumulator][c * LANES], T.simd.vdup(T.float32(0.0), "float32"))

    @T.macro
    def one_row(G, buffers, row):
        T.copy(gm.row_of(G["GY"], N, row, 0, D), buffers["gy_ub"][0:D])
        T.copy(gm.row_of(G["X"], N, row, 0, D), buffers["x_ub"][0:D])
        if spec.grad_residual:
            T.copy(gm.row_of(G["GR"], N, row, 0, D), buffers["gr_ub"][0:D])
        if spec.kind == "layer":
            T.copy(gm.statistic_of(G["MEAN"], N, row), buffers["mean_ub"][0:1])
        T.copy(gm.statistic_of(G["RSTD"], N, row), buffers["rstd_ub"][0:1])
        compute(buffers)
        T.copy(buffers["gy_ub"][0:D], gm.row_of(G["GX"], N, row, 0, D))

    def norm_backward_kernel(tensors):
        G = gm.declare(tensors)
        with T.Kernel(PARTIALS) as block:
            buffers = {name: T.alloc_shared(plan[name][0], plan[name][1]) for name in names}
            versions = {buffers[name]: plan[name][2] for name in names if plan[name][2] > 1}
            prepare(G, buffers)
            for it in rows.row_loop(T.ceildiv(count - block, PARTIALS), versions, spec.num_buffers):
                one_row(G, buffers, block + it * PARTIALS)
            for partials, accumulator, _ in spec.reduced:
                store_partial(buffers[accumulator], G[partials], block, D)

    return gm.prim_func(norm_backward_kernel, params)


# ---------------------------------------------------------------------- the column sum


def build_column_sum(spec: ColumnSumSpec):
    """The column sum of ``spec`` (UB budget checked)."""
    rows.check_budget(spec.footprint, spec.budget, spec.describe())
    D, W = spec.hidden, spec.width
    plan = spec.plan()

    @T.macro
    def add_partial(part_ub, sum_ub):
        with T.SimdVF():
            for c in T.serial(rows.registers(W)):
                total = T.simd.vadd(T.simd.vld(sum_ub[c * LANES]), T.simd.vld(part_ub[c * LANES]))
                T.simd.vsts(sum_ub[c * LANES], total)

    @T.prim_func
    def norm_column_sum(partials: T.Tensor((PARTIALS, D), "float32"), total: T.Tensor((D,), "float32")):
        with T.Kernel(spec.blocks) as block:
            part_ub = T.alloc_shared(plan["part_ub"][0], "float32")
            sum_ub = T.alloc_shared(plan["sum_ub"][0], "float32")
            start = T.min(block * W, D - W)
            with T.SimdVF():
                for c in T.serial(rows.registers(W)):
                    T.simd.vsts(sum_ub[c * LANES], T.simd.vdup(T.float32(0.0), "float32"))
            for it in rows.row_loop(PARTIALS, {part_ub: spec.num_buffers}, spec.num_buffers):
                T.copy(partials[it, start:start + W], part_ub[0:W])
                add_partial(part_ub, sum_ub)
            T.copy(sum_ub[0:W], total[start:start + W])

    return norm_column_sum


# ---------------------------------------------------------------------- the kernel object


def _row_arguments(spec: BackwardSpec, inputs, outputs, partials: dict) -> list:
    values = {"GY": inputs.grad_y, "X": inputs.x, "W": inputs.weight, "GR": inputs.grad_residual_out,
              "MEAN": inputs.mean, "RSTD": inputs.rstd, "GX": outputs.grad_x, **partials}
    return [values[name] for name in gm.argument_names(parameters(spec)[0])]


class BackwardKernel(SpecKernel):
    """A norm backward op: the row kernel, then one column sum per gradient summed over rows."""

    def __init__(self, op: str, row_compute) -> None:
        super().__init__(op, spec_of, decline_reason, lambda spec: build_rows(spec, row_compute), _row_arguments)
        self.column_sums = CompileCache(build_column_sum)

    def lowerings(self, call) -> list:
        """The row kernel's lowering and, when a gradient is summed over rows, the column sum's."""
        target = lowering_target()
        row_spec = self.spec_of(call, target)
        found = [self.lowering(call)]
        if row_spec.reduced:
            found.append(checked_lowering(ColumnSumSpec(call.hidden, row_spec.vector_cores), build_column_sum, target))
        return found

    def __call__(self, call, inputs, outputs) -> None:
        import torch

        spec = self.spec_of(call, dispatch_target(call.device))
        device = outputs.grad_x.device
        partials = {name: torch.empty((PARTIALS, spec.hidden), dtype=torch.float32, device=device)
                    for name, _, _ in spec.reduced}
        self.compiled.get(spec)(*_row_arguments(spec, inputs, outputs, partials))
        column_sum = self.column_sums.get(ColumnSumSpec(spec.hidden, spec.vector_cores))
        for name, _, field in spec.reduced:
            column_sum(partials[name], getattr(outputs, field))
