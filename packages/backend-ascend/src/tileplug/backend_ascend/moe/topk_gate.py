"""Ascend kernel of ``topk_gate`` (SPEC §7): the indices of each row's ``k`` largest fp32
scores, largest first, equal scores to the smaller index; a row holding an inf or a NaN
gives −1 in every slot (never an abort).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

Rows stream through UB in one :func:`~tileplug.backend_ascend.rows.row_loop` (``T.Pipelined``,
the score row and the index row double-buffered): vector core ``cid`` takes rows
``cid, cid + C, ...``. Per row, one ``T.SimdVF`` region over 64-lane fp32 registers:

1. the tail lanes of the last register (past the true ``E``) are set to −inf in UB, and the
   row's finiteness is taken as ``Σ (x − x)`` (0 for a finite row, NaN otherwise: the sum of
   a NaN or of ``inf − inf``), reduced by ``vcadd``;
2. ``k`` rounds, each of two passes over the row's registers: (a) the column taken in the
   previous round is set to −inf (in UB) and the lane-wise ``vmax`` of the row reduced by
   ``vcmax``; (b) the smallest column index whose value equals that maximum: a lane-wise
   ``vmin`` of the column ramp (``vci``) where ``vcmp`` finds the maximum, else 2²⁴, reduced by
   ``vcmin``. The index goes into lane ``j`` of an index register. Values compare as numbers
   (``−0.0 == +0.0``), a taken column is −inf and a finite row's maximum never is, so every
   round takes a new column and ties go to the smaller index at every place;
3. a non-finite row's index register becomes −1 everywhere; the register is converted to
   int32 and interleaved with its sign word (``vintlv``): the little-endian int64 indices,
   written as int32 pairs into the row of the ``[T, 2k]`` int32 view of ``topk_idx``.

Column indices are held as fp32 (exact below 2²⁴; ``E`` is at most :data:`MAX_EXPERTS`).
"""

from dataclasses import dataclass

import tilelang.ascend.language as T
from tvm import tirx

from tileplug.backend_ascend import gm, rows
from tileplug.backend_ascend.device import DeviceTarget, lowering_target
from tileplug.backend_ascend.ub import LANES, Plan, PlannedInSimdUb, VERSIONS, padded

F32 = "float32"
MAX_TOPK = 32
"""Slots one index register holds as int64 (64 int32 lanes = 32 int64 values)."""
MAX_EXPERTS = 16384
"""Largest E served: fp32 column indices are exact far beyond it; its double-buffered row is 128 KiB of UB."""
NOT_FOUND = 16777216.0
"""The ramp value of a lane that does not hold the maximum (2²⁴, past every column)."""


@dataclass(frozen=True)
class TopkSpec(PlannedInSimdUb):
    """Everything the ``topk_gate`` kernel is specialised on: ``experts`` E, ``topk`` k, the
    vector-core count and the buffer versions of the streamed rows."""

    experts: int
    topk: int
    vector_cores: int = 64
    num_buffers: int = VERSIONS

    def plan(self) -> Plan:
        """``s_ub``: a row of scores (padded to whole registers; its taken columns and tail
        lanes are overwritten with −inf); ``o_ub``: the row's indices as int32 pairs."""
        return {
            "s_ub": ((padded(self.experts),), F32, self.num_buffers),
            "o_ub": ((LANES,), "int32", self.num_buffers),
        }

    @property
    def layout(self) -> str:
        return "one row of scores per pipeline step, whole in UB; k max / min-index rounds in registers"

    def describe(self) -> str:
        return f"topk_gate [T, {self.experts}] float32 k={self.topk}"


def spec_of(call, target: DeviceTarget | None = None) -> TopkSpec:
    cores = (target or lowering_target()).vector_cores
    return TopkSpec(experts=call.num_experts, topk=call.num_topk, vector_cores=cores)


def decline_reason(call) -> str | None:
    """Why the Ascend ``topk_gate`` kernel cannot serve ``call`` (None: it can)."""
    if call.num_topk > MAX_TOPK:
        return (f"num_topk = {call.num_topk} > {MAX_TOPK}: one index register holds 32 int64 slots on Ascend; "
                "falls to the reference")
    if call.num_experts > MAX_EXPERTS:
        return f"E = {call.num_experts} > {MAX_EXPERTS} experts is not served on Ascend; falls to the reference"
    return None


def neg_inf():
    """An fp32 register of −inf in every lane (the bits 0xFF800000)."""
    return tirx.reinterpret("float32x64", T.simd.vdup(T.int32(-8388608), "int32"))


def ramp(c):
    """The fp32 column indices ``64c .. 64c + 63`` of register ``c``."""
    return T.simd.vci(T.Cast(F32, c * LANES), F32)


def select_compute(spec: TopkSpec):
    """The per-row vector work of ``spec`` (a macro over the row's two UB buffers). Looked up by
    :func:`build` at trace time; tests/ascend_bad_kernels.py replaces it with scalar code to
    show the vector check failing."""
    E, k = spec.experts, spec.topk
    full, tail = rows.chunks(E)
    nreg = rows.registers(E)

    @T.macro
    def compute(s_ub, o_ub):
        with T.SimdVF():
            ninf = neg_inf()
            if tail > 0:
                last = T.simd.vld(s_ub[full * LANES])
                T.simd.vsts(s_ub[full * LANES], T.simd.vsel(last, ninf, T.simd.update_mask(tail, 32)))
            T.simd.mem_bar("VST_VLD")
            nan_if_bad = rows.row_sum_at(E, lambda off: T.simd.vsub(T.simd.vld(s_ub[off]), T.simd.vld(s_ub[off])))
            finite = T.simd.vcmps(T.simd.vdupv(nan_if_bad), T.float32(0.0), op="eq")
            lanes = T.simd.vci(T.float32(0.0), F32)
            slot = T.simd.alloc_var(F32)
            slot = T.simd.vdup(T.float32(0.0), F32)
            taken = T.simd.alloc_var(F32)
            taken = T.simd.vdup(T.float32(-1.0), F32)
            found = T.simd.alloc_var(F32)
            found = T.simd.vdup(T.float32(-1.0), F32)
            for j in T.serial(k):
                best = T.simd.alloc_var(F32)
                best = ninf
                for c in T.serial(nreg):
                    v = T.simd.vsel(ninf, T.simd.vld(s_ub[c * LANES]), T.simd.vcmp(ramp(c), taken, op="eq"))
                    T.simd.vsts(s_ub[c * LANES], v)
                    best = T.simd.vmax(best, v)
                T.simd.mem_bar("VST_VLD")
                top = T.simd.vdupv(T.simd.vcmax(best))
                first = T.simd.alloc_var(F32)
                first = T.simd.vdup(T.float32(NOT_FOUND), F32)
                for c in T.serial(nreg):
                    hit = T.simd.vcmp(T.simd.vld(s_ub[c * LANES]), top, op="eq")
                    first = T.simd.vmin(first, T.simd.vsel(ramp(c), T.simd.vdup(T.float32(NOT_FOUND), F32), hit))
                taken = T.simd.vdupv(T.simd.vcmin(first))
                found = T.simd.vsel(taken, found, T.simd.vcmp(lanes, slot, op="eq"))
                slot = T.simd.vadds(slot, T.float32(1.0))
            found = T.simd.vsel(found, T.simd.vdup(T.float32(-1.0), F32), finite)
            low = T.simd.vcvt(found, "int32", round="ROUND_R")
            high = T.simd.vcvt(T.simd.vmins(found, T.float32(0.0)), "int32", round="ROUND_R")
            pairs, _ = T.simd.vintlv(low, high)
            T.simd.vsts(o_ub[0], pairs)

    return compute


def parameters(spec: TopkSpec):
    """``(name, tensor type)`` of the GM tensors, in launch order: ``S`` the scores (any row
    stride), ``O`` the int32 ``[T, 2k]`` view of ``topk_idx``."""
    Tn = T.dynamic("T")
    return [
        ("S", T.StridedTensor((Tn, spec.experts), (T.dynamic("s_s0"), 1), F32)),
        ("O", T.Tensor((Tn, 2 * spec.topk), "int32")),
    ], Tn


def build(spec: TopkSpec):
    """The prim_func of ``spec`` (UB budget checked)."""
    rows.check_budget(spec.footprint, spec.budget, spec.describe())
    params, Tn = parameters(spec)
    plan = spec.plan()
    E, k, C = spec.experts, spec.topk, spec.vector_cores
    compute = select_compute(spec)

    def topk_kernel(tensors):
        G = gm.declare(tensors)
        with T.Kernel(C) as cid:
            s_ub = T.alloc_shared(*plan["s_ub"][:2])
            o_ub = T.alloc_shared(*plan["o_ub"][:2])
            for it in rows.row_loop(T.ceildiv(Tn - cid, C), {s_ub: plan["s_ub"][2], o_ub: plan["o_ub"][2]},
                                    spec.num_buffers):
                T.copy(G["S"][cid + it * C, 0:E], s_ub[0:E])
                compute(s_ub, o_ub)
                T.copy(o_ub[0:2 * k], G["O"][cid + it * C, 0:2 * k])

    return gm.prim_func(topk_kernel, params)


def arguments(spec: TopkSpec, inputs, outputs) -> list:
    """Launch arguments: the scores and the int32 view of the (contiguous) int64 indices."""
    import torch

    return [inputs.scores, outputs.topk_idx.view(torch.int32)]


def _kernel():
    from tileplug.backend_ascend.kernel import SpecKernel

    return SpecKernel("topk_gate", spec_of, decline_reason, build, arguments)


KERNEL = _kernel()
