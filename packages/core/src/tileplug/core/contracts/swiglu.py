"""Contracts of the SwiGLU family (SPEC §8, docs/spec.md "SwiGLU").

Each builder checks every argument (ContractError naming it) and returns a :class:`SwigluCall`
(the frozen, hashable description: selection cache key and kernel specialisation) and the
tensors the kernel reads. The call holds what a kernel specialises on — ``H``, dtypes,
whether routed weights, a clamp or an expert layout are given, the scaling factor, the
cast's configuration, the byte alignment of the row tensors — never the row count ``N``.

Shapes (``N`` expanded rows, ``H`` the output width, ``E`` experts):

- ``swiglu``: ``x`` ``[N, 2H]`` = ``[gate | up]`` bf16 / fp32 (fp64: computed in fp64, for
  gradcheck), ``topk_weights`` ``[N]`` in the compute dtype, ``expert_ends`` int32 ``[E]``
  → ``y`` ``[N, H]`` in ``out_dtype`` (default x's dtype).
- ``swiglu_per_token_cast``: the same inputs (x bf16 / fp32) → ``(q, sf)`` of the fp32 ``y``,
  as ``per_token_cast`` makes them.
- ``swiglu_backward``: ``x`` and ``grad_y`` ``[N, H]`` → ``grad_x`` ``[N, 2H]`` (x's dtype),
  ``grad_topk_weights`` ``[N]`` (compute dtype; None without ``topk_weights``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from tileplug.core import config
from tileplug.core.call import Call, Ledger, call_type
from tileplug.core.contracts.checks import check_choice, check_matrix, check_same_device, check_tensor, describe
from tileplug.core.contracts.moe import _check_scaling, check_int
from tileplug.core.contracts.quant import (
    MODE_CAST,
    PER_TOKEN_GROUPS,
    QuantCall,
    RecentCalls,
    byte_alignment,
    cast_config,
)
from tileplug.core.errors import ContractError

SWIGLU = "swiglu"
SWIGLU_PER_TOKEN_CAST = "swiglu_per_token_cast"
SWIGLU_BACKWARD = "swiglu_backward"

INPUT_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
"""``x`` of ``swiglu`` / ``swiglu_backward``: bf16 and fp32 (SPEC §8), and fp64, computed in
fp64 throughout so that ``torch.autograd.gradcheck`` can run (the reference serves it; another
backend may decline it)."""
CAST_INPUT_DTYPES = (torch.bfloat16, torch.float32)
"""``x`` of ``swiglu_per_token_cast`` (SPEC §8)."""
OUTPUT_DTYPES = (torch.bfloat16, torch.float32)
"""``out_dtype`` of ``swiglu`` for a bf16 / fp32 ``x`` (an fp64 ``x`` gives fp64)."""
ENDS_DTYPE = torch.int32
"""``expert_ends``: the int32 prefix ends ``moe_expert_counts`` / ``moe_permute`` return (SPEC §7)."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 for fp64 inputs, fp32 otherwise: the dtype of the math, the weights and their gradient."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------- inputs and outputs


class SwigluInputs(NamedTuple):
    """Tensors a SwiGLU kernel reads: ``x`` ``[N, 2H]``, and where given ``topk_weights``
    ``[N]``, ``expert_ends`` int32 ``[E]`` and (backward) ``grad_y`` ``[N, H]``."""

    x: torch.Tensor
    topk_weights: torch.Tensor | None = None
    expert_ends: torch.Tensor | None = None
    grad_y: torch.Tensor | None = None


class SwigluOutputs(NamedTuple):
    """Tensors a forward kernel writes: ``y`` ``[N, H]`` (``swiglu``), or ``q`` / ``sf``
    (``swiglu_per_token_cast``, laid out as ``per_token_cast`` lays them out); None where absent."""

    y: torch.Tensor | None = None
    q: torch.Tensor | None = None
    sf: torch.Tensor | None = None


class SwigluGradients(NamedTuple):
    """Tensors ``swiglu_backward`` writes: ``grad_x`` ``[N, 2H]`` (x's dtype) and
    ``grad_topk_weights`` ``[N]`` (compute dtype; None without ``topk_weights``)."""

    grad_x: torch.Tensor
    grad_topk_weights: torch.Tensor | None = None


@call_type
class SwigluCall(Call):
    """Frozen description of one SwiGLU-family call (a :class:`tileplug.core.call.Call`).

    ``hidden`` is ``H`` (x has ``2H`` columns), ``input_dtype`` x's dtype, ``output_dtype``
    ``y``'s (``swiglu``; fp32 for the cast, which quantizes the fp32 ``y``; the backward's
    ``grad_y`` dtype), ``weighted``: ``topk_weights`` is given, ``routed_scaling_factor`` the
    factor every row's weight is multiplied by, ``clamp_value`` the clamp (None: none),
    ``num_experts`` the length of ``expert_ends`` (None: every row is valid) and
    ``expert_alignment`` the alignment its layout was made with. ``quant``: the
    ``per_token_cast`` of ``swiglu_per_token_cast`` over ``[N, H]`` fp32. ``alignment``: the
    byte alignment (1..16) of the row tensors' data pointers and row strides.
    """

    hidden: int
    input_dtype: torch.dtype
    output_dtype: torch.dtype
    weighted: bool = False
    routed_scaling_factor: float = 1.0
    clamp_value: float | None = None
    num_experts: int | None = None
    expert_alignment: int = 128
    quant: QuantCall | None = None
    alignment: int = 16

    @property
    def compute_dtype(self) -> torch.dtype:
        return compute_dtype(self.input_dtype)

    def allocation_plan(self, traits: Any) -> SwigluPlan:
        return SwigluPlan(self, traits)

    def result(self, outputs: Any) -> Any:
        """``y`` (``swiglu``), ``(q, sf)`` (the cast), ``(grad_x, grad_topk_weights | None)`` (backward)."""
        if self.op == SWIGLU_BACKWARD:
            return outputs.grad_x, outputs.grad_topk_weights
        if self.op == SWIGLU_PER_TOKEN_CAST:
            return outputs.q, outputs.sf
        return outputs.y

    def ledger(self, traits: Any) -> Ledger:
        """Bytes that must move: ``x`` (``2H`` per row), the weights and ``expert_ends`` read
        once, each output written once (the cast: its ``q`` and ``sf`` only — the fused op
        never stores the activation, which the unfused chain writes in fp32 and reads back);
        flops ~ 6 per output element forward (clamp, sigmoid, three products), 12 backward."""
        rows, width = self.tokens, self.hidden
        read = rows * 2 * width * self.input_dtype.itemsize
        read += rows * self.compute_dtype.itemsize if self.weighted else 0
        read += (self.num_experts or 0) * ENDS_DTYPE.itemsize
        if self.op == SWIGLU_BACKWARD:
            read += rows * width * self.output_dtype.itemsize
            written = rows * 2 * width * self.input_dtype.itemsize
            written += rows * self.compute_dtype.itemsize if self.weighted else 0
            return Ledger(read, written, 12 * rows * width)
        if self.op == SWIGLU_PER_TOKEN_CAST:
            cast = self.quant.ledger(traits)
            return Ledger(read, cast.bytes_written, 6 * rows * width + cast.flops)
        return Ledger(read, rows * width * self.output_dtype.itemsize, 6 * rows * width)


class SwigluPlan:
    """Output allocation of one SwiGLU call signature for any row count."""

    __slots__ = ("call", "quant_plan")

    def __init__(self, call: SwigluCall, traits: Any) -> None:
        self.call = call
        self.quant_plan = call.quant.allocation_plan(traits) if call.quant is not None else None

    def allocate(self, tokens: int, device: torch.device | None) -> Any:
        call = self.call
        if call.op == SWIGLU_BACKWARD:
            grad_weights = torch.empty(tokens, dtype=call.compute_dtype, device=device) if call.weighted else None
            return SwigluGradients(torch.empty(tokens, 2 * call.hidden, dtype=call.input_dtype, device=device),
                                   grad_weights)
        if call.op == SWIGLU_PER_TOKEN_CAST:
            q, sf = self.quant_plan.allocate(tokens, device)
            return SwigluOutputs(None, q, sf)
        return SwigluOutputs(torch.empty(tokens, call.hidden, dtype=call.output_dtype, device=device))


# ---------------------------------------------------------------------- argument checks


def check_gate_up(op: str, value: Any, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """``x``: a 2-D ``[N, 2H]`` tensor of one of ``dtypes``, unit last stride, ``2H`` even and ≥ 2."""
    x = check_matrix(op, "x", value, dtypes, "[N, 2H] ([gate | up])")
    if x.shape[1] < 2 or x.shape[1] % 2:
        raise ContractError(op, "x", "an even last dim 2H ([gate | up]) with at least 1 column in each half",
                            describe(x))
    return x


def check_out_dtype(op: str, value: Any, x: torch.Tensor) -> torch.dtype:
    """``out_dtype``: None (x's dtype), bf16 or fp32; an fp64 x computes and returns fp64 only."""
    if value is None:
        return x.dtype
    if x.dtype == torch.float64:
        if value == torch.float64:
            return value
        raise ContractError(op, "out_dtype", "None or torch.float64 for an fp64 x", describe(value))
    if isinstance(value, torch.dtype) and value in OUTPUT_DTYPES:
        return value
    raise ContractError(op, "out_dtype", "None, torch.bfloat16 or torch.float32", describe(value))


def check_topk_weights(op: str, value: Any, x: torch.Tensor) -> torch.Tensor | None:
    """None, or the routed weight of each row: a contiguous 1-D ``[N]`` tensor in the compute dtype."""
    if value is None:
        return None
    tensor = check_tensor(op, "topk_weights", value)
    rows, work = x.shape[0], compute_dtype(x.dtype)
    if tensor.dim() != 1 or tensor.shape[0] != rows:
        raise ContractError(op, "topk_weights", f"a 1-D tensor of shape [{rows}] (one weight per row of x)",
                            describe(tensor))
    if tensor.dtype != work:
        raise ContractError(op, "topk_weights", f"dtype {str(work).replace('torch.', '')}", describe(tensor))
    check_same_device(op, "topk_weights", tensor, x.device)
    if rows > 1 and tensor.stride(0) != 1:
        raise ContractError(op, "topk_weights", "unit stride (a contiguous vector)", describe(tensor))
    return tensor


def check_clamp_value(op: str, value: Any) -> float | None:
    """None, or a finite Python number > 0 (not a bool)."""
    if value is None:
        return None
    if (value.__class__ is float or value.__class__ is int) and math.isfinite(value) and value > 0:
        return float(value)
    raise ContractError(op, "clamp_value", "None or a finite float > 0", describe(value))


def check_expert_ends(op: str, value: Any, x: torch.Tensor) -> torch.Tensor | None:
    """None, or int32 ``[E]`` (``E >= 1``) contiguous on x's device: SPEC §7's prefix ends.
    The values are not read here (that would wait on the device): rows outside every
    expert's range are padding, rows at or past the last end too."""
    if value is None:
        return None
    tensor = check_tensor(op, "expert_ends", value)
    if tensor.dim() != 1 or tensor.shape[0] < 1:
        raise ContractError(op, "expert_ends", "a 1-D tensor [E] with E >= 1 (one end per expert)",
                            describe(tensor))
    if tensor.dtype != ENDS_DTYPE:
        raise ContractError(op, "expert_ends", "dtype int32 (moe_expert_counts' expert_ends)", describe(tensor))
    check_same_device(op, "expert_ends", tensor, x.device)
    if tensor.shape[0] > 1 and tensor.stride(0) != 1:
        raise ContractError(op, "expert_ends", "unit stride (a contiguous vector)", describe(tensor))
    return tensor


def check_grad_y(op: str, value: Any, x: torch.Tensor) -> torch.Tensor:
    """``grad_y``: ``[N, H]``, unit last stride, on x's device; bf16 / fp32 (fp64 with an fp64 x)."""
    dtypes = (torch.float64,) if x.dtype == torch.float64 else OUTPUT_DTYPES
    tensor = check_matrix(op, "grad_y", value, dtypes, "[N, H]")
    rows, width = x.shape[0], x.shape[1] // 2
    if tuple(tensor.shape) != (rows, width):
        raise ContractError(op, "grad_y", f"a tensor of shape [{rows}, {width}] (y's: x's rows, half its columns)",
                            describe(tensor))
    check_same_device(op, "grad_y", tensor, x.device)
    return tensor


def _common(op: str, x: Any, dtypes: tuple[torch.dtype, ...], topk_weights: Any, routed_scaling_factor: Any,
            clamp_value: Any, expert_ends: Any, expert_alignment: Any) -> tuple:
    x = check_gate_up(op, x, dtypes)
    weights = check_topk_weights(op, topk_weights, x)
    scaling = _check_scaling(op, routed_scaling_factor)
    clamp = check_clamp_value(op, clamp_value)
    ends = check_expert_ends(op, expert_ends, x)
    alignment = check_int(op, "expert_alignment", expert_alignment, 1)
    return x, weights, scaling, clamp, ends, alignment


def _call(op: str, x: torch.Tensor, output_dtype: torch.dtype, weights: torch.Tensor | None, scaling: float,
          clamp: float | None, ends: torch.Tensor | None, alignment: int, rows_tensors: tuple = (),
          quant: QuantCall | None = None) -> SwigluCall:
    current = config.current()
    byte_aligned = min(byte_alignment(t) for t in (x, *rows_tensors))
    return SwigluCall(op, x.device.type, op, int(x.shape[1]) // 2, x.dtype, output_dtype, weighted=weights is not None,
                      routed_scaling_factor=scaling, clamp_value=clamp,
                      num_experts=None if ends is None else int(ends.shape[0]), expert_alignment=alignment,
                      quant=quant, alignment=byte_aligned, host_layout=current.host_layout,
                      sf_alignment_bytes=current.token_alignment_bytes, tokens=int(x.shape[0]), device=x.device,
                      empty=x.numel() == 0)


def _plain(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """Kernels read plain tensors: autograd, where recorded, is the custom op's registration."""
    return tensor.detach() if tensor is not None and tensor.requires_grad else tensor


def _checked_swiglu(x: Any, out_dtype: Any, topk_weights: Any, routed_scaling_factor: Any, clamp_value: Any,
                    expert_ends: Any, expert_alignment: Any) -> SwigluCall:
    """Every check of ``swiglu``."""
    op = SWIGLU
    x, weights, scaling, clamp, ends, alignment = _common(op, x, INPUT_DTYPES, topk_weights, routed_scaling_factor,
                                                          clamp_value, expert_ends, expert_alignment)
    return _call(op, x, check_out_dtype(op, out_dtype, x), weights, scaling, clamp, ends, alignment)


def _checked_swiglu_per_token_cast(x: Any, fmt: Any, num_per_channels: Any, topk_weights: Any,
                                   routed_scaling_factor: Any, clamp_value: Any, expert_ends: Any,
                                   expert_alignment: Any, round_sf: Any, use_packed_ue8m0: Any,
                                   use_tma_aligned_col_major_sf: Any, use_e4m3_sf: Any) -> SwigluCall:
    """Every check of ``swiglu_per_token_cast``: ``swiglu``'s, then ``per_token_cast``'s on its
    fp32 output ``[N, H]`` (the same checks and the same cast configuration object)."""
    op = SWIGLU_PER_TOKEN_CAST
    x, weights, scaling, clamp, ends, alignment = _common(op, x, CAST_INPUT_DTYPES, topk_weights,
                                                          routed_scaling_factor, clamp_value, expert_ends,
                                                          expert_alignment)
    group = check_choice(op, "num_per_channels", num_per_channels, PER_TOKEN_GROUPS)
    current = config.current()
    cast = cast_config(op, fmt, (1, group), use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, use_e4m3_sf,
                       current)
    width = int(x.shape[1]) // 2
    if cast.fmt.values_per_byte == 2 and width % 2:
        raise ContractError(op, "x", "an even H (x's last dim a multiple of 4) for fmt='e2m1' (two values per byte)",
                            describe(x))
    quant = QuantCall("per_token_cast", x.device.type, "per_token_cast", MODE_CAST, width, torch.float32, cast,
                      host_layout=current.host_layout, sf_alignment_bytes=current.token_alignment_bytes,
                      tokens=int(x.shape[0]), device=x.device, empty=x.numel() == 0)
    return _call(op, x, torch.float32, weights, scaling, clamp, ends, alignment, quant=quant)


def _checked_swiglu_backward(x: Any, grad_y: Any, topk_weights: Any, routed_scaling_factor: Any, clamp_value: Any,
                             expert_ends: Any, expert_alignment: Any) -> SwigluCall:
    """Every check of ``swiglu_backward``."""
    op = SWIGLU_BACKWARD
    x, weights, scaling, clamp, ends, alignment = _common(op, x, INPUT_DTYPES, topk_weights, routed_scaling_factor,
                                                          clamp_value, expert_ends, expert_alignment)
    grad_y = check_grad_y(op, grad_y, x)
    return _call(op, x, grad_y.dtype, weights, scaling, clamp, ends, alignment, rows_tensors=(grad_y,))


# ---------------------------------------------------------------------- the contracts (fast path first)

recent_calls = RecentCalls()
"""Checked SwiGLU calls by everything the checks read (the hot path's memo)."""

_SCALAR_CLASSES = (float, int, bool, str, type(None), torch.dtype)


def _memoized(op: str, tensors: tuple, scalars: tuple, checked: Any) -> SwigluCall:
    """The call of a signature seen before (``RecentCalls.memoized``: tensor metadata, pointer
    alignment, scalars of exact classes — a dtype included —, the config in force), else
    ``checked()`` — remembered when it passes."""
    return recent_calls.memoized(op, tensors, scalars, checked, _SCALAR_CLASSES)


def swiglu(x: Any, out_dtype: Any, topk_weights: Any, routed_scaling_factor: Any, clamp_value: Any,
           expert_ends: Any, expert_alignment: Any) -> tuple[SwigluCall, SwigluInputs]:
    """Contract of ``swiglu`` → (call, inputs)."""
    call = _memoized(SWIGLU, (x, topk_weights, expert_ends),
                     (out_dtype, routed_scaling_factor, clamp_value, expert_alignment),
                     lambda: _checked_swiglu(x, out_dtype, topk_weights, routed_scaling_factor, clamp_value,
                                             expert_ends, expert_alignment))
    return call, SwigluInputs(_plain(x), _plain(topk_weights), expert_ends)


def swiglu_per_token_cast(x: Any, fmt: Any, num_per_channels: Any, topk_weights: Any, routed_scaling_factor: Any,
                          clamp_value: Any, expert_ends: Any, expert_alignment: Any, round_sf: Any,
                          use_packed_ue8m0: Any, use_tma_aligned_col_major_sf: Any, use_e4m3_sf: Any
                          ) -> tuple[SwigluCall, SwigluInputs]:
    """Contract of ``swiglu_per_token_cast`` → (call, inputs)."""
    arguments = (x, fmt, num_per_channels, topk_weights, routed_scaling_factor, clamp_value, expert_ends,
                 expert_alignment, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf, use_e4m3_sf)
    call = _memoized(SWIGLU_PER_TOKEN_CAST, (x, topk_weights, expert_ends),
                     (fmt, num_per_channels, routed_scaling_factor, clamp_value, expert_alignment, round_sf,
                      use_packed_ue8m0, use_tma_aligned_col_major_sf, use_e4m3_sf),
                     lambda: _checked_swiglu_per_token_cast(*arguments))
    return call, SwigluInputs(_plain(x), _plain(topk_weights), expert_ends)


def swiglu_backward(x: Any, grad_y: Any, topk_weights: Any, routed_scaling_factor: Any, clamp_value: Any,
                    expert_ends: Any, expert_alignment: Any) -> tuple[SwigluCall, SwigluInputs]:
    """Contract of ``swiglu_backward`` → (call, inputs)."""
    call = _memoized(SWIGLU_BACKWARD, (x, grad_y, topk_weights, expert_ends),
                     (routed_scaling_factor, clamp_value, expert_alignment),
                     lambda: _checked_swiglu_backward(x, grad_y, topk_weights, routed_scaling_factor, clamp_value,
                                                      expert_ends, expert_alignment))
    return call, SwigluInputs(_plain(x), _plain(topk_weights), expert_ends, _plain(grad_y))
