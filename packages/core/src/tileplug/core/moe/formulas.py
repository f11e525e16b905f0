"""MoE routing formulas, exact to the contract (SPEC §7, docs/spec.md "MoE routing").

Everything is plain PyTorch and runs on any device. Scores, weights and gradients are in the
compute dtype (fp32; fp64 for fp64 logits). The choices the contract fixes:

- selection is a stable descending sort: among equal values the smaller index comes first
  (values compare as numbers: ``-0.0`` equals ``+0.0``);
- the softmax denominator and the backward's row dot product are summed with the norm
  family's fixed pairwise tree (:func:`tileplug.core.norm.formulas.row_sum`), so a row's
  bytes depend on that row alone;
- sums over slots (the renormalization, ``normalize_weight``, ``moe_unpermute``) run left to
  right in slot order;
- a row is *non-finite* when one of its logits is inf or NaN, or the bias holds one (then
  every row is): such rows, and masked rows, get index −1 and weight 0 in every slot.
"""

from __future__ import annotations

import torch

from tileplug.core.call import Scoring
from tileplug.core.norm.formulas import row_sum

RENORMALIZE_EPSILON = 1e-20
"""Added to the sum of the routed weights before dividing by it (in the compute dtype)."""


def scores_of(logits: torch.Tensor, scoring: Scoring, work: torch.dtype) -> torch.Tensor:
    """The scores ``u`` ``[T, E]`` in ``work``: softmax over each row (max subtracted, the
    denominator a pairwise-tree sum), ``sigmoid(x) = 1 / (1 + exp(-x))``, or ``sqrt(softplus(x))``
    with the stable ``softplus(x) = max(x, 0) + log1p(exp(-|x|))``. Each step is rounded to
    ``work``; in fp32 ``exp``, ``log1p`` and ``sqrt`` are correctly rounded
    (:func:`correctly_rounded`), so the scores are the same bytes on every host and device."""
    x = logits.to(work)
    if scoring is Scoring.SOFTMAX:
        if x.shape[1] == 0:
            return x
        shifted = correctly_rounded(torch.exp, x - x.amax(dim=1, keepdim=True))
        return shifted / row_sum(shifted).unsqueeze(1)
    if scoring is Scoring.SIGMOID:
        if work == torch.float64:
            return torch.sigmoid(x)
        return 1 / (1 + correctly_rounded(torch.exp, -x))
    softplus = torch.clamp_min(x, 0) + correctly_rounded(torch.log1p, correctly_rounded(torch.exp, -x.abs()))
    return correctly_rounded(torch.sqrt, softplus)


def correctly_rounded(function, values: torch.Tensor) -> torch.Tensor:
    """``function(values)`` (``torch.exp`` / ``torch.log1p`` / ``torch.sqrt``) correctly rounded
    for fp32: taken in fp64 and rounded once to fp32 (exact but for a double rounding at a
    near-tie, about 2^-28 of the inputs for exp / log1p; never for sqrt: a double root rounds to
    fp32 without one, see :func:`tileplug.core.norm.formulas.reciprocal_sqrt`). PyTorch's
    vectorized fp32 CPU functions are not correctly rounded (exp and log1p differ from the
    correctly rounded value by one ulp for about 1 % of the inputs on an AVX-512 host; sqrt on
    some hosts), and a kernel's ``expf`` differs again: one fixed rounding is what lets a
    backend match the scores and weights to the ulp on every host. Other dtypes: ``function``."""
    if values.dtype == torch.float32:
        return function(values.to(torch.float64)).to(torch.float32)
    return function(values)


def finite_rows(logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bool ``[T]``: the rows whose logits (and the bias) are all finite."""
    finite = torch.isfinite(logits).all(dim=1)
    if bias is not None:
        finite = finite & torch.isfinite(bias).all()
    return finite


def select(values: torch.Tensor, count: int) -> torch.Tensor:
    """int64 ``[T, count]``: per row the indices of the ``count`` largest values, in descending
    order, ties to the smaller index (a stable sort). NaN must not occur in ``values``."""
    return torch.sort(values, dim=1, descending=True, stable=True).indices[:, :count]


def group_limited(values: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """``values`` ``[T, E]`` with every expert outside the ``topk_groups`` best of its row's
    ``num_groups`` equal contiguous groups set to −inf. A group's score is the sum of its two
    largest values (the larger first); groups tie to the smaller group index."""
    tokens, experts = values.shape
    grouped = values.view(tokens, num_groups, experts // num_groups)
    top_two = torch.sort(grouped, dim=2, descending=True, stable=True).values[..., :2]
    group_scores = top_two[..., 0] + top_two[..., 1]
    chosen = select(group_scores, topk_groups)
    keep = torch.zeros(tokens, num_groups, dtype=torch.bool, device=values.device)
    keep.scatter_(1, chosen, True)
    return torch.where(keep.unsqueeze(2), grouped, float("-inf")).view(tokens, experts)


def slot_sum(values: torch.Tensor) -> torch.Tensor:
    """``[T, K] → [T]``: the sum over slots, left to right (``K = 0`` gives 0)."""
    if values.shape[1] == 0:
        return values.new_zeros(values.shape[0])
    total = values[:, 0]
    for slot in range(1, values.shape[1]):
        total = total + values[:, slot]
    return total


def gate(logits: torch.Tensor, num_topk: int, scoring: Scoring, bias: torch.Tensor | None = None,
         num_groups: int = 1, topk_groups: int = 1, renormalize: bool = True, routed_scaling_factor: float = 1.0,
         num_shared_experts: int = 0, mask: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_topk_gate``'s outputs ``(topk_idx int64 [T, k + S], topk_weights [T, k + S], scores [T, E])``.

    Selection runs on ``u + bias`` (bias for selection only), group-limited when
    ``num_groups > 1``; the weights are the unbiased ``u`` of the chosen experts, divided by
    their left-to-right sum plus 1e-20 when ``renormalize``, then multiplied by
    ``routed_scaling_factor``; shared slots hold ``E, E+1, ...`` with weight 1. Non-finite and
    masked rows: −1 / 0 in every slot (their scores are what the formula gives).
    """
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    tokens, experts = logits.shape
    device = logits.device
    scores = scores_of(logits, scoring, work)
    valid = finite_rows(logits, bias)
    if mask is not None:
        valid = valid & mask
    chosen_values = scores if bias is None else scores + bias.to(work)
    chosen_values = torch.where(valid.unsqueeze(1), chosen_values, 0)  # no NaN reaches the sort
    if num_groups > 1:
        chosen_values = group_limited(chosen_values, num_groups, topk_groups)
    topk_idx = select(chosen_values, num_topk)
    weights = scores.gather(1, topk_idx)
    weights = torch.where(valid.unsqueeze(1), weights, 0)
    if renormalize:
        weights = weights / (slot_sum(weights) + torch.full((), RENORMALIZE_EPSILON, dtype=work, device=device)
                             ).unsqueeze(1)
    if routed_scaling_factor != 1.0:
        weights = weights * torch.full((), routed_scaling_factor, dtype=work, device=device)
    if num_shared_experts:
        shared = torch.arange(experts, experts + num_shared_experts, dtype=torch.int64, device=device)
        topk_idx = torch.cat((topk_idx, shared.expand(tokens, num_shared_experts)), dim=1)
        weights = torch.cat((weights, torch.ones(tokens, num_shared_experts, dtype=work, device=device)), dim=1)
    topk_idx = torch.where(valid.unsqueeze(1), topk_idx, -1)
    weights = torch.where(valid.unsqueeze(1), weights, 0)
    return topk_idx, weights, scores


def topk(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
    """``topk_gate``: int64 ``[T, k]``, ties to the smaller index; rows holding a non-finite
    score get −1 in every slot."""
    valid = torch.isfinite(scores).all(dim=1, keepdim=True)
    topk_idx = select(torch.where(valid, scores, 0), num_topk)
    return torch.where(valid, topk_idx, -1)


def normalize(topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``normalize_weight``: ``(denominator [T], normalized [T, K])`` with the left-to-right
    sum; a row summing to 0 divides by 0 (NaN for 0/0, as IEEE says)."""
    denominator = slot_sum(topk_weights)
    return denominator, topk_weights / denominator.unsqueeze(1)


def gate_backward(scores: torch.Tensor, topk_idx: torch.Tensor, grad_topk_weights: torch.Tensor, scoring: Scoring,
                  renormalize: bool = True, routed_scaling_factor: float = 1.0,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """``moe_topk_gate_backward``: the gradient ``[T, E]`` of the routed weights w.r.t. the logits.

    Slots whose index is outside ``[0, E)`` (−1, shared experts) carry nothing; an expert in
    two slots accumulates both (slot order). With ``w_s = c·u_s / S`` (``S`` the slots'
    left-to-right sum + 1e-20; ``S = 1`` without ``renormalize``) the gradient of ``u_s`` is
    ``(c / S)·(g_s − Σ_r g_r·u_r / S)`` (``c·g_s`` without renormalize), then through the
    scoring: softmax ``u ⊙ (∂u − ⟨∂u, u⟩)``, sigmoid ``∂u · u(1 − u)``, sqrtsoftplus
    ``∂u · (1 − exp(−u²)) / (2u)`` (0 where ``u = 0``). Rows without a routed slot, and
    masked rows, get 0.
    """
    work = scores.dtype
    tokens, experts = scores.shape
    device = scores.device
    routed = (topk_idx >= 0) & (topk_idx < experts)
    if mask is not None:
        routed = routed & mask.unsqueeze(1)
    index = torch.where(routed, topk_idx, 0).to(torch.int64)
    chosen = torch.where(routed, scores.gather(1, index), 0)
    grads = torch.where(routed, grad_topk_weights, 0)
    scale = torch.full((), routed_scaling_factor, dtype=work, device=device)
    if renormalize:
        total = (slot_sum(chosen) + torch.full((), RENORMALIZE_EPSILON, dtype=work, device=device)).unsqueeze(1)
        inner = slot_sum(grads * chosen).unsqueeze(1) / total
        grad_chosen = torch.where(routed, (scale / total) * (grads - inner), 0)
    else:
        grad_chosen = torch.where(routed, scale * grads, 0)
    grad_scores = torch.zeros(tokens, experts, dtype=work, device=device)
    for slot in range(topk_idx.shape[1]):  # one index per row and slot: no collision inside a scatter
        grad_scores.scatter_add_(1, index[:, slot:slot + 1], grad_chosen[:, slot:slot + 1])
    if scoring is Scoring.SOFTMAX:
        dot = row_sum(grad_scores * scores).unsqueeze(1)
        grad_logits = scores * (grad_scores - dot)
    elif scoring is Scoring.SIGMOID:
        grad_logits = grad_scores * (scores * (1 - scores))
    else:
        derivative = -torch.expm1(-(scores * scores)) / (2 * scores)
        grad_logits = grad_scores * torch.where(scores > 0, derivative, 0)
    active = routed.any(dim=1, keepdim=True)
    return torch.where(active, grad_logits, 0)


def expert_layout(topk_idx: torch.Tensor, num_experts: int, alignment: int = 1
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(counts int32 [E], expert_ends int32 [E], permutation int32 [T, K])`` of a routing.

    A pair ``(t, slot)`` whose index is in ``[0, E)`` is routed; others (−1, shared experts
    beyond ``num_experts``) are not. ``start[0] = 0``, ``start[e] = align(expert_ends[e−1],
    alignment)``, ``expert_ends[e] = start[e] + counts[e]``; expert ``e``'s pairs take rows
    ``start[e], start[e] + 1, ...`` in token order (then slot order): ``permutation[t, slot]``
    is the row of the pair, −1 when it is not routed.
    """
    tokens, slots = topk_idx.shape
    device = topk_idx.device
    flat = topk_idx.reshape(-1).to(torch.int64)
    routed = (flat >= 0) & (flat < num_experts)
    keys = torch.where(routed, flat, num_experts)  # not routed: after every expert
    counts = torch.bincount(keys, minlength=num_experts + 1)[:num_experts]
    padded = (counts + alignment - 1) // alignment * alignment
    starts = torch.cumsum(padded, 0) - padded
    ends = starts + counts
    order = torch.sort(keys, stable=True).indices  # token order (then slot order) within an expert
    first_of_expert = torch.cumsum(counts, 0) - counts
    sorted_keys = keys[order]
    position = torch.arange(flat.numel(), device=device)
    expert_of = torch.clamp_max(sorted_keys, num_experts - 1)
    rows_sorted = starts[expert_of] + (position - first_of_expert[expert_of])
    rows_sorted = torch.where(sorted_keys < num_experts, rows_sorted, -1)
    rows = torch.empty_like(rows_sorted)
    rows[order] = rows_sorted
    return counts.to(torch.int32), ends.to(torch.int32), rows.view(tokens, slots).to(torch.int32)


def permute_rows(rows: torch.Tensor, permutation: torch.Tensor, expanded: int) -> torch.Tensor:
    """The expanded copy ``[expanded, W]`` of ``rows`` ``[T, W]`` (unit last stride): row
    ``permutation[t, slot]`` holds a byte copy of ``rows[t]`` for every routed pair; every
    other row is zero."""
    tokens, slots = permutation.shape
    raw = rows.view(torch.uint8)
    out = torch.zeros(expanded, raw.shape[1], dtype=torch.uint8, device=rows.device)
    flat = permutation.reshape(-1).to(torch.int64)
    routed = flat >= 0
    sources = torch.arange(tokens, device=rows.device).repeat_interleave(slots)
    out[flat[routed]] = raw[sources[routed]]
    return out.view(rows.dtype)


def unpermute(y_expanded: torch.Tensor, permutation: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``y[t] = Σ_slots w[t, slot] · y_expanded[permutation[t, slot]]`` in fp32, slot by slot
    (each product rounded, then added), skipping slots whose row is outside ``[0, R)``; rounded
    once to y_expanded's dtype."""
    tokens, slots = permutation.shape
    rows = y_expanded.shape[0]
    total = torch.zeros(tokens, y_expanded.shape[1], dtype=torch.float32, device=y_expanded.device)
    if rows == 0:
        return total.to(y_expanded.dtype)
    index = permutation.to(torch.int64)
    for slot in range(slots):
        row = index[:, slot]
        routed = ((row >= 0) & (row < rows)).unsqueeze(1)
        gathered = y_expanded[torch.clamp(row, 0, rows - 1)].float()
        total = torch.where(routed, total + topk_weights[:, slot:slot + 1] * gathered, total)
    return total.to(y_expanded.dtype)
