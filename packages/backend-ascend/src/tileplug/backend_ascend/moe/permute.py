"""Ascend kernels of ``moe_permute`` (SPEC §7): row ``t`` of ``x`` (and of ``x_sf``) copied to
the row of every routed pair ``(t, slot)``; within an expert the pairs take rows in token order
(then slot order) from ``start[e]`` (``start[0] = 0``, ``start[e] = align(expert_ends[e − 1],
alignment)``); ``permutation[t, slot]`` is that row, −1 for a pair not routed (an index outside
``[0, E)``); every padding row is zero bytes.

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

Two kernels, launched in order, after the expanded tensors are zeroed on the device (a plain
fill of ``R`` rows: the padding rows; the routed ones are then overwritten):

**Index kernel** (:func:`build_index`). ``T.Kernel(1)``: one block walks every row of
``topk_idx`` twice, each walk a pipelined :func:`~tileplug.backend_ascend.rows.row_loop` (the
index row double-buffered). The first counts the pairs per expert into an fp32 accumulator in UB
(``moe_expert_counts``' count macro); then ``moe_expert_counts``' aligned scan turns the counts
into ``expert_ends`` (written out) and each expert's first row (over the counts: the *cursor*).
The second walk, per row, in one ``T.SimdVF`` region: each slot's index broadcast into a UB row,
then slot after slot, for each 64-expert register, the cursor lane of the slot's expert taken
(``vsel``, summed over registers: one lane is not zero) and that lane advanced by one; the
slot's row (or −1) goes to lane ``slot`` of the permutation row, stored as int32 and DMA'd out.
One block and the data in order: token order within an expert by construction, and the same
Ascend C for any vector-core count. Every row number is an integer held in fp32, exact while
``R`` stays below 2²⁴ (:data:`EXACT_ROWS`); past that the launch runs the reference's formula.

**Copy kernel** (:func:`build_copy`). Rows are moved as int32 words (every dtype: x, x_sf are
viewed as int32, so their rows must be whole words and 4-byte aligned). ``T.Kernel(C)``: one
:func:`~tileplug.backend_ascend.rows.row_loop` over the items ``(token, column tile)`` of vector
core ``cid`` (tokens ``cid, cid + C, ...``, each in ``ceil(Wx / W)`` tiles of ``W`` words, the
last one starting at ``Wx − W``, as ``moe_unpermute``'s). Per item: the tile (and the token's
whole scale row) DMA'd into UB, copied register by register into an output buffer in one
``T.SimdVF`` region (so the next item's load never waits for this item's stores), then for each
slot whose permutation entry (read from GM as a scalar) is ``≥ 0`` DMA'd to that row. Every
expanded row has at most one writer; bytes are copied, never converted.
"""

from dataclasses import dataclass

import tilelang.ascend.language as T

from tileplug.backend_ascend import gm, rows
from tileplug.backend_ascend.device import DeviceTarget, dispatch_target, lowering_target
from tileplug.backend_ascend.kernel import SpecKernel, checked_lowering
from tileplug.backend_ascend.lowering import CompileCache
from tileplug.backend_ascend.moe import expert_counts
from tileplug.backend_ascend.moe.expert_counts import (
    INDEX_DTYPES,
    CountSpec,
    aligned_scan,
    count_compute,
    slot_broadcast,
)
from tileplug.backend_ascend.moe.index_rows import TopkIndexRows
from tileplug.backend_ascend.moe.topk_gate import neg_inf, ramp
from tileplug.backend_ascend.ub import LANES, Plan, PlannedInSimdUb, VERSIONS, padded, widest_tile

F32 = "float32"
WORD = "int32"
WORD_BYTES = 4
EXACT_ROWS = 2**24
"""Row numbers are exact integers in fp32 below this many expanded rows."""
MAX_TILE = 8192
"""Widest column tile of the copy kernel (int32 words)."""


@dataclass(frozen=True)
class IndexSpec(TopkIndexRows, PlannedInSimdUb):
    """What the index kernel is specialised on: ``experts`` E, ``slots`` K, ``index_dtype`` of
    ``topk_idx`` ("int32" / "int64"), ``alignment``. ``vector_cores`` only heads the lowered
    source: the kernel is one block."""

    experts: int
    slots: int
    index_dtype: str
    alignment: int
    vector_cores: int = 64
    num_buffers: int = VERSIONS


    def count_spec(self) -> CountSpec:
        """The ``moe_expert_counts`` count specialisation whose per-row macro the first walk runs."""
        return CountSpec(experts=self.experts, slots=self.slots, index_dtype=self.index_dtype,
                         vector_cores=self.vector_cores, num_buffers=self.num_buffers)

    def plan(self) -> Plan:
        """``i_ub`` / ``p_ub`` a row of indices (int32 words) of the count / place walk (one
        buffer each, so that each rotates with its own loop); ``b_ub`` each slot's index
        broadcast over a register; ``acc_ub`` the fp32 counts, then the cursors; ``e_ub`` the
        int32 ends; ``o_ub`` the int32 permutation row."""
        return {
            "i_ub": ((padded(self.words),), WORD, self.num_buffers),
            "p_ub": ((padded(self.words),), WORD, self.num_buffers),
            "b_ub": ((self.slots * LANES,), F32, 1),
            "acc_ub": ((padded(self.experts),), F32, 1),
            "e_ub": ((padded(self.experts),), WORD, 1),
            "o_ub": ((padded(self.slots),), WORD, self.num_buffers),
        }

    @property
    def layout(self) -> str:
        return "one block; one row of indices per pipeline step, two walks (count, then place) around an aligned scan"

    def describe(self) -> str:
        return f"moe_permute_index [T, {self.slots}] {self.index_dtype} E={self.experts} alignment={self.alignment}"


@dataclass(frozen=True)
class CopySpec(PlannedInSimdUb):
    """What the copy kernel is specialised on: ``row_words`` (int32 words of a row of x),
    ``sf_words`` (of a scale row; 0 without scales), ``slots`` K, the column tile ``width`` W
    (words), the vector-core count and the buffer versions."""

    row_words: int
    sf_words: int
    slots: int
    width: int
    vector_cores: int = 64
    num_buffers: int = VERSIONS

    @property
    def tiles(self) -> int:
        return -(-self.row_words // self.width)

    def plan(self) -> Plan:
        """``x_ub`` / ``o_ub`` the tile as loaded / as stored; ``s_ub`` / ``so_ub`` the scale row
        as loaded / as stored (only with scales)."""
        versions, width = self.num_buffers, padded(self.width)
        plan = {"x_ub": ((width,), WORD, versions), "o_ub": ((width,), WORD, versions)}
        if self.sf_words:
            plan["s_ub"] = ((padded(self.sf_words),), WORD, versions)
            plan["so_ub"] = ((padded(self.sf_words),), WORD, versions)
        return plan

    @property
    def layout(self) -> str:
        return (f"one (token, {self.width}-word tile) per pipeline step, {self.tiles} tile(s) per token; "
                "written to each routed pair's row")

    def describe(self) -> str:
        scales = f" + sf [R, {self.sf_words}] words" if self.sf_words else ""
        return f"moe_permute_rows [R, {self.row_words}] words{scales} K={self.slots} W={self.width}"


def _words(dtype, width: int) -> int:
    """int32 words of ``width`` elements of the torch ``dtype`` (a whole number: checked by the decline)."""
    return width * dtype.itemsize // WORD_BYTES


def tile_width(row_words: int, sf_words: int, slots: int) -> int:
    """The widest column tile (the whole row, else a multiple of 64 words, at most
    :data:`MAX_TILE`) whose double-buffered plan fits the budget."""
    def fits(width: int) -> bool:
        probe = CopySpec(row_words=width, sf_words=sf_words, slots=slots, width=width)
        return probe.footprint <= probe.budget

    return widest_tile(row_words, MAX_TILE, fits)


def index_spec_of(call, target: DeviceTarget | None = None) -> IndexSpec:
    """The index kernel's specialisation of a ``moe_permute`` call (``topk_idx`` ``[T, K]``)."""
    cores = (target or lowering_target()).vector_cores
    return IndexSpec(experts=call.num_experts, slots=call.num_slots, index_dtype=INDEX_DTYPES[str(call.index_dtype)],
                     alignment=call.alignment, vector_cores=cores)


def copy_spec_of(call, target: DeviceTarget | None = None) -> CopySpec:
    """The copy kernel's specialisation of a ``moe_permute`` call (``x`` ``[T, H]`` and ``x_sf``
    ``[T, F]`` as int32 words)."""
    cores = (target or lowering_target()).vector_cores
    row_words = _words(call.row_dtype, call.row_width)
    sf_words = 0 if call.sf_dtype is None else _words(call.sf_dtype, call.sf_width)
    return CopySpec(row_words=row_words, sf_words=sf_words, slots=call.num_slots,
                    width=tile_width(row_words, sf_words, call.num_slots), vector_cores=cores)


def decline_reason(call) -> str | None:
    """Why the Ascend ``moe_permute`` kernels cannot serve ``call`` (None: they can): the limits of
    ``moe_expert_counts``' macros its index kernel runs, then the copy kernel's own."""
    counting = expert_counts.decline_reason(call)
    if counting is not None:
        return counting
    row_bytes = call.row_width * call.row_dtype.itemsize
    sf_bytes = 0 if call.sf_dtype is None else call.sf_width * call.sf_dtype.itemsize
    if row_bytes % WORD_BYTES or sf_bytes % WORD_BYTES or call.input_alignment < WORD_BYTES:
        return (f"rows of {row_bytes} bytes (scale rows {sf_bytes}) at {call.input_alignment}-byte alignment are not "
                "whole 4-byte aligned words (the Ascend copy moves int32 words); falls to the reference")
    for spec in (index_spec_of(call), copy_spec_of(call)):
        if spec.footprint > spec.budget:
            return f"UB plan needs {spec.footprint} bytes > {spec.budget}; falls to the reference"
    return None


# ---------------------------------------------------------------------- the index kernel


def place_compute(spec: IndexSpec):
    """The per-row vector work of the second walk (a macro over the UB buffers by plan name):
    each slot's row from its expert's cursor, the cursor advanced, the permutation row stored.
    Looked up by :func:`build_index` at trace time; tests/ascend_bad_kernels.py replaces it
    with scalar code to show the vector check failing."""
    E, K = spec.experts, spec.slots
    nreg = rows.registers(E)
    fill = slot_broadcast(K, spec.index_dtype)

    @T.macro
    def compute(buffers):
        p_ub, b_ub, acc_ub, o_ub = (buffers[n] for n in ("p_ub", "b_ub", "acc_ub", "o_ub"))
        with T.SimdVF():
            ninf = neg_inf()
            lanes = T.simd.vci(T.float32(0.0), F32)
            fill(p_ub, b_ub, ninf, lanes)
            T.simd.mem_bar("VST_VLD")
            one = T.simd.vdup(T.float32(1.0), F32)
            zero = T.simd.vdup(T.float32(0.0), F32)
            unrouted = T.simd.vdup(T.float32(-1.0), F32)
            out = T.simd.alloc_var(F32)
            out = unrouted
            slot = T.simd.alloc_var(F32)
            slot = T.simd.vdup(T.float32(0.0), F32)
            for j in T.serial(K):
                expert = T.simd.vld(b_ub[j * LANES])
                row = T.simd.alloc_var(F32)
                row = zero
                for c in T.serial(nreg):
                    match = T.simd.vcmp(ramp(c), expert, op="eq")
                    cursor = T.simd.vld(acc_ub[c * LANES])
                    row = T.simd.vadd(row, T.simd.vsel(cursor, zero, match))
                    T.simd.vsts(acc_ub[c * LANES], T.simd.vadd(cursor, T.simd.vsel(one, zero, match)))
                T.simd.mem_bar("VST_VLD")
                value = T.simd.vsel(T.simd.vdupv(T.simd.vcadd(row)), unrouted,
                                    T.simd.vcmps(expert, T.float32(E), op="lt"))
                value = T.simd.vsel(value, unrouted, T.simd.vcmps(expert, T.float32(0.0), op="ge"))
                out = T.simd.vsel(value, out, T.simd.vcmp(lanes, slot, op="eq"))
                slot = T.simd.vadds(slot, T.float32(1.0))
            T.simd.vsts(o_ub[0], T.simd.vcvt(out, WORD, round="ROUND_R"))

    return compute


def index_parameters(spec: IndexSpec):
    """``I`` the int32 words of ``topk_idx`` (any row stride), ``PERM`` the permutation,
    ``ENDS`` expert_ends."""
    Tn = T.dynamic("T")
    return [
        ("I", T.StridedTensor((Tn, spec.words), (T.dynamic("i_s0"), 1), WORD)),
        ("PERM", T.Tensor((Tn, spec.slots), WORD)),
        ("ENDS", T.Tensor((spec.experts,), WORD)),
    ], Tn


def build_index(spec: IndexSpec):
    """The index kernel of ``spec`` (UB budget checked)."""
    rows.check_budget(spec.footprint, spec.budget, spec.describe())
    params, Tn = index_parameters(spec)
    plan = spec.plan()
    E, K, W = spec.experts, spec.slots, spec.words
    nreg = rows.registers(E)
    count = count_compute(spec.count_spec())
    scan = aligned_scan(E, spec.alignment)
    place = place_compute(spec)

    def index_kernel(tensors):
        G = gm.declare(tensors)
        with T.Kernel(1) as block:  # noqa: F841 - one block
            buffers, versions = rows.plan_buffers(plan)
            with T.SimdVF():
                for c in T.serial(nreg):
                    T.simd.vsts(buffers["acc_ub"][c * LANES], T.simd.vdup(T.float32(0.0), F32))
            # one annotation of every versioned buffer, given to both walks (a second, different
            # one would replace the first); each walk has its own index buffer
            for it in rows.row_loop(Tn, versions, spec.num_buffers):
                T.copy(G["I"][it, 0:W], buffers["i_ub"][0:W])
                count(buffers)
            scan(buffers["acc_ub"], None, buffers["e_ub"], buffers["acc_ub"])
            T.copy(buffers["e_ub"][0:E], G["ENDS"][0:E])
            for it in rows.row_loop(Tn, versions, spec.num_buffers):
                T.copy(G["I"][it, 0:W], buffers["p_ub"][0:W])
                place(buffers)
                T.copy(buffers["o_ub"][0:K], G["PERM"][it, 0:K])

    return gm.prim_func(index_kernel, params)


# ---------------------------------------------------------------------- the copy kernel


def copy_compute(spec: CopySpec):
    """The per-item vector work of ``spec``: the loaded tile (and scale row) copied register by
    register into the buffers the DMA out reads. Looked up by :func:`build_copy` at trace time;
    tests/ascend_bad_kernels.py replaces it with scalar code to show the vector check failing."""
    tile_registers = rows.registers(spec.width)
    sf_registers = rows.registers(spec.sf_words)

    @T.macro
    def compute(buffers):
        with T.SimdVF():
            for c in T.serial(tile_registers):
                T.simd.vsts(buffers["o_ub"][c * LANES], T.simd.vld(buffers["x_ub"][c * LANES]))
            if spec.sf_words > 0:
                for c in T.serial(sf_registers):
                    T.simd.vsts(buffers["so_ub"][c * LANES], T.simd.vld(buffers["s_ub"][c * LANES]))

    return compute


def copy_parameters(spec: CopySpec):
    """``X`` x as int32 words (any row stride), ``S`` x_sf as words (with scales), ``PERM`` the
    permutation, ``XE`` x_expanded as words, ``SE`` x_sf_expanded as words (with scales)."""
    Tn, Rn = T.dynamic("T"), T.dynamic("R")
    params = [("X", T.StridedTensor((Tn, spec.row_words), (T.dynamic("x_s0"), 1), WORD))]
    if spec.sf_words:
        params.append(("S", T.StridedTensor((Tn, spec.sf_words), (T.dynamic("s_s0"), 1), WORD)))
    params += [("PERM", T.Tensor((Tn, spec.slots), WORD)), ("XE", T.Tensor((Rn, spec.row_words), WORD))]
    if spec.sf_words:
        params.append(("SE", T.Tensor((Rn, spec.sf_words), WORD)))
    return params, Tn


def build_copy(spec: CopySpec):
    """The copy kernel of ``spec`` (UB budget checked)."""
    rows.check_budget(spec.footprint, spec.budget, spec.describe())
    params, Tn = copy_parameters(spec)
    plan = spec.plan()
    H, W, F, K, C, tiles = spec.row_words, spec.width, spec.sf_words, spec.slots, spec.vector_cores, spec.tiles
    compute = copy_compute(spec)

    def copy_kernel(tensors):
        G = gm.declare(tensors)
        with T.Kernel(C) as cid:
            buffers, versions = rows.plan_buffers(plan)
            for it in rows.row_loop(T.ceildiv(Tn - cid, C) * tiles, versions, spec.num_buffers):
                token = cid + (it // tiles) * C
                start = T.min((it % tiles) * W, H - W)
                T.copy(G["X"][token, start:start + W], buffers["x_ub"][0:W])
                if F > 0:
                    T.copy(G["S"][token, 0:F], buffers["s_ub"][0:F])
                compute(buffers)
                for j in T.serial(K):
                    row = G["PERM"][token, j]
                    if row >= 0:
                        T.copy(buffers["o_ub"][0:W], G["XE"][row, start:start + W])
                        if F > 0:
                            T.copy(buffers["so_ub"][0:F], G["SE"][row, 0:F])

    return gm.prim_func(copy_kernel, params)


# ---------------------------------------------------------------------- the kernel object


def _index_arguments(spec: IndexSpec, inputs, outputs) -> list:
    import torch

    return [inputs.topk_idx.view(torch.int32), outputs.permutation, outputs.expert_ends]


def _copy_arguments(spec: CopySpec, inputs, outputs) -> list:
    import torch

    arguments = [inputs.x.view(torch.int32)]
    if spec.sf_words:
        arguments.append(inputs.x_sf.view(torch.int32))
    arguments += [outputs.permutation, outputs.x_expanded.view(torch.int32)]
    if spec.sf_words:
        arguments.append(outputs.x_sf_expanded.view(torch.int32))
    return arguments


class PermuteKernel(SpecKernel):
    """``moe_permute``: the expanded tensors zeroed, then the index kernel, then the copy kernel."""

    def __init__(self) -> None:
        super().__init__("moe_permute", index_spec_of, decline_reason, build_index, _index_arguments)
        self.copies = CompileCache(build_copy)

    def describe(self, call) -> str:
        """Both specialisations ``call`` lowers to, in launch order, as one line."""
        return f"{index_spec_of(call).describe()}; {copy_spec_of(call).describe()}"

    def lowerings(self, call) -> list:
        """The index kernel's lowering and the copy kernel's, in launch order."""
        target = lowering_target()
        return [self.lowering(call), checked_lowering(copy_spec_of(call, target), build_copy, target)]

    def __call__(self, call, inputs, outputs) -> None:
        if inputs.topk_idx.shape[0] == 0:  # T = 0: expert_ends was allocated as zeros, R = 0
            return
        if outputs.x_expanded.shape[0] >= EXACT_ROWS:  # fp32 row numbers would not be exact: the reference's formula
            from tileplug.core.moe import formulas

            _, ends, permutation = formulas.expert_layout(inputs.topk_idx, call.num_experts, call.alignment)
            rows_total = outputs.x_expanded.shape[0]
            outputs.x_expanded.copy_(formulas.permute_rows(inputs.x, permutation, rows_total))
            if outputs.x_sf_expanded is not None:
                outputs.x_sf_expanded.copy_(formulas.permute_rows(inputs.x_sf, permutation, rows_total))
            outputs.permutation.copy_(permutation)
            outputs.expert_ends.copy_(ends)
            return
        target = dispatch_target(call.device)
        outputs.x_expanded.zero_()
        if outputs.x_sf_expanded is not None:
            outputs.x_sf_expanded.zero_()
        index_spec = self.spec_of(call, target)
        self.compiled.get(index_spec)(*_index_arguments(index_spec, inputs, outputs))
        copy_spec = copy_spec_of(call, target)
        self.copies.get(copy_spec)(*_copy_arguments(copy_spec, inputs, outputs))


KERNEL = PermuteKernel()
