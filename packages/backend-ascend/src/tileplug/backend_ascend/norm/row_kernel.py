"""The pipelined row kernel both forward norms are built on (``rms_norm.py``, ``layer_norm.py``
supply the per-row vector work).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

Per vector core ``cid`` of ``T.Kernel(C)``: once, DMA the weight (and bias) into UB and turn
them into fp32 factors in a ``T.SimdVF`` region; then one :func:`~tileplug.backend_ascend.rows.row_loop`
over rows ``cid, cid + C, ...`` of the ``rows`` (``T`` or ``T·N``, ``T`` dynamic): DMA the row
of ``x`` (and ``residual``) GM -> UB, the op's vector work (one ``T.SimdVF`` region: it writes
``y`` over the row of ``x`` and ``residual_out`` over the row of ``residual``), DMA ``y``,
``residual_out`` and the statistics UB -> GM. Only the row's own values are read: a row never
sees a neighbour row or padding in its reduction.

GM parameters, in order (those the call has): ``X``, ``W``, ``B``, ``R``, ``Y``, ``RO``,
``MEAN``, ``RSTD``; row tensors take their strides as dynamic symbols, so ``out=x`` /
``residual_out=residual`` (in place) and any row stride are read and written directly.
"""

import tilelang.ascend.language as T

from tileplug.backend_ascend import gm, rows
from tileplug.backend_ascend.norm.spec import NormSpec
from tileplug.backend_ascend.quant import row_cast


def parameters(spec: NormSpec):
    """``(name, tensor type)`` of the kernel's GM tensors, in launch order."""
    Tn = T.dynamic("T")
    D, N, dt = spec.hidden, spec.heads, spec.in_dtype
    stat_shape = (Tn,) if N is None else (Tn, N)
    params = [("X", gm.rows_tensor("x", D, N, dt, Tn))]
    if spec.weight_dtype is not None:
        params.append(("W", T.Tensor((D,), spec.weight_dtype)))
    if spec.bias_dtype is not None:
        params.append(("B", T.Tensor((D,), spec.bias_dtype)))
    if spec.residual:
        params.append(("R", gm.rows_tensor("r", D, N, dt, Tn)))
    if spec.cast is None or spec.unquantized:
        params.append(("Y", gm.rows_tensor("y", D, N, dt, Tn)))
    if spec.residual:
        params.append(("RO", gm.rows_tensor("ro", D, N, dt, Tn)))
    if spec.cast is not None:  # column-major scales are passed as their [groups, T] transpose
        params += row_cast.cast_tensors(Tn, (Tn, D), spec.groups, spec.cast[4])
    if spec.stats and spec.kind == "layer":
        params.append(("MEAN", T.Tensor(stat_shape, "float32")))
    if spec.stats:
        params.append(("RSTD", T.Tensor(stat_shape, "float32")))
    return params, Tn


def _alloc(plan, name):
    if name not in plan:
        return None
    shape, dtype, _ = plan[name]
    return T.alloc_shared(shape, dtype)


def _vector_source(plan, name):
    """The UB buffer a GM vector is DMA'd into: its ``*_raw`` buffer when it needs converting."""
    return name + "_raw" if name + "_raw" in plan else name + "_ub"


def build(spec: NormSpec, row_compute):
    """The prim_func of ``spec``, its per-row vector work made by ``row_compute(spec)`` (a macro
    ``compute(buffers)`` over the UB buffers by plan name); raises ``UBBudgetError`` when the
    plan does not fit the budget (TileLang would lower it silently)."""
    rows.check_budget(spec.footprint, spec.budget, spec.describe())
    params, Tn = parameters(spec)
    plan = spec.plan()
    names = tuple(plan)
    D, N, C = spec.hidden, spec.heads, spec.vector_cores
    count = Tn if N is None else Tn * N
    has_w, has_b = spec.weight_dtype is not None, spec.bias_dtype is not None
    rms = spec.kind == "rms"
    writes_y = spec.cast is None or spec.unquantized
    compute = row_compute(spec)
    store_scales = row_cast.store_cast(spec.groups, spec.cast[4]) if spec.cast is not None else None

    @T.macro
    def prepare(G, buffers):
        if has_w:
            T.copy(G["W"][0:D], buffers[_vector_source(plan, "w")][0:D])
            if rms:
                rows.prepare_vector(buffers[_vector_source(plan, "w")], buffers["w_ub"], spec.weight_dtype, D,
                                    spec.weight_offset, spec.out_scale)
            else:
                rows.prepare_vector(buffers[_vector_source(plan, "w")], buffers["w_ub"], spec.weight_dtype, D, None,
                                    None)
        if has_b:
            T.copy(G["B"][0:D], buffers[_vector_source(plan, "b")][0:D])
            rows.prepare_vector(buffers[_vector_source(plan, "b")], buffers["b_ub"], spec.bias_dtype, D, None, None)

    @T.macro
    def one_row(G, buffers, row):
        x_ub = buffers["x_ub"]
        T.copy(gm.row_of(G["X"], N, row, 0, D), x_ub[0:D])
        if spec.residual:
            T.copy(gm.row_of(G["R"], N, row, 0, D), buffers["r_ub"][0:D])
        compute(buffers)
        if spec.residual:
            T.copy(buffers["r_ub"][0:D], gm.row_of(G["RO"], N, row, 0, D))
        if writes_y:
            T.copy(x_ub[0:D], gm.row_of(G["Y"], N, row, 0, D))
        if spec.cast is not None:
            T.copy(buffers["q_ub"][0:D], G["Q"][row, 0:D])
            store_scales(G, buffers["sf_ub"], row, 0)
        if spec.stats and not rms:
            T.copy(buffers["mean_ub"][0:1], gm.statistic_of(G["MEAN"], N, row))
        if spec.stats:
            T.copy(buffers["rstd_ub"][0:1], gm.statistic_of(G["RSTD"], N, row))

    def norm_kernel(tensors):
        G = gm.declare(tensors)
        with T.Kernel(C) as cid:
            buffers = {name: _alloc(plan, name) for name in names}
            versions = {buffers[name]: plan[name][2] for name in names if plan[name][2] > 1}
            prepare(G, buffers)
            for it in rows.row_loop(T.ceildiv(count - cid, C), versions, spec.num_buffers):
                one_row(G, buffers, cid + it * C)

    return gm.prim_func(norm_kernel, params)


_ARGUMENTS = {
    "X": lambda inputs, outputs: inputs.x,
    "W": lambda inputs, outputs: inputs.weight,
    "B": lambda inputs, outputs: inputs.bias,
    "R": lambda inputs, outputs: inputs.residual,
    "Y": lambda inputs, outputs: outputs.y,
    "RO": lambda inputs, outputs: outputs.residual_out,
    "MEAN": lambda inputs, outputs: outputs.mean,
    "RSTD": lambda inputs, outputs: outputs.rstd,
    "Q": lambda inputs, outputs: outputs.q,
    "SF": lambda inputs, outputs: outputs.sf,
}


def arguments(spec: NormSpec, inputs, outputs) -> list:
    """Launch arguments of ``spec``'s prim_func, in its parameter order (column-major scales
    as their ``[groups, T]`` transpose, unit last stride)."""
    values = [_ARGUMENTS[name](inputs, outputs) for name in gm.argument_names(parameters(spec)[0])]
    if spec.cast is not None and spec.cast[4]:
        values[-1] = values[-1].t()
    return values


def kernel(op: str, build):
    """The tileplug Kernel of forward norm ``op`` built by ``build(spec)``."""
    from tileplug.backend_ascend.kernel import SpecKernel
    from tileplug.backend_ascend.norm.spec import decline_reason, spec_of

    return SpecKernel(op, spec_of, decline_reason, build, arguments)
