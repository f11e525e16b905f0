"""Ascend kernel of ``moe_unpermute`` (SPEC §7): ``y[t] = Σ_slots w[t, slot] ·
y_expanded[permutation[t, slot]]``, each product and each sum in fp32, slot after slot,
rounded once to y_expanded's dtype; slots whose row is outside ``[0, R)`` are skipped.

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

``T.Kernel(C)``; one :func:`~tileplug.backend_ascend.rows.row_loop` (``T.Pipelined``, every
per-item buffer double-buffered) over the items ``(token, column tile)`` of vector core
``cid``: tokens ``cid, cid + C, ...``, each in ``ceil(H / W)`` tiles of ``W`` columns (the
last tile starts at ``H − W``, so every DMA has the static width ``W``; columns two tiles
share are computed identically and written with the same bytes). Per item:

1. DMA the token's permutation row (int32 words; int64 as word pairs) and weight row into UB;
   for each slot the row is read from GM as a scalar (the DMA source address), replaced by row
   0 when it is outside ``[0, R)`` (that row is read and its values discarded, below), and its
   ``W`` columns DMA'd into the slot's UB row;
2. one ``T.SimdVF`` region: each slot's weight and validity flag taken out of their registers
   exactly and broadcast into UB; then per 64-column register ``acc = +0``, and slot after slot
   ``acc = valid ? acc + w · y : acc`` (``vmul`` then ``vadd``, two roundings, as the
   reference), rounded once to the dtype on store; DMA out.

Exact slot order, so within the 1 ulp SPEC §7 allows, and bytewise equal to the reference
wherever the hardware's fp32 ``vmul`` / ``vadd`` are IEEE (no FMA: separate instructions).
"""

from dataclasses import dataclass

import tilelang.ascend.language as T

from tileplug.backend_ascend import gm, rows
from tileplug.backend_ascend.device import DeviceTarget, lowering_target
from tileplug.backend_ascend.moe.index_rows import TopkIndexRows
from tileplug.backend_ascend.moe.normalize_weight import neg_zero
from tileplug.backend_ascend.moe.topk_gate import neg_inf
from tileplug.backend_ascend.ub import LANES, Plan, PlannedInSimdUb, VERSIONS, padded, widest_tile

F32 = "float32"
DTYPE_NAMES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}
INDEX_DTYPES = {"torch.int32": "int32", "torch.int64": "int64"}
MAX_SLOTS = 32
"""Widest permutation served (one UB row per slot and column tile)."""
MAX_TILE = 4096
"""Widest column tile (elements)."""


@dataclass(frozen=True)
class UnpermuteSpec(TopkIndexRows, PlannedInSimdUb):
    """What the ``moe_unpermute`` kernel is specialised on: ``hidden`` H, ``dtype`` of the rows,
    ``slots`` K, ``index_dtype`` of the permutation, the column tile ``width`` W, the
    vector-core count and the buffer versions."""

    hidden: int
    dtype: str
    slots: int
    index_dtype: str
    width: int
    vector_cores: int = 64
    num_buffers: int = VERSIONS


    @property
    def tiles(self) -> int:
        return -(-self.hidden // self.width)

    def plan(self) -> Plan:
        """``p_ub`` the permutation row (int32 words), ``w_ub`` the weight row, ``y_ub`` the
        slots' rows of one column tile, ``o_ub`` the output tile, ``b_ub`` the broadcast weights
        and validity flags."""
        versions, width = self.num_buffers, padded(self.width)
        return {
            "p_ub": ((padded(self.words),), "int32", versions),
            "w_ub": ((padded(self.slots),), F32, versions),
            "y_ub": ((self.slots * width,), self.dtype, versions),
            "o_ub": ((width,), self.dtype, versions),
            "b_ub": ((2 * self.slots * LANES,), F32, 1),
        }

    @property
    def layout(self) -> str:
        return (f"one (token, {self.width}-column tile) per pipeline step, {self.tiles} tile(s) per token; "
                "the slots' rows DMA'd by their GM row index")

    def describe(self) -> str:
        return (f"moe_unpermute [R, {self.hidden}] {self.dtype} K={self.slots} permutation={self.index_dtype} "
                f"W={self.width}")


def tile_width(hidden: int, dtype: str, slots: int) -> int:
    """The widest column tile (the whole row, else a multiple of 64 columns, at most
    :data:`MAX_TILE`) whose double-buffered plan fits the budget."""
    def fits(width: int) -> bool:
        probe = UnpermuteSpec(hidden=width, dtype=dtype, slots=slots, index_dtype="int64", width=width)
        return probe.footprint <= probe.budget

    return widest_tile(hidden, MAX_TILE, fits)


def spec_of(call, target: DeviceTarget | None = None) -> UnpermuteSpec:
    cores = (target or lowering_target()).vector_cores
    dtype = DTYPE_NAMES[str(call.dtype)]
    return UnpermuteSpec(hidden=call.hidden, dtype=dtype, slots=call.num_slots,
                         index_dtype=INDEX_DTYPES[str(call.permutation_dtype)],
                         width=tile_width(call.hidden, dtype, call.num_slots), vector_cores=cores)


def decline_reason(call) -> str | None:
    """Why the Ascend ``moe_unpermute`` kernel cannot serve ``call`` (None: it can)."""
    if str(call.dtype) not in DTYPE_NAMES:
        return f"y_expanded dtype {call.dtype} is not served on Ascend; falls to the reference"
    if str(call.permutation_dtype) not in INDEX_DTYPES:
        return f"permutation dtype {call.permutation_dtype} is not served on Ascend; falls to the reference"
    if call.num_slots == 0:
        return "K = 0 slots: y is zeros, nothing to launch on Ascend; falls to the reference"
    if call.num_slots > MAX_SLOTS:
        return f"K = {call.num_slots} > {MAX_SLOTS} slots is not served on Ascend; falls to the reference"
    spec = spec_of(call)
    if spec.footprint > spec.budget:
        return f"UB plan needs {spec.footprint} bytes > {spec.budget}; falls to the reference"
    return None


def unpermute_compute(spec: UnpermuteSpec, rows_total):
    """The per-item vector work of ``spec`` (a macro over the UB buffers by plan name);
    ``rows_total`` is R. Looked up by :func:`build` at trace time."""
    K, dt = spec.slots, spec.dtype
    step = 2 if spec.index_dtype == "int64" else 1
    width = padded(spec.width)
    nreg = rows.registers(spec.width)

    @T.macro
    def compute(buffers):
        p_ub, w_ub, y_ub, o_ub, b_ub = (buffers[n] for n in ("p_ub", "w_ub", "y_ub", "o_ub", "b_ub"))
        with T.SimdVF():
            ninf = neg_inf()
            nz = neg_zero()
            one = T.simd.vdup(T.float32(1.0), F32)
            zero = T.simd.vdup(T.float32(0.0), F32)
            lanes = T.simd.vci(T.float32(0.0), F32)
            words = T.simd.vld(p_ub[0])
            in_range = T.simd.vsel(T.simd.vsel(one, zero, T.simd.vcmps(words, T.int32(0), op="ge")), zero,
                                   T.simd.vcmps(words, T.Cast("int32", rows_total), op="lt"))
            high_zero = T.simd.vsel(one, zero, T.simd.vcmps(words, T.int32(0), op="eq"))
            weights = T.simd.vld(w_ub[0])
            position = T.simd.alloc_var(F32)
            position = T.simd.vdup(T.float32(0.0), F32)
            slot = T.simd.alloc_var(F32)
            slot = T.simd.vdup(T.float32(0.0), F32)
            for j in T.serial(K):
                flag = T.simd.vdupv(T.simd.vcmax(T.simd.vsel(in_range, ninf, T.simd.vcmp(lanes, position, op="eq"))))
                if step == 2:
                    high = T.simd.vdupv(T.simd.vcmax(T.simd.vsel(
                        high_zero, ninf, T.simd.vcmp(lanes, T.simd.vadds(position, T.float32(1.0)), op="eq"))))
                    T.simd.vsts(b_ub[(2 * j + 1) * LANES], T.simd.vmul(flag, high))
                else:
                    T.simd.vsts(b_ub[(2 * j + 1) * LANES], flag)
                w = T.simd.vdupv(T.simd.vcadd(T.simd.vsel(weights, nz, T.simd.vcmp(lanes, slot, op="eq"))))
                T.simd.vsts(b_ub[2 * j * LANES], w)
                position = T.simd.vadds(position, T.float32(step))
                slot = T.simd.vadds(slot, T.float32(1.0))
            T.simd.mem_bar("VST_VLD")
            for c in T.serial(nreg):
                acc = T.simd.alloc_var(F32)
                acc = zero
                for j in T.serial(K):
                    value = rows.load_f32(y_ub, j * width + c * LANES, dt)
                    product = T.simd.vmul(T.simd.vld(b_ub[2 * j * LANES]), value)
                    valid = T.simd.vcmps(T.simd.vld(b_ub[(2 * j + 1) * LANES]), T.float32(0.5), op="gt")
                    acc = T.simd.vsel(T.simd.vadd(acc, product), acc, valid)
                rows.store_rounded(o_ub, c * LANES, acc, dt)

    return compute


def parameters(spec: UnpermuteSpec):
    """``(name, tensor type)`` of the GM tensors, in launch order: ``Y`` y_expanded ``[R, H]``
    (any row stride), ``P`` the int32 words of the permutation, ``WT`` the weights, ``O`` y."""
    Tn, Rn = T.dynamic("T"), T.dynamic("R")
    return [
        ("Y", T.StridedTensor((Rn, spec.hidden), (T.dynamic("y_s0"), 1), spec.dtype)),
        ("P", T.Tensor((Tn, spec.words), "int32")),
        ("WT", T.Tensor((Tn, spec.slots), F32)),
        ("O", T.Tensor((Tn, spec.hidden), spec.dtype)),
    ], Tn, Rn


def build(spec: UnpermuteSpec):
    """The prim_func of ``spec`` (UB budget checked)."""
    rows.check_budget(spec.footprint, spec.budget, spec.describe())
    params, Tn, Rn = parameters(spec)
    plan = spec.plan()
    H, W, K, C, tiles = spec.hidden, spec.width, spec.slots, spec.vector_cores, spec.tiles
    step = 2 if spec.index_dtype == "int64" else 1
    width = padded(W)
    compute = unpermute_compute(spec, Rn)

    def unpermute_kernel(tensors):
        G = gm.declare(tensors)
        with T.Kernel(C) as cid:
            buffers, versions = rows.plan_buffers(plan)
            for it in rows.row_loop(T.ceildiv(Tn - cid, C) * tiles, versions, spec.num_buffers):
                token = cid + (it // tiles) * C
                start = T.min((it % tiles) * W, H - W)
                T.copy(G["P"][token, 0:spec.words], buffers["p_ub"][0:spec.words])
                T.copy(G["WT"][token, 0:K], buffers["w_ub"][0:K])
                for j in T.serial(K):
                    low = G["P"][token, j * step]
                    if step == 2:
                        source = T.if_then_else(T.And(T.And(low >= 0, low < Rn), G["P"][token, j * step + 1] == 0),
                                                low, 0)
                        T.copy(G["Y"][source, start:start + W], buffers["y_ub"][j * width:j * width + W])
                    else:
                        source = T.if_then_else(T.And(low >= 0, low < Rn), low, 0)
                        T.copy(G["Y"][source, start:start + W], buffers["y_ub"][j * width:j * width + W])
                compute(buffers)
                T.copy(buffers["o_ub"][0:W], G["O"][token, start:start + W])

    return gm.prim_func(unpermute_kernel, params)


def arguments(spec: UnpermuteSpec, inputs, outputs) -> list:
    """Launch arguments: y_expanded, the int32 view of the permutation, the weights, y."""
    import torch

    permutation = inputs.permutation.contiguous().view(torch.int32)
    return [inputs.y_expanded, permutation, inputs.topk_weights.contiguous(), outputs.y]


def _kernel():
    from tileplug.backend_ascend.kernel import SpecKernel

    class UnpermuteKernel(SpecKernel):
        """``moe_unpermute``: an empty ``y_expanded`` (R = 0) leaves every slot skipped: y is zeros."""

        def __call__(self, call, inputs, outputs) -> None:
            if inputs.y_expanded.shape[0] == 0:
                outputs.y.zero_()
                return
            super().__call__(call, inputs, outputs)

    return UnpermuteKernel("moe_unpermute", spec_of, decline_reason, build, arguments)


KERNEL = _kernel()
