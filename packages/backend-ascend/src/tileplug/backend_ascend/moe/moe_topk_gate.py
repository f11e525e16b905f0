"""Ascend kernel of ``moe_topk_gate`` (SPEC §7): scores in fp32, selection on ``u + bias``
(group-limited with ``num_groups > 1``), the unbiased weights renormalized and scaled,
shared-expert slots.

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

Rows stream through UB in one :func:`~tileplug.backend_ascend.rows.row_loop` (``T.Pipelined``,
every per-row buffer double-buffered); the bias is DMA'd once per vector core. Per row, one
``T.SimdVF`` region over 64-lane fp32 registers:

1. ``u`` into ``u_ub``: softmax (row max by ``vmax`` / ``vcmax``, ``exp(x − max)``, the
   denominator in the fixed order of :func:`~tileplug.backend_ascend.rows.row_sum_at`, one
   correctly rounded division), ``1 / (1 + exp(−x))``, or ``sqrt(max(x, 0) + log1p(exp(−|x|)))``
   with ``log1p(t) = ln(1 + t) · t / ((1 + t) − 1)`` (``t`` where ``1 + t`` rounds to 1);
2. the selection values ``u + bias`` into ``s_ub``, the tail lanes −inf; the row is finite when
   ``Σ (x − x) + Σ (b − b)`` is 0 (NaN otherwise);
   with ``num_groups = G > 1`` (:func:`group_limit_of`) each group's score (its largest value
   plus its second largest) into lane ``g`` of a register, the ``topk_groups`` best chosen as
   the experts are (ties to the smaller group), every expert of the others set to −inf;
3. ``k`` rounds as in :mod:`.topk_gate` (max, then the smallest index holding it; the taken
   column −inf), each taking the unbiased ``u`` of its column into lane ``j`` of the weight
   register and adding it to the running slot-order sum;
4. weights ``/ (sum + 1e-20)`` (correctly rounded) with ``renormalize``, then ``× factor``;
   lanes ``k .. k+S−1`` get index ``E + lane − k`` and weight 1; a non-finite row −1 / 0 in
   every lane, and so does a row whose ``mask`` flag (a byte read from GM as a scalar in the
   row loop) is False. Indices are written as int32 pairs (the int64 view), weights and scores fp32.
"""

from dataclasses import dataclass

import tilelang.ascend.language as T

from tileplug.backend_ascend import gm, rows
from tileplug.backend_ascend.device import DeviceTarget, lowering_target
from tileplug.backend_ascend.moe.topk_gate import MAX_EXPERTS, MAX_TOPK, NOT_FOUND, neg_inf, ramp
from tileplug.backend_ascend.ub import LANES, Plan, PlannedInSimdUb, VERSIONS, padded

F32 = "float32"
DTYPE_NAMES = {"torch.bfloat16": "bfloat16", "torch.float32": "float32"}
RENORMALIZE_EPSILON = 1e-20
MAX_GROUPS = LANES
"""Most expert groups served (one lane of a register per group's score)."""


@dataclass(frozen=True)
class GateSpec(PlannedInSimdUb):
    """What the ``moe_topk_gate`` kernel is specialised on (compile-time constants)."""

    experts: int
    topk: int
    scoring: str
    logits_dtype: str
    has_bias: bool
    renormalize: bool
    routed_scaling_factor: float
    num_shared_experts: int
    return_scores: bool
    has_mask: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    vector_cores: int = 64
    num_buffers: int = VERSIONS

    @property
    def slots(self) -> int:
        return self.topk + self.num_shared_experts

    def plan(self) -> Plan:
        """``x_ub`` the row of logits; ``u_ub`` its scores; ``s_ub`` the selection values;
        ``o_ub`` / ``w_ub`` the row's indices (int32 pairs) and weights; ``b_ub`` the bias (once)."""
        width, versions = padded(self.experts), self.num_buffers
        plan: Plan = {
            "x_ub": ((width,), self.logits_dtype, versions),
            "u_ub": ((width,), F32, versions),
            "s_ub": ((width,), F32, versions),
            "o_ub": ((LANES,), "int32", versions),
            "w_ub": ((LANES,), F32, versions),
        }
        if self.has_bias:
            plan["b_ub"] = ((width,), F32, 1)
        return plan

    @property
    def layout(self) -> str:
        return "one row of logits per pipeline step, whole in UB; k max / min-index rounds in registers"

    def describe(self) -> str:
        bits = [f"moe_topk_gate [T, {self.experts}] {self.logits_dtype} k={self.topk} {self.scoring}"]
        if self.has_bias:
            bits.append("bias")
        if self.num_groups > 1:
            bits.append(f"groups={self.topk_groups}/{self.num_groups}")
        bits.append("renormalize" if self.renormalize else "raw")
        if self.routed_scaling_factor != 1.0:
            bits.append(f"scale={self.routed_scaling_factor!r}")
        if self.num_shared_experts:
            bits.append(f"shared={self.num_shared_experts}")
        if self.has_mask:
            bits.append("mask")
        if self.return_scores:
            bits.append("scores")
        return " ".join(bits)


def spec_of(call, target: DeviceTarget | None = None) -> GateSpec:
    cores = (target or lowering_target()).vector_cores
    return GateSpec(
        experts=call.num_experts, topk=call.num_topk, scoring=call.scoring.value,
        logits_dtype=DTYPE_NAMES[str(call.logits_dtype)], has_bias=call.has_bias, renormalize=call.renormalize,
        routed_scaling_factor=float(call.routed_scaling_factor), num_shared_experts=call.num_shared_experts,
        return_scores=call.return_scores, has_mask=call.has_mask, num_groups=call.num_groups,
        topk_groups=call.topk_groups, vector_cores=cores,
    )


def decline_reason(call) -> str | None:
    """Why the Ascend ``moe_topk_gate`` kernel cannot serve ``call`` (None: it can)."""
    if str(call.logits_dtype) not in DTYPE_NAMES:
        return f"logits dtype {call.logits_dtype} is not served on Ascend (bf16 / fp32); falls to the reference"
    if call.num_groups > MAX_GROUPS:
        return (f"num_groups = {call.num_groups} > {MAX_GROUPS}: the group scores sit in one register on Ascend; "
                "falls to the reference")
    if call.num_topk + call.num_shared_experts > MAX_TOPK:
        return (f"k + S = {call.num_topk + call.num_shared_experts} > {MAX_TOPK}: one index register holds 32 int64 "
                "slots on Ascend; falls to the reference")
    if call.num_experts > MAX_EXPERTS:
        return f"E = {call.num_experts} > {MAX_EXPERTS} experts is not served on Ascend; falls to the reference"
    spec = spec_of(call)
    if spec.footprint > spec.budget:
        return f"E = {call.num_experts}: UB plan needs {spec.footprint} bytes > {spec.budget}; falls to the reference"
    return None


@T.macro
def score_of(x, scoring):
    """The sigmoid / sqrtsoftplus score of the fp32 register ``x`` (softmax is done per row)."""
    if scoring == "sigmoid":
        one = T.simd.vdup(T.float32(1.0), F32)
        return T.simd.vdiv(one, T.simd.vadds(T.simd.vexp(T.simd.vneg(x)), T.float32(1.0)), precision=rows.DIV_EXACT)
    else:
        t = T.simd.vexp(T.simd.vneg(T.simd.vabs(x)))
        one_t = T.simd.vadds(t, T.float32(1.0))
        grown = T.simd.vadds(one_t, T.float32(-1.0))
        ratio = T.simd.vdiv(t, grown, precision=rows.DIV_EXACT)
        log1p = T.simd.vsel(t, T.simd.vmul(T.simd.vln(one_t), ratio),
                            T.simd.vcmps(one_t, T.float32(1.0), op="eq"))
        return T.simd.vsqrt(T.simd.vadd(T.simd.vmaxs(x, T.float32(0.0)), log1p), precision=rows.SQRT_EXACT)


def nan_unless_finite(v):
    """``v − v``: +0 in a lane holding a finite value, NaN where it holds an inf or a NaN."""
    return T.simd.vsub(v, v)


def group_limit_of(spec: GateSpec):
    """A macro ``group_limit(s_ub, ninf)``: the selection values ``s_ub`` of a row with every expert
    outside the ``topk_groups`` best of the ``num_groups`` equal contiguous groups set to −inf. A
    group's score is its largest value plus its second largest (the largest's first column
    excluded: a value held twice counts twice, as the reference's sorted top two); groups are
    chosen as the experts are, largest score first, equal scores to the smaller group."""
    G, chosen_count, size = spec.num_groups, spec.topk_groups, spec.experts // spec.num_groups
    nreg = rows.registers(spec.experts)

    @T.macro
    def in_group(value, ninf, c, low, high):
        inside = T.simd.vsel(value, ninf, T.simd.vcmp(ramp(c), low, op="ge"))
        return T.simd.vsel(inside, ninf, T.simd.vcmp(ramp(c), high, op="lt"))

    @T.macro
    def group_limit(s_ub, ninf):
        lanes = T.simd.vci(T.float32(0.0), F32)
        zero = T.simd.vdup(T.float32(0.0), F32)
        one = T.simd.vdup(T.float32(1.0), F32)
        not_found = T.simd.vdup(T.float32(NOT_FOUND), F32)
        scores = T.simd.alloc_var(F32)
        scores = ninf
        group = T.simd.alloc_var(F32)
        group = T.simd.vdup(T.float32(0.0), F32)
        for g in T.serial(G):
            low = T.simd.vmuls(group, T.float32(size))
            high = T.simd.vadds(low, T.float32(size))
            best = T.simd.alloc_var(F32)
            best = ninf
            for c in T.serial(nreg):
                best = T.simd.vmax(best, in_group(T.simd.vld(s_ub[c * LANES]), ninf, c, low, high))
            top = T.simd.vdupv(T.simd.vcmax(best))
            first = T.simd.alloc_var(F32)
            first = not_found
            for c in T.serial(nreg):
                hit = T.simd.vcmp(in_group(T.simd.vld(s_ub[c * LANES]), ninf, c, low, high), top, op="eq")
                first = T.simd.vmin(first, T.simd.vsel(ramp(c), not_found, hit))
            column = T.simd.vdupv(T.simd.vcmin(first))
            second = T.simd.alloc_var(F32)
            second = ninf
            for c in T.serial(nreg):
                rest = T.simd.vsel(ninf, in_group(T.simd.vld(s_ub[c * LANES]), ninf, c, low, high),
                                   T.simd.vcmp(ramp(c), column, op="eq"))
                second = T.simd.vmax(second, rest)
            score = T.simd.vadd(top, T.simd.vdupv(T.simd.vcmax(second)))
            scores = T.simd.vsel(score, scores, T.simd.vcmp(lanes, group, op="eq"))
            group = T.simd.vadds(group, T.float32(1.0))
        chosen = T.simd.alloc_var(F32)
        chosen = zero
        for r in T.serial(chosen_count):
            peak = T.simd.vdupv(T.simd.vcmax(scores))
            pick = T.simd.vdupv(T.simd.vcmin(T.simd.vsel(lanes, not_found, T.simd.vcmp(scores, peak, op="eq"))))
            here = T.simd.vcmp(lanes, pick, op="eq")
            chosen = T.simd.vsel(one, chosen, here)
            scores = T.simd.vsel(ninf, scores, here)
        group = T.simd.vdup(T.float32(0.0), F32)
        for g in T.serial(G):
            low = T.simd.vmuls(group, T.float32(size))
            high = T.simd.vadds(low, T.float32(size))
            kept = T.simd.vdupv(T.simd.vcmax(T.simd.vsel(chosen, T.simd.vdup(T.float32(-1.0), F32),
                                                         T.simd.vcmp(lanes, group, op="eq"))))
            dropped = T.simd.vcmps(kept, T.float32(0.5), op="lt")
            for c in T.serial(nreg):
                inside = in_group(one, zero, c, low, high)
                drop = T.simd.vsel(inside, zero, dropped)
                value = T.simd.vld(s_ub[c * LANES])
                T.simd.vsts(s_ub[c * LANES], T.simd.vsel(ninf, value, T.simd.vcmps(drop, T.float32(0.5), op="gt")))
            group = T.simd.vadds(group, T.float32(1.0))

    return group_limit


def gate_compute(spec: GateSpec):
    """The per-row vector work of ``spec`` (a macro over the UB buffers by plan name). Looked up
    by :func:`build` at trace time."""
    E, k, S, dt = spec.experts, spec.topk, spec.num_shared_experts, spec.logits_dtype
    full, tail = rows.chunks(E)
    nreg = rows.registers(E)
    softmax = spec.scoring == "softmax"
    group_limit = group_limit_of(spec)

    @T.macro
    def compute(buffers, keep):
        x_ub, u_ub, s_ub, o_ub, w_ub = (buffers[n] for n in ("x_ub", "u_ub", "s_ub", "o_ub", "w_ub"))
        b_ub = buffers.get("b_ub")
        with T.SimdVF():
            ninf = neg_inf()
            tail_mask = T.simd.update_mask(tail, 32)
            if softmax:
                peak = T.simd.alloc_var(F32)
                peak = ninf
                for c in T.serial(full):
                    peak = T.simd.vmax(peak, rows.load_f32(x_ub, c * LANES, dt))
                if tail > 0:
                    peak = T.simd.vmax(peak, T.simd.vsel(rows.load_f32(x_ub, full * LANES, dt), ninf, tail_mask))
                top = T.simd.vdupv(T.simd.vcmax(peak))
                for c in T.serial(nreg):
                    T.simd.vsts(u_ub[c * LANES], T.simd.vexp(T.simd.vsub(rows.load_f32(x_ub, c * LANES, dt), top)))
                T.simd.mem_bar("VST_VLD")
                total = T.simd.vdupv(rows.row_sum_at(E, lambda off: T.simd.vld(u_ub[off])))
                for c in T.serial(nreg):
                    T.simd.vsts(u_ub[c * LANES], T.simd.vdiv(T.simd.vld(u_ub[c * LANES]), total,
                                                             precision=rows.DIV_EXACT))
            else:
                for c in T.serial(nreg):
                    T.simd.vsts(u_ub[c * LANES], score_of(rows.load_f32(x_ub, c * LANES, dt), spec.scoring))
            T.simd.mem_bar("VST_VLD")
            for c in T.serial(nreg):
                if spec.has_bias:
                    value = T.simd.vadd(T.simd.vld(u_ub[c * LANES]), T.simd.vld(b_ub[c * LANES]))
                else:
                    value = T.simd.vld(u_ub[c * LANES])
                T.simd.vsts(s_ub[c * LANES], value)
            if tail > 0:
                last = T.simd.vld(s_ub[full * LANES])
                T.simd.vsts(s_ub[full * LANES], T.simd.vsel(last, ninf, tail_mask))
            T.simd.mem_bar("VST_VLD")
            if spec.num_groups > 1:
                group_limit(s_ub, ninf)
                T.simd.mem_bar("VST_VLD")
            bad = rows.row_sum_at(E, lambda off: nan_unless_finite(rows.load_f32(x_ub, off, dt)))
            if spec.has_bias:
                bad = T.simd.vadd(bad, rows.row_sum_at(E, lambda off: nan_unless_finite(T.simd.vld(b_ub[off]))))
            finite = T.simd.vcmps(T.simd.vdupv(bad), T.float32(0.0), op="eq")
            lanes = T.simd.vci(T.float32(0.0), F32)
            slot = T.simd.alloc_var(F32)
            slot = T.simd.vdup(T.float32(0.0), F32)
            taken = T.simd.alloc_var(F32)
            taken = T.simd.vdup(T.float32(-1.0), F32)
            found = T.simd.alloc_var(F32)
            found = T.simd.vdup(T.float32(-1.0), F32)
            weights = T.simd.alloc_var(F32)
            weights = T.simd.vdup(T.float32(0.0), F32)
            summed = T.simd.alloc_var(F32)
            summed = T.simd.vdup(T.float32(0.0), F32)
            for j in T.serial(k):
                best = T.simd.alloc_var(F32)
                best = ninf
                for c in T.serial(nreg):
                    v = T.simd.vsel(ninf, T.simd.vld(s_ub[c * LANES]), T.simd.vcmp(ramp(c), taken, op="eq"))
                    T.simd.vsts(s_ub[c * LANES], v)
                    best = T.simd.vmax(best, v)
                T.simd.mem_bar("VST_VLD")
                top_s = T.simd.vdupv(T.simd.vcmax(best))
                first = T.simd.alloc_var(F32)
                first = T.simd.vdup(T.float32(NOT_FOUND), F32)
                for c in T.serial(nreg):
                    hit = T.simd.vcmp(T.simd.vld(s_ub[c * LANES]), top_s, op="eq")
                    first = T.simd.vmin(first, T.simd.vsel(ramp(c), T.simd.vdup(T.float32(NOT_FOUND), F32), hit))
                taken = T.simd.vdupv(T.simd.vcmin(first))
                picked = T.simd.alloc_var(F32)
                picked = ninf
                for c in T.serial(nreg):
                    mine = T.simd.vsel(T.simd.vld(u_ub[c * LANES]), ninf, T.simd.vcmp(ramp(c), taken, op="eq"))
                    picked = T.simd.vmax(picked, mine)
                weight = T.simd.vdupv(T.simd.vcmax(picked))
                here = T.simd.vcmp(lanes, slot, op="eq")
                found = T.simd.vsel(taken, found, here)
                weights = T.simd.vsel(weight, weights, here)
                summed = T.simd.vadd(summed, weight)
                slot = T.simd.vadds(slot, T.float32(1.0))
            if spec.renormalize:
                weights = T.simd.vdiv(weights, T.simd.vadds(summed, T.float32(RENORMALIZE_EPSILON)),
                                      precision=rows.DIV_EXACT)
            if spec.routed_scaling_factor != 1.0:
                weights = T.simd.vmuls(weights, T.float32(spec.routed_scaling_factor))
            if S > 0:
                shared = T.simd.vcmps(lanes, T.float32(k - 0.5), op="gt")
                found = T.simd.vsel(T.simd.vadds(lanes, T.float32(E - k)), found, shared)
                weights = T.simd.vsel(T.simd.vdup(T.float32(1.0), F32), weights, shared)
            found = T.simd.vsel(found, T.simd.vdup(T.float32(-1.0), F32), finite)
            weights = T.simd.vsel(weights, T.simd.vdup(T.float32(0.0), F32), finite)
            if spec.has_mask:
                kept = T.simd.vcmps(T.simd.vdup(keep, "int32"), T.int32(0), op="ne")
                found = T.simd.vsel(found, T.simd.vdup(T.float32(-1.0), F32), kept)
                weights = T.simd.vsel(weights, T.simd.vdup(T.float32(0.0), F32), kept)
            low = T.simd.vcvt(found, "int32", round="ROUND_R")
            high = T.simd.vcvt(T.simd.vmins(found, T.float32(0.0)), "int32", round="ROUND_R")
            pairs, _ = T.simd.vintlv(low, high)
            T.simd.vsts(o_ub[0], pairs)
            T.simd.vsts(w_ub[0], weights)

    return compute


def parameters(spec: GateSpec):
    """``(name, tensor type)`` of the GM tensors, in launch order: ``X`` logits (any row
    stride), ``B`` bias, ``O`` the int32 ``[T, 2(k+S)]`` view of ``topk_idx``, ``W`` weights,
    ``U`` scores."""
    Tn = T.dynamic("T")
    params = [("X", T.StridedTensor((Tn, spec.experts), (T.dynamic("x_s0"), 1), spec.logits_dtype))]
    if spec.has_bias:
        params.append(("B", T.Tensor((spec.experts,), F32)))
    params.append(("O", T.Tensor((Tn, 2 * spec.slots), "int32")))
    params.append(("W", T.Tensor((Tn, spec.slots), F32)))
    if spec.return_scores:
        params.append(("U", T.Tensor((Tn, spec.experts), F32)))
    if spec.has_mask:
        params.append(("M", T.Tensor((Tn,), "uint8")))
    return params, Tn


def build(spec: GateSpec):
    """The prim_func of ``spec`` (UB budget checked)."""
    rows.check_budget(spec.footprint, spec.budget, spec.describe())
    params, Tn = parameters(spec)
    plan = spec.plan()
    E, K, C = spec.experts, spec.slots, spec.vector_cores
    compute = gate_compute(spec)

    def gate_kernel(tensors):
        G = gm.declare(tensors)
        with T.Kernel(C) as cid:
            buffers, versions = rows.plan_buffers(plan)
            if spec.has_bias:
                T.copy(G["B"][0:E], buffers["b_ub"][0:E])
            for it in rows.row_loop(T.ceildiv(Tn - cid, C), versions, spec.num_buffers):
                T.copy(G["X"][cid + it * C, 0:E], buffers["x_ub"][0:E])
                if spec.has_mask:
                    compute(buffers, T.Cast("int32", G["M"][cid + it * C]))
                else:
                    compute(buffers, 0)
                T.copy(buffers["o_ub"][0:2 * K], G["O"][cid + it * C, 0:2 * K])
                T.copy(buffers["w_ub"][0:K], G["W"][cid + it * C, 0:K])
                if spec.return_scores:
                    T.copy(buffers["u_ub"][0:E], G["U"][cid + it * C, 0:E])

    return gm.prim_func(gate_kernel, params)


def arguments(spec: GateSpec, inputs, outputs) -> list:
    """Launch arguments in the prim_func's order (the int64 indices as their int32 view)."""
    import torch

    values = [inputs.logits]
    if spec.has_bias:
        values.append(inputs.bias)
    values += [outputs.topk_idx.view(torch.int32), outputs.topk_weights]
    if spec.return_scores:
        values.append(outputs.scores)
    if spec.has_mask:
        values.append(inputs.mask.view(torch.uint8))
    return values


def _kernel():
    from tileplug.backend_ascend.kernel import SpecKernel

    return SpecKernel("moe_topk_gate", spec_of, decline_reason, build, arguments)


KERNEL = _kernel()
