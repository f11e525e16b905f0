"""Contracts of the norm family (SPEC §5, docs/spec.md "Norms").

Each builder checks every argument (ContractError naming it) and returns a :class:`NormCall`
(the frozen, hashable description: selection cache key and kernel specialisation), the
tensors the kernel reads, and the caller's ``out=`` / ``residual_out=`` tensors, which may
alias ``x`` / ``residual`` exactly (the in-place form ``rms_norm(x, w, residual=r, out=x,
residual_out=r)``) and must otherwise share no memory with any input or with each other.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from tileplug.core import config
from tileplug.core.call import Call, Ledger, call_type, overlaps
from tileplug.core.contracts.checks import check_bool, check_choice, check_same_device, check_tensor, describe
from tileplug.core.contracts.quant import (
    MODE_CAST,
    PER_TOKEN_GROUPS,
    AllocationPlan,
    QuantCall,
    RecentCalls,
    cast_config,
    has_storage,
)
from tileplug.core.errors import ContractError
from tileplug.core.norm.formulas import compute_dtype

NORM_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
"""Input dtypes of every norm op: bf16 / fp16 / fp32 as SPEC §5 says, and fp64, which the
reference serves so that ``torch.autograd.gradcheck`` can run (other backends may decline it)."""
CAST_INPUT_DTYPES = (torch.bfloat16, torch.float32)
"""Inputs of ``rms_norm_per_token_cast``: those of ``per_token_cast``, which reads its output."""
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_DTYPE_NAMES = {dtype: str(dtype).replace("torch.", "") for dtype in NORM_INPUT_DTYPES}

RMS_NORM = "rms_norm"
LAYER_NORM = "layer_norm"
RMS_NORM_PER_TOKEN_CAST = "rms_norm_per_token_cast"
RMS_NORM_BACKWARD = "rms_norm_backward"
LAYER_NORM_BACKWARD = "layer_norm_backward"


class NormInputs(NamedTuple):
    """Tensors a forward norm kernel reads: ``x`` [T, D] or [T, N, D], and ``weight`` /
    ``bias`` [D], ``residual`` (x's shape) where given."""

    x: torch.Tensor
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    residual: torch.Tensor | None = None


class NormBackwardInputs(NamedTuple):
    """Tensors a norm backward kernel reads: ``grad_y`` and ``x`` (the normalized input
    ``s``, i.e. ``residual_out`` of a forward with a residual), ``weight``, the saved
    statistics ``mean`` (LayerNorm) and ``rstd`` (x's shape without D), ``grad_residual_out``."""

    grad_y: torch.Tensor
    x: torch.Tensor
    weight: torch.Tensor | None
    mean: torch.Tensor | None
    rstd: torch.Tensor
    grad_residual_out: torch.Tensor | None


class NormOutputs(NamedTuple):
    """Tensors a forward norm kernel writes (None where the call has no such output): ``y``
    (x's shape and dtype; for ``rms_norm_per_token_cast`` the unquantized output, when asked),
    ``residual_out``, the statistics ``mean`` / ``rstd`` (x's shape without D, compute dtype),
    and the quantized ``q`` / ``sf`` of ``rms_norm_per_token_cast``."""

    y: torch.Tensor | None
    residual_out: torch.Tensor | None = None
    mean: torch.Tensor | None = None
    rstd: torch.Tensor | None = None
    q: torch.Tensor | None = None
    sf: torch.Tensor | None = None


class NormGradients(NamedTuple):
    """Tensors a norm backward kernel writes: ``grad_x`` (x's shape and dtype),
    ``grad_weight`` / ``grad_bias`` [D] in the compute dtype (None where absent)."""

    grad_x: torch.Tensor
    grad_weight: torch.Tensor | None = None
    grad_bias: torch.Tensor | None = None


@call_type
class NormCall(Call):
    """Frozen description of one norm-family call (a :class:`tileplug.core.call.Call`).

    ``op`` is the kernel-table key (the public op's name), ``hidden`` the normalized size
    ``D``, ``heads`` ``N`` of a 3-D ``[T, N, D]`` input (None for 2-D ``[T, D]``), so a kernel
    runs ``T · N`` (or ``T``) rows. ``weight_dtype`` / ``bias_dtype`` are None when absent;
    ``residual``: a residual is added (``residual_out`` written); ``stats``: the statistics
    are returned (``return_rstd`` / ``return_stats``; backward: always read).
    ``quant``: the per-token cast ``rms_norm_per_token_cast`` ends in (its QuantCall over
    ``[T, N·D]``), ``unquantized``: that op also returns ``y``. ``grad_residual``: a backward
    call adds ``grad_residual_out``. ``alignment``: the byte alignment (1..16) every data
    pointer and row stride of the call's tensors shares.
    """

    hidden: int
    heads: int | None
    input_dtype: torch.dtype
    weight_dtype: torch.dtype | None = None
    bias_dtype: torch.dtype | None = None
    residual: bool = False
    eps: float = 0.0
    weight_offset: float = 0.0
    out_scale: float = 1.0
    stats: bool = False
    quant: QuantCall | None = None
    unquantized: bool = False
    grad_residual: bool = False
    alignment: int = 16

    @property
    def rows(self) -> int:
        """Rows the kernel normalizes: ``T · N`` (``T`` for a 2-D input)."""
        return self.tokens * (1 if self.heads is None else self.heads)

    @property
    def statistics_dtype(self) -> torch.dtype:
        return compute_dtype(self.input_dtype)

    def allocation_plan(self, traits: Any) -> NormPlan:
        return NormPlan(self, traits)

    # ------------------------------------------------------------------ results
    def result(self, outputs: Any) -> Any:
        """What the public op returns (SPEC §5 order): ``y``, then ``residual_out`` with a
        residual, then the statistics when asked; ``(q, sf[, residual_out][, y])`` for the
        cast; ``(grad_x, grad_weight | None[, grad_bias])`` for a backward."""
        op = self.op
        if op == RMS_NORM_BACKWARD:
            return outputs.grad_x, outputs.grad_weight
        if op == LAYER_NORM_BACKWARD:
            return outputs.grad_x, outputs.grad_weight, outputs.grad_bias
        if op == RMS_NORM_PER_TOKEN_CAST:
            extra = (outputs.residual_out,) if self.residual else ()
            return (outputs.q, outputs.sf, *extra, *((outputs.y,) if self.unquantized else ()))
        extra = [outputs.residual_out] if self.residual else []
        if self.stats:
            extra += [outputs.mean, outputs.rstd] if op == LAYER_NORM else [outputs.rstd]
        return (outputs.y, *extra) if extra else outputs.y

    # ------------------------------------------------------------------ ledger
    def ledger(self, traits: Any) -> Ledger:
        """Bytes that must move: each input read once, each output written once (the sf of the
        cast counted without layout padding); flops ~ 4 per element (two passes for LayerNorm)."""
        elements = self.rows * self.hidden
        size = self.input_dtype.itemsize
        vector = self.hidden
        weight = vector * self.weight_dtype.itemsize if self.weight_dtype is not None else 0
        bias = vector * self.bias_dtype.itemsize if self.bias_dtype is not None else 0
        statistics = self.rows * self.statistics_dtype.itemsize
        if self.op in (RMS_NORM_BACKWARD, LAYER_NORM_BACKWARD):
            layer = self.op == LAYER_NORM_BACKWARD
            read = 2 * elements * size + weight + statistics * (2 if layer else 1)
            read += elements * size if self.grad_residual else 0
            reduced = vector * self.statistics_dtype.itemsize  # grad_weight / grad_bias, compute dtype
            gradients = (reduced if self.weight_dtype is not None else 0) + (reduced if layer else 0)
            return Ledger(read, elements * size + gradients, 8 * elements)
        read = elements * size * (2 if self.residual else 1) + weight + bias
        written = elements * size if self.residual else 0
        if self.op == RMS_NORM_PER_TOKEN_CAST:
            cast_ledger = self.quant.ledger(traits)
            written += cast_ledger.bytes_written + (elements * size if self.unquantized else 0)
            return Ledger(read, written, 4 * elements + cast_ledger.flops)
        written += elements * size
        if self.stats:
            written += statistics * (2 if self.op == LAYER_NORM else 1)
        return Ledger(read, written, (6 if self.op == LAYER_NORM else 4) * elements)


class NormPlan:
    """Output allocation of one norm call signature for any token count; outputs the caller
    passed (``given``, already checked by the contract) are used as they are."""

    __slots__ = ("call", "quant_plan")

    def __init__(self, call: NormCall, traits: Any) -> None:
        self.call = call
        self.quant_plan: AllocationPlan | None = call.quant.allocation_plan(traits) if call.quant is not None else None

    def _shape(self, tokens: int) -> tuple[int, ...]:
        call = self.call
        return (tokens, call.hidden) if call.heads is None else (tokens, call.heads, call.hidden)

    def allocate(self, tokens: int, device: torch.device | None, given: NormOutputs | None = None) -> Any:
        call = self.call
        shape = self._shape(tokens)
        dtype = call.input_dtype
        if call.op in (RMS_NORM_BACKWARD, LAYER_NORM_BACKWARD):
            vector = (call.hidden,)
            work = call.statistics_dtype
            # a sum over no rows is 0: with nothing to compute (no launch) the gradients are zeros
            reduced = torch.zeros if tokens * (1 if call.heads is None else call.heads) == 0 else torch.empty
            return NormGradients(
                torch.empty(shape, dtype=dtype, device=device),
                reduced(vector, dtype=work, device=device) if call.weight_dtype is not None else None,
                reduced(vector, dtype=work, device=device) if call.op == LAYER_NORM_BACKWARD else None,
            )
        given_y = given.y if given is not None else None
        given_residual = given.residual_out if given is not None else None
        residual_out = None
        if call.residual:
            residual_out = given_residual if given_residual is not None else torch.empty(shape, dtype=dtype,
                                                                                         device=device)
        if call.op == RMS_NORM_PER_TOKEN_CAST:
            q, sf = self.quant_plan.allocate(tokens, device)
            y = torch.empty(shape, dtype=dtype, device=device) if call.unquantized else None
            return NormOutputs(y, residual_out, None, None, q, sf)
        y = given_y if given_y is not None else torch.empty(shape, dtype=dtype, device=device)
        mean = rstd = None
        if call.stats:
            rstd = torch.empty(shape[:-1], dtype=call.statistics_dtype, device=device)
            if call.op == LAYER_NORM:
                mean = torch.empty(shape[:-1], dtype=call.statistics_dtype, device=device)
        return NormOutputs(y, residual_out, mean, rstd)


# ---------------------------------------------------------------------- argument checks


def _alignment(tensor: torch.Tensor | None, limit: int = 16) -> int:
    """Byte alignment of a tensor's data pointer and its non-unit strides (``limit`` without storage)."""
    if tensor is None or not has_storage(tensor.__class__):
        return limit
    bits = tensor.data_ptr()
    for size, stride in zip(tensor.shape[:-1], tensor.stride()[:-1]):
        if size > 1:
            bits |= stride * tensor.element_size()
    return limit if bits == 0 else min(limit, bits & -bits)


def check_rows(op: str, name: str, value: Any, dtypes: tuple[torch.dtype, ...] = NORM_INPUT_DTYPES,
               dims: tuple[int, ...] = (2, 3)) -> torch.Tensor:
    """``x``-like input: a ``[T, D]`` or ``[T, N, D]`` tensor of one of ``dtypes`` with unit
    stride on the last dim (any other strides) and ``D >= 1``."""
    tensor = check_tensor(op, name, value)
    if tensor.dim() not in dims:
        shapes = " or ".join({2: "2-D [T, D]", 3: "3-D [T, N, D]"}[d] for d in dims)
        raise ContractError(op, name, f"a {shapes} tensor", describe(tensor))
    if tensor.dtype not in dtypes:
        raise ContractError(op, name, f"dtype in ({', '.join(_DTYPE_NAMES[d] for d in dtypes)})", describe(tensor))
    if tensor.shape[-1] < 1:
        raise ContractError(op, name, "a normalized (last) dim D >= 1", describe(tensor))
    if tensor.stride(-1) != 1 and tensor.shape[-1] > 1:
        raise ContractError(op, name, "unit stride on the last dim", describe(tensor))
    return tensor


def _check_like(op: str, name: str, value: Any, x: torch.Tensor) -> torch.Tensor:
    """A tensor of ``x``'s shape, dtype and device with unit stride on the last dim."""
    tensor = check_tensor(op, name, value)
    if tensor.shape != x.shape or tensor.dtype != x.dtype:
        raise ContractError(op, name, f"a tensor of x's shape {tuple(x.shape)} and dtype {x.dtype}",
                            describe(tensor))
    check_same_device(op, name, tensor, x.device)
    if tensor.stride(-1) != 1 and tensor.shape[-1] > 1:
        raise ContractError(op, name, "unit stride on the last dim", describe(tensor))
    return tensor


def _check_vector(op: str, name: str, value: Any, x: torch.Tensor) -> torch.Tensor | None:
    """None, or a ``[D]`` float tensor on x's device with unit stride (weight, bias)."""
    if value is None:
        return None
    tensor = check_tensor(op, name, value)
    hidden = x.shape[-1]
    if tensor.dim() != 1 or tensor.shape[0] != hidden:
        raise ContractError(op, name, f"a 1-D tensor of shape [{hidden}] (x's last dim)", describe(tensor))
    if tensor.dtype not in WEIGHT_DTYPES:
        raise ContractError(op, name, "a float tensor (bf16, fp16, fp32 or fp64)", describe(tensor))
    check_same_device(op, name, tensor, x.device)
    if tensor.stride(0) != 1 and hidden > 1:
        raise ContractError(op, name, "unit stride", describe(tensor))
    return tensor


def _check_real(op: str, name: str, value: Any, minimum: float | None = None) -> float:
    """A finite Python number (not a bool), ``>= minimum`` where given → float."""
    if value.__class__ is float or value.__class__ is int:
        number = float(value)
        if math.isfinite(number) and (minimum is None or number >= minimum):
            return number
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        return _check_real(op, name, float(value), minimum)
    expected = "a finite float" + ("" if minimum is None else f" >= {minimum}")
    raise ContractError(op, name, expected, describe(value))


def _check_written(op: str, name: str, value: Any, source: torch.Tensor | None, source_name: str,
                   inputs: tuple[torch.Tensor | None, ...]) -> torch.Tensor | None:
    """An ``out=``-like tensor: like ``source`` (shape, dtype, device, unit last stride),
    writable, not requiring grad, and either ``source`` itself (the same view: pointer,
    shape and strides) or sharing no memory with any input."""
    if value is None:
        return None
    if source is None:
        raise ContractError(op, name, f"None when {source_name} is None", describe(value))
    tensor = _check_like(op, name, value, source)
    if tensor.requires_grad:
        raise ContractError(op, name, "a tensor that does not require grad (it is written in place)",
                            describe(tensor))
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        raise ContractError(op, name, "a tensor writable outside inference mode", describe(tensor))
    if not has_storage(tensor.__class__):
        return tensor
    aliases_source = tensor.data_ptr() == source.data_ptr() and tensor.stride() == source.stride()
    for other in inputs:
        if other is None or (other is source and aliases_source):
            continue
        if overlaps(tensor, other):
            raise ContractError(op, name, f"{source_name} itself (the same view) or a tensor sharing no memory "
                                "with the inputs", describe(tensor))
    return tensor


def _heads(x: torch.Tensor) -> int | None:
    return int(x.shape[1]) if x.dim() == 3 else None


def _common(op: str, x: Any, weight: Any, residual: Any, eps: Any, dtypes: tuple[torch.dtype, ...] = NORM_INPUT_DTYPES
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, float]:
    x = check_rows(op, "x", x, dtypes)
    weight = _check_vector(op, "weight", weight, x)
    if residual is not None:
        residual = _check_like(op, "residual", residual, x)
    return x, weight, residual, _check_real(op, "eps", eps, 0.0)


def _check_offset(op: str, weight: torch.Tensor | None, weight_offset: Any) -> float:
    offset = _check_real(op, "weight_offset", weight_offset)
    if weight is None and offset != 0.0:
        raise ContractError(op, "weight_offset", "0.0 when weight is None (the offset is added to the weight)",
                            describe(weight_offset))
    return offset


def _written_pair(op: str, x: torch.Tensor, residual: torch.Tensor | None, inputs: tuple, out: Any,
                  residual_out: Any) -> NormOutputs | None:
    out = _check_written(op, "out", out, x, "x", inputs)
    residual_out = _check_written(op, "residual_out", residual_out, residual, "residual", inputs)
    if out is not None and residual_out is not None and has_storage(out.__class__) and overlaps(out, residual_out):
        raise ContractError(op, "residual_out", "a tensor sharing no memory with out", describe(residual_out))
    if out is None and residual_out is None:
        return None
    return NormOutputs(out, residual_out)


def _call(op: str, x: torch.Tensor, tensors: tuple, **fields: Any) -> NormCall:
    current = config.current()
    alignment = min(_alignment(t) for t in (x, *tensors))
    return NormCall(op, x.device.type, op, int(x.shape[-1]), _heads(x), x.dtype, alignment=alignment,
                    host_layout=current.host_layout, sf_alignment_bytes=current.token_alignment_bytes,
                    tokens=x.shape[0], device=x.device, empty=x.numel() == 0, **fields)


def _plain(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """Kernels read plain tensors: autograd, where recorded, is the custom op's registration."""
    return tensor.detach() if tensor is not None and tensor.requires_grad else tensor


# ---------------------------------------------------------------------- the checked contracts


def _checked_rms_norm(x: Any, weight: Any, eps: Any, residual: Any, weight_offset: Any, out_scale: Any, out: Any,
             residual_out: Any, return_rstd: Any) -> tuple[NormCall, NormInputs, NormOutputs | None]:
    """Every check of ``rms_norm`` → (call, inputs, given outputs or None)."""
    op = RMS_NORM
    x, weight, residual, eps = _common(op, x, weight, residual, eps)
    offset = _check_offset(op, weight, weight_offset)
    scale = _check_real(op, "out_scale", out_scale)
    stats = check_bool(op, "return_rstd", return_rstd)
    given = _written_pair(op, x, residual, (x, weight, residual), out, residual_out)
    call = _call(op, x, (residual, *(given or ())), weight_dtype=None if weight is None else weight.dtype,
                 residual=residual is not None, eps=eps, weight_offset=offset, out_scale=scale, stats=stats)
    return call, NormInputs(_plain(x), _plain(weight), None, _plain(residual)), given


def _checked_layer_norm(x: Any, weight: Any, bias: Any, eps: Any, residual: Any, out: Any, residual_out: Any,
               return_stats: Any) -> tuple[NormCall, NormInputs, NormOutputs | None]:
    """Every check of ``layer_norm`` → (call, inputs, given outputs or None)."""
    op = LAYER_NORM
    x, weight, residual, eps = _common(op, x, weight, residual, eps)
    bias = _check_vector(op, "bias", bias, x)
    stats = check_bool(op, "return_stats", return_stats)
    given = _written_pair(op, x, residual, (x, weight, bias, residual), out, residual_out)
    call = _call(op, x, (residual, *(given or ())), weight_dtype=None if weight is None else weight.dtype,
                 bias_dtype=None if bias is None else bias.dtype, residual=residual is not None, eps=eps,
                 stats=stats)
    return call, NormInputs(_plain(x), _plain(weight), _plain(bias), _plain(residual)), given


def _checked_rms_norm_per_token_cast(x: Any, weight: Any, eps: Any, fmt: Any, num_per_channels: Any, residual: Any,
                            weight_offset: Any, out_scale: Any, round_sf: Any, use_packed_ue8m0: Any,
                            use_tma_aligned_col_major_sf: Any, use_e4m3_sf: Any, return_unquantized: Any,
                            residual_out: Any) -> tuple[NormCall, NormInputs, NormOutputs | None]:
    """Every check of ``rms_norm_per_token_cast``: ``rms_norm``'s, then ``per_token_cast``'s on its
    output ``[T, N·D]`` (the same checks and the same cast configuration object)."""
    op = RMS_NORM_PER_TOKEN_CAST
    x, weight, residual, eps = _common(op, x, weight, residual, eps, CAST_INPUT_DTYPES)
    offset = _check_offset(op, weight, weight_offset)
    scale = _check_real(op, "out_scale", out_scale)
    unquantized = check_bool(op, "return_unquantized", return_unquantized)
    group = check_choice(op, "num_per_channels", num_per_channels, PER_TOKEN_GROUPS)
    current = config.current()
    cast = cast_config(op, fmt, (1, group), use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, use_e4m3_sf,
                       current)
    width = int(x.shape[-1]) * (int(x.shape[1]) if x.dim() == 3 else 1)
    if cast.fmt.values_per_byte == 2 and width % 2:
        raise ContractError(op, "x", "an even N·D for fmt='e2m1' (two values per byte)", describe(x))
    given = _written_pair(op, x, residual, (x, weight, residual), None, residual_out)
    quant = QuantCall("per_token_cast", x.device.type, "per_token_cast", MODE_CAST, width, x.dtype, cast,
                      host_layout=current.host_layout, sf_alignment_bytes=current.token_alignment_bytes,
                      tokens=x.shape[0], device=x.device, empty=x.numel() == 0)
    call = _call(op, x, (residual, *(given or ())), weight_dtype=None if weight is None else weight.dtype,
                 residual=residual is not None, eps=eps, weight_offset=offset, out_scale=scale, quant=quant,
                 unquantized=unquantized)
    return call, NormInputs(_plain(x), _plain(weight), None, _plain(residual)), given


def _check_statistic(op: str, name: str, value: Any, x: torch.Tensor) -> torch.Tensor:
    """A saved statistic: a contiguous tensor of x's shape without D, in the compute dtype."""
    tensor = check_tensor(op, name, value)
    shape, dtype = tuple(x.shape[:-1]), compute_dtype(x.dtype)
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise ContractError(op, name, f"a tensor of shape {shape} and dtype {dtype} (the forward's)", describe(tensor))
    check_same_device(op, name, tensor, x.device)
    if not tensor.is_contiguous():
        raise ContractError(op, name, "a contiguous tensor", describe(tensor))
    return tensor


def _backward_common(op: str, grad_y: Any, x: Any, weight: Any, grad_residual_out: Any
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    x = check_rows(op, "x", x)
    grad_y = _check_like(op, "grad_y", grad_y, x)
    weight = _check_vector(op, "weight", weight, x)
    if grad_residual_out is not None:
        grad_residual_out = _check_like(op, "grad_residual_out", grad_residual_out, x)
    return grad_y, x, weight, grad_residual_out


def _checked_rms_norm_backward(grad_y: Any, x: Any, weight: Any, rstd: Any, weight_offset: Any, out_scale: Any,
                      grad_residual_out: Any) -> tuple[NormCall, NormBackwardInputs]:
    """Every check of ``rms_norm_backward``."""
    op = RMS_NORM_BACKWARD
    grad_y, x, weight, grad_residual_out = _backward_common(op, grad_y, x, weight, grad_residual_out)
    rstd = _check_statistic(op, "rstd", rstd, x)
    offset = _check_offset(op, weight, weight_offset)
    scale = _check_real(op, "out_scale", out_scale)
    call = _call(op, x, (grad_y, grad_residual_out), weight_dtype=None if weight is None else weight.dtype,
                 weight_offset=offset, out_scale=scale, stats=True, grad_residual=grad_residual_out is not None)
    inputs = NormBackwardInputs(_plain(grad_y), _plain(x), _plain(weight), None, _plain(rstd),
                                _plain(grad_residual_out))
    return call, inputs


def _checked_layer_norm_backward(grad_y: Any, x: Any, weight: Any, mean: Any, rstd: Any, grad_residual_out: Any
                        ) -> tuple[NormCall, NormBackwardInputs]:
    """Every check of ``layer_norm_backward``."""
    op = LAYER_NORM_BACKWARD
    grad_y, x, weight, grad_residual_out = _backward_common(op, grad_y, x, weight, grad_residual_out)
    mean = _check_statistic(op, "mean", mean, x)
    rstd = _check_statistic(op, "rstd", rstd, x)
    call = _call(op, x, (grad_y, grad_residual_out), weight_dtype=None if weight is None else weight.dtype,
                 stats=True, grad_residual=grad_residual_out is not None)
    inputs = NormBackwardInputs(_plain(grad_y), _plain(x), _plain(weight), _plain(mean), _plain(rstd),
                                _plain(grad_residual_out))
    return call, inputs


# ---------------------------------------------------------------------- the contracts (fast path first)

recent_calls = RecentCalls()
"""Checked norm calls by everything the checks read (the per-token hot path's memo)."""


def _memoized(op: str, tensors: tuple, scalars: tuple, checked: Any) -> NormCall:
    """The call of a repeated signature (``RecentCalls.memoized``; scalars exactly float / int /
    bool / str), else the call of ``checked()`` (which returns ``(call, inputs[, outputs])``)."""
    return recent_calls.memoized(op, tensors, scalars, lambda: checked()[0])


def rms_norm(x: Any, weight: Any, eps: Any, residual: Any, weight_offset: Any, out_scale: Any, out: Any,
             residual_out: Any, return_rstd: Any) -> tuple[NormCall, NormInputs, NormOutputs | None]:
    """Contract of ``rms_norm`` → (call, inputs, given outputs or None). Calls without ``out`` /
    ``residual_out`` whose arguments were seen before skip the checks (a memo of everything the
    checks read: tensor metadata, pointer alignment, scalars, the config in force)."""
    if out is not None or residual_out is not None:
        return _checked_rms_norm(x, weight, eps, residual, weight_offset, out_scale, out, residual_out, return_rstd)
    call = _memoized(RMS_NORM, (x, weight, residual), (eps, weight_offset, out_scale, return_rstd),
                     lambda: _checked_rms_norm(x, weight, eps, residual, weight_offset, out_scale, None, None,
                                               return_rstd))
    return call, NormInputs(_plain(x), _plain(weight), None, _plain(residual)), None


def layer_norm(x: Any, weight: Any, bias: Any, eps: Any, residual: Any, out: Any, residual_out: Any,
               return_stats: Any) -> tuple[NormCall, NormInputs, NormOutputs | None]:
    """Contract of ``layer_norm`` → (call, inputs, given outputs or None); memoized like :func:`rms_norm`."""
    if out is not None or residual_out is not None:
        return _checked_layer_norm(x, weight, bias, eps, residual, out, residual_out, return_stats)
    call = _memoized(LAYER_NORM, (x, weight, bias, residual), (eps, return_stats),
                     lambda: _checked_layer_norm(x, weight, bias, eps, residual, None, None, return_stats))
    return call, NormInputs(_plain(x), _plain(weight), _plain(bias), _plain(residual)), None


def rms_norm_per_token_cast(x: Any, weight: Any, eps: Any, fmt: Any, num_per_channels: Any, residual: Any,
                            weight_offset: Any, out_scale: Any, round_sf: Any, use_packed_ue8m0: Any,
                            use_tma_aligned_col_major_sf: Any, use_e4m3_sf: Any, return_unquantized: Any,
                            residual_out: Any) -> tuple[NormCall, NormInputs, NormOutputs | None]:
    """Contract of ``rms_norm_per_token_cast``; memoized like :func:`rms_norm`."""
    arguments = (x, weight, eps, fmt, num_per_channels, residual, weight_offset, out_scale, round_sf, use_packed_ue8m0,
                 use_tma_aligned_col_major_sf, use_e4m3_sf, return_unquantized)
    if residual_out is not None:
        return _checked_rms_norm_per_token_cast(*arguments, residual_out)
    call = _memoized(RMS_NORM_PER_TOKEN_CAST, (x, weight, residual),
                     (eps, fmt, num_per_channels, weight_offset, out_scale, round_sf, use_packed_ue8m0,
                      use_tma_aligned_col_major_sf, use_e4m3_sf, return_unquantized),
                     lambda: _checked_rms_norm_per_token_cast(*arguments, None))
    return call, NormInputs(_plain(x), _plain(weight), None, _plain(residual)), None


def rms_norm_backward(grad_y: Any, x: Any, weight: Any, rstd: Any, weight_offset: Any, out_scale: Any,
                      grad_residual_out: Any) -> tuple[NormCall, NormBackwardInputs]:
    """Contract of ``rms_norm_backward``; memoized like :func:`rms_norm`."""
    call = _memoized(RMS_NORM_BACKWARD, (grad_y, x, weight, rstd, grad_residual_out), (weight_offset, out_scale),
                     lambda: _checked_rms_norm_backward(grad_y, x, weight, rstd, weight_offset, out_scale,
                                                        grad_residual_out))
    return call, NormBackwardInputs(_plain(grad_y), _plain(x), _plain(weight), None, _plain(rstd),
                                    _plain(grad_residual_out))


def layer_norm_backward(grad_y: Any, x: Any, weight: Any, mean: Any, rstd: Any, grad_residual_out: Any
                        ) -> tuple[NormCall, NormBackwardInputs]:
    """Contract of ``layer_norm_backward``; memoized like :func:`rms_norm`."""
    call = _memoized(LAYER_NORM_BACKWARD, (grad_y, x, weight, mean, rstd, grad_residual_out), (),
                     lambda: _checked_layer_norm_backward(grad_y, x, weight, mean, rstd, grad_residual_out))
    return call, NormBackwardInputs(_plain(grad_y), _plain(x), _plain(weight), _plain(mean), _plain(rstd),
                                    _plain(grad_residual_out))
