"""The kernel objects of the CUDA MoE routing ops (the protocol side: ``supports`` / ``specs``
/ ``prepare`` and each kernel's argument order); the TileLang programs are built by
``topk_gate``, ``moe_topk_gate``, ``moe_topk_gate_backward``, ``normalize_weight``, ``routing``
and ``rows`` (``*Spec.build``).

Nothing here imports TileLang: a process that finds its kernels in the kernel index loads
them without TileLang's import (``jit``). A launcher is built once per call signature by
``prepare``: a call costs the tvm_ffi launches (and, for the layout ops, one scratch
allocation from torch's caching allocator); no host sync, no formatting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tileplug.backend_cuda import jit
from tileplug.backend_cuda.moe.spec import (
    MAX_EXPERTS,
    MAX_TOPK,
    VECTOR_BYTES,
    WARP,
    GateSpec,
    LayoutSpec,
    RowCopySpec,
    RowSpec,
    batched_layout,
    chunk_tokens,
    gate_ctas_per_sm,
    gate_fixed_heads,
    gate_unrolled,
    gate_vec,
    lane_groups,
    lane_heads,
    table_math,
)
from tileplug.core.call import Scoring

Launcher = Callable[[Any, Any], None]

MAX_NORMALIZE_SLOTS = 64
"""normalize_weight: a row's slots are one thread's registers."""
MAX_LAYOUT_SLOTS = 2048
"""Slots per token of the layout kernels (a chunk's ids are in shared memory)."""
MAX_ROW_ELEMENTS_PER_THREAD = 64
"""Row kernels: elements of a row one thread of 128 holds in registers (unpermute also holds
as many fp32 sums): rows of at most 8192 elements."""
ROW_THREADS = 128

GATE_VERIFIED = True
"""Whether ``MoeTopkGate.supports`` accepts calls. True since the GPU run of 2026-12-01 (fifth
session, H200, main at 5d9867f: ``tests/gpu/test_cuda_moe.py`` 362 passed) verified the kernel
after the fixes of :data:`GATE_FIX_COMMIT` (softmax denominator in the reference's pairwise
tree, correctly rounded exp / log1p, -inf logits flagged). Set to False, every call is declined
with :data:`GATE_UNVERIFIED` and falls to the next backend, while the compile grid still lowers
and compiles its specialisations (it asks :meth:`_Kernel.capability`, which ignores the switch)
and ``tests/gpu/test_cuda_moe.py`` sets it to True for its module: the state to put a changed
gate in until one GPU run verifies it."""
GATE_UNVERIFIED = ("not yet GPU-verified after the fixes of {commit}: weights were 3-5 ulp from the reference "
                   "and -inf logits under sqrtsoftplus were not flagged")
GATE_FIX_COMMIT = "e2063ca"
"""The commit whose fixes :data:`GATE_UNVERIFIED` names."""

TL_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
            torch.float8_e4m3fn: "float8_e4m3fn", torch.int8: "int8", torch.int32: "int32", torch.int16: "int16",
            torch.int64: "int64"}


def _row_view(tensor: torch.Tensor, vec: int) -> torch.Tensor:
    """``tensor`` ``[M, W]`` whose unused row stride (``M = 1``) is a multiple of ``vec``: the
    kernel's runtime check of ``T.assume(stride % vec == 0)`` reads it (a view, no copy)."""
    if vec > 1 and tensor.shape[0] == 1 and tensor.stride(0) % vec:
        width = tensor.shape[1]
        return tensor.as_strided(tensor.shape, (-(-width // vec) * vec, 1))
    return tensor


class _Kernel:
    """Base: ``supports`` (``op`` check then :meth:`reason`), ``source``, ``__call__``."""

    op = ""

    def supports(self, call: Any) -> str | None:
        return self.capability(call)

    def capability(self, call: Any) -> str | None:
        """What the kernel can compile and run (``supports`` may decline more: an unverified kernel)."""
        if call.op != self.op:
            return f"this kernel serves {self.op}, not {call.op}"
        return self.reason(call)

    def reason(self, call: Any) -> str | None:
        return None

    def specs(self, call: Any) -> list:
        raise NotImplementedError

    def spec(self, call: Any) -> Any:
        """The main specialisation serving ``call`` (the compile grid's entry)."""
        return self.specs(call)[0]

    def source(self, call: Any, arch: str = jit.DEFAULT_ARCH) -> str:
        """Generated CUDA source of the kernels serving ``call`` (no GPU needed)."""
        return "\n".join(jit.lower_source(spec, arch) for spec in self.specs(call))

    def __call__(self, call: Any, inputs: Any, outputs: Any) -> None:
        self.prepare(call)(inputs, outputs)


def _experts_reason(experts: int) -> str | None:
    if experts > MAX_EXPERTS:
        return f"E = {experts} experts: the CUDA kernels serve at most {MAX_EXPERTS} (one warp's registers / one scan CTA)"
    return None


def _selection_form(call: Any, vec: int) -> dict[str, Any]:
    """The ``GateSpec`` fields of how a gate's warp selects its ``k`` experts (both gates alike): the rounds over
    the lanes' heads, the heads kept in place, the register bound and the unrolled rounds."""
    headed = lane_heads()
    return {"lane_heads": headed, "fixed_heads": headed and gate_fixed_heads(),
            "ctas_per_sm": gate_ctas_per_sm(call.num_experts, vec), "unrolled": gate_unrolled(call.num_topk)}


class TopkGate(_Kernel):
    """``topk_gate``: one warp per row (``topk_gate.py``)."""

    op = "topk_gate"

    def reason(self, call: Any) -> str | None:
        if call.num_topk > MAX_TOPK:
            return f"k = {call.num_topk}: the CUDA warp top-k serves k <= {MAX_TOPK} (one lane per slot)"
        return _experts_reason(call.num_experts)

    def specs(self, call: Any) -> list:
        vec = gate_vec(call.num_experts, "float32", call.input_alignment)
        return [GateSpec("topk_gate", call.num_experts, call.num_topk, "float32", vec, **_selection_form(call, vec))]

    def prepare(self, call: Any) -> Launcher:
        spec = self.spec(call)
        kernel, vec = jit.entry(spec), spec.vec

        def launch(inputs: Any, outputs: Any) -> None:
            kernel(_row_view(inputs.scores, vec), outputs.topk_idx)

        return launch


class MoeTopkGate(_Kernel):
    """``moe_topk_gate``: one warp per row (``moe_topk_gate.py``)."""

    op = "moe_topk_gate"

    def supports(self, call: Any) -> str | None:
        reason = self.capability(call)
        if reason is None and not GATE_VERIFIED:
            return GATE_UNVERIFIED.format(commit=GATE_FIX_COMMIT)
        return reason

    def reason(self, call: Any) -> str | None:
        if call.logits_dtype not in (torch.bfloat16, torch.float32):
            return f"{call.logits_dtype} logits: the CUDA kernel serves bf16 and fp32 (fp64 is the reference's gradcheck dtype)"
        if call.num_slots > MAX_TOPK:
            return (f"k + shared = {call.num_slots} slots: the CUDA warp top-k serves at most {MAX_TOPK} "
                    "(one lane per slot)")
        if call.num_groups > WARP:
            return f"{call.num_groups} groups: the CUDA kernel serves at most {WARP} (one lane per group)"
        return _experts_reason(call.num_experts)

    def specs(self, call: Any) -> list:
        dtype = TL_NAMES[call.logits_dtype]
        vec = gate_vec(call.num_experts, dtype, call.input_alignment)
        scoring = {Scoring.SOFTMAX: "softmax", Scoring.SIGMOID: "sigmoid", Scoring.SQRTSOFTPLUS: "sqrtsoftplus"}
        return [GateSpec("moe_topk_gate", call.num_experts, call.num_topk, dtype, vec,
                         scoring=scoring[call.scoring], biased=call.has_bias, groups=call.num_groups,
                         topk_groups=call.topk_groups if call.num_groups > 1 else 1, renormalize=call.renormalize,
                         scaling=float(call.routed_scaling_factor), shared=call.num_shared_experts,
                         masked=call.has_mask, with_scores=call.return_scores,
                         lane_groups=lane_groups(call.num_experts, call.num_groups, vec),
                         table_math=table_math(scoring[call.scoring]), **_selection_form(call, vec))]

    def prepare(self, call: Any) -> Launcher:
        spec = self.spec(call)
        kernel, vec = jit.entry(spec), spec.vec
        biased, masked, with_scores = spec.biased, spec.masked, spec.with_scores

        def launch(inputs: Any, outputs: Any) -> None:
            logits = _row_view(inputs.logits, vec)
            kernel(logits, inputs.bias if biased else logits, inputs.mask if masked else logits, outputs.topk_idx,
                   outputs.topk_weights, outputs.scores if with_scores else logits)

        return launch


class NormalizeWeight(_Kernel):
    """``normalize_weight``: one thread per row (``normalize_weight.py``)."""

    op = "normalize_weight"

    def reason(self, call: Any) -> str | None:
        if call.num_slots > MAX_NORMALIZE_SLOTS:
            return f"K = {call.num_slots} slots: the CUDA kernel serves at most {MAX_NORMALIZE_SLOTS} (one thread's registers)"
        return None

    def specs(self, call: Any) -> list:
        return [RowSpec("normalize_weight", call.num_slots)]

    def prepare(self, call: Any) -> Launcher:
        kernel = jit.entry(self.spec(call))

        def launch(inputs: Any, outputs: Any) -> None:
            kernel(inputs.topk_weights, outputs.denominator, outputs.normalized)

        return launch


class MoeTopkGateBackward(_Kernel):
    """``moe_topk_gate_backward``: one warp per row (``moe_topk_gate_backward.py``), scalar
    loads (the call carries no alignment of the scores)."""

    op = "moe_topk_gate_backward"

    def reason(self, call: Any) -> str | None:
        if call.dtype != torch.float32:
            return f"{call.dtype} scores: the CUDA kernel serves fp32 (fp64 is the reference's gradcheck dtype)"
        if call.num_slots > MAX_TOPK:
            return f"K = {call.num_slots} slots: the CUDA kernel serves at most {MAX_TOPK} (one lane per slot)"
        return _experts_reason(call.num_experts)

    def specs(self, call: Any) -> list:
        scoring = {Scoring.SOFTMAX: "softmax", Scoring.SIGMOID: "sigmoid", Scoring.SQRTSOFTPLUS: "sqrtsoftplus"}
        return [GateSpec("moe_topk_gate_backward", call.num_experts, call.num_slots, "float32", 1,
                         scoring=scoring[call.scoring], renormalize=call.renormalize,
                         scaling=float(call.routed_scaling_factor), masked=call.has_mask,
                         index_dtype=TL_NAMES[call.index_dtype])]

    def prepare(self, call: Any) -> Launcher:
        spec = self.spec(call)
        kernel, masked = jit.entry(spec), spec.masked

        def launch(inputs: Any, outputs: Any) -> None:
            scores = inputs.scores
            kernel(scores, inputs.topk_idx, inputs.grad_topk_weights, inputs.mask if masked else scores,
                   outputs.grad_logits)

        return launch


def _layout_reason(call: Any) -> str | None:
    if call.num_slots > MAX_LAYOUT_SLOTS:
        return f"K = {call.num_slots} slots: the CUDA layout kernels serve at most {MAX_LAYOUT_SLOTS}"
    return _experts_reason(call.num_experts)


class ExpertCounts(_Kernel):
    """``moe_expert_counts``: per-chunk counts, then the one-CTA expert scan (``routing.py``)."""

    op = "moe_expert_counts"

    def reason(self, call: Any) -> str | None:
        return _layout_reason(call)

    def specs(self, call: Any) -> list:
        index = TL_NAMES[call.index_dtype]
        batched = batched_layout()
        return [LayoutSpec("chunk_counts", call.num_experts, call.num_slots, index, batched=batched),
                LayoutSpec("expert_scan", call.num_experts, alignment=call.alignment, batched=batched)]

    def prepare(self, call: Any) -> Launcher:
        counts_spec, scan_spec = self.specs(call)
        count, scan = jit.entry(counts_spec), jit.entry(scan_spec)
        per_chunk, experts = chunk_tokens(call.num_slots), call.num_experts

        def launch(inputs: Any, outputs: Any) -> None:
            topk_idx = inputs.topk_idx
            partial = torch.empty((-(-topk_idx.shape[0] // per_chunk), experts), dtype=torch.int32,
                                  device=topk_idx.device)
            count(topk_idx, partial)
            scan(partial, outputs.counts, outputs.expert_ends)

        return launch


def _row_vec(dtype: torch.dtype, width: int, alignment: int) -> int:
    """Elements per piece of a row: 16 bytes when rows are 16-byte multiples and aligned, else 1."""
    size = torch.empty((), dtype=dtype).element_size()
    return VECTOR_BYTES // size if (width * size) % VECTOR_BYTES == 0 and alignment >= VECTOR_BYTES else 1


def _pieces_reason(width: int, vec: int) -> str | None:
    per_thread = -(-(-(-width // vec)) // ROW_THREADS) * vec
    if per_thread > MAX_ROW_ELEMENTS_PER_THREAD:
        return (f"a row of {width} elements needs {per_thread} per thread (the CUDA row kernels hold at most "
                f"{MAX_ROW_ELEMENTS_PER_THREAD} in registers: rows of at most {MAX_ROW_ELEMENTS_PER_THREAD * ROW_THREADS})")
    return None


class Permute(_Kernel):
    """``moe_permute``: the layout kernels, then the row copy with the padding zeros (``routing.py``, ``rows.py``)."""

    op = "moe_permute"

    def reason(self, call: Any) -> str | None:
        return _layout_reason(call) or _pieces_reason(call.row_width, self._vec(call))

    @staticmethod
    def _vec(call: Any) -> int:
        return _row_vec(call.row_dtype, call.row_width, call.input_alignment)

    def specs(self, call: Any) -> list:
        index, dtype, vec = TL_NAMES[call.index_dtype], TL_NAMES[call.row_dtype], self._vec(call)
        sf = None if call.sf_dtype is None else TL_NAMES[call.sf_dtype]
        width = call.sf_width or 0
        batched = batched_layout()
        return [RowCopySpec("permute_rows", dtype, call.row_width, vec, slots=call.num_slots,
                            experts=call.num_experts, alignment=call.alignment, sf_dtype=sf, sf_width=width,
                            batched=batched),
                LayoutSpec("chunk_counts", call.num_experts, call.num_slots, index, batched=batched),
                LayoutSpec("expert_scan", call.num_experts, alignment=call.alignment, bases=True, batched=batched),
                LayoutSpec("permute_index", call.num_experts, call.num_slots, index, batched=batched)]

    def prepare(self, call: Any) -> Launcher:
        rows_spec, counts_spec, scan_spec, index_spec = self.specs(call)
        copy, count, scan = jit.entry(rows_spec), jit.entry(counts_spec), jit.entry(scan_spec)
        place = jit.entry(index_spec)
        per_chunk, experts, vec = chunk_tokens(call.num_slots), call.num_experts, rows_spec.vec
        scaled = call.sf_dtype is not None

        def launch(inputs: Any, outputs: Any) -> None:
            topk_idx, x = inputs.topk_idx, _row_view(inputs.x, vec)
            device = topk_idx.device
            partial = torch.empty((-(-topk_idx.shape[0] // per_chunk), experts), dtype=torch.int32, device=device)
            counts = torch.empty((experts,), dtype=torch.int32, device=device)
            count(topk_idx, partial)
            scan(partial, counts, outputs.expert_ends)
            place(topk_idx, partial, outputs.permutation)
            expanded = outputs.x_expanded  # its copies and its padding rows' zeros: one launch
            copy(outputs.expert_ends, x, inputs.x_sf if scaled else x, outputs.permutation, expanded,
                 outputs.x_sf_expanded if scaled else expanded)

        return launch


class Unpermute(_Kernel):
    """``moe_unpermute``: one CTA per token (``rows.py``)."""

    op = "moe_unpermute"

    def reason(self, call: Any) -> str | None:
        return _pieces_reason(call.hidden, self._vec(call))

    @staticmethod
    def _vec(call: Any) -> int:
        return _row_vec(call.dtype, call.hidden, call.input_alignment)

    def specs(self, call: Any) -> list:
        return [RowCopySpec("unpermute", TL_NAMES[call.dtype], call.hidden, self._vec(call), slots=call.num_slots,
                            index_dtype=TL_NAMES[call.permutation_dtype])]

    def prepare(self, call: Any) -> Launcher:
        spec = self.spec(call)
        kernel, vec = jit.entry(spec), spec.vec

        def launch(inputs: Any, outputs: Any) -> None:
            kernel(_row_view(inputs.y_expanded, vec), inputs.permutation, inputs.topk_weights, outputs.y)

        return launch
