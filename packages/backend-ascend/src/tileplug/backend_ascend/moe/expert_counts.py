"""Ascend kernels of ``moe_expert_counts`` (SPEC §7): ``counts[e]`` = pairs routed to ``e``
(an index in ``[0, E)``; −1 and shared experts past ``E`` are not counted), ``expert_ends[e] =
start[e] + counts[e]`` with ``start[0] = 0``, ``start[e] = align(expert_ends[e − 1], alignment)``.

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

Deterministic, no atomics, the split a constant (the norm backward's design):

**Count kernel** (:func:`build_count`). ``T.Kernel(PARTIALS)``: block ``p`` takes the rows
``p, p + PARTIALS, ...`` of ``topk_idx`` (int64 read as int32 word pairs) in one pipelined
:func:`~tileplug.backend_ascend.rows.row_loop` (the index row double-buffered). Per row, one
``T.SimdVF`` region: each slot's index is taken out of its register (``vcvt`` to fp32, the
lane selected, ``vcmax``; an int64 whose high word is not 0 becomes −1) and broadcast into a
UB row of its own; then for every 64-expert register ``c`` of the block's fp32 count
accumulator (in UB for the whole loop) the slots add ``1`` where the expert ramp ``64c + lane``
equals the slot's index. After the loop the block writes its counts as row ``p`` of the
partial counts ``[PARTIALS, E]`` (a GM workspace; a block with no rows writes zeros).

**Scan kernel** (:func:`build_scan`). ``T.Kernel(1)``: the ``PARTIALS`` partial rows added in
partial order (a pipelined loop), then, per register, ``padded = align(count)`` (``q`` =
``count / alignment`` rounded to the nearest integer, plus one ``alignment`` where
``count − q · alignment > 0``), the inclusive prefix sum of ``padded`` lane by lane, and
``expert_ends = prefix − padded + count``; both written as int32.

Every count and every end is an integer held in fp32, exact while the layout's rows
``T·K + (E − 1)·(alignment − 1)`` stay below 2²⁴ (:data:`EXACT_ROWS`); a launch past that runs
the reference's formula on the device instead (the kernel object checks the token count).
Integer sums are exact in any order, so the result is the reference's, bytewise.
"""

from dataclasses import dataclass

import tilelang.ascend.language as T

from tileplug.backend_ascend import gm, rows
from tileplug.backend_ascend.device import DeviceTarget, dispatch_target, lowering_target
from tileplug.backend_ascend.kernel import SpecKernel, checked_lowering
from tileplug.backend_ascend.lowering import CompileCache
from tileplug.backend_ascend.moe.index_rows import TopkIndexRows
from tileplug.backend_ascend.moe.topk_gate import neg_inf, ramp
from tileplug.backend_ascend.ub import LANES, Plan, PlannedInSimdUb, VERSIONS, padded

F32 = "float32"
PARTIALS = 64
"""Partial-count rows: row ``r`` of ``topk_idx`` is counted by block ``r % PARTIALS``. A
constant (one wave on a 64-vector-core part), never the core count."""
MAX_EXPERTS = 8192
"""Largest E served (the accumulators stay well within UB; larger E falls to the reference)."""
MAX_SLOTS = 64
"""Widest ``topk_idx`` served (one UB row of broadcast indices per slot)."""
EXACT_ROWS = 2**24
"""Counts and ends are exact integers in fp32 below this many expanded rows."""
ROUND_MAGIC = 12582912.0
"""1.5 · 2²³: ``(q + M) − M`` rounds a fp32 ``|q| < 2²²`` to the nearest integer."""
INDEX_DTYPES = {"torch.int32": "int32", "torch.int64": "int64"}


@dataclass(frozen=True)
class CountSpec(TopkIndexRows, PlannedInSimdUb):
    """What the count kernel is specialised on: ``experts`` E, ``slots`` K, ``index_dtype``
    ("int32" / "int64"). ``vector_cores`` only heads the lowered source: the split is
    :data:`PARTIALS`."""

    experts: int
    slots: int
    index_dtype: str
    vector_cores: int = 64
    num_buffers: int = VERSIONS


    def plan(self) -> Plan:
        """``i_ub`` a row of indices (int32 words); ``b_ub`` each slot's index broadcast over a
        register; ``acc_ub`` the block's fp32 counts."""
        return {
            "i_ub": ((padded(self.words),), "int32", self.num_buffers),
            "b_ub": ((self.slots * LANES,), F32, 1),
            "acc_ub": ((padded(self.experts),), F32, 1),
        }

    @property
    def layout(self) -> str:
        return (f"one row of indices per pipeline step; row r counted by block r % {PARTIALS} "
                f"({PARTIALS} blocks, a constant)")

    def describe(self) -> str:
        return f"moe_expert_counts [T, {self.slots}] {self.index_dtype} E={self.experts}"


@dataclass(frozen=True)
class ScanSpec(PlannedInSimdUb):
    """The scan kernel: the partial counts ``[PARTIALS, experts]`` summed, aligned, scanned."""

    experts: int
    alignment: int
    vector_cores: int = 64
    num_buffers: int = VERSIONS

    def plan(self) -> Plan:
        """``p_ub`` one partial row, ``s_ub`` their sum, ``c_ub`` / ``e_ub`` the int32 counts / ends."""
        width = padded(self.experts)
        return {
            "p_ub": ((width,), F32, self.num_buffers),
            "s_ub": ((width,), F32, 1),
            "c_ub": ((width,), "int32", 1),
            "e_ub": ((width,), "int32", 1),
        }

    @property
    def layout(self) -> str:
        return "one block; one partial row per pipeline step, then an aligned prefix scan in registers"

    def describe(self) -> str:
        return f"moe_expert_scan [{PARTIALS}, {self.experts}] float32 alignment={self.alignment}"


def spec_of(call, target: DeviceTarget | None = None) -> CountSpec:
    cores = (target or lowering_target()).vector_cores
    return CountSpec(experts=call.num_experts, slots=call.num_slots, index_dtype=INDEX_DTYPES[str(call.index_dtype)],
                     vector_cores=cores)


def scan_spec_of(call, target: DeviceTarget | None = None) -> ScanSpec:
    cores = (target or lowering_target()).vector_cores
    return ScanSpec(experts=call.num_experts, alignment=call.alignment, vector_cores=cores)


def decline_reason(call) -> str | None:
    """Why the Ascend ``moe_expert_counts`` kernels cannot serve ``call`` (None: they can)."""
    if str(call.index_dtype) not in INDEX_DTYPES:
        return f"index dtype {call.index_dtype} is not served on Ascend (int32 / int64); falls to the reference"
    if call.num_experts > MAX_EXPERTS:
        return f"E = {call.num_experts} > {MAX_EXPERTS} experts is not served on Ascend; falls to the reference"
    if call.num_slots > MAX_SLOTS:
        return f"K = {call.num_slots} > {MAX_SLOTS} slots is not served on Ascend; falls to the reference"
    if call.alignment >= 2**22:
        return f"alignment = {call.alignment} >= 2**22 is not served on Ascend (fp32 counts); falls to the reference"
    return None


def exact_at(call) -> bool:
    """Whether the fp32 counts and ends are exact at this call's token count."""
    from tileplug.core.contracts.moe import expanded_rows

    return expanded_rows(call.tokens, call.num_slots, call.num_experts, call.alignment) < EXACT_ROWS


# ---------------------------------------------------------------------- the count kernel


def slot_broadcast(slots: int, index_dtype: str):
    """A macro ``fill(i_ub, b_ub, ninf, lanes)``: each of the ``slots`` indices of the row in
    ``i_ub`` (int32 words; int64 as word pairs) taken out of its register as fp32 and broadcast
    into row ``j`` (64 lanes) of ``b_ub``; an int64 whose high word is not 0 becomes −1. Shared
    with ``moe_permute``'s index kernel."""
    step = 2 if index_dtype == "int64" else 1
    per_register = LANES // step
    full, tail = divmod(slots, per_register)

    @T.macro
    def broadcast(words, b_ub, first, count, ninf, lanes):
        position = T.simd.alloc_var(F32)
        position = T.simd.vdup(T.float32(0.0), F32)
        for p in T.serial(count):
            low = T.simd.vdupv(T.simd.vcmax(T.simd.vsel(words, ninf, T.simd.vcmp(lanes, position, op="eq"))))
            if step == 2:
                high = T.simd.vdupv(T.simd.vcmax(T.simd.vsel(
                    words, ninf, T.simd.vcmp(lanes, T.simd.vadds(position, T.float32(1.0)), op="eq"))))
                T.simd.vsts(b_ub[(first + p) * LANES], T.simd.vsel(low, T.simd.vdup(T.float32(-1.0), F32),
                                                                   T.simd.vcmps(high, T.float32(0.0), op="eq")))
            else:
                T.simd.vsts(b_ub[(first + p) * LANES], low)
            position = T.simd.vadds(position, T.float32(step))

    @T.macro
    def fill(i_ub, b_ub, ninf, lanes):
        for r in T.serial(full):
            broadcast(T.simd.vcvt(T.simd.vld(i_ub[r * LANES]), F32), b_ub, r * per_register, per_register,
                      ninf, lanes)
        if tail > 0:
            broadcast(T.simd.vcvt(T.simd.vld(i_ub[full * LANES]), F32), b_ub, full * per_register, tail,
                      ninf, lanes)

    return fill


def count_compute(spec: CountSpec):
    """The per-row vector work of ``spec`` (a macro over the UB buffers by plan name). Looked up
    by :func:`build_count` at trace time; tests/ascend_bad_kernels.py replaces it with scalar
    code to show the vector check failing."""
    K = spec.slots
    nreg = rows.registers(spec.experts)
    fill = slot_broadcast(K, spec.index_dtype)

    @T.macro
    def compute(buffers):
        i_ub, b_ub, acc_ub = buffers["i_ub"], buffers["b_ub"], buffers["acc_ub"]
        with T.SimdVF():
            ninf = neg_inf()
            lanes = T.simd.vci(T.float32(0.0), F32)
            fill(i_ub, b_ub, ninf, lanes)
            T.simd.mem_bar("VST_VLD")
            one = T.simd.vdup(T.float32(1.0), F32)
            zero = T.simd.vdup(T.float32(0.0), F32)
            for c in T.serial(nreg):
                total = T.simd.alloc_var(F32)
                total = T.simd.vld(acc_ub[c * LANES])
                experts = ramp(c)
                for j in T.serial(K):
                    total = T.simd.vadd(total, T.simd.vsel(one, zero, T.simd.vcmp(experts, T.simd.vld(b_ub[j * LANES]),
                                                                                  op="eq")))
                T.simd.vsts(acc_ub[c * LANES], total)

    return compute


@T.macro
def store_partial(accumulator, partials, block, width):
    """Row ``block`` of ``partials`` := the block's counts (a plain store: each block owns its
    row). Looked up at trace time; tests/ascend_bad_kernels.py replaces it with an atomic add
    into one shared row to show the determinism check failing."""
    T.copy(accumulator[0:width], partials[block, 0:width])


def count_parameters(spec: CountSpec):
    """``I`` the int32 words of ``topk_idx`` (any row stride), ``P`` the partial counts."""
    Tn = T.dynamic("T")
    return [
        ("I", T.StridedTensor((Tn, spec.words), (T.dynamic("i_s0"), 1), "int32")),
        ("P", T.Tensor((PARTIALS, spec.experts), F32)),
    ], Tn


def build_count(spec: CountSpec):
    """The count kernel of ``spec`` (UB budget checked)."""
    rows.check_budget(spec.footprint, spec.budget, spec.describe())
    params, Tn = count_parameters(spec)
    plan = spec.plan()
    E, W = spec.experts, spec.words
    nreg = rows.registers(E)
    compute = count_compute(spec)

    def count_kernel(tensors):
        G = gm.declare(tensors)
        with T.Kernel(PARTIALS) as block:
            buffers, versions = rows.plan_buffers(plan)
            with T.SimdVF():
                for c in T.serial(nreg):
                    T.simd.vsts(buffers["acc_ub"][c * LANES], T.simd.vdup(T.float32(0.0), F32))
            for it in rows.row_loop(T.ceildiv(Tn - block, PARTIALS), versions, spec.num_buffers):
                T.copy(G["I"][block + it * PARTIALS, 0:W], buffers["i_ub"][0:W])
                compute(buffers)
            store_partial(buffers["acc_ub"], G["P"], block, E)

    return gm.prim_func(count_kernel, params)


# ---------------------------------------------------------------------- the scan kernel


def aligned_scan(experts: int, alignment: int):
    """A macro ``scan(s_ub, c_ub, e_ub, start_ub)`` over the fp32 counts ``s_ub`` of ``experts``
    experts: ``padded = align(count, alignment)``, its inclusive prefix lane by lane, and
    ``expert_ends = prefix − padded + count`` into ``e_ub`` (int32); with ``c_ub`` the counts as
    int32, with ``start_ub`` (may be ``s_ub`` itself) each expert's first row as fp32. Shared
    with ``moe_permute``'s index kernel."""
    A = alignment
    nreg = rows.registers(experts)

    @T.macro
    def aligned(count):
        if A == 1:
            return count
        else:
            quotient = T.simd.vdiv(count, T.simd.vdup(T.float32(A), F32), precision=rows.DIV_EXACT)
            nearest = T.simd.vadds(T.simd.vadds(quotient, T.float32(ROUND_MAGIC)), T.float32(-ROUND_MAGIC))
            floor_part = T.simd.vmuls(nearest, T.float32(A))
            short = T.simd.vcmps(T.simd.vsub(count, floor_part), T.float32(0.0), op="gt")
            return T.simd.vadd(floor_part, T.simd.vsel(T.simd.vdup(T.float32(A), F32),
                                                       T.simd.vdup(T.float32(0.0), F32), short))

    @T.macro
    def scan(s_ub, c_ub, e_ub, start_ub):
        with T.SimdVF():
            ninf = neg_inf()
            lanes = T.simd.vci(T.float32(0.0), F32)
            carry = T.simd.alloc_var(F32)
            carry = T.simd.vdup(T.float32(0.0), F32)
            for c in T.serial(nreg):
                count = T.simd.vld(s_ub[c * LANES])
                pad = aligned(count)
                prefix = T.simd.alloc_var(F32)
                prefix = T.simd.vdup(T.float32(0.0), F32)
                position = T.simd.alloc_var(F32)
                position = T.simd.vdup(T.float32(0.0), F32)
                for j in T.serial(LANES):
                    here = T.simd.vcmp(lanes, position, op="eq")
                    carry = T.simd.vadd(carry, T.simd.vdupv(T.simd.vcmax(T.simd.vsel(pad, ninf, here))))
                    prefix = T.simd.vsel(carry, prefix, here)
                    position = T.simd.vadds(position, T.float32(1.0))
                ends = T.simd.vadd(T.simd.vsub(prefix, pad), count)
                if c_ub is not None:
                    T.simd.vsts(c_ub[c * LANES], T.simd.vcvt(count, "int32", round="ROUND_R"))
                if start_ub is not None:
                    T.simd.vsts(start_ub[c * LANES], T.simd.vsub(prefix, pad))
                T.simd.vsts(e_ub[c * LANES], T.simd.vcvt(ends, "int32", round="ROUND_R"))

    return scan


def build_scan(spec: ScanSpec):
    """The scan kernel of ``spec`` (UB budget checked)."""
    rows.check_budget(spec.footprint, spec.budget, spec.describe())
    E, A = spec.experts, spec.alignment
    nreg = rows.registers(E)
    plan = spec.plan()

    @T.macro
    def add_partial(p_ub, s_ub):
        with T.SimdVF():
            for c in T.serial(nreg):
                T.simd.vsts(s_ub[c * LANES], T.simd.vadd(T.simd.vld(s_ub[c * LANES]), T.simd.vld(p_ub[c * LANES])))

    scan = aligned_scan(E, A)

    @T.prim_func
    def moe_expert_scan(partials: T.Tensor((PARTIALS, E), F32), counts: T.Tensor((E,), "int32"),
                        expert_ends: T.Tensor((E,), "int32")):
        with T.Kernel(1) as block:  # noqa: F841 - one block
            p_ub = T.alloc_shared(plan["p_ub"][0], F32)
            s_ub = T.alloc_shared(plan["s_ub"][0], F32)
            c_ub = T.alloc_shared(plan["c_ub"][0], "int32")
            e_ub = T.alloc_shared(plan["e_ub"][0], "int32")
            with T.SimdVF():
                for c in T.serial(nreg):
                    T.simd.vsts(s_ub[c * LANES], T.simd.vdup(T.float32(0.0), F32))
            for it in rows.row_loop(PARTIALS, {p_ub: spec.num_buffers}, spec.num_buffers):
                T.copy(partials[it, 0:E], p_ub[0:E])
                add_partial(p_ub, s_ub)
            scan(s_ub, c_ub, e_ub, None)
            T.copy(c_ub[0:E], counts[0:E])
            T.copy(e_ub[0:E], expert_ends[0:E])

    return moe_expert_scan


# ---------------------------------------------------------------------- the kernel object


def _count_arguments(spec: CountSpec, inputs, outputs, partials) -> list:
    import torch

    return [inputs.topk_idx.view(torch.int32), partials]


class ExpertCountsKernel(SpecKernel):
    """``moe_expert_counts``: the count kernel, then the scan kernel."""

    def __init__(self) -> None:
        super().__init__("moe_expert_counts", spec_of, decline_reason, build_count, _count_arguments)
        self.scans = CompileCache(build_scan)

    def lowerings(self, call) -> list:
        """The count kernel's lowering and the scan kernel's, in launch order."""
        target = lowering_target()
        return [self.lowering(call), checked_lowering(scan_spec_of(call, target), build_scan, target)]

    def __call__(self, call, inputs, outputs) -> None:
        import torch

        if not exact_at(call):  # past 2**24 rows fp32 counts are not exact: the reference's formula
            from tileplug.core.moe import formulas

            counts, ends, _ = formulas.expert_layout(inputs.topk_idx, call.num_experts, call.alignment)
            outputs.counts.copy_(counts)
            outputs.expert_ends.copy_(ends)
            return
        target = dispatch_target(call.device)
        spec = self.spec_of(call, target)
        partials = torch.empty((PARTIALS, spec.experts), dtype=torch.float32, device=outputs.counts.device)
        self.compiled.get(spec)(*_count_arguments(spec, inputs, outputs, partials))
        self.scans.get(scan_spec_of(call, target))(partials, outputs.counts, outputs.expert_ends)


KERNEL = ExpertCountsKernel()
