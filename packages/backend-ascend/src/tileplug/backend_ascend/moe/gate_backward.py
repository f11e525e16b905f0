"""Ascend kernel of ``moe_topk_gate_backward`` (SPEC §7), fp32: ``grad_logits`` ``[T, E]`` of
the routed weights from the forward's ``scores`` ``u``, ``topk_idx`` and the incoming
``grad_topk_weights`` ``g``.

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

Rows stream through UB in one :func:`~tileplug.backend_ascend.rows.row_loop` (``T.Pipelined``,
every per-row buffer double-buffered): per row the scores, the index row (int64 as int32 word
pairs) and the gradient row DMA'd in; the ``mask`` flag, a byte read from GM as a scalar. One
``T.SimdVF`` region:

1. each slot's index broadcast into a UB row (``moe_expert_counts``' slot broadcast); a slot is
   *routed* when its index is in ``[0, E)`` and the row is kept; its score ``u_s`` taken out of
   the scores' registers (the lane equal to the index, every other lane +0, added: exact), its
   gradient ``g_s`` out of the gradient register exactly (every other lane −0.0);
2. in slot order the sums of the reference, each from −0.0 (so ``−0.0 + x = x`` starts them as
   the reference's first element does): ``S = Σ u_s + 1e-20`` and ``Σ g_s u_s``; then
   ``∂u_s = (c / S) · (g_s − Σ g_r u_r / S)`` (two correctly rounded divisions; without
   ``renormalize`` ``c · g_s``), +0 for a slot not routed, each broadcast into a UB row;
3. per 64-expert register ``∂u = +0`` and slot after slot ``∂u += (expert == index_s) ? ∂u_s :
   +0`` (an expert named twice receives both, in slot order), then through the scoring: softmax
   ``u ⊙ (∂u − ⟨∂u, u⟩)`` (the dot product in :func:`~tileplug.backend_ascend.rows.row_sum_at`'s
   fixed order, not the reference's pairwise tree: within the 1e-5 SPEC §7 allows), sigmoid
   ``∂u · (u (1 − u))``, sqrtsoftplus ``∂u · (−expm1(−u²) / (2u))`` (0 where ``u ≤ 0``;
   ``expm1(x) = (eˣ − 1) · x / ln(eˣ)`` for ``−0.5 < x``, ``x`` where ``eˣ`` rounds to 1,
   ``eˣ − 1`` below); a row without a routed slot is +0 throughout.
"""

from dataclasses import dataclass

import tilelang.ascend.language as T

from tileplug.backend_ascend import gm, rows
from tileplug.backend_ascend.device import DeviceTarget, lowering_target
from tileplug.backend_ascend.moe.expert_counts import INDEX_DTYPES, slot_broadcast
from tileplug.backend_ascend.moe.index_rows import TopkIndexRows
from tileplug.backend_ascend.moe.normalize_weight import neg_zero
from tileplug.backend_ascend.moe.topk_gate import MAX_EXPERTS, neg_inf, ramp
from tileplug.backend_ascend.ub import LANES, Plan, PlannedInSimdUb, VERSIONS, padded

F32 = "float32"
RENORMALIZE_EPSILON = 1e-20
MAX_SLOTS = LANES
"""Widest ``topk_idx`` served (the slots' gradients sit in one register)."""
KAHAN_BELOW = -0.5
"""``expm1(x)`` by ``(eˣ − 1) · x / ln(eˣ)`` for ``x`` above this, ``eˣ − 1`` at or below it."""


@dataclass(frozen=True)
class GateBackwardSpec(TopkIndexRows, PlannedInSimdUb):
    """What the ``moe_topk_gate_backward`` kernel is specialised on: ``experts`` E, ``slots`` K,
    ``index_dtype`` of topk_idx, ``scoring``, ``renormalize``, ``routed_scaling_factor``,
    ``has_mask``; the vector-core count and the buffer versions."""

    experts: int
    slots: int
    index_dtype: str
    scoring: str
    renormalize: bool
    routed_scaling_factor: float
    has_mask: bool = False
    vector_cores: int = 64
    num_buffers: int = VERSIONS


    def plan(self) -> Plan:
        """``s_ub`` the scores row, ``i_ub`` the index row (int32 words), ``g_ub`` the gradient
        row, ``o_ub`` the gradient of the scores, then of the logits; ``b_ub`` / ``c_ub`` each
        slot's index / score gradient broadcast over a register."""
        versions, width = self.num_buffers, padded(self.experts)
        return {
            "s_ub": ((width,), F32, versions),
            "i_ub": ((padded(self.words),), "int32", versions),
            "g_ub": ((padded(self.slots),), F32, versions),
            "o_ub": ((width,), F32, versions),
            "b_ub": ((self.slots * LANES,), F32, 1),
            "c_ub": ((self.slots * LANES,), F32, 1),
        }

    @property
    def layout(self) -> str:
        return "one row per pipeline step, whole in UB"

    def describe(self) -> str:
        bits = [self.scoring, f"renormalize={self.renormalize}", f"factor={self.routed_scaling_factor}"]
        if self.has_mask:
            bits.append("mask")
        return (f"moe_topk_gate_backward [T, {self.experts}] float32 K={self.slots} {self.index_dtype} "
                + " ".join(bits))


def spec_of(call, target: DeviceTarget | None = None) -> GateBackwardSpec:
    """The specialisation of a ``moe_topk_gate_backward`` call (scores ``[T, E]``, topk_idx ``[T, K]``)."""
    cores = (target or lowering_target()).vector_cores
    return GateBackwardSpec(experts=call.num_experts, slots=call.num_slots,
                            index_dtype=INDEX_DTYPES[str(call.index_dtype)], scoring=call.scoring.value,
                            renormalize=call.renormalize, routed_scaling_factor=call.routed_scaling_factor,
                            has_mask=call.has_mask, vector_cores=cores)


def decline_reason(call) -> str | None:
    """Why the Ascend ``moe_topk_gate_backward`` kernel cannot serve ``call`` (None: it can)."""
    if str(call.dtype) != "torch.float32":
        return f"{call.dtype} scores are not served on Ascend (fp32 only); falls to the reference"
    if str(call.index_dtype) not in INDEX_DTYPES:
        return f"index dtype {call.index_dtype} is not served on Ascend (int32 / int64); falls to the reference"
    if call.num_experts > MAX_EXPERTS:
        return f"E = {call.num_experts} > {MAX_EXPERTS} experts is not served on Ascend; falls to the reference"
    if call.num_slots > MAX_SLOTS:
        return f"K = {call.num_slots} > {MAX_SLOTS} slots is not served on Ascend; falls to the reference"
    spec = spec_of(call)
    if spec.footprint > spec.budget:
        return f"UB plan needs {spec.footprint} bytes > {spec.budget}; falls to the reference"
    return None


@T.macro
def expm1_of(x):
    """``expm1(x)`` for ``x ≤ 0`` in fp32 (Kahan's ``(eˣ − 1) · x / ln(eˣ)`` near 0)."""
    e = T.simd.vexp(x)
    minus_one = T.simd.vadds(e, T.float32(-1.0))
    near = T.simd.vmul(minus_one, T.simd.vdiv(x, T.simd.vln(e), precision=rows.DIV_EXACT))
    near = T.simd.vsel(x, near, T.simd.vcmps(e, T.float32(1.0), op="eq"))
    return T.simd.vsel(near, minus_one, T.simd.vcmps(x, T.float32(KAHAN_BELOW), op="gt"))


def backward_compute(spec: GateBackwardSpec):
    """The per-row vector work of ``spec`` (a macro over the UB buffers by plan name and the
    row's mask flag, an int32 scalar). Looked up by :func:`build` at trace time;
    tests/ascend_bad_kernels.py replaces it with scalar code to show the vector check failing."""
    E, K = spec.experts, spec.slots
    nreg = rows.registers(E)
    fill = slot_broadcast(K, spec.index_dtype)
    factor = spec.routed_scaling_factor

    @T.macro
    def compute(buffers, keep):
        s_ub, i_ub, g_ub, o_ub, b_ub, c_ub = (buffers[n] for n in ("s_ub", "i_ub", "g_ub", "o_ub", "b_ub", "c_ub"))
        with T.SimdVF():
            ninf = neg_inf()
            nz = neg_zero()
            lanes = T.simd.vci(T.float32(0.0), F32)
            zero = T.simd.vdup(T.float32(0.0), F32)
            one = T.simd.vdup(T.float32(1.0), F32)
            unrouted = T.simd.vdup(T.float32(-1.0), F32)
            kept = T.simd.vcmps(T.simd.vdup(keep, "int32"), T.int32(0), op="ne")
            fill(i_ub, b_ub, ninf, lanes)
            T.simd.mem_bar("VST_VLD")
            grads = T.simd.vld(g_ub[0])
            chosen_sum = T.simd.alloc_var(F32)
            chosen_sum = nz
            inner_sum = T.simd.alloc_var(F32)
            inner_sum = nz
            routed_grads = T.simd.alloc_var(F32)
            routed_grads = zero
            routed_flags = T.simd.alloc_var(F32)
            routed_flags = zero
            slot = T.simd.alloc_var(F32)
            slot = T.simd.vdup(T.float32(0.0), F32)
            for j in T.serial(K):
                expert = T.simd.vld(b_ub[j * LANES])
                flag = T.simd.vsel(one, zero, T.simd.vcmps(expert, T.float32(0.0), op="ge"))
                flag = T.simd.vsel(flag, zero, T.simd.vcmps(expert, T.float32(E), op="lt"))
                flag = T.simd.vsel(flag, zero, kept)
                routed = T.simd.vcmps(flag, T.float32(0.5), op="gt")
                picked = T.simd.alloc_var(F32)
                picked = zero
                for c in T.serial(nreg):
                    picked = T.simd.vadd(picked, T.simd.vsel(T.simd.vld(s_ub[c * LANES]), zero,
                                                             T.simd.vcmp(ramp(c), expert, op="eq")))
                chosen = T.simd.vsel(T.simd.vdupv(T.simd.vcadd(picked)), zero, routed)
                here = T.simd.vcmp(lanes, slot, op="eq")
                grad = T.simd.vsel(T.simd.vdupv(T.simd.vcadd(T.simd.vsel(grads, nz, here))), zero, routed)
                chosen_sum = T.simd.vadd(chosen_sum, chosen)
                inner_sum = T.simd.vadd(inner_sum, T.simd.vmul(grad, chosen))
                routed_grads = T.simd.vsel(grad, routed_grads, here)
                routed_flags = T.simd.vsel(flag, routed_flags, here)
                T.simd.vsts(b_ub[j * LANES], T.simd.vsel(expert, unrouted, routed))
                slot = T.simd.vadds(slot, T.float32(1.0))
            if spec.renormalize:
                total = T.simd.vadds(chosen_sum, T.float32(RENORMALIZE_EPSILON))
                inner = T.simd.vdiv(inner_sum, total, precision=rows.DIV_EXACT)
                scale = T.simd.vdiv(T.simd.vdup(T.float32(factor), F32), total, precision=rows.DIV_EXACT)
                grad_chosen = T.simd.vmul(scale, T.simd.vsub(routed_grads, inner))
            else:
                grad_chosen = T.simd.vmuls(routed_grads, T.float32(factor))
            grad_chosen = T.simd.vsel(grad_chosen, zero, T.simd.vcmps(routed_flags, T.float32(0.5), op="gt"))
            active = T.simd.vcmps(T.simd.vdupv(T.simd.vcmax(routed_flags)), T.float32(0.5), op="gt")
            position = T.simd.alloc_var(F32)
            position = T.simd.vdup(T.float32(0.0), F32)
            for j in T.serial(K):
                T.simd.vsts(c_ub[j * LANES], T.simd.vdupv(T.simd.vcadd(T.simd.vsel(
                    grad_chosen, nz, T.simd.vcmp(lanes, position, op="eq")))))
                position = T.simd.vadds(position, T.float32(1.0))
            T.simd.mem_bar("VST_VLD")
            for c in T.serial(nreg):
                grad_scores = T.simd.alloc_var(F32)
                grad_scores = zero
                experts = ramp(c)
                for j in T.serial(K):
                    grad_scores = T.simd.vadd(grad_scores, T.simd.vsel(
                        T.simd.vld(c_ub[j * LANES]), zero, T.simd.vcmp(experts, T.simd.vld(b_ub[j * LANES]), op="eq")))
                T.simd.vsts(o_ub[c * LANES], grad_scores)
            T.simd.mem_bar("VST_VLD")
            if spec.scoring == "softmax":
                dot = T.simd.vdupv(rows.row_sum_at(E, lambda off: T.simd.vmul(T.simd.vld(o_ub[off]),
                                                                              T.simd.vld(s_ub[off]))))
                for c in T.serial(nreg):
                    u = T.simd.vld(s_ub[c * LANES])
                    out = T.simd.vmul(u, T.simd.vsub(T.simd.vld(o_ub[c * LANES]), dot))
                    T.simd.vsts(o_ub[c * LANES], T.simd.vsel(out, zero, active))
            elif spec.scoring == "sigmoid":
                for c in T.serial(nreg):
                    u = T.simd.vld(s_ub[c * LANES])
                    out = T.simd.vmul(T.simd.vld(o_ub[c * LANES]), T.simd.vmul(u, T.simd.vsub(one, u)))
                    T.simd.vsts(o_ub[c * LANES], T.simd.vsel(out, zero, active))
            else:
                for c in T.serial(nreg):
                    u = T.simd.vld(s_ub[c * LANES])
                    expm1 = expm1_of(T.simd.vneg(T.simd.vmul(u, u)))
                    derivative = T.simd.vdiv(T.simd.vneg(expm1), T.simd.vmuls(u, T.float32(2.0)),
                                             precision=rows.DIV_EXACT)
                    derivative = T.simd.vsel(derivative, zero, T.simd.vcmps(u, T.float32(0.0), op="gt"))
                    out = T.simd.vmul(T.simd.vld(o_ub[c * LANES]), derivative)
                    T.simd.vsts(o_ub[c * LANES], T.simd.vsel(out, zero, active))

    return compute


def parameters(spec: GateBackwardSpec):
    """``(name, tensor type)`` of the GM tensors, in launch order: ``U`` scores, ``I`` the int32
    words of topk_idx, ``G`` grad_topk_weights (any row strides), ``O`` grad_logits, ``M`` the
    mask bytes (with a mask)."""
    Tn = T.dynamic("T")
    params = [
        ("U", T.StridedTensor((Tn, spec.experts), (T.dynamic("u_s0"), 1), F32)),
        ("I", T.StridedTensor((Tn, spec.words), (T.dynamic("i_s0"), 1), "int32")),
        ("G", T.StridedTensor((Tn, spec.slots), (T.dynamic("g_s0"), 1), F32)),
        ("O", T.Tensor((Tn, spec.experts), F32)),
    ]
    if spec.has_mask:
        params.append(("M", T.Tensor((Tn,), "uint8")))
    return params, Tn


def build(spec: GateBackwardSpec):
    """The prim_func of ``spec`` (UB budget checked)."""
    rows.check_budget(spec.footprint, spec.budget, spec.describe())
    params, Tn = parameters(spec)
    plan = spec.plan()
    E, K, W, C = spec.experts, spec.slots, spec.words, spec.vector_cores
    compute = backward_compute(spec)

    def backward_kernel(tensors):
        G = gm.declare(tensors)
        with T.Kernel(C) as cid:
            buffers, versions = rows.plan_buffers(plan)
            for it in rows.row_loop(T.ceildiv(Tn - cid, C), versions, spec.num_buffers):
                row = cid + it * C
                T.copy(G["U"][row, 0:E], buffers["s_ub"][0:E])
                T.copy(G["I"][row, 0:W], buffers["i_ub"][0:W])
                T.copy(G["G"][row, 0:K], buffers["g_ub"][0:K])
                if spec.has_mask:
                    compute(buffers, T.Cast("int32", G["M"][row]))
                else:
                    compute(buffers, 1)
                T.copy(buffers["o_ub"][0:E], G["O"][row, 0:E])

    return gm.prim_func(backward_kernel, params)


def arguments(spec: GateBackwardSpec, inputs, outputs) -> list:
    """Launch arguments in the prim_func's order (topk_idx as its int32 view, the mask as bytes)."""
    import torch

    values = [inputs.scores, inputs.topk_idx.view(torch.int32), inputs.grad_topk_weights, outputs.grad_logits]
    if spec.has_mask:
        values.append(inputs.mask.view(torch.uint8))
    return values


def _kernel():
    from tileplug.backend_ascend.kernel import SpecKernel

    return SpecKernel("moe_topk_gate_backward", spec_of, decline_reason, build, arguments)


KERNEL = _kernel()
