"""Ascend kernel of ``normalize_weight`` (SPEC §7): ``denominator = w[0] + w[1] + ...`` left
to right in slot order, ``normalized = w / denominator`` (correctly rounded fp32 division).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

Rows stream through UB in one :func:`~tileplug.backend_ascend.rows.row_loop` (``T.Pipelined``,
the weight row, the normalized row and the denominator double-buffered): vector core ``cid``
takes rows ``cid, cid + C, ...``. Per row, one ``T.SimdVF`` region over 64-lane fp32 registers:

1. the sum, slot after slot: slot ``j``'s value is taken out of its register exactly (the
   register with every other lane set to −0.0, reduced by ``vcadd``: ``x + (−0.0) = x`` for
   every ``x``, NaN and ±inf included, in any order of the reduction) and added to a running
   register that starts at −0.0 (so ``−0.0 + w[0] = w[0]`` bit for bit: the reference starts
   its sum with ``w[0]``). Lanes past ``K`` never enter the sum;
2. every register of the row divided by the sum (``vdiv`` correctly rounded), stored, and the
   sum stored as the row's denominator.

The order is the reference's (one left-to-right sum, one division), so the result is bytewise
the reference's, except that the correctly rounded ``vdiv`` flushes a denormal quotient to
zero (a weight below ~1.2e-38 times its row's sum).
"""

from dataclasses import dataclass

import tilelang.ascend.language as T
from tvm import tirx

from tileplug.backend_ascend import gm, rows
from tileplug.backend_ascend.device import DeviceTarget, lowering_target
from tileplug.backend_ascend.ub import LANES, Plan, PlannedInSimdUb, VERSIONS, padded

F32 = "float32"
MAX_SLOTS = 1024
"""Widest row served: the sum is one unrolled step per slot (16 registers)."""


@dataclass(frozen=True)
class NormalizeSpec(PlannedInSimdUb):
    """What the ``normalize_weight`` kernel is specialised on: ``slots`` K, the vector-core
    count and the buffer versions of the streamed rows."""

    slots: int
    vector_cores: int = 64
    num_buffers: int = VERSIONS

    def plan(self) -> Plan:
        """``w_ub`` a row of weights, ``n_ub`` the normalized row, ``d_ub`` its denominator."""
        width, versions = padded(self.slots), self.num_buffers
        return {
            "w_ub": ((width,), F32, versions),
            "n_ub": ((width,), F32, versions),
            "d_ub": ((8,), F32, versions),
        }

    @property
    def layout(self) -> str:
        return "one row of weights per pipeline step, whole in UB; a slot-order sum in registers"

    def describe(self) -> str:
        return f"normalize_weight [T, {self.slots}] float32"


def spec_of(call, target: DeviceTarget | None = None) -> NormalizeSpec:
    cores = (target or lowering_target()).vector_cores
    return NormalizeSpec(slots=call.num_slots, vector_cores=cores)


def decline_reason(call) -> str | None:
    """Why the Ascend ``normalize_weight`` kernel cannot serve ``call`` (None: it can)."""
    if call.num_slots > MAX_SLOTS:
        return (f"K = {call.num_slots} > {MAX_SLOTS} slots: the slot-order sum is unrolled per slot on Ascend; "
                "falls to the reference")
    return None


def neg_zero():
    """An fp32 register of −0.0 in every lane (the bits 0x80000000): the exact additive identity."""
    return tirx.reinterpret("float32x64", T.simd.vdup(T.int32(-2147483648), "int32"))


def normalize_compute(spec: NormalizeSpec):
    """The per-row vector work of ``spec`` (a macro over the row's UB buffers). Looked up by
    :func:`build` at trace time; tests/ascend_bad_kernels.py replaces it with scalar code to
    show the vector check failing."""
    K = spec.slots
    full, tail = rows.chunks(K)
    nreg = rows.registers(K)

    @T.macro
    def compute(w_ub, n_ub, d_ub):
        with T.SimdVF():
            nz = neg_zero()
            lanes = T.simd.vci(T.float32(0.0), F32)
            total = T.simd.alloc_var(F32)
            total = nz
            slot = T.simd.alloc_var(F32)
            for c in T.serial(full):
                v = T.simd.vld(w_ub[c * LANES])
                slot = T.simd.vdup(T.float32(0.0), F32)
                for j in T.serial(LANES):
                    total = T.simd.vadd(total, T.simd.vdupv(T.simd.vcadd(T.simd.vsel(
                        v, nz, T.simd.vcmp(lanes, slot, op="eq")))))
                    slot = T.simd.vadds(slot, T.float32(1.0))
            if tail > 0:
                last = T.simd.vld(w_ub[full * LANES])
                slot = T.simd.vdup(T.float32(0.0), F32)
                for j in T.serial(tail):
                    total = T.simd.vadd(total, T.simd.vdupv(T.simd.vcadd(T.simd.vsel(
                        last, nz, T.simd.vcmp(lanes, slot, op="eq")))))
                    slot = T.simd.vadds(slot, T.float32(1.0))
            for c in T.serial(nreg):
                T.simd.vsts(n_ub[c * LANES], T.simd.vdiv(T.simd.vld(w_ub[c * LANES]), total,
                                                         precision=rows.DIV_EXACT))
            T.simd.vsts(d_ub[0], total, dist="ONEPT_B32")

    return compute


def parameters(spec: NormalizeSpec):
    """``(name, tensor type)`` of the GM tensors, in launch order: ``W`` the weights (any row
    stride), ``D`` the denominators ``[T]``, ``N`` the normalized weights ``[T, K]``."""
    Tn = T.dynamic("T")
    return [
        ("W", T.StridedTensor((Tn, spec.slots), (T.dynamic("w_s0"), 1), F32)),
        ("D", T.Tensor((Tn,), F32)),
        ("N", T.Tensor((Tn, spec.slots), F32)),
    ], Tn


def build(spec: NormalizeSpec):
    """The prim_func of ``spec`` (UB budget checked)."""
    rows.check_budget(spec.footprint, spec.budget, spec.describe())
    params, Tn = parameters(spec)
    plan = spec.plan()
    K, C = spec.slots, spec.vector_cores
    compute = normalize_compute(spec)

    def normalize_kernel(tensors):
        G = gm.declare(tensors)
        with T.Kernel(C) as cid:
            buffers, versions = rows.plan_buffers(plan)
            for it in rows.row_loop(T.ceildiv(Tn - cid, C), versions, spec.num_buffers):
                row = cid + it * C
                T.copy(G["W"][row, 0:K], buffers["w_ub"][0:K])
                compute(buffers["w_ub"], buffers["n_ub"], buffers["d_ub"])
                T.copy(buffers["n_ub"][0:K], G["N"][row, 0:K])
                T.copy(buffers["d_ub"][0:1], G["D"][row:row + 1])

    return gm.prim_func(normalize_kernel, params)


def arguments(spec: NormalizeSpec, inputs, outputs) -> list:
    """Launch arguments in the prim_func's order."""
    return [inputs.topk_weights, outputs.denominator, outputs.normalized]


def _kernel():
    from tileplug.backend_ascend.kernel import SpecKernel

    return SpecKernel("normalize_weight", spec_of, decline_reason, build, arguments)


KERNEL = _kernel()
