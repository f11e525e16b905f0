"""MoE routing (SPEC §7, docs/spec.md "MoE routing"): the public functions and their declarations.

Shapes (``T`` tokens, ``E`` experts, ``k`` routed slots, ``S`` shared experts, ``K`` the slot
count of a ``topk_idx``, ``H`` the row width, ``R`` expanded rows):

- the gates read scores / logits ``[T, E]`` and return ``topk_idx`` int64 ``[T, k (+ S)]``
  and weights ``[T, k (+ S)]``;
- ``moe_expert_counts`` / ``moe_permute`` / ``moe_unpermute`` map ``(token, slot)`` pairs to
  the expanded layout a grouped GEMM reads: expert ``e`` owns rows
  ``[start[e], expert_ends[e])``, ``R = T·K + min(T·K, E − 1)·(alignment − 1)`` rows in all.

In the op table a case's ``hidden`` is ``E`` for the gates and their backward (the
``experts`` input option overrides it: bench configurations name their expert count while
``--hidden`` is the model's), ``K`` for ``normalize_weight`` and ``H`` for the permutation ops.

``moe_topk_gate``'s weights are differentiable w.r.t. the logits: while autograd records,
the op goes through ``torch.ops.tileplug.moe_topk_gate``, whose backward is
``moe_topk_gate_backward`` through the op table (eager and under
``torch.compile(fullgraph=True)``). Indices and scores carry no gradient; the other ops are
not differentiable.

``config.check_finite(True)`` (a debug mode) makes the two gates synchronise and raise
ContractError naming the rows whose scores are non-finite; by default such rows get index
−1 and weight 0 and nothing waits on the device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.compiler import is_compiling

from tileplug.core import config
from tileplug.core.contracts import moe as contracts
from tileplug.core.errors import ContractError
from tileplug.core.opdefs import BenchCase, Case, OpDef, bound_contract, checked_case_inputs, declare, run, wants_grad

# ---------------------------------------------------------------------- the public ops


def topk_gate(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
    """Indices of the ``num_topk`` largest scores of each row → ``topk_idx`` int64 ``[T, k]``.

    ``scores`` fp32 ``[T, E]`` (unit last stride, any row stride), ``1 ≤ k ≤ E`` (every
    backend serves ``k ≤ 32``). Descending order, ties to the smaller index. A row holding an
    inf or NaN gets −1 in every slot (``config.check_finite(True)``: ContractError instead).
    """
    if is_compiling():
        return TOPK_GATE.traced(scores, num_topk)
    call, inputs = contracts.topk_gate(scores, num_topk)
    if config.current().check_finite and not call.empty:
        raise_on_non_finite_rows(call.name, "scores", inputs.scores)
    return run(call, inputs)


def normalize_weight(topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_weights`` fp32 ``[T, K]`` → ``(denominator [T], normalized [T, K])``, fp32.

    ``denominator = w[:, 0] + w[:, 1] + ...`` left to right in slot order, ``normalized =
    w / denominator`` (IEEE division: a row summing to 0 gives NaN or inf)."""
    if is_compiling():
        return NORMALIZE_WEIGHT.traced(topk_weights)
    call, inputs = contracts.normalize_weight(topk_weights)
    return run(call, inputs)


def moe_topk_gate(
    logits: torch.Tensor,
    num_topk: int,
    scoring: str = "softmax",
    bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    num_shared_experts: int = 0,
    mask: torch.Tensor | None = None,
    return_scores: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Route each token to experts → ``(topk_idx, topk_weights)`` or ``(topk_idx, topk_weights, scores)``.

    ``logits`` ``[T, E]`` bf16 / fp32 (fp64: computed in fp64, for gradcheck). Scores ``u``
    (fp32; fp64 for fp64 logits): ``'softmax'`` over the row, ``'sigmoid'`` or
    ``'sqrtsoftplus'`` (``sqrt(softplus(x))``). The ``num_topk`` experts are chosen on
    ``u + bias`` (``bias`` fp32 ``[E]``, selection only), among the ``topk_groups`` best of
    ``num_groups`` equal contiguous groups (a group's score: the sum of its two largest biased
    scores), ties to the smaller index. Weights are the chosen ``u``, divided by their sum
    (+1e-20) with ``renormalize``, times ``routed_scaling_factor``; then ``num_shared_experts``
    slots with index ``E, E+1, ...`` and weight 1. ``mask`` bool ``[T]``: False rows, and rows
    with a non-finite logit, get index −1 and weight 0 in every slot.

    ``topk_idx`` int64 ``[T, k + S]``, ``topk_weights`` ``[T, k + S]``, ``scores`` ``[T, E]``
    (unbiased ``u``) with ``return_scores``. The weights are differentiable w.r.t. ``logits``.
    """
    if wants_grad(logits):
        result = MOE_TOPK_GATE.traced(logits, num_topk, scoring, bias, num_groups, topk_groups, renormalize,
                                      routed_scaling_factor, num_shared_experts, mask, True)
        return tuple(result) if return_scores else (result[0], result[1])
    if is_compiling():
        return MOE_TOPK_GATE.traced(logits, num_topk, scoring, bias, num_groups, topk_groups, renormalize,
                                    routed_scaling_factor, num_shared_experts, mask, return_scores)
    call, inputs = contracts.moe_topk_gate(logits, num_topk, scoring, bias, num_groups, topk_groups, renormalize,
                                           routed_scaling_factor, num_shared_experts, mask, return_scores)
    if config.current().check_finite and not call.empty:
        raise_on_non_finite_rows(call.name, "logits", inputs.logits, inputs.bias, inputs.mask)
    return run(call, inputs)


def moe_topk_gate_backward(
    scores: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    grad_topk_weights: torch.Tensor,
    scoring: str,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient of :func:`moe_topk_gate`'s weights w.r.t. its logits → ``grad_logits`` ``[T, E]``.

    ``scores`` ``[T, E]`` are the forward's unbiased scores (fp32, or fp64), ``topk_idx``
    ``[T, K]`` int32 / int64 and ``topk_weights`` ``[T, K]`` its outputs, ``grad_topk_weights``
    ``[T, K]`` the incoming gradient (scores' dtype). Slots whose index is outside ``[0, E)``
    (−1, shared experts) carry no gradient; an expert named twice accumulates. The result is
    in the scores' dtype.
    """
    if is_compiling():
        return MOE_TOPK_GATE_BACKWARD.traced(scores, topk_idx, topk_weights, grad_topk_weights, scoring, renormalize,
                                             routed_scaling_factor, mask)
    call, inputs = contracts.moe_topk_gate_backward(scores, topk_idx, topk_weights, grad_topk_weights, scoring,
                                                    renormalize, routed_scaling_factor, mask)
    return run(call, inputs)


def moe_expert_counts(topk_idx: torch.Tensor, num_experts: int, alignment: int = 1
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens per expert and the expanded layout's ends → ``(counts, expert_ends)``, int32 ``[E]``.

    ``topk_idx`` int32 / int64 ``[T, K]``; a pair whose index is outside ``[0, num_experts)``
    (−1, a shared expert past E) is not counted. ``counts[e]`` = pairs routed to ``e``;
    ``start[0] = 0``, ``start[e] = align(expert_ends[e − 1], alignment)``, ``expert_ends[e] =
    start[e] + counts[e]``.
    """
    if is_compiling():
        return MOE_EXPERT_COUNTS.traced(topk_idx, num_experts, alignment)
    call, inputs = contracts.moe_expert_counts(topk_idx, num_experts, alignment)
    return run(call, inputs)


def moe_permute(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    num_experts: int,
    alignment: int = 1,
    x_sf: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Copy each token's row to every expert it is routed to → ``(x_expanded, x_sf_expanded, permutation, expert_ends)``.

    ``x`` ``[T, H]`` bf16 / fp16 / fp32, or quantized (e4m3, or e2m1 packed in int8 ``[T, H/2]``)
    with its row-major scale rows ``x_sf`` ``[T, F]`` (fp32, e4m3, packed UE8M0 int32 / int16).
    ``topk_idx`` ``[T, K]`` as :func:`moe_expert_counts` reads it. ``x_expanded`` ``[R, H]``
    (``x_sf_expanded`` ``[R, F]``, None without scales): expert ``e``'s rows are
    ``[start[e], expert_ends[e])`` in token order; every other row is zero.
    ``permutation`` int32 ``[T, K]``: the row of each ``(token, slot)``, −1 when not routed.
    """
    if is_compiling():
        return MOE_PERMUTE.traced(x, topk_idx, num_experts, alignment, x_sf)
    call, inputs = contracts.moe_permute(x, topk_idx, num_experts, alignment, x_sf)
    return run(call, inputs)


def moe_unpermute(y_expanded: torch.Tensor, permutation: torch.Tensor, topk_weights: torch.Tensor,
                  num_tokens: int) -> torch.Tensor:
    """The weighted sum of each token's expert rows → ``y`` ``[T, H]`` in y_expanded's dtype.

    ``y_expanded`` ``[R, H]`` bf16 / fp16 / fp32, ``permutation`` ``[T, K]`` from
    :func:`moe_permute`, ``topk_weights`` fp32 ``[T, K]``, ``num_tokens`` = T.
    ``y[t] = Σ_slots w[t, slot] · y_expanded[permutation[t, slot]]`` in fp32, slot by slot,
    rounded once; slots whose row is outside ``[0, R)`` (−1) are skipped.
    """
    if is_compiling():
        return MOE_UNPERMUTE.traced(y_expanded, permutation, topk_weights, num_tokens)
    call, inputs = contracts.moe_unpermute(y_expanded, permutation, topk_weights, num_tokens)
    return run(call, inputs)


# ---------------------------------------------------------------------- the checked mode


def raise_on_non_finite_rows(op: str, name: str, values: torch.Tensor, bias: torch.Tensor | None = None,
                             mask: torch.Tensor | None = None) -> None:
    """``config.check_finite``'s check (a host synchronisation): ContractError naming the first
    rows (unmasked) whose ``values`` — or the bias, which every row adds — hold inf or NaN."""
    from tileplug.core.moe.formulas import finite_rows

    bad = ~finite_rows(values, bias)
    if mask is not None:
        bad = bad & mask
    rows = torch.nonzero(bad).flatten()
    if rows.numel() == 0:
        return
    shown = rows[:16].tolist()
    more = f" and {rows.numel() - len(shown)} more" if rows.numel() > len(shown) else ""
    where = "the bias (every row)" if bias is not None and not bool(torch.isfinite(bias).all()) else \
        f"row(s) {', '.join(map(str, shown))}{more}"
    raise ContractError(op, name, "finite scores in every row (config.check_finite is on)",
                        f"inf or NaN in {where}")


# ---------------------------------------------------------------------- autograd (through the op table)


def _gate_setup(ctx: Any, inputs: tuple, output: list) -> None:
    logits, num_topk, scoring, bias, num_groups, topk_groups, renormalize, scaling, shared, mask, return_scores = inputs
    topk_idx, topk_weights = output[0], output[1]
    scores = output[2] if return_scores else None
    if scores is not None:
        ctx.mark_non_differentiable(scores)  # the scores are returned for inspection: no gradient flows back
    ctx.save_for_backward(logits if scores is None else None, scores, topk_idx, topk_weights, bias, mask)
    ctx.options = (num_topk, scoring, num_groups, topk_groups, renormalize, scaling, shared)
    ctx.logits_dtype = logits.dtype


def _gate_backward(ctx: Any, grads: list) -> tuple:
    logits, scores, topk_idx, topk_weights, bias, mask = ctx.saved_tensors
    num_topk, scoring, num_groups, topk_groups, renormalize, scaling, shared = ctx.options
    if scores is None:  # torch.ops.tileplug.moe_topk_gate called directly without return_scores: recompute them
        scores = moe_topk_gate(logits.detach(), num_topk, scoring, bias, num_groups, topk_groups, renormalize, scaling,
                               shared, mask, True)[2]
    grad_weights = grads[1]
    if grad_weights is None:
        grad_weights = torch.zeros_like(topk_weights)
    elif not grad_weights.is_contiguous():  # autograd hands e.g. expanded gradients of a sum
        grad_weights = grad_weights.contiguous()
    grad_logits = moe_topk_gate_backward(scores, topk_idx, topk_weights, grad_weights, scoring, renormalize, scaling,
                                         mask)
    return (grad_logits.to(ctx.logits_dtype),) + (None,) * 10


# ---------------------------------------------------------------------- declarations: arguments

INPUT_OPTIONS: dict[str, str] = {
    "experts": "int >= 1: the expert count E (gates: instead of hidden; permutation ops: of the routing made)",
    "ties": "'none', 'coarse' (logits on a grid of quarter steps: many equal scores) or 'all_equal'",
    "non_finite": "bool: some rows hold NaN, +inf or -inf",
    "bias": "bool: moe_topk_gate gets a selection bias [E]",
    "mask": "bool: every third token is masked out",
    "topk": "int >= 1: routed slots of the routing a backward / permutation op reads (default 8, at most E)",
    "shared": "int >= 0: shared-expert slots of the routing a backward / permutation op reads",
    "unrouted": "bool: some slots are -1 or a shared expert past E (not routed)",
    "skewed": "bool: routing concentrated on a few experts (others stay empty)",
    "index_dtype": "'int64' or 'int32': the dtype of topk_idx / permutation",
    "quantized": "'none', 'e4m3_fp32_sf', 'e4m3_ue8m0_sf', 'e4m3_ue8m0_int16_sf' or 'e2m1_e4m3_sf': moe_permute's rows",
    "alignment": "int >= 1: the expanded layout's alignment (moe_unpermute's input)",
    "row_stride_pad": "int >= 0: x / y_expanded / logits are views of rows padded by this many elements",
}
_CHOICES: dict[str, tuple] = {
    "ties": ("none", "coarse", "all_equal"), "non_finite": (False, True), "bias": (False, True),
    "mask": (False, True), "unrouted": (False, True), "skewed": (False, True), "index_dtype": ("int64", "int32"),
    "quantized": ("none", "e4m3_fp32_sf", "e4m3_ue8m0_sf", "e4m3_ue8m0_int16_sf", "e2m1_e4m3_sf"),
}
_GATES = (contracts.TOPK_GATE, contracts.MOE_TOPK_GATE, contracts.MOE_TOPK_GATE_BACKWARD)


def _options(op: str, inputs: dict[str, Any]) -> dict[str, Any]:
    checked_case_inputs(op, inputs, INPUT_OPTIONS, _CHOICES, {"shared": 0, "row_stride_pad": 0}, default_minimum=1)
    defaults = {"ties": "none", "non_finite": False, "bias": False, "mask": False, "topk": 8, "shared": 0,
                "unrouted": False, "skewed": False, "index_dtype": "int64", "quantized": "none", "alignment": 1,
                "row_stride_pad": 0}
    return {**defaults, **inputs}


def _padded(values: torch.Tensor, pad: int) -> torch.Tensor:
    """``values`` ``[T, W]`` as a view of rows padded by ``pad`` elements (the same values)."""
    if not pad:
        return values
    full = torch.zeros(values.shape[0], values.shape[1] + pad, dtype=values.dtype, device=values.device)
    full[:, :values.shape[1]] = values
    return full[:, :values.shape[1]]


def _logits(tokens: int, experts: int, dtype: torch.dtype, options: dict[str, Any], device: torch.device,
            seed: int) -> torch.Tensor:
    """Router logits ``[T, E]`` with the ties / non-finite patterns the options ask for."""
    pad = options["row_stride_pad"]
    if device.type == "meta":
        return torch.empty(tokens, experts + pad, dtype=dtype, device=device)[:, :experts]
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(tokens, experts, generator=generator, dtype=torch.float64) * 2
    if options["ties"] == "coarse":
        values = torch.round(values.clamp(-1.5, 1.5) * 4) / 4  # 13 levels: ties at the k-th place, across groups
    elif options["ties"] == "all_equal":
        values = torch.zeros_like(values) + 0.5
    if options["non_finite"] and experts:
        for token in range(1, tokens, 4):
            column = (token * 7) % experts
            values[token, column] = (float("nan"), float("inf"), float("-inf"))[(token // 4) % 3]
    return _padded(values.to(dtype), pad).to(device)


def _routing(tokens: int, experts: int, slots: int, options: dict[str, Any], device: torch.device, seed: int
             ) -> torch.Tensor:
    """A ``topk_idx`` ``[T, K]``: distinct experts per token where ``K ≤ E``; ``skewed``
    concentrates it on the first quarter of the experts; ``unrouted`` puts −1 and ``E + s``."""
    index_dtype = getattr(torch, options["index_dtype"])
    if device.type == "meta":
        return torch.empty(tokens, slots, dtype=index_dtype, device=device)
    generator = torch.Generator().manual_seed(seed)
    keys = torch.rand(tokens, experts, generator=generator)
    if options["skewed"]:
        keys[:, : max(1, experts // 4)] += 2.0
        keys[:, experts // 2:] -= 4.0  # the upper half is rarely or never chosen
    order = torch.argsort(keys, dim=1, descending=True)
    if slots <= experts:
        topk_idx = order[:, :slots]
    else:  # more slots than experts: experts repeat (still a valid routing)
        topk_idx = order.repeat(1, -(-slots // experts))[:, :slots]
    if options["unrouted"]:
        grid = torch.arange(tokens).unsqueeze(1) + torch.arange(slots).unsqueeze(0)
        topk_idx = torch.where(grid % 5 == 0, -1, topk_idx)
        topk_idx = torch.where(grid % 7 == 3, experts + torch.arange(slots).unsqueeze(0), topk_idx)
    return topk_idx.to(index_dtype).to(device)


_QUANTIZED: dict[str, tuple[torch.dtype, int, torch.dtype, int]] = {
    # option: (data dtype, values per byte, sf dtype, values per sf element)
    "e4m3_fp32_sf": (torch.float8_e4m3fn, 1, torch.float32, 128),
    "e4m3_ue8m0_sf": (torch.float8_e4m3fn, 1, torch.int32, 128 * 4),
    "e4m3_ue8m0_int16_sf": (torch.float8_e4m3fn, 1, torch.int16, 128 * 2),
    "e2m1_e4m3_sf": (torch.int8, 2, torch.float8_e4m3fn, 16),
}


def _rows(tokens: int, hidden: int, dtype: torch.dtype, options: dict[str, Any], device: torch.device, seed: int
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``moe_permute``'s ``x`` (and ``x_sf``): activations, or quantized bytes with scale rows."""
    from tileplug.core.testing import activation

    pad = options["row_stride_pad"]
    kind = options["quantized"]
    if kind == "none":
        if device.type == "meta":
            return torch.empty(tokens, hidden + pad, dtype=dtype, device=device)[:, :hidden], None
        return _padded(activation(tokens, hidden, dtype, seed=seed), pad).to(device), None
    data_dtype, per_byte, sf_dtype, per_sf = _QUANTIZED[kind]
    width, sf_width = hidden // per_byte, -(-hidden // per_sf)
    if device.type == "meta":
        return (torch.empty(tokens, width + pad, dtype=data_dtype, device=device)[:, :width],
                torch.empty(tokens, sf_width, dtype=sf_dtype, device=device))
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(-128, 128, (tokens, width), generator=generator, dtype=torch.int8)
    if data_dtype == torch.float8_e4m3fn:
        data = torch.where((data & 0x7F) == 0x7F, 0x3C, data)  # no NaN encodings: any byte pattern is copied
    sf = torch.randint(0, 2**15, (tokens, sf_width * sf_dtype.itemsize), generator=generator).to(torch.uint8)
    sf = sf.view(sf_dtype) if sf.shape[1] else torch.empty((tokens, 0), dtype=sf_dtype)  # no group: no scale
    return _padded(data.view(data_dtype), pad).to(device), sf.to(device)


def moe_arguments(op: str, tokens: int, hidden: int, dtype: torch.dtype, kwargs: dict[str, Any],
                  inputs: dict[str, Any], device: torch.device, seed: int) -> tuple[tuple, dict]:
    """(args, kwargs) of a MoE op at ``tokens`` rows on ``device`` (meta: shapes only).

    ``hidden`` is E for the gates (unless ``inputs.experts``) and H for the permutation ops;
    :data:`INPUT_OPTIONS` choose ties, non-finite rows, bias, mask, the routing read
    (``topk``, ``shared``, ``unrouted``, ``skewed``, ``index_dtype``), quantized rows and
    padded row strides. A backward's forward outputs come from
    :mod:`tileplug.core.moe.formulas` (no backend needed); so does the layout ``moe_unpermute``
    reads.
    """
    from tileplug.core.moe import formulas

    options = _options(op, inputs)
    kwargs = dict(kwargs)
    if op in _GATES:
        experts = options.get("experts", hidden)
        if op == contracts.TOPK_GATE:
            return (_logits(tokens, experts, torch.float32, options, device, seed),
                    kwargs.pop("num_topk", min(8, experts))), kwargs
        if op == contracts.MOE_TOPK_GATE:
            if options["bias"]:
                kwargs["bias"] = _bias(experts, device, seed + 1)
            if options["mask"]:
                kwargs["mask"] = _mask(tokens, device)
            return (_logits(tokens, experts, dtype, options, device, seed),
                    kwargs.pop("num_topk", min(8, experts))), kwargs
        return _backward_arguments(tokens, experts, dtype, kwargs, options, device, seed)
    experts = kwargs.get("num_experts", options.get("experts", 16))
    if op != contracts.MOE_UNPERMUTE:
        kwargs.setdefault("num_experts", experts)
    slots = options["topk"] + options["shared"]
    topk_idx = _routing(tokens, experts, slots, options, device, seed + 1)
    if op == contracts.MOE_EXPERT_COUNTS:
        return (topk_idx,), kwargs
    if op == contracts.MOE_PERMUTE:
        x, x_sf = _rows(tokens, hidden, dtype, options, device, seed)
        if x_sf is not None:
            kwargs["x_sf"] = x_sf
        return (x, topk_idx), kwargs
    # moe_unpermute: the expanded rows of a routing laid out as moe_permute lays it out
    alignment = options["alignment"]
    rows = contracts.expanded_rows(tokens, slots, experts, alignment)
    pad = options["row_stride_pad"]
    permutation_dtype = getattr(torch, options["index_dtype"])
    if device.type == "meta":
        return (torch.empty(rows, hidden + pad, dtype=dtype, device=device)[:, :hidden],
                torch.empty(tokens, slots, dtype=permutation_dtype, device=device),
                torch.empty(tokens, slots, dtype=torch.float32, device=device), tokens), kwargs
    from tileplug.core.testing import activation

    _, _, permutation = formulas.expert_layout(topk_idx.cpu(), experts, alignment)
    generator = torch.Generator().manual_seed(seed + 2)
    weights = torch.rand(tokens, slots, generator=generator)
    y_expanded = _padded(activation(rows, hidden, dtype, seed=seed), pad)
    return (y_expanded.to(device), permutation.to(permutation_dtype).to(device), weights.to(device), tokens), kwargs


def _bias(experts: int, device: torch.device, seed: int) -> torch.Tensor:
    if device.type == "meta":
        return torch.empty(experts, dtype=torch.float32, device=device)
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, generator=generator) * 0.1).to(device)


def _mask(tokens: int, device: torch.device) -> torch.Tensor:
    if device.type == "meta":
        return torch.empty(tokens, dtype=torch.bool, device=device)
    return (torch.arange(tokens) % 3 != 2).to(device)


def _backward_arguments(tokens: int, experts: int, dtype: torch.dtype, kwargs: dict[str, Any],
                        options: dict[str, Any], device: torch.device, seed: int) -> tuple[tuple, dict]:
    """A backward call: the forward (:func:`tileplug.core.moe.formulas.gate`) of logits made as
    for ``moe_topk_gate``, and a random incoming gradient."""
    from tileplug.core.moe import formulas

    work = contracts.compute_dtype(dtype)
    kwargs.setdefault("scoring", "softmax")
    num_topk = min(options["topk"], experts)
    slots = num_topk + options["shared"]
    mask = _mask(tokens, device) if options["mask"] else None
    if mask is not None:
        kwargs["mask"] = mask
    if device.type == "meta":
        return (torch.empty(tokens, experts, dtype=work, device=device),
                torch.empty(tokens, slots, dtype=torch.int64, device=device),
                torch.empty(tokens, slots, dtype=work, device=device),
                torch.empty(tokens, slots, dtype=work, device=device)), kwargs
    logits = _logits(tokens, experts, dtype, options, torch.device("cpu"), seed)
    scoring = contracts.check_scoring("moe_topk_gate_backward", kwargs["scoring"])
    topk_idx, weights, scores = formulas.gate(
        logits, num_topk, scoring, renormalize=kwargs.get("renormalize", True),
        routed_scaling_factor=kwargs.get("routed_scaling_factor", 1.0), num_shared_experts=options["shared"],
        mask=None if mask is None else mask.cpu())
    generator = torch.Generator().manual_seed(seed + 3)
    grad = torch.randn(tokens, slots, generator=generator, dtype=torch.float64).to(work)
    return (scores.to(device), topk_idx.to(device), weights.to(device), grad.to(device)), kwargs


# ---------------------------------------------------------------------- declarations: comparison


def compare_moe(case: Case, tokens: int, actual: list[torch.Tensor | None], expected: list[torch.Tensor | None]
                ) -> None:
    """SPEC §7 against the reference: indices, counts, ends, permutations and permuted rows
    bytewise; ``moe_topk_gate``'s weights and scores within 2 ulp of fp32 (scores of a
    non-finite row: non-finite where the reference's are); ``normalize_weight`` bytewise (a
    left-to-right sum and a division); the backward within a relative 1e-5 (norm-wise);
    ``moe_unpermute`` within 1 ulp."""
    from tileplug.core.testing import assert_bytes_equal, assert_within_ulps, relative_error, require

    what = f"{case.id} T={tokens}"
    require(len(actual) == len(expected), f"{what}: {len(actual)} outputs, expected {len(expected)}")
    for index, (have, want) in enumerate(zip(actual, expected)):
        label = f"{what} output {index}"
        if have is None or want is None:
            require(have is None and want is None, f"{label}: {have!r} vs {want!r}")
            continue
        require(have.shape == want.shape and have.dtype == want.dtype,
                f"{label}: {tuple(have.shape)} {have.dtype} vs {tuple(want.shape)} {want.dtype}")
        if case.op == contracts.MOE_TOPK_GATE and index >= 1:
            if index == 2:  # scores: rows the reference made non-finite are compared as such
                finite = torch.isfinite(want).all(dim=1)
                require(bool((~torch.isfinite(have[~finite]).all(dim=1)).all()),
                        f"{label}: a non-finite row's scores are all finite")
                have, want = have[finite], want[finite]
            assert_within_ulps(have, want, 2, what=label)
        elif case.op == contracts.MOE_TOPK_GATE_BACKWARD:
            error = relative_error(have, want)
            require(error <= 1e-5, f"{label}: the gradients differ, relative error {error:.3g} > 1e-5")
        elif case.op == contracts.MOE_UNPERMUTE:
            assert_within_ulps(have, want, 1, what=label)
        else:
            assert_bytes_equal(have, want, what=label, strides=True)


# ---------------------------------------------------------------------- declarations: grids

_BF16, _FP32, _FP16 = torch.bfloat16, torch.float32, torch.float16


def moe_cases() -> list[Case]:
    """The family's grid: E not a multiple of 32 or 64 first (72, 100, 60, 1000), E from 8 to
    1024, k from 1 to 32; adversarial ties (quarter-step grids, all-equal rows), non-finite and
    masked rows, every scoring, bias, groups, shared experts; the permutation ops with
    unrouted and skewed routings, alignments 1 / 3 / 16 / 128, int32 and int64 indices,
    padded row strides and quantized rows with every sf encoding."""
    gate, full, back = contracts.TOPK_GATE, contracts.MOE_TOPK_GATE, contracts.MOE_TOPK_GATE_BACKWARD
    counts, permute, unpermute = contracts.MOE_EXPERT_COUNTS, contracts.MOE_PERMUTE, contracts.MOE_UNPERMUTE
    return [
        Case.of(gate, 72, _FP32, num_topk=6),
        Case.of(gate, 100, _FP32, inputs={"ties": "coarse", "row_stride_pad": 3}, num_topk=32),
        Case.of(gate, 8, _FP32, num_topk=1),
        Case.of(gate, 8, _FP32, inputs={"ties": "all_equal"}, num_topk=8),
        Case.of(gate, 1000, _FP32, inputs={"non_finite": True}, num_topk=8),
        Case.of(gate, 64, _FP32, inputs={"ties": "coarse", "non_finite": True}, num_topk=6),
        Case.of(gate, 256, _FP32, num_topk=8),
        Case.of(gate, 384, _FP32, inputs={"ties": "coarse"}, num_topk=8),
        Case.of(gate, 1024, _FP32, num_topk=32),
        Case.of(contracts.NORMALIZE_WEIGHT, 6, _FP32),
        Case.of(contracts.NORMALIZE_WEIGHT, 8, _FP32, inputs={"shared": 1}),
        Case.of(contracts.NORMALIZE_WEIGHT, 32, _FP32),
        Case.of(contracts.NORMALIZE_WEIGHT, 1, _FP32),
        Case.of(full, 72, _FP32, num_topk=6, renormalize=False),
        Case.of(full, 60, _BF16, inputs={"ties": "coarse", "mask": True}, num_topk=4),
        Case.of(full, 256, _BF16, inputs={"bias": True}, num_topk=8, scoring="sigmoid", num_groups=8, topk_groups=4,
                routed_scaling_factor=2.5),
        Case.of(full, 160, _FP32, inputs={"bias": True, "ties": "coarse"}, num_topk=6, scoring="sigmoid",
                num_groups=10, topk_groups=3),
        Case.of(full, 256, _FP32, inputs={"bias": True}, num_topk=8, scoring="sqrtsoftplus", num_shared_experts=1,
                return_scores=True),
        Case.of(full, 1000, _BF16, inputs={"row_stride_pad": 8}, num_topk=32, scoring="sqrtsoftplus"),
        Case.of(full, 1024, _FP32, inputs={"non_finite": True}, num_topk=32, return_scores=True),
        Case.of(full, 8, _FP32, inputs={"ties": "all_equal"}, num_topk=2, scoring="sigmoid", num_groups=4,
                topk_groups=2, num_shared_experts=2),
        Case.of(full, 384, _BF16, inputs={"mask": True, "non_finite": True, "bias": True}, num_topk=8,
                scoring="sqrtsoftplus", renormalize=False, routed_scaling_factor=1.5, return_scores=True),
        Case.of(back, 72, _FP32, inputs={"topk": 6}, scoring="softmax"),
        Case.of(back, 256, _FP32, inputs={"shared": 1}, scoring="sigmoid", routed_scaling_factor=2.5),
        Case.of(back, 100, _FP32, inputs={"topk": 5, "mask": True}, scoring="sqrtsoftplus", renormalize=False),
        Case.of(back, 1024, _FP32, inputs={"topk": 32, "ties": "coarse"}, scoring="softmax", renormalize=False),
        Case.of(counts, 1, num_experts=72, inputs={"topk": 6}),
        Case.of(counts, 1, num_experts=256, inputs={"skewed": True}, alignment=128),
        Case.of(counts, 1, num_experts=9, inputs={"topk": 9, "unrouted": True, "index_dtype": "int32"}, alignment=3),
        Case.of(counts, 1, num_experts=1024, inputs={"topk": 32}, alignment=16),
        Case.of(permute, 576, _BF16, num_experts=72, inputs={"topk": 6}),
        Case.of(permute, 7, _FP32, num_experts=9, inputs={"topk": 3, "unrouted": True, "index_dtype": "int32",
                                                          "row_stride_pad": 3}, alignment=3),
        Case.of(permute, 7168, _BF16, num_experts=256, inputs={"skewed": True}, alignment=128),
        Case.of(permute, 64, _FP16, num_experts=16, inputs={"topk": 8, "shared": 1}, alignment=16),
        Case.of(permute, 512, _BF16, num_experts=32, inputs={"quantized": "e4m3_fp32_sf"}),
        Case.of(permute, 7168, _BF16, num_experts=64, inputs={"quantized": "e4m3_ue8m0_sf", "skewed": True},
                alignment=128),
        Case.of(permute, 1024, _BF16, num_experts=16, inputs={"quantized": "e4m3_ue8m0_int16_sf", "topk": 4}),
        Case.of(permute, 576, _BF16, num_experts=24, inputs={"quantized": "e2m1_e4m3_sf", "unrouted": True,
                                                             "row_stride_pad": 16}, alignment=16),
        Case.of(unpermute, 576, _BF16, inputs={"experts": 72, "topk": 6}),
        Case.of(unpermute, 7, _FP32, inputs={"experts": 9, "topk": 3, "unrouted": True, "row_stride_pad": 3,
                                             "alignment": 3}),
        Case.of(unpermute, 7168, _BF16, inputs={"experts": 256, "skewed": True, "alignment": 128}),
        Case.of(unpermute, 64, _FP16, inputs={"experts": 16, "topk": 9, "index_dtype": "int64"}),
    ]


def _bench(name: str) -> list[BenchCase]:
    """What ``tileplug bench`` times: the issue's top-k shapes (E, k) = (64, 6), (256, 8),
    (384, 8); DeepSeek-V3's grouped sigmoid router, the sqrtsoftplus router with bias and one
    shared expert, a softmax router; counting and permutation of 256 experts × top-8 rows of
    ``--hidden`` (bf16, and e4m3 with UE8M0 scales, aligned to 128)."""
    return {
        contracts.TOPK_GATE: [BenchCase.of(f"topk_gate/e{e}-k{k}", contracts.TOPK_GATE, inputs={"experts": e},
                                           num_topk=k) for e, k in ((64, 6), (256, 8), (384, 8))],
        contracts.NORMALIZE_WEIGHT: [BenchCase.of("normalize_weight/k8", contracts.NORMALIZE_WEIGHT,
                                                  inputs={"topk": 8})],
        contracts.MOE_TOPK_GATE: [
            BenchCase.of("moe_topk_gate/deepseek-v3", contracts.MOE_TOPK_GATE, inputs={"experts": 256, "bias": True},
                         num_topk=8, scoring="sigmoid", num_groups=8, topk_groups=4, routed_scaling_factor=2.5),
            BenchCase.of("moe_topk_gate/sqrtsoftplus-shared1", contracts.MOE_TOPK_GATE,
                         inputs={"experts": 256, "bias": True}, num_topk=8, scoring="sqrtsoftplus",
                         num_shared_experts=1),
            BenchCase.of("moe_topk_gate/softmax-e64-k6", contracts.MOE_TOPK_GATE, inputs={"experts": 64}, num_topk=6,
                         renormalize=False),
        ],
        contracts.MOE_TOPK_GATE_BACKWARD: [BenchCase.of("moe_topk_gate_backward/sigmoid-e256-k8",
                                                        contracts.MOE_TOPK_GATE_BACKWARD, inputs={"experts": 256},
                                                        scoring="sigmoid")],
        contracts.MOE_EXPERT_COUNTS: [BenchCase.of("moe_expert_counts/e256-k8", contracts.MOE_EXPERT_COUNTS,
                                                   num_experts=256, alignment=128)],
        contracts.MOE_PERMUTE: [
            BenchCase.of("moe_permute/e256-k8", contracts.MOE_PERMUTE, num_experts=256),
            BenchCase.of("moe_permute/e256-k8-e4m3-ue8m0-a128", contracts.MOE_PERMUTE,
                         inputs={"quantized": "e4m3_ue8m0_sf"}, num_experts=256, alignment=128),
        ],
        contracts.MOE_UNPERMUTE: [BenchCase.of("moe_unpermute/e256-k8", contracts.MOE_UNPERMUTE,
                                               inputs={"experts": 256})],
    }.get(name, [])


def _declare(function: Any, builder: Any, autograd: tuple[Any, Any] | None = None) -> OpDef:
    name = function.__name__
    return declare(OpDef(
        name=name, family="moe", function=function, contract=bound_contract(function, builder),
        outputs=lambda call, traits: call.allocation_plan(traits), result=lambda call, outputs: call.result(outputs),
        ledger=lambda call, traits: call.ledger(traits),
        cases=lambda: [case for case in moe_cases() if case.op == name],
        bench=lambda: _bench(name),
        arguments=lambda *args: _arguments(name, *args),
        compare=compare_moe, input_options=INPUT_OPTIONS, autograd=autograd,
    ))


def _arguments(op: str, tokens: int, hidden: int, dtype: torch.dtype, kwargs: dict[str, Any], inputs: dict[str, Any],
               device: torch.device, seed: int) -> tuple[tuple, dict]:
    if op == contracts.NORMALIZE_WEIGHT:  # hidden is K (inputs.topk overrides it: bench), weights in [0, 1)
        options = _options(op, inputs)
        slots = inputs.get("topk", hidden) + options["shared"]
        if device.type == "meta":
            return (torch.empty(tokens, slots, dtype=torch.float32, device=device),), dict(kwargs)
        generator = torch.Generator().manual_seed(seed)
        return (torch.rand(tokens, slots, generator=generator).to(device),), dict(kwargs)
    return moe_arguments(op, tokens, hidden, dtype, kwargs, inputs, device, seed)


TOPK_GATE = _declare(topk_gate, contracts.topk_gate)
NORMALIZE_WEIGHT = _declare(normalize_weight, contracts.normalize_weight)
MOE_TOPK_GATE = _declare(moe_topk_gate, contracts.moe_topk_gate, autograd=(_gate_setup, _gate_backward))
MOE_TOPK_GATE_BACKWARD = _declare(moe_topk_gate_backward, contracts.moe_topk_gate_backward)
MOE_EXPERT_COUNTS = _declare(moe_expert_counts, contracts.moe_expert_counts)
MOE_PERMUTE = _declare(moe_permute, contracts.moe_permute)
MOE_UNPERMUTE = _declare(moe_unpermute, contracts.moe_unpermute)
