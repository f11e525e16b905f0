"""Contracts of the MoE routing family (SPEC.md §7, docs/spec.md "MoE routing").

Each builder checks every argument (ContractError naming it) and returns a frozen, hashable
call (the selection cache key and the kernel specialisation) and the tensors the kernel
reads. The calls hold what a kernel specialises on — expert count, top-k, scoring function,
group routing, flags, dtypes, the byte alignment of the row tensor — never the token count.

Shapes (``T`` tokens, ``E`` experts, ``k`` routed slots, ``S`` shared-expert slots,
``K`` = the slot count of a ``topk_idx``, ``H`` the row width, ``R`` expanded rows):

- ``topk_gate``: ``scores`` fp32 ``[T, E]`` → ``topk_idx`` int64 ``[T, k]``.
- ``normalize_weight``: ``topk_weights`` fp32 ``[T, K]`` → ``denominator`` fp32 ``[T]``,
  ``normalized`` fp32 ``[T, K]``.
- ``moe_topk_gate``: ``logits`` bf16 / fp32 (fp64: reference, for gradcheck) ``[T, E]``,
  ``bias`` fp32 ``[E]``, ``mask`` bool ``[T]`` → ``topk_idx`` int64 ``[T, k + S]``,
  ``topk_weights`` ``[T, k + S]`` and (``return_scores``) ``scores`` ``[T, E]``, both in the
  compute dtype (fp32; fp64 for fp64 logits).
- ``moe_topk_gate_backward``: ``scores`` / ``topk_weights`` / ``grad_topk_weights`` in one
  compute dtype, ``topk_idx`` int32 / int64 ``[T, K]`` → ``grad_logits`` ``[T, E]`` (that dtype).
- ``moe_expert_counts``: ``topk_idx`` int32 / int64 ``[T, K]`` → ``counts``, ``expert_ends``
  int32 ``[E]``.
- ``moe_permute``: ``x`` ``[T, H]`` (bf16 / fp16 / fp32, or quantized e4m3 / packed e2m1 with
  its row-major ``x_sf`` ``[T, F]``) → ``x_expanded`` ``[R, H]``, ``x_sf_expanded`` ``[R, F]``
  (None without sf), ``permutation`` int32 ``[T, K]``, ``expert_ends`` int32 ``[E]``, where
  ``R = T·K + min(T·K, E − 1)·(alignment − 1)`` is the largest layout any routing can need.
- ``moe_unpermute``: ``y_expanded`` ``[R, H]`` bf16 / fp16 / fp32, ``permutation`` int32 /
  int64 ``[T, K]``, ``topk_weights`` fp32 ``[T, K]`` → ``y`` ``[T, H]`` in y_expanded's dtype.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from tileplug.core import config
from tileplug.core.call import Call, Ledger, Scoring, call_type
from tileplug.core.contracts.checks import check_bool, check_same_device, check_tensor, describe
from tileplug.core.contracts.quant import RecentCalls, byte_alignment
from tileplug.core.errors import ContractError

TOPK_GATE = "topk_gate"
NORMALIZE_WEIGHT = "normalize_weight"
MOE_TOPK_GATE = "moe_topk_gate"
MOE_TOPK_GATE_BACKWARD = "moe_topk_gate_backward"
MOE_EXPERT_COUNTS = "moe_expert_counts"
MOE_PERMUTE = "moe_permute"
MOE_UNPERMUTE = "moe_unpermute"

LOGITS_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
"""``moe_topk_gate`` logits: bf16 and fp32 (SPEC §7), and fp64, computed in fp64 throughout, so
that ``torch.autograd.gradcheck`` can check the backward (the reference serves it; another
backend may decline it)."""
WEIGHT_DTYPES = (torch.float32, torch.float64)
"""Scores, weights and their gradients: the compute dtype (fp64 only for fp64 logits)."""
INDEX_DTYPES = (torch.int64, torch.int32)
ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Unquantized rows ``moe_permute`` copies and ``moe_unpermute`` reads."""
QUANTIZED_ROW_DTYPES = (torch.float8_e4m3fn, torch.int8)
"""Quantized rows ``moe_permute`` copies with their scale rows: e4m3 values, or e2m1 values
packed two per int8 byte (the layouts ``per_token_cast`` produces)."""
SF_DTYPES = (torch.float32, torch.float8_e4m3fn, torch.int32, torch.int16)
"""Scale rows ``moe_permute`` copies: fp32, e4m3-stored, packed UE8M0 (int32: CUDA layout,
int16: Ascend layout), always row-major ``[T, F]``."""
ROUTED_SCALING_LIMIT = 2.0**64
"""``routed_scaling_factor`` bound: weights stay far from the fp32 overflow."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 for fp64 inputs, fp32 otherwise: the dtype scores, weights and gradients are in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def expanded_rows(tokens: int, num_slots: int, num_experts: int, alignment: int) -> int:
    """``R``: rows of ``moe_permute``'s expanded layout, the most any routing of ``tokens × num_slots``
    pairs over ``num_experts`` experts with ``alignment`` can fill. Every routed pair takes one
    row; padding follows only an expert with rows whose end is unaligned and which is not the
    last, at most ``alignment − 1`` rows each: ``T·K + min(T·K, E − 1)·(alignment − 1)``."""
    pairs = tokens * num_slots
    return pairs + min(pairs, num_experts - 1) * (alignment - 1)


# ---------------------------------------------------------------------- inputs and outputs


class TopkGateInputs(NamedTuple):
    """What a ``topk_gate`` kernel reads: ``scores`` fp32 ``[T, E]`` (unit last stride)."""

    scores: torch.Tensor


class TopkGateOutputs(NamedTuple):
    """What a ``topk_gate`` kernel writes: ``topk_idx`` int64 ``[T, k]``, contiguous."""

    topk_idx: torch.Tensor


class NormalizeWeightInputs(NamedTuple):
    """What a ``normalize_weight`` kernel reads: ``topk_weights`` fp32 ``[T, K]``."""

    topk_weights: torch.Tensor


class NormalizeWeightOutputs(NamedTuple):
    """``denominator`` fp32 ``[T]`` and ``normalized`` fp32 ``[T, K]``, contiguous."""

    denominator: torch.Tensor
    normalized: torch.Tensor


class MoeGateInputs(NamedTuple):
    """What a ``moe_topk_gate`` kernel reads: ``logits`` ``[T, E]`` (unit last stride, any row
    stride), ``bias`` fp32 ``[E]`` contiguous or None, ``mask`` bool ``[T]`` contiguous or None."""

    logits: torch.Tensor
    bias: torch.Tensor | None
    mask: torch.Tensor | None


class MoeGateOutputs(NamedTuple):
    """What a ``moe_topk_gate`` kernel writes, contiguous: ``topk_idx`` int64 ``[T, k + S]``,
    ``topk_weights`` ``[T, k + S]`` and ``scores`` ``[T, E]`` (None unless the call returns them)
    in the compute dtype."""

    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    scores: torch.Tensor | None


class MoeGateBackwardInputs(NamedTuple):
    """What a ``moe_topk_gate_backward`` kernel reads: the forward's ``scores`` ``[T, E]``,
    ``topk_idx`` ``[T, K]``, ``topk_weights`` ``[T, K]``, the incoming ``grad_topk_weights``
    ``[T, K]`` and the forward's ``mask`` ``[T]`` or None (unit last strides)."""

    scores: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    grad_topk_weights: torch.Tensor
    mask: torch.Tensor | None


class MoeGateBackwardOutputs(NamedTuple):
    """``grad_logits`` ``[T, E]`` in the scores' dtype, contiguous."""

    grad_logits: torch.Tensor


class ExpertCountsInputs(NamedTuple):
    """What a ``moe_expert_counts`` kernel reads: ``topk_idx`` int32 / int64 ``[T, K]``."""

    topk_idx: torch.Tensor


class ExpertCountsOutputs(NamedTuple):
    """``counts`` and ``expert_ends`` int32 ``[E]`` (zeros for ``T = 0``, nothing launched)."""

    counts: torch.Tensor
    expert_ends: torch.Tensor


class PermuteInputs(NamedTuple):
    """What a ``moe_permute`` kernel reads: ``x`` ``[T, H]`` (unit last stride, any row stride),
    ``topk_idx`` ``[T, K]`` and the scale rows ``x_sf`` ``[T, F]`` of a quantized ``x`` (or None)."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    x_sf: torch.Tensor | None


class PermuteOutputs(NamedTuple):
    """What a ``moe_permute`` kernel writes, contiguous: ``x_expanded`` ``[R, H]`` (x's dtype),
    ``x_sf_expanded`` ``[R, F]`` (x_sf's dtype; None without sf), ``permutation`` int32
    ``[T, K]`` and ``expert_ends`` int32 ``[E]`` (zeros for ``T = 0``, nothing launched)."""

    x_expanded: torch.Tensor
    x_sf_expanded: torch.Tensor | None
    permutation: torch.Tensor
    expert_ends: torch.Tensor


class UnpermuteInputs(NamedTuple):
    """What a ``moe_unpermute`` kernel reads: ``y_expanded`` ``[R, H]`` (unit last stride),
    ``permutation`` ``[T, K]``, ``topk_weights`` fp32 ``[T, K]``."""

    y_expanded: torch.Tensor
    permutation: torch.Tensor
    topk_weights: torch.Tensor


class UnpermuteOutputs(NamedTuple):
    """``y`` ``[T, H]`` in y_expanded's dtype, contiguous."""

    y: torch.Tensor


# ---------------------------------------------------------------------- the calls


class MoePlan:
    """The allocation plan of one MoE call signature: the call's own ``allocate`` for any token count."""

    __slots__ = ("call",)

    def __init__(self, call: Any) -> None:
        self.call = call

    def allocate(self, tokens: int, device: torch.device | None) -> Any:
        return self.call.allocate(tokens, device)


class _MoeCall:
    """What every MoE call shares (a mixin of plain methods: the fields live on each call)."""

    __slots__ = ()

    def allocation_plan(self, traits: Any) -> MoePlan:
        return MoePlan(self)


@call_type
class TopkGateCall(_MoeCall, Call):
    """One ``topk_gate`` call: ``num_experts`` E (the scores' width), ``num_topk`` k (1 ≤ k ≤ E;
    every backend serves k ≤ 32), ``input_alignment`` the byte alignment (1..16) of the scores'
    data pointer and row stride. Scores are fp32."""

    num_experts: int
    num_topk: int
    input_alignment: int = 16

    def allocate(self, tokens: int, device: torch.device | None) -> TopkGateOutputs:
        return TopkGateOutputs(torch.empty((tokens, self.num_topk), dtype=torch.int64, device=device))

    def result(self, outputs: TopkGateOutputs) -> torch.Tensor:
        return outputs.topk_idx

    def ledger(self, traits: Any) -> Ledger:
        """One read of the scores, one write of the indices; ~k comparisons per score."""
        tokens = self.tokens
        return Ledger(tokens * self.num_experts * 4, tokens * self.num_topk * 8,
                      tokens * self.num_experts * self.num_topk)


@call_type
class NormalizeWeightCall(_MoeCall, Call):
    """One ``normalize_weight`` call: ``num_slots`` K (the weights' width). Weights are fp32."""

    num_slots: int

    def allocate(self, tokens: int, device: torch.device | None) -> NormalizeWeightOutputs:
        fill = torch.zeros if self.num_slots == 0 else torch.empty  # no slot: the sum over none, nothing launched
        return NormalizeWeightOutputs(fill((tokens,), dtype=torch.float32, device=device),
                                      torch.empty((tokens, self.num_slots), dtype=torch.float32, device=device))

    def result(self, outputs: NormalizeWeightOutputs) -> tuple[torch.Tensor, torch.Tensor]:
        return outputs.denominator, outputs.normalized

    def ledger(self, traits: Any) -> Ledger:
        elements = self.tokens * self.num_slots
        return Ledger(elements * 4, elements * 4 + self.tokens * 4, 2 * elements)


@call_type
class MoeGateCall(_MoeCall, Call):
    """One ``moe_topk_gate`` call.

    - ``num_experts`` E, ``num_topk`` k routed slots (1 ≤ k ≤ topk_groups · E / num_groups).
    - ``scoring``: :class:`tileplug.core.call.Scoring` (softmax, sigmoid, sqrtsoftplus).
    - ``logits_dtype``: bf16, fp32 or fp64 (fp64: computed in fp64, the reference's gradcheck dtype).
    - ``has_bias``: an fp32 ``[E]`` selection bias is added to the scores for selection only.
    - ``num_groups`` G (divides E; groups of ≥ 2 experts when G > 1), ``topk_groups`` (1..G):
      group-limited routing (G = 1: none).
    - ``renormalize``: the routed weights are divided by their sum (+1e-20);
      ``routed_scaling_factor``: then multiplied by this (a finite float > 0).
    - ``num_shared_experts`` S: slots ``k .. k+S-1`` hold experts ``E .. E+S-1`` with weight 1.
    - ``has_mask``: a bool ``[T]`` mask is given (False rows: index −1, weight 0 everywhere).
    - ``return_scores``: the unbiased scores ``[T, E]`` are written too.
    - ``input_alignment``: byte alignment (1..16) of the logits' data pointer and row stride.
    """

    num_experts: int
    num_topk: int
    scoring: Scoring
    logits_dtype: torch.dtype
    has_bias: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    has_mask: bool = False
    return_scores: bool = False
    input_alignment: int = 16

    @property
    def num_slots(self) -> int:
        """Output slots per token: ``k + S``."""
        return self.num_topk + self.num_shared_experts

    @property
    def group_size(self) -> int:
        """Experts per group: ``E / G``."""
        return self.num_experts // self.num_groups

    @property
    def compute_dtype(self) -> torch.dtype:
        return compute_dtype(self.logits_dtype)

    def allocate(self, tokens: int, device: torch.device | None) -> MoeGateOutputs:
        work = self.compute_dtype
        scores = torch.empty((tokens, self.num_experts), dtype=work, device=device) if self.return_scores else None
        return MoeGateOutputs(torch.empty((tokens, self.num_slots), dtype=torch.int64, device=device),
                              torch.empty((tokens, self.num_slots), dtype=work, device=device), scores)

    def result(self, outputs: MoeGateOutputs) -> tuple[torch.Tensor, ...]:
        """``(topk_idx, topk_weights)``, then ``scores`` with ``return_scores``."""
        if self.return_scores:
            return outputs.topk_idx, outputs.topk_weights, outputs.scores
        return outputs.topk_idx, outputs.topk_weights

    def ledger(self, traits: Any) -> Ledger:
        """One read of logits (and bias, mask), one write of indices, weights (and scores);
        ~(k + 8) operations per logit (scoring, selection)."""
        tokens, experts, work = self.tokens, self.num_experts, self.compute_dtype.itemsize
        read = tokens * experts * self.logits_dtype.itemsize + (experts * 4 if self.has_bias else 0)
        read += tokens if self.has_mask else 0
        written = tokens * self.num_slots * (8 + work) + (tokens * experts * work if self.return_scores else 0)
        return Ledger(read, written, tokens * experts * (self.num_topk + 8))


@call_type
class MoeGateBackwardCall(_MoeCall, Call):
    """One ``moe_topk_gate_backward`` call: ``num_experts`` E (the scores' width), ``num_slots``
    K (topk_idx's width; slots whose index is outside ``[0, E)`` — −1, shared experts — carry
    no gradient), ``scoring``, ``dtype`` of scores / weights / gradients (fp32, or fp64),
    ``index_dtype`` of topk_idx, ``renormalize``, ``routed_scaling_factor`` and ``has_mask``
    as in the forward."""

    num_experts: int
    num_slots: int
    scoring: Scoring
    dtype: torch.dtype
    index_dtype: torch.dtype = torch.int64
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    has_mask: bool = False

    def allocate(self, tokens: int, device: torch.device | None) -> MoeGateBackwardOutputs:
        return MoeGateBackwardOutputs(torch.empty((tokens, self.num_experts), dtype=self.dtype, device=device))

    def result(self, outputs: MoeGateBackwardOutputs) -> torch.Tensor:
        return outputs.grad_logits

    def ledger(self, traits: Any) -> Ledger:
        tokens, size = self.tokens, self.dtype.itemsize
        read = tokens * self.num_experts * size + tokens * self.num_slots * (self.index_dtype.itemsize + 2 * size)
        read += tokens if self.has_mask else 0
        return Ledger(read, tokens * self.num_experts * size, tokens * (4 * self.num_experts + 4 * self.num_slots))


@call_type
class ExpertCountsCall(_MoeCall, Call):
    """One ``moe_expert_counts`` call: ``num_experts`` E, ``num_slots`` K (topk_idx's width),
    ``index_dtype``, ``alignment`` (≥ 1: each expert's first row is a multiple of it)."""

    num_experts: int
    num_slots: int
    index_dtype: torch.dtype = torch.int64
    alignment: int = 1

    def allocate(self, tokens: int, device: torch.device | None) -> ExpertCountsOutputs:
        fill = torch.zeros if tokens == 0 or self.num_slots == 0 else torch.empty  # nothing is launched then
        return ExpertCountsOutputs(fill((self.num_experts,), dtype=torch.int32, device=device),
                                   fill((self.num_experts,), dtype=torch.int32, device=device))

    def result(self, outputs: ExpertCountsOutputs) -> tuple[torch.Tensor, torch.Tensor]:
        return outputs.counts, outputs.expert_ends

    def ledger(self, traits: Any) -> Ledger:
        pairs = self.tokens * self.num_slots
        return Ledger(pairs * self.index_dtype.itemsize, 2 * self.num_experts * 4, pairs + self.num_experts)


@call_type
class PermuteCall(_MoeCall, Call):
    """One ``moe_permute`` call.

    - ``num_experts`` E, ``num_slots`` K (topk_idx's width), ``index_dtype``, ``alignment``.
    - ``row_dtype`` / ``row_width``: x's dtype and physical row width (e2m1: H/2 bytes).
    - ``sf_dtype`` / ``sf_width``: the scale rows' dtype and width F (None: no scales).
    - ``input_alignment``: byte alignment (1..16) of x's (and x_sf's) data pointers and row strides.
    """

    num_experts: int
    num_slots: int
    row_dtype: torch.dtype
    row_width: int
    index_dtype: torch.dtype = torch.int64
    alignment: int = 1
    sf_dtype: torch.dtype | None = None
    sf_width: int | None = None
    input_alignment: int = 16

    def expanded_rows(self, tokens: int) -> int:
        """``R`` at ``tokens`` (:func:`expanded_rows`)."""
        return expanded_rows(tokens, self.num_slots, self.num_experts, self.alignment)

    def allocate(self, tokens: int, device: torch.device | None) -> PermuteOutputs:
        rows = self.expanded_rows(tokens)
        fill = torch.zeros if tokens == 0 else torch.empty  # nothing is launched for T = 0
        sf = None
        if self.sf_dtype is not None:
            sf = torch.empty((rows, self.sf_width), dtype=self.sf_dtype, device=device)
        return PermuteOutputs(
            torch.empty((rows, self.row_width), dtype=self.row_dtype, device=device), sf,
            torch.empty((tokens, self.num_slots), dtype=torch.int32, device=device),
            fill((self.num_experts,), dtype=torch.int32, device=device))

    def result(self, outputs: PermuteOutputs) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        return outputs.x_expanded, outputs.x_sf_expanded, outputs.permutation, outputs.expert_ends

    def ledger(self, traits: Any) -> Ledger:
        """x (and x_sf) read once and topk_idx; every expanded row written (copies and zero
        padding), the permutation and the ends."""
        tokens, rows = self.tokens, self.expanded_rows(self.tokens)
        row_bytes = self.row_width * self.row_dtype.itemsize
        sf_bytes = 0 if self.sf_dtype is None else self.sf_width * self.sf_dtype.itemsize
        pairs = tokens * self.num_slots
        read = tokens * (row_bytes + sf_bytes) + pairs * self.index_dtype.itemsize
        written = rows * (row_bytes + sf_bytes) + pairs * 4 + self.num_experts * 4
        return Ledger(read, written, pairs + self.num_experts)


@call_type
class UnpermuteCall(_MoeCall, Call):
    """One ``moe_unpermute`` call: ``hidden`` H, ``dtype`` of y_expanded (and y),
    ``num_slots`` K, ``permutation_dtype``, ``input_alignment`` (byte alignment of
    y_expanded's data pointer and row stride). ``R`` (y_expanded's rows) is a runtime size."""

    hidden: int
    dtype: torch.dtype
    num_slots: int
    permutation_dtype: torch.dtype = torch.int32
    input_alignment: int = 16

    def allocate(self, tokens: int, device: torch.device | None) -> UnpermuteOutputs:
        return UnpermuteOutputs(torch.empty((tokens, self.hidden), dtype=self.dtype, device=device))

    def result(self, outputs: UnpermuteOutputs) -> torch.Tensor:
        return outputs.y

    def ledger(self, traits: Any) -> Ledger:
        """Every routed slot's row read once (K rows per token at most), the permutation and
        weights; y written once; a multiply-add per element of each slot."""
        tokens, size = self.tokens, self.dtype.itemsize
        pairs = tokens * self.num_slots
        read = pairs * self.hidden * size + pairs * (self.permutation_dtype.itemsize + 4)
        return Ledger(read, tokens * self.hidden * size, 2 * pairs * self.hidden)


# ---------------------------------------------------------------------- argument checks


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_int(op: str, name: str, value: Any, low: int, high: int | None = None, why: str = "") -> int:
    """An exact int (not a bool) with ``low ≤ value ≤ high``."""
    if value.__class__ is int and value >= low and (high is None or value <= high):
        return value
    bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ContractError(op, name, f"an int {bounds}{why}", describe(value))


def _check_table(op: str, name: str, value: Any, dtypes: tuple[torch.dtype, ...], what: str,
                 min_width: int = 1) -> torch.Tensor:
    """A 2-D ``[T, ...]`` tensor of one of ``dtypes``, unit last stride, width ≥ ``min_width``."""
    tensor = check_tensor(op, name, value)
    if tensor.dim() != 2:
        raise ContractError(op, name, f"a 2-D {what} tensor", describe(tensor))
    if tensor.dtype not in dtypes:
        raise ContractError(op, name, f"dtype in ({_names(dtypes)})", describe(tensor))
    if tensor.shape[1] < min_width:
        raise ContractError(op, name, f"a {what} tensor with at least {min_width} column(s)", describe(tensor))
    if tensor.shape[1] > 1 and tensor.stride(1) != 1:
        raise ContractError(op, name, "unit stride on the last dim", describe(tensor))
    return tensor


def _check_rows_like(op: str, name: str, value: Any, tokens: int, width: int | None, dtypes: tuple[torch.dtype, ...],
                     device: torch.device, what: str, of: str) -> torch.Tensor:
    """A ``[T, width]`` companion tensor (``width`` None: any ≥ 1) on ``device``, the device of ``of``."""
    tensor = _check_table(op, name, value, dtypes, what)
    if tensor.shape[0] != tokens or (width is not None and tensor.shape[1] != width):
        shape = f"[{tokens}, {'K' if width is None else width}]"
        raise ContractError(op, name, f"a tensor of shape {shape} (one row per token)", describe(tensor))
    check_same_device(op, name, tensor, device, of)
    return tensor


def _check_vector(op: str, name: str, value: Any, length: int, dtypes: tuple[torch.dtype, ...],
                  device: torch.device, what: str, of: str) -> torch.Tensor | None:
    """None, or a contiguous 1-D ``[length]`` tensor of one of ``dtypes`` on ``device``, the device of ``of``."""
    if value is None:
        return None
    tensor = check_tensor(op, name, value)
    if tensor.dim() != 1 or tensor.shape[0] != length:
        raise ContractError(op, name, f"a 1-D tensor of shape [{length}] ({what})", describe(tensor))
    if tensor.dtype not in dtypes:
        raise ContractError(op, name, f"dtype in ({_names(dtypes)})", describe(tensor))
    check_same_device(op, name, tensor, device, of)
    if length > 1 and tensor.stride(0) != 1:
        raise ContractError(op, name, "unit stride (a contiguous vector)", describe(tensor))
    return tensor


def check_scoring(op: str, value: Any) -> Scoring:
    """``scoring``: 'softmax', 'sigmoid' or 'sqrtsoftplus' (or the :class:`Scoring` member)."""
    if isinstance(value, Scoring):
        return value
    if isinstance(value, str):
        for member in Scoring:
            if member.value == value:
                return member
    raise ContractError(op, "scoring", f"one of {', '.join(repr(m.value) for m in Scoring)}", describe(value))


def _check_scaling(op: str, value: Any) -> float:
    if (value.__class__ is float or value.__class__ is int) and math.isfinite(value) \
            and 0 < value <= ROUTED_SCALING_LIMIT:
        return float(value)
    raise ContractError(op, "routed_scaling_factor", "a finite float > 0 (at most 2**64)", describe(value))


def _plain(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """Kernels read plain tensors: autograd, where recorded, is the custom op's registration."""
    return tensor.detach() if tensor is not None and tensor.requires_grad else tensor


def _base(op: str, tensor: torch.Tensor) -> dict[str, Any]:
    current = config.current()
    return dict(host_layout=current.host_layout, sf_alignment_bytes=current.token_alignment_bytes,
                tokens=int(tensor.shape[0]), device=tensor.device, empty=tensor.numel() == 0)


# ---------------------------------------------------------------------- the checked contracts


def _checked_topk_gate(scores: Any, num_topk: Any) -> TopkGateCall:
    op = TOPK_GATE
    scores = _check_table(op, "scores", scores, (torch.float32,), "[T, E] scores")
    experts = int(scores.shape[1])
    k = check_int(op, "num_topk", num_topk, 1, experts, " (at most E, the scores' width)")
    return TopkGateCall(op, scores.device.type, op, experts, k, byte_alignment(scores), **_base(op, scores))


def _checked_normalize_weight(topk_weights: Any) -> NormalizeWeightCall:
    op = NORMALIZE_WEIGHT
    weights = _check_table(op, "topk_weights", topk_weights, (torch.float32,), "[T, K] weights")
    return NormalizeWeightCall(op, weights.device.type, op, int(weights.shape[1]), **_base(op, weights))


def _checked_moe_topk_gate(logits: Any, num_topk: Any, scoring: Any, bias: Any, num_groups: Any, topk_groups: Any,
                           renormalize: Any, routed_scaling_factor: Any, num_shared_experts: Any, mask: Any,
                           return_scores: Any) -> MoeGateCall:
    op = MOE_TOPK_GATE
    logits = _check_table(op, "logits", logits, LOGITS_DTYPES, "[T, E] logits")
    tokens, experts, device = int(logits.shape[0]), int(logits.shape[1]), logits.device
    scoring = check_scoring(op, scoring)
    bias = _check_vector(op, "bias", bias, experts, (torch.float32,), device, "E, the logits' width", of="logits")
    groups = check_int(op, "num_groups", num_groups, 1, experts)
    if experts % groups:
        raise ContractError(op, "num_groups", f"a divisor of E = {experts} (equal contiguous groups)", describe(groups))
    if groups > 1 and experts // groups < 2:
        raise ContractError(op, "num_groups", f"at most E / 2 = {experts // 2} (a group's score is the sum of its "
                            "two largest scores)", describe(groups))
    chosen_groups = check_int(op, "topk_groups", topk_groups, 1, groups, " (at most num_groups)")
    available = chosen_groups * (experts // groups)
    k = check_int(op, "num_topk", num_topk, 1, available,
                  f" (at most the {available} experts of the topk_groups best groups)" if groups > 1
                  else " (at most E, the logits' width)")
    renormalize = check_bool(op, "renormalize", renormalize)
    scaling = _check_scaling(op, routed_scaling_factor)
    shared = check_int(op, "num_shared_experts", num_shared_experts, 0)
    mask = _check_vector(op, "mask", mask, tokens, (torch.bool,), device, "T, one flag per token", of="logits")
    scores = check_bool(op, "return_scores", return_scores)
    return MoeGateCall(op, device.type, op, experts, k, scoring, logits.dtype, bias is not None, groups,
                       chosen_groups, renormalize, scaling, shared, mask is not None, scores,
                       byte_alignment(logits), **_base(op, logits))


def _checked_moe_topk_gate_backward(scores: Any, topk_idx: Any, topk_weights: Any, grad_topk_weights: Any,
                                    scoring: Any, renormalize: Any, routed_scaling_factor: Any, mask: Any
                                    ) -> MoeGateBackwardCall:
    op = MOE_TOPK_GATE_BACKWARD
    scores = _check_table(op, "scores", scores, WEIGHT_DTYPES, "[T, E] scores (the forward's)")
    tokens, device = int(scores.shape[0]), scores.device
    topk_idx = _check_rows_like(op, "topk_idx", topk_idx, tokens, None, INDEX_DTYPES, device, "[T, K] index", of="scores")
    slots = int(topk_idx.shape[1])
    for name, value in (("topk_weights", topk_weights), ("grad_topk_weights", grad_topk_weights)):
        tensor = _check_rows_like(op, name, value, tokens, slots, WEIGHT_DTYPES, device, "[T, K] weight", of="scores")
        if tensor.dtype != scores.dtype:
            raise ContractError(op, name, f"dtype {scores.dtype} (the scores')", describe(tensor))
    scoring = check_scoring(op, scoring)
    renormalize = check_bool(op, "renormalize", renormalize)
    scaling = _check_scaling(op, routed_scaling_factor)
    mask = _check_vector(op, "mask", mask, tokens, (torch.bool,), device, "T, one flag per token", of="scores")
    return MoeGateBackwardCall(op, device.type, op, int(scores.shape[1]), slots, scoring, scores.dtype,
                               topk_idx.dtype, renormalize, scaling, mask is not None, **_base(op, scores))


def _checked_moe_expert_counts(topk_idx: Any, num_experts: Any, alignment: Any) -> ExpertCountsCall:
    op = MOE_EXPERT_COUNTS
    topk_idx = _check_table(op, "topk_idx", topk_idx, INDEX_DTYPES, "[T, K] index")
    experts = check_int(op, "num_experts", num_experts, 1)
    align = check_int(op, "alignment", alignment, 1)
    return ExpertCountsCall(op, topk_idx.device.type, op, experts, int(topk_idx.shape[1]), topk_idx.dtype, align,
                            **_base(op, topk_idx))


def _checked_moe_permute(x: Any, topk_idx: Any, num_experts: Any, alignment: Any, x_sf: Any) -> PermuteCall:
    op = MOE_PERMUTE
    x = _check_table(op, "x", x, ROW_DTYPES + QUANTIZED_ROW_DTYPES, "[T, H] row")
    tokens, device = int(x.shape[0]), x.device
    quantized = x.dtype in QUANTIZED_ROW_DTYPES
    topk_idx = _check_rows_like(op, "topk_idx", topk_idx, tokens, None, INDEX_DTYPES, device, "[T, K] index", of="x")
    experts = check_int(op, "num_experts", num_experts, 1)
    align = check_int(op, "alignment", alignment, 1)
    sf_dtype = sf_width = None
    alignment_bytes = byte_alignment(x)
    if x_sf is not None:
        if not quantized:
            raise ContractError(op, "x_sf", f"None for unquantized {x.dtype} rows (scale rows go with e4m3 / e2m1 x)",
                                describe(x_sf))
        sf = check_tensor(op, "x_sf", x_sf)
        if sf.dim() == 2 and sf.shape[1] > 1 and sf.stride(1) != 1:
            raise ContractError(op, "x_sf", "row-major scale rows [T, F] (unit stride on the last dim; pass a "
                                "column-major sf as .contiguous())", describe(sf))
        sf = _check_rows_like(op, "x_sf", sf, tokens, None, SF_DTYPES, device, "[T, F] scale", of="x")
        sf_dtype, sf_width = sf.dtype, int(sf.shape[1])
        alignment_bytes = min(alignment_bytes, byte_alignment(sf))
    elif quantized:
        raise ContractError(op, "x_sf", f"the scale rows [T, F] of the quantized {x.dtype} x", describe(x_sf))
    return PermuteCall(op, device.type, op, experts, int(topk_idx.shape[1]), x.dtype, int(x.shape[1]),
                       topk_idx.dtype, align, sf_dtype, sf_width, alignment_bytes, **_base(op, x))


def _checked_moe_unpermute(y_expanded: Any, permutation: Any, topk_weights: Any, num_tokens: Any) -> UnpermuteCall:
    op = MOE_UNPERMUTE
    y_expanded = _check_table(op, "y_expanded", y_expanded, ROW_DTYPES, "[R, H] expanded row")
    device = y_expanded.device
    permutation = _check_table(op, "permutation", permutation, INDEX_DTYPES, "[T, K] row index")
    check_same_device(op, "permutation", permutation, device, of="y_expanded")
    tokens, slots = int(permutation.shape[0]), int(permutation.shape[1])
    topk_weights = _check_rows_like(op, "topk_weights", topk_weights, tokens, slots, (torch.float32,), device,
                                    "[T, K] weight", of="y_expanded")
    if num_tokens.__class__ is not int or num_tokens != tokens:
        raise ContractError(op, "num_tokens", f"the token count T = {tokens} (permutation's rows)",
                            describe(num_tokens))
    current = config.current()
    return UnpermuteCall(op, device.type, op, int(y_expanded.shape[1]), y_expanded.dtype, slots, permutation.dtype,
                         byte_alignment(y_expanded), host_layout=current.host_layout,
                         sf_alignment_bytes=current.token_alignment_bytes, tokens=tokens, device=device,
                         empty=tokens == 0 or y_expanded.shape[1] == 0)


# ---------------------------------------------------------------------- the contracts (memo first)

recent_calls = RecentCalls()
"""Memo of checked MoE calls by everything the checks read (an LRU of the family's own)."""

MEMO_SCALARS = (float, int, bool, str, type(None))
"""Scalar classes a memoized MoE call may carry (others run the checks alone)."""


def _memoized(op: str, tensors: tuple, scalars: tuple, checked: Any) -> Any:
    """The call of a repeated signature (``RecentCalls.memoized``: tensor metadata and pointer
    alignment, exactly-typed scalars or None, the config in force), else ``checked()`` remembered."""
    return recent_calls.memoized(op, tensors, scalars, checked, MEMO_SCALARS)


def topk_gate(scores: Any, num_topk: Any) -> tuple[TopkGateCall, TopkGateInputs]:
    """Contract of ``topk_gate`` (SPEC §7) → (call, inputs)."""
    call = _memoized(TOPK_GATE, (scores,), (num_topk,), lambda: _checked_topk_gate(scores, num_topk))
    return call, TopkGateInputs(_plain(scores))


def normalize_weight(topk_weights: Any) -> tuple[NormalizeWeightCall, NormalizeWeightInputs]:
    """Contract of ``normalize_weight`` → (call, inputs)."""
    call = _memoized(NORMALIZE_WEIGHT, (topk_weights,), (), lambda: _checked_normalize_weight(topk_weights))
    return call, NormalizeWeightInputs(_plain(topk_weights))


def moe_topk_gate(logits: Any, num_topk: Any, scoring: Any, bias: Any, num_groups: Any, topk_groups: Any,
                  renormalize: Any, routed_scaling_factor: Any, num_shared_experts: Any, mask: Any,
                  return_scores: Any) -> tuple[MoeGateCall, MoeGateInputs]:
    """Contract of ``moe_topk_gate`` → (call, inputs)."""
    arguments = (logits, num_topk, scoring, bias, num_groups, topk_groups, renormalize, routed_scaling_factor,
                 num_shared_experts, mask, return_scores)
    call = _memoized(MOE_TOPK_GATE, (logits, bias, mask),
                     (num_topk, scoring, num_groups, topk_groups, renormalize, routed_scaling_factor,
                      num_shared_experts, return_scores),
                     lambda: _checked_moe_topk_gate(*arguments))
    return call, MoeGateInputs(_plain(logits), _plain(bias), _plain(mask))


def moe_topk_gate_backward(scores: Any, topk_idx: Any, topk_weights: Any, grad_topk_weights: Any, scoring: Any,
                           renormalize: Any, routed_scaling_factor: Any, mask: Any
                           ) -> tuple[MoeGateBackwardCall, MoeGateBackwardInputs]:
    """Contract of ``moe_topk_gate_backward`` → (call, inputs)."""
    arguments = (scores, topk_idx, topk_weights, grad_topk_weights, scoring, renormalize, routed_scaling_factor, mask)
    call = _memoized(MOE_TOPK_GATE_BACKWARD, (scores, topk_idx, topk_weights, grad_topk_weights, mask),
                     (scoring, renormalize, routed_scaling_factor),
                     lambda: _checked_moe_topk_gate_backward(*arguments))
    return call, MoeGateBackwardInputs(_plain(scores), topk_idx, _plain(topk_weights), _plain(grad_topk_weights),
                                       mask)


def moe_expert_counts(topk_idx: Any, num_experts: Any, alignment: Any) -> tuple[ExpertCountsCall, ExpertCountsInputs]:
    """Contract of ``moe_expert_counts`` → (call, inputs)."""
    call = _memoized(MOE_EXPERT_COUNTS, (topk_idx,), (num_experts, alignment),
                     lambda: _checked_moe_expert_counts(topk_idx, num_experts, alignment))
    return call, ExpertCountsInputs(topk_idx)


def moe_permute(x: Any, topk_idx: Any, num_experts: Any, alignment: Any, x_sf: Any
                ) -> tuple[PermuteCall, PermuteInputs]:
    """Contract of ``moe_permute`` → (call, inputs)."""
    call = _memoized(MOE_PERMUTE, (x, topk_idx, x_sf), (num_experts, alignment),
                     lambda: _checked_moe_permute(x, topk_idx, num_experts, alignment, x_sf))
    return call, PermuteInputs(_plain(x), topk_idx, _plain(x_sf))


def moe_unpermute(y_expanded: Any, permutation: Any, topk_weights: Any, num_tokens: Any
                  ) -> tuple[UnpermuteCall, UnpermuteInputs]:
    """Contract of ``moe_unpermute`` → (call, inputs)."""
    call = _memoized(MOE_UNPERMUTE, (y_expanded, permutation, topk_weights), (num_tokens,),
                     lambda: _checked_moe_unpermute(y_expanded, permutation, topk_weights, num_tokens))
    return call, UnpermuteInputs(_plain(y_expanded), permutation, _plain(topk_weights))


__all__ = [
    "ExpertCountsCall", "MoeGateBackwardCall", "MoeGateCall", "NormalizeWeightCall", "PermuteCall", "Scoring",
    "TopkGateCall", "UnpermuteCall", "compute_dtype", "expanded_rows",
]

