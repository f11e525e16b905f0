"""Norm ops (SPEC §5, docs/spec.md "Norms"): the public functions and their op-table declarations.

Shapes: ``x`` is ``[T, D]`` or ``[T, N, D]`` (per-head norm over the last dim), bf16 / fp16 /
fp32 (fp64 for gradcheck), unit last stride, any other strides; ``weight`` / ``bias`` ``[D]``;
``residual`` has x's shape and dtype; statistics (``rstd``, ``mean``) have x's shape without
``D``, in fp32 (fp64 for fp64 inputs).

``rms_norm`` and ``layer_norm`` are differentiable: while autograd records (grad mode on and
an input requires grad) they go through ``torch.ops.tileplug.<name>``, whose backward is
``rms_norm_backward`` / ``layer_norm_backward`` through the op table, eager and under
``torch.compile(fullgraph=True)``. ``out=`` / ``residual_out=`` may alias ``x`` /
``residual`` (the in-place form); under ``torch.compile`` (and while autograd records) the
op's fresh outputs are copied into them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.compiler import is_compiling

from tileplug.core.contracts import norm as contracts
from tileplug.core.errors import ContractError
from tileplug.core import unfused
from tileplug.core.opdefs import BenchCase, Case, OpDef, bound_contract, declare, run, wants_grad
from tileplug.core.ops.quant import SF_MODES

NormResult = torch.Tensor | tuple[torch.Tensor, ...]


# ---------------------------------------------------------------------- forward


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    out_scale: float = 1.0,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    return_rstd: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """RMSNorm of each row of ``x`` [T, D] (or of each head of [T, N, D]) → ``y`` | ``(y, ...)``.

    ``s = x + residual`` (rounded to x.dtype) when ``residual`` is given, else ``x``;
    ``rstd = 1 / sqrt(sum(s²) / D + eps)`` in fp32; ``y = round_to(x.dtype, (s · rstd) ·
    ((float(weight) + weight_offset) · out_scale))`` (``weight_offset=1.0``: Gemma).
    Returns ``y``, then ``residual_out`` (= ``s``) with a residual, then ``rstd`` (x's shape
    without D) with ``return_rstd``. ``out`` / ``residual_out`` may be ``x`` / ``residual``
    themselves: ``rms_norm(x, w, residual=r, out=x, residual_out=r)`` works in place.
    """
    if wants_grad(x, weight, residual):
        result = RMS_NORM.traced(x, weight, eps, residual, weight_offset, out_scale, return_rstd=True,
                                 out=out, residual_out=residual_out)
        return result if return_rstd else _without_last(result)
    if is_compiling():
        return RMS_NORM.traced(x, weight, eps, residual, weight_offset, out_scale, return_rstd=return_rstd,
                               out=out, residual_out=residual_out)
    call, inputs, given = contracts.rms_norm(x, weight, eps, residual, weight_offset, out_scale, out, residual_out,
                                             return_rstd)
    return run(call, inputs, given=given)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    return_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """LayerNorm of each row of ``x`` [T, D] (or [T, N, D]) → ``y`` | ``(y, ...)``.

    ``mean = sum(s) / D``, ``var = sum((s − mean)²) / D`` (two passes), ``rstd = 1 / sqrt(var + eps)``
    in fp32; ``y = round_to(x.dtype, (s − mean) · rstd · float(weight) + float(bias))``.
    Returns ``y``, then ``residual_out`` with a residual, then ``(mean, rstd)`` with
    ``return_stats``. ``out`` / ``residual_out`` may alias ``x`` / ``residual``.
    """
    if wants_grad(x, weight, bias, residual):
        result = LAYER_NORM.traced(x, weight, bias, eps, residual, return_stats=True, out=out,
                                   residual_out=residual_out)
        return result if return_stats else _without_last(_without_last(result))
    if is_compiling():
        return LAYER_NORM.traced(x, weight, bias, eps, residual, return_stats=return_stats, out=out,
                                 residual_out=residual_out)
    call, inputs, given = contracts.layer_norm(x, weight, bias, eps, residual, out, residual_out, return_stats)
    return run(call, inputs, given=given)


def rms_norm_per_token_cast(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    fmt: str = "e4m3",
    num_per_channels: int = 128,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    out_scale: float = 1.0,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    use_tma_aligned_col_major_sf: bool = False,
    use_e4m3_sf: bool = False,
    return_unquantized: bool = False,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """``per_token_cast(rms_norm(x, ...), fmt, num_per_channels, ...)`` bytewise, in one op →
    ``(q, sf)``, then ``residual_out`` with a residual, then the unquantized ``y`` (x's shape,
    x.dtype) with ``return_unquantized``.

    ``x``: [T, D] or [T, N, D] bf16 / fp32 (what ``per_token_cast`` reads); a 3-D ``x`` is
    quantized as [T, N·D]. The scale flags are ``per_token_cast``'s (SPEC §2-3). Not
    differentiable (outputs carry no autograd history).
    """
    if is_compiling():
        return RMS_NORM_PER_TOKEN_CAST.traced(
            x, weight, eps, fmt, num_per_channels, residual, weight_offset, out_scale, round_sf, use_packed_ue8m0,
            use_tma_aligned_col_major_sf, use_e4m3_sf, return_unquantized, residual_out=residual_out)
    call, inputs, given = contracts.rms_norm_per_token_cast(
        x, weight, eps, fmt, num_per_channels, residual, weight_offset, out_scale, round_sf, use_packed_ue8m0,
        use_tma_aligned_col_major_sf, use_e4m3_sf, return_unquantized, residual_out)
    return run(call, inputs, given=given)


def _without_last(result: tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    return result[0] if len(result) == 2 else result[:-1]


# ---------------------------------------------------------------------- backward


def rms_norm_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    weight_offset: float = 0.0,
    out_scale: float = 1.0,
    grad_residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of :func:`rms_norm` → ``(grad_x, grad_weight | None)``.

    ``x`` is the normalized input ``s`` (``residual_out`` of a forward with a residual; its
    gradient is also the residual's), ``rstd`` the forward's (x's shape without D, fp32).
    ``x̂ = s · rstd``, ``g = grad_y · (float(w) + weight_offset) · out_scale``,
    ``grad_x = rstd · (g − x̂ · mean(g · x̂)) + grad_residual_out`` rounded to x.dtype;
    ``grad_weight = Σ_rows grad_y · out_scale · x̂`` [D] in fp32, in a fixed order.
    """
    if is_compiling():
        return RMS_NORM_BACKWARD.traced(grad_y, x, weight, rstd, weight_offset, out_scale, grad_residual_out)
    call, inputs = contracts.rms_norm_backward(grad_y, x, weight, rstd, weight_offset, out_scale, grad_residual_out)
    return run(call, inputs)


def layer_norm_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    grad_residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Gradients of :func:`layer_norm` → ``(grad_x, grad_weight | None, grad_bias)``
    (``grad_weight`` / ``grad_bias`` [D] fp32, reduced over rows in a fixed order)."""
    if is_compiling():
        return LAYER_NORM_BACKWARD.traced(grad_y, x, weight, mean, rstd, grad_residual_out)
    call, inputs = contracts.layer_norm_backward(grad_y, x, weight, mean, rstd, grad_residual_out)
    return run(call, inputs)


# ---------------------------------------------------------------------- autograd (through the op table)


def _unit_last_stride(gradient: torch.Tensor | None) -> torch.Tensor | None:
    """An incoming gradient as the backward ops read it (autograd hands e.g. expanded ones,
    stride 0, for the gradient of a sum)."""
    if gradient is None or gradient.stride(-1) == 1 or gradient.shape[-1] <= 1:
        return gradient
    return gradient.contiguous()


def _rms_norm_setup(ctx: Any, inputs: tuple, output: list) -> None:
    x, weight, eps, residual, weight_offset, out_scale, return_rstd = inputs
    normalized_input = output[1] if residual is not None else x
    rstd = output[-1] if return_rstd else None  # the public function always asks for it while recording
    if rstd is not None:
        ctx.mark_non_differentiable(rstd)  # a statistic: no gradient flows through it
    ctx.save_for_backward(normalized_input, weight, rstd)
    ctx.eps, ctx.weight_offset, ctx.out_scale, ctx.residual = eps, weight_offset, out_scale, residual is not None


def _rms_norm_backward(ctx: Any, grads: list) -> tuple:
    normalized_input, weight, rstd = ctx.saved_tensors
    if rstd is None:  # torch.ops.tileplug.rms_norm called directly without return_rstd: recompute it
        rstd = rms_norm(normalized_input, eps=ctx.eps, return_rstd=True)[1]
    grad_y = _unit_last_stride(grads[0]) if grads[0] is not None else torch.zeros_like(normalized_input)
    grad_residual_out = _unit_last_stride(grads[1]) if ctx.residual else None
    grad_x, grad_weight = rms_norm_backward(grad_y, normalized_input, weight, rstd, ctx.weight_offset,
                                            ctx.out_scale, grad_residual_out)
    grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
    return grad_x, grad_weight, None, grad_x if ctx.residual else None, None, None, None


def _layer_norm_setup(ctx: Any, inputs: tuple, output: list) -> None:
    x, weight, bias, eps, residual, return_stats = inputs
    normalized_input = output[1] if residual is not None else x
    mean, rstd = (output[-2], output[-1]) if return_stats else (None, None)
    if return_stats:
        ctx.mark_non_differentiable(mean, rstd)  # statistics: no gradient flows through them
    ctx.save_for_backward(normalized_input, weight, mean, rstd)
    ctx.eps, ctx.residual = eps, residual is not None
    ctx.bias_dtype = None if bias is None else bias.dtype


def _layer_norm_backward(ctx: Any, grads: list) -> tuple:
    normalized_input, weight, mean, rstd = ctx.saved_tensors
    if rstd is None:  # called directly without return_stats: recompute them
        _, mean, rstd = layer_norm(normalized_input, eps=ctx.eps, return_stats=True)
    grad_y = _unit_last_stride(grads[0]) if grads[0] is not None else torch.zeros_like(normalized_input)
    grad_residual_out = _unit_last_stride(grads[1]) if ctx.residual else None
    grad_x, grad_weight, grad_bias = layer_norm_backward(grad_y, normalized_input, weight, mean, rstd,
                                                         grad_residual_out)
    grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
    grad_bias = None if ctx.bias_dtype is None else grad_bias.to(ctx.bias_dtype)
    return grad_x, grad_weight, grad_bias, None, grad_x if ctx.residual else None, None


# ---------------------------------------------------------------------- declarations: arguments

INPUT_OPTIONS: dict[str, str] = {
    "row_stride_pad": "int >= 0: x (and residual) are views of [T, (N,) D + pad] (a padded row stride)",
    "heads": "int >= 1: x is 3-D [T, heads, D] (per-head norm)",
    "weight": "'none' or a dtype name ('bf16', 'fp16', 'fp32', 'fp64'): the weight (default: x's dtype)",
    "bias": "'none' or a dtype name: the LayerNorm bias (default: 'none')",
    "residual": "bool: a residual is added (forward)",
    "grad_residual": "bool: a grad_residual_out is passed (backward)",
}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def _check_input_options(op: str, inputs: dict[str, Any]) -> None:
    for key, value in inputs.items():
        if key not in INPUT_OPTIONS:
            raise ContractError(op, f"inputs.{key}", f"one of {', '.join(INPUT_OPTIONS)}", key)
        if key in ("row_stride_pad", "heads") and (type(value) is not int or value < (0 if key == "row_stride_pad"
                                                                                       else 1)):
            raise ContractError(op, f"inputs.{key}", "an int >= 0" if key == "row_stride_pad" else "an int >= 1",
                                repr(value))
        if key in ("weight", "bias") and value != "none" and value not in _DTYPES:
            raise ContractError(op, f"inputs.{key}", f"'none' or one of {', '.join(_DTYPES)}", repr(value))
        if key in ("residual", "grad_residual") and type(value) is not bool:
            raise ContractError(op, f"inputs.{key}", "a bool", repr(value))


def _rows_tensor(tokens: int, hidden: int, dtype: torch.dtype, heads: int | None, pad: int, device: torch.device,
                 seed: int, scale: float = 1.0) -> torch.Tensor:
    """An activation [T, D] or [T, heads, D], a view of a row-padded buffer when ``pad``."""
    from tileplug.core.testing import activation

    rows = tokens * (heads or 1)
    if device.type == "meta":
        full = torch.empty(rows, hidden + pad, dtype=dtype, device=device)
    else:
        full = (activation(rows, hidden + pad, torch.float32, seed=seed) * scale).to(dtype).to(device)
    shaped = full.view(tokens, heads, hidden + pad) if heads else full
    return shaped[..., :hidden]


def _vector(hidden: int, dtype: torch.dtype, device: torch.device, seed: int, center: float) -> torch.Tensor:
    if device.type == "meta":
        return torch.empty(hidden, dtype=dtype, device=device)
    generator = torch.Generator().manual_seed(seed)
    return (center + 0.1 * torch.randn(hidden, generator=generator)).to(dtype).to(device)


def norm_arguments(op: str, tokens: int, hidden: int, dtype: torch.dtype, kwargs: dict[str, Any],
                   inputs: dict[str, Any], device: torch.device, seed: int) -> tuple[tuple, dict]:
    """(args, kwargs) of a norm op at ``[tokens, (heads,) hidden]`` on ``device`` (meta: shapes only).

    ``inputs`` options (:data:`INPUT_OPTIONS`): ``row_stride_pad``, ``heads``, ``weight`` and
    ``bias`` dtypes, ``residual`` (forward), ``grad_residual`` (backward). A backward's
    statistics are the forward's, computed with :mod:`tileplug.core.norm.formulas` (no
    backend needed).
    """
    from tileplug.core.norm import formulas

    _check_input_options(op, inputs)
    kwargs = dict(kwargs)
    heads, pad = inputs.get("heads"), inputs.get("row_stride_pad", 0)
    x = _rows_tensor(tokens, hidden, dtype, heads, pad, device, seed)
    weight_kind = inputs.get("weight", _DTYPE_NAMES[dtype])
    gemma = kwargs.get("weight_offset", 0.0) != 0.0
    weight = None if weight_kind == "none" else _vector(hidden, _DTYPES[weight_kind], device, seed + 1,
                                                        0.0 if gemma else 1.0)
    bias_kind = inputs.get("bias", "none")
    bias = None if bias_kind == "none" else _vector(hidden, _DTYPES[bias_kind], device, seed + 2, 0.0)
    backward = op.endswith("_backward")
    if not backward:
        if inputs.get("residual", False):
            kwargs["residual"] = _rows_tensor(tokens, hidden, dtype, heads, pad, device, seed + 3)
        if op == contracts.LAYER_NORM:
            return (x,), {"weight": weight, "bias": bias, **kwargs}
        return (x,), {"weight": weight, **kwargs}
    grad_y = _rows_tensor(tokens, hidden, dtype, heads, 0, device, seed + 4, scale=0.1)
    if inputs.get("grad_residual", False):
        kwargs["grad_residual_out"] = _rows_tensor(tokens, hidden, dtype, heads, 0, device, seed + 5, scale=0.1)
    statistics_shape = tuple(x.shape[:-1])
    work = formulas.compute_dtype(dtype)
    if device.type == "meta" or x.numel() == 0:
        mean = torch.empty(statistics_shape, dtype=work, device=device)
        rstd = torch.empty(statistics_shape, dtype=work, device=device)
    else:
        rows = x.reshape(-1, hidden)
        if op == contracts.RMS_NORM_BACKWARD:
            _, rstd = formulas.rms_norm_rows(rows, None, 1e-6)
        else:
            _, mean, rstd = formulas.layer_norm_rows(rows, None, None, 1e-5)
            mean = mean.reshape(statistics_shape)
        rstd = rstd.reshape(statistics_shape)
    if op == contracts.RMS_NORM_BACKWARD:
        return (grad_y, x, weight, rstd), kwargs
    return (grad_y, x, weight, mean, rstd), kwargs


# ---------------------------------------------------------------------- declarations: comparison


def compare_norm(case: Case, tokens: int, actual: list[torch.Tensor | None], expected: list[torch.Tensor | None]
                 ) -> None:
    """SPEC §4-5 against the reference: outputs (``y``, ``residual_out``, ``grad_x``) within
    1 ulp of their dtype, statistics (``rstd``, ``mean``) within 4 ulp of fp32 (fp64), weight
    and bias gradients within relative 1e-5 (norm-wise); the cast's ``(q, sf)`` by
    :func:`tileplug.core.testing.assert_quantized_close` (the same bytes where the rows agree)."""
    from tileplug.core.testing import assert_quantized_close, assert_within_ulps, relative_error, require

    what = f"{case.id} T={tokens}"
    require(len(actual) == len(expected), f"{what}: {len(actual)} outputs, expected {len(expected)}")
    kwargs = dict(case.kwargs)
    start = 0
    if case.op == contracts.RMS_NORM_PER_TOKEN_CAST:
        assert_quantized_close(actual[0], actual[1], expected[0], expected[1], kwargs.get("fmt", "e4m3"),
                               kwargs.get("num_per_channels", 128), case.dtype, what=f"{what} (q, sf)")
        start = 2
    backward = case.op.endswith("_backward")
    row_outputs = 1 + bool(dict(case.inputs).get("residual", False))  # y [, residual_out]; then statistics
    for index in range(start, len(actual)):
        have, want = actual[index], expected[index]
        label = f"{what} output {index}"
        if want is None or have is None:
            require(have is None and want is None, f"{label}: {have!r} vs {want!r}")
            continue
        require(have.shape == want.shape and have.dtype == want.dtype,
                f"{label}: {tuple(have.shape)} {have.dtype} vs {tuple(want.shape)} {want.dtype}")
        if backward and index >= 1:  # grad_weight, grad_bias: sums over rows
            error = relative_error(have, want)
            require(error <= 1e-5, f"{label}: relative error {error:.3g} > 1e-5")
        elif not backward and start == 0 and index >= row_outputs:  # rstd, mean
            assert_within_ulps(have, want, 4, what=label)
        else:  # y, residual_out, grad_x, the cast's residual_out and unquantized y
            assert_within_ulps(have, want, 1, what=label)


# ---------------------------------------------------------------------- declarations: grids

_FP16, _FP32, _BF16 = torch.float16, torch.float32, torch.bfloat16


def norm_cases() -> list[Case]:
    """The family's grid: non-aligned D first (1, 7, 64, 576, 1536, 5120, 7168), every input
    dtype, weight dtypes, residual, Gemma offset, out_scale, 3-D per-head, padded row
    strides, statistics returned, and every sf option of the cast."""
    rms, layer, cast = contracts.RMS_NORM, contracts.LAYER_NORM, contracts.RMS_NORM_PER_TOKEN_CAST
    rms_back, layer_back = contracts.RMS_NORM_BACKWARD, contracts.LAYER_NORM_BACKWARD
    return [
        Case.of(rms, 1),
        Case.of(rms, 7, _FP16, inputs={"weight": "fp32", "residual": True}),
        Case.of(rms, 64, _FP32, inputs={"heads": 4}, return_rstd=True),
        Case.of(rms, 576, inputs={"residual": True}, return_rstd=True),
        Case.of(rms, 576, weight_offset=1.0, out_scale=0.5),
        Case.of(rms, 1536, _FP16, inputs={"weight": "none", "row_stride_pad": 8}),
        Case.of(rms, 5120, _FP32, inputs={"residual": True, "row_stride_pad": 3}, eps=1e-5),
        Case.of(rms, 7168, inputs={"residual": True, "weight": "fp32"}, return_rstd=True),
        Case.of(rms, 128, inputs={"heads": 8, "row_stride_pad": 64}, weight_offset=1.0),
        Case.of(layer, 1, _FP32),
        Case.of(layer, 7, inputs={"bias": "bf16", "residual": True}),
        Case.of(layer, 64, _FP16, inputs={"weight": "none"}),
        Case.of(layer, 576, inputs={"bias": "fp32"}, return_stats=True),
        Case.of(layer, 1536, _FP32, inputs={"residual": True, "heads": 3}, return_stats=True),
        Case.of(layer, 5120, inputs={"weight": "none", "bias": "bf16"}),
        Case.of(layer, 7168, inputs={"bias": "bf16", "residual": True, "row_stride_pad": 16}, eps=1e-6),
        Case.of(cast, 576),
        Case.of(cast, 576, **SF_MODES["round"]),
        Case.of(cast, 576, use_tma_aligned_col_major_sf=True, **SF_MODES["ue8m0"]),
        Case.of(cast, 7, num_per_channels=16, **SF_MODES["e4m3sf"]),
        Case.of(cast, 64, _FP32, inputs={"heads": 4}, fmt="e2m1", num_per_channels=32),
        Case.of(cast, 1536, _FP32, inputs={"residual": True}, num_per_channels=64, use_tma_aligned_col_major_sf=True),
        Case.of(cast, 5120, inputs={"residual": True, "row_stride_pad": 8}, weight_offset=1.0, out_scale=2.0,
                return_unquantized=True),
        Case.of(cast, 7168, inputs={"residual": True}, return_unquantized=True, **SF_MODES["ue8m0"]),
        Case.of(rms_back, 1, _FP32),
        Case.of(rms_back, 7, inputs={"grad_residual": True}),
        Case.of(rms_back, 576, inputs={"weight": "fp32", "grad_residual": True}),
        Case.of(rms_back, 64, _FP32, inputs={"heads": 4}, weight_offset=1.0, out_scale=0.5),
        Case.of(rms_back, 1536, _FP16, inputs={"row_stride_pad": 8}),
        Case.of(rms_back, 7168, inputs={"weight": "none"}),
        Case.of(layer_back, 7, _FP32),
        Case.of(layer_back, 576, inputs={"grad_residual": True}),
        Case.of(layer_back, 64, _FP16, inputs={"heads": 4, "weight": "none"}),
        Case.of(layer_back, 7168, inputs={"weight": "fp32"}),
    ]


def _bench(name: str) -> list[BenchCase]:
    """The configurations ``tileplug bench`` times (the seed chapter's: residual, Gemma, per-token 1×128)."""
    return {
        contracts.RMS_NORM: [BenchCase.of("rms_norm", "rms_norm"),
                             BenchCase.of("rms_norm/residual", "rms_norm", inputs={"residual": True})],
        contracts.LAYER_NORM: [BenchCase.of("layer_norm", "layer_norm", inputs={"bias": "bf16"})],
        contracts.RMS_NORM_PER_TOKEN_CAST: [
            BenchCase.of("rms_norm_per_token_cast", "rms_norm_per_token_cast"),
            # TileKernels' fused norm cast takes only 1×32 groups
            BenchCase.of("rms_norm_per_token_cast/g32", "rms_norm_per_token_cast", num_per_channels=32),
        ],
        contracts.RMS_NORM_BACKWARD: [BenchCase.of("rms_norm_backward", "rms_norm_backward")],
        contracts.LAYER_NORM_BACKWARD: [BenchCase.of("layer_norm_backward", "layer_norm_backward")],
    }.get(name, [])


def _declare(function: Any, contract: Any, written: dict[str, int] | None = None,
             autograd: tuple[Any, Any] | None = None, unfused: Any = None) -> OpDef:
    """Declare a norm op; ``contract`` takes the public function's parameters but ``out``, in
    order, and returns ``(call, inputs)`` or ``(call, inputs, given outputs)``."""
    name = function.__name__
    bound = bound_contract(function, contract)

    def call_and_inputs(*args: Any, **kwargs: Any) -> Any:
        return bound(*args, **kwargs)[:2]

    return declare(OpDef(
        name=name,
        family="norm",
        function=function,
        contract=call_and_inputs,
        outputs=contracts.NormCall.allocation_plan,
        result=contracts.NormCall.result,
        ledger=contracts.NormCall.ledger,
        cases=lambda: [case for case in norm_cases() if case.op == name],
        bench=lambda: _bench(name),
        arguments=lambda *args: norm_arguments(name, *args),
        compare=compare_norm,
        input_options=INPUT_OPTIONS,
        written=written or {},
        autograd=autograd,
        unfused=unfused,
    ))


RMS_NORM = _declare(
    rms_norm,
    lambda x, weight, eps, residual, weight_offset, out_scale, residual_out, return_rstd:
    contracts.rms_norm(x, weight, eps, residual, weight_offset, out_scale, None, residual_out, return_rstd),
    written={"out": 0, "residual_out": 1}, autograd=(_rms_norm_setup, _rms_norm_backward),
    unfused=lambda call, traits: unfused.norm_eager_steps(call))
LAYER_NORM = _declare(
    layer_norm,
    lambda x, weight, bias, eps, residual, residual_out, return_stats:
    contracts.layer_norm(x, weight, bias, eps, residual, None, residual_out, return_stats),
    written={"out": 0, "residual_out": 1}, autograd=(_layer_norm_setup, _layer_norm_backward),
    unfused=lambda call, traits: unfused.norm_eager_steps(call))
RMS_NORM_PER_TOKEN_CAST = _declare(rms_norm_per_token_cast, contracts.rms_norm_per_token_cast,
                                   written={"residual_out": 2}, unfused=unfused.norm_cast_chain)
RMS_NORM_BACKWARD = _declare(rms_norm_backward, contracts.rms_norm_backward)
LAYER_NORM_BACKWARD = _declare(layer_norm_backward, contracts.layer_norm_backward)
