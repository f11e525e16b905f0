"""SwiGLU ops (SPEC §8, docs/spec.md "SwiGLU"): the public functions and their declarations.

Shapes (``N`` rows — tokens, or the expanded rows of an MoE layout — ``H`` the output width,
``E`` experts): ``x`` ``[N, 2H]`` = ``[gate | up]``, ``topk_weights`` ``[N]``, ``expert_ends``
int32 ``[E]`` (SPEC §7), ``y`` ``[N, H]``. In the op table a case's ``hidden`` is ``H``.

With ``expert_ends`` (and the ``expert_alignment`` it was made with), rows outside every
expert's valid range ``[start[e], expert_ends[e])`` are padding: never read, written as
zeros (zero gradients, zero scales). ``swiglu`` is differentiable w.r.t. ``x`` and
``topk_weights``: while autograd records it goes through ``torch.ops.tileplug.swiglu``, whose
backward is ``swiglu_backward`` through the op table (eager and under
``torch.compile(fullgraph=True)``); the cast is not differentiable.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.compiler import is_compiling

from tileplug.core import unfused
from tileplug.core.contracts import swiglu as contracts
from tileplug.core.opdefs import BenchCase, Case, OpDef, bound_contract, checked_case_inputs, declare, run, wants_grad
from tileplug.core.ops.quant import SF_MODES
from tileplug.core.swiglu.layout import expert_ends_for, valid_rows_of

# ---------------------------------------------------------------------- the public ops


def swiglu(
    x: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    topk_weights: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    clamp_value: float | None = None,
    expert_ends: torch.Tensor | None = None,
    expert_alignment: int = 128,
) -> torch.Tensor:
    """SwiGLU of each row of ``x`` ``[N, 2H]`` = ``[gate | up]`` → ``y`` ``[N, H]`` in ``out_dtype``.

    In fp32 (fp64 for an fp64 ``x``): ``g = min(gate, c)``, ``u = clamp(up, −c, c)`` with
    ``clamp_value = c`` (else ``g = gate``, ``u = up``), ``y = g·sigmoid(g) · u · (w ·
    routed_scaling_factor)`` with ``w`` = ``topk_weights[row]`` (fp32 ``[N]``; 1 without),
    rounded once to ``out_dtype`` (None: x's dtype; bf16 or fp32). ``expert_ends`` int32 ``[E]``
    with its ``expert_alignment``: rows outside every expert's ``[start[e], expert_ends[e])``
    are not read and their ``y`` is 0. Differentiable w.r.t. ``x`` and ``topk_weights``.
    """
    if is_compiling() or wants_grad(x, topk_weights):
        return SWIGLU.traced(x, out_dtype, topk_weights, routed_scaling_factor, clamp_value, expert_ends,
                             expert_alignment)
    call, inputs = contracts.swiglu(x, out_dtype, topk_weights, routed_scaling_factor, clamp_value, expert_ends,
                                    expert_alignment)
    return run(call, inputs)


def swiglu_per_token_cast(
    x: torch.Tensor,
    fmt: str = "e4m3",
    num_per_channels: int = 128,
    topk_weights: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    clamp_value: float | None = None,
    expert_ends: torch.Tensor | None = None,
    expert_alignment: int = 128,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    use_tma_aligned_col_major_sf: bool = False,
    use_e4m3_sf: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_token_cast(swiglu(x, out_dtype=torch.float32, ...), fmt, num_per_channels, ...)``
    bytewise, in one op → ``(q, sf)``: the fp32 ``y`` is quantized directly (one rounding).

    ``x`` ``[N, 2H]`` bf16 / fp32; the weights, clamp and expert layout are :func:`swiglu`'s,
    the format, group and scale flags ``per_token_cast``'s (SPEC §2-3; e2m1 needs an even H).
    ``q`` ``[N, H]`` (e2m1: int8 ``[N, H/2]``), ``sf`` ``[N, ceil(H/g)]`` in the layout the flags
    ask for. Padding rows (outside every expert's range) get zero ``q`` and zero scale bytes.
    """
    if is_compiling():
        return SWIGLU_PER_TOKEN_CAST.traced(x, fmt, num_per_channels, topk_weights, routed_scaling_factor,
                                            clamp_value, expert_ends, expert_alignment, round_sf, use_packed_ue8m0,
                                            use_tma_aligned_col_major_sf, use_e4m3_sf)
    call, inputs = contracts.swiglu_per_token_cast(x, fmt, num_per_channels, topk_weights, routed_scaling_factor,
                                                   clamp_value, expert_ends, expert_alignment, round_sf,
                                                   use_packed_ue8m0, use_tma_aligned_col_major_sf, use_e4m3_sf)
    return run(call, inputs)


def swiglu_backward(
    x: torch.Tensor,
    grad_y: torch.Tensor,
    topk_weights: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    clamp_value: float | None = None,
    expert_ends: torch.Tensor | None = None,
    expert_alignment: int = 128,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of :func:`swiglu` → ``(grad_x [N, 2H] (x's dtype), grad_topk_weights [N] | None)``.

    ``grad_y`` ``[N, H]`` bf16 / fp32. In fp32, with ``s = sigmoid(g)`` and ``w' = w ·
    routed_scaling_factor``: ``grad_gate = grad·u·w'·s·(1 + g·(1 − s))`` (0 where the clamp
    cut: ``gate > c``), ``grad_up = grad·g·s·w'`` (0 where ``|up| > c``), ``grad_topk_weights =
    Σ_h grad·g·s·u · routed_scaling_factor`` (fp32, only with ``topk_weights``). Padding rows'
    gradients are 0 and their inputs are not read.
    """
    if is_compiling():
        return SWIGLU_BACKWARD.traced(x, grad_y, topk_weights, routed_scaling_factor, clamp_value, expert_ends,
                                      expert_alignment)
    call, inputs = contracts.swiglu_backward(x, grad_y, topk_weights, routed_scaling_factor, clamp_value,
                                             expert_ends, expert_alignment)
    return run(call, inputs)


# ---------------------------------------------------------------------- autograd (through the op table)


def _swiglu_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    x, out_dtype, topk_weights, routed_scaling_factor, clamp_value, expert_ends, expert_alignment = inputs
    ctx.save_for_backward(x, topk_weights, expert_ends)
    ctx.options = (routed_scaling_factor, clamp_value, expert_alignment)


def _swiglu_backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
    x, topk_weights, expert_ends = ctx.saved_tensors
    routed_scaling_factor, clamp_value, expert_alignment = ctx.options
    if grad_y.stride(-1) != 1 and grad_y.shape[-1] > 1:  # autograd hands e.g. expanded gradients of a sum
        grad_y = grad_y.contiguous()
    if grad_y.dtype not in (x.dtype, *contracts.OUTPUT_DTYPES):
        grad_y = grad_y.to(x.dtype)
    grad_x, grad_weights = swiglu_backward(x.detach(), grad_y, None if topk_weights is None else topk_weights.detach(),
                                           routed_scaling_factor, clamp_value, expert_ends, expert_alignment)
    return grad_x, None, grad_weights, None, None, None, None


# ---------------------------------------------------------------------- declarations: arguments

INPUT_OPTIONS: dict[str, str] = {
    "weighted": "bool: topk_weights [N] in (0, 1] are given",
    "experts": "int >= 1: an expert_ends [E] of this many experts, laid out over the N rows with expert_alignment "
               "(some rows are padding)",
    "nan_padding": "bool: the padding rows of x (and grad_y) hold NaN (they must never be read)",
    "row_stride_pad": "int >= 0: x (and grad_y) are views of rows padded by this many elements",
    "scale": "int >= 1: x's values are multiplied by this (large values exercise the clamp)",
}
_CHOICES: dict[str, tuple] = {"weighted": (False, True), "nan_padding": (False, True)}


def _rows(tokens: int, width: int, dtype: torch.dtype, pad: int, device: torch.device, seed: int,
          scale: float) -> torch.Tensor:
    from tileplug.core.testing import activation

    if device.type == "meta":
        return torch.empty(tokens, width + pad, dtype=dtype, device=device)[:, :width]
    full = (activation(tokens, width + pad, torch.float32, seed=seed) * scale).to(dtype)
    return full[:, :width]


def swiglu_arguments(op: str, tokens: int, hidden: int, dtype: torch.dtype, kwargs: dict[str, Any],
                     inputs: dict[str, Any], device: torch.device, seed: int) -> tuple[tuple, dict]:
    """(args, kwargs) of a SwiGLU op with ``N = tokens`` rows and ``H = hidden`` (meta: shapes).

    ``inputs`` options (:data:`INPUT_OPTIONS`): routed weights, an expert layout (with
    ``kwargs['expert_alignment']``, default 128) whose padding rows may hold NaN, a padded row
    stride, a value scale; the backward gets a random ``grad_y`` ``[N, H]`` in x's dtype."""
    checked_case_inputs(op, inputs, INPUT_OPTIONS, _CHOICES, {"row_stride_pad": 0}, default_minimum=1)
    kwargs = dict(kwargs)
    pad, scale = inputs.get("row_stride_pad", 0), float(inputs.get("scale", 1))
    x = _rows(tokens, 2 * hidden, dtype, pad, device, seed, scale)
    grad_y = None
    if op == contracts.SWIGLU_BACKWARD:
        grad_y = _rows(tokens, hidden, dtype, pad, device, seed + 1, 0.1)
    if inputs.get("weighted", False):
        if device.type == "meta":
            kwargs["topk_weights"] = torch.empty(tokens, dtype=contracts.compute_dtype(dtype), device=device)
        else:
            generator = torch.Generator().manual_seed(seed + 2)
            weights = 1.0 - torch.rand(tokens, generator=generator, dtype=torch.float64)
            kwargs["topk_weights"] = weights.to(contracts.compute_dtype(dtype)).to(device)
    experts = inputs.get("experts")
    if experts is not None:
        alignment = kwargs.get("expert_alignment", 128)
        if device.type == "meta":
            kwargs["expert_ends"] = torch.empty(experts, dtype=torch.int32, device=device)
        else:
            ends = expert_ends_for(tokens, experts, alignment, seed + 3)
            if inputs.get("nan_padding", False) and tokens:
                padding = ~valid_rows_of(tokens, ends, alignment)
                x[padding] = float("nan")
                if grad_y is not None:
                    grad_y[padding] = float("nan")
            kwargs["expert_ends"] = ends.to(device)
    if device.type != "meta":
        x = x.to(device)
        grad_y = None if grad_y is None else grad_y.to(device)
    if op == contracts.SWIGLU_BACKWARD:
        return (x, grad_y), kwargs
    return (x,), kwargs


# ---------------------------------------------------------------------- declarations: comparison


def compare_swiglu(case: Case, tokens: int, actual: list[torch.Tensor | None], expected: list[torch.Tensor | None]
                   ) -> None:
    """SPEC §4/§8 against the reference: ``y`` and ``grad_x`` within 2 ulp of their dtype,
    ``grad_topk_weights`` (a sum over the row) within a relative 1e-5 (norm-wise), the cast's
    ``(q, sf)`` by :func:`tileplug.core.testing.assert_quantized_close` (the same bytes where
    the fp32 ``y`` agrees; a scale or value one step apart where it differs by an ulp)."""
    from tileplug.core.testing import assert_quantized_close, assert_within_ulps, relative_error, require

    what = f"{case.id} T={tokens}"
    require(len(actual) == len(expected), f"{what}: {len(actual)} outputs, expected {len(expected)}")
    if case.op == contracts.SWIGLU_PER_TOKEN_CAST:
        kwargs = dict(case.kwargs)
        assert_quantized_close(actual[0], actual[1], expected[0], expected[1], kwargs.get("fmt", "e4m3"),
                               kwargs.get("num_per_channels", 128), torch.float32, what=f"{what} (q, sf)")
        return
    for index, (have, want) in enumerate(zip(actual, expected)):
        label = f"{what} output {index}"
        if have is None or want is None:
            require(have is None and want is None, f"{label}: {have!r} vs {want!r}")
            continue
        require(have.shape == want.shape and have.dtype == want.dtype,
                f"{label}: {tuple(have.shape)} {have.dtype} vs {tuple(want.shape)} {want.dtype}")
        if index == 1:  # grad_topk_weights
            error = relative_error(have, want)
            require(error <= 1e-5, f"{label}: relative error {error:.3g} > 1e-5")
        else:
            assert_within_ulps(have, want, 2, what=label)


# ---------------------------------------------------------------------- declarations: grids

_BF16, _FP32 = torch.bfloat16, torch.float32


def swiglu_cases() -> list[Case]:
    """The family's grid: odd and small H first (3, 72), then the MoE widths H = 1408/2 and
    7168/2; bf16 and fp32; fp32 and bf16 outputs; routed weights with a scaling factor; the
    clamp on values large enough to be cut; expert layouts with padding rows (holding NaN)
    at alignments 4, 16 and 128; for the cast e4m3 and e2m1 at every group (16, 32, 64, 128)
    and every scale flag (plain, power of two, packed UE8M0, e4m3-stored, column-major)."""
    forward, cast, backward = contracts.SWIGLU, contracts.SWIGLU_PER_TOKEN_CAST, contracts.SWIGLU_BACKWARD
    moe = {"weighted": True, "experts": 8, "nan_padding": True}
    return [
        Case.of(forward, 3),
        Case.of(forward, 3, _FP32, inputs={"experts": 3, "nan_padding": True, "row_stride_pad": 5},
                expert_alignment=4, out_dtype=_BF16),
        Case.of(forward, 72, _FP32, inputs={"weighted": True}, routed_scaling_factor=2.5),
        Case.of(forward, 72, inputs={"scale": 4}, clamp_value=7.0, out_dtype=_FP32),
        Case.of(forward, 704, inputs=moe, expert_alignment=16, routed_scaling_factor=1.5),
        Case.of(forward, 704, _FP32, inputs={"scale": 8, "experts": 4}, clamp_value=10.0, expert_alignment=128),
        Case.of(forward, 3584, inputs={"weighted": True, "scale": 4}, clamp_value=7.0, routed_scaling_factor=2.5),
        Case.of(forward, 3584, _FP32, inputs={**moe, "row_stride_pad": 16}, expert_alignment=128),
        Case.of(cast, 3, num_per_channels=16),
        Case.of(cast, 72, _FP32, fmt="e2m1", num_per_channels=16),
        Case.of(cast, 72, num_per_channels=32, **SF_MODES["round"]),
        Case.of(cast, 704, inputs=moe, num_per_channels=64, expert_alignment=16, use_tma_aligned_col_major_sf=True,
                **SF_MODES["ue8m0"]),
        Case.of(cast, 704, _FP32, inputs={"experts": 4, "nan_padding": True}, fmt="e2m1", num_per_channels=64,
                expert_alignment=4, use_tma_aligned_col_major_sf=True),
        Case.of(cast, 704, inputs={"scale": 4}, num_per_channels=16, clamp_value=7.0, use_tma_aligned_col_major_sf=True),
        Case.of(cast, 3584, inputs={"weighted": True, "scale": 4}, clamp_value=7.0, routed_scaling_factor=2.5,
                **SF_MODES["e4m3sf"]),
        Case.of(cast, 3584, _FP32, inputs={"experts": 8}, fmt="e2m1", num_per_channels=32, expert_alignment=128,
                **SF_MODES["ue8m0"]),
        Case.of(cast, 72, fmt="e2m1", num_per_channels=128, **SF_MODES["e4m3sf"]),
        Case.of(cast, 3584, inputs={**moe, "row_stride_pad": 8}, expert_alignment=128),
        Case.of(backward, 3, _FP32),
        Case.of(backward, 72, inputs={"weighted": True}, routed_scaling_factor=2.5),
        Case.of(backward, 72, _FP32, inputs={"scale": 4, "row_stride_pad": 3}, clamp_value=7.0),
        Case.of(backward, 704, inputs={**moe, "scale": 4}, clamp_value=7.0, expert_alignment=16),
        Case.of(backward, 3584, _FP32, inputs={"weighted": True, "experts": 4}, routed_scaling_factor=1.5,
                expert_alignment=128),
    ]


def _bench(name: str) -> list[BenchCase]:
    """What ``tileplug bench`` times (H = ``--hidden``): each op dense, and in the MoE form —
    routed weights and an expert layout of 32 experts aligned to 128 (the goal: at most 3 %
    slower than dense) — the forward also with a clamp, the cast also with UE8M0 scales in the
    column-major layout a DeepGEMM-style grouped GEMM reads."""
    moe = {"weighted": True, "experts": 32}
    return {
        contracts.SWIGLU: [BenchCase.of("swiglu", contracts.SWIGLU),
                           BenchCase.of("swiglu/moe", contracts.SWIGLU, inputs=moe),
                           BenchCase.of("swiglu/moe-clamp", contracts.SWIGLU, inputs=moe, clamp_value=7.0)],
        contracts.SWIGLU_PER_TOKEN_CAST: [
            BenchCase.of("swiglu_per_token_cast", contracts.SWIGLU_PER_TOKEN_CAST),
            BenchCase.of("swiglu_per_token_cast/moe", contracts.SWIGLU_PER_TOKEN_CAST, inputs=moe),
            BenchCase.of("swiglu_per_token_cast/moe-ue8m0-col-major", contracts.SWIGLU_PER_TOKEN_CAST, inputs=moe,
                         use_tma_aligned_col_major_sf=True, **SF_MODES["ue8m0"]),
        ],
        contracts.SWIGLU_BACKWARD: [BenchCase.of("swiglu_backward", contracts.SWIGLU_BACKWARD),
                                    BenchCase.of("swiglu_backward/weighted", contracts.SWIGLU_BACKWARD,
                                                 inputs={"weighted": True})],
    }.get(name, [])


def _declare(function: Any, builder: Any, unfused_steps: Any = None, autograd: tuple[Any, Any] | None = None
             ) -> OpDef:
    name = function.__name__
    return declare(OpDef(
        name=name, family="swiglu", function=function, contract=bound_contract(function, builder),
        outputs=lambda call, traits: call.allocation_plan(traits), result=lambda call, outputs: call.result(outputs),
        ledger=lambda call, traits: call.ledger(traits),
        cases=lambda: [case for case in swiglu_cases() if case.op == name],
        bench=lambda: _bench(name),
        arguments=lambda *args: swiglu_arguments(name, *args),
        compare=compare_swiglu, input_options=INPUT_OPTIONS, unfused=unfused_steps, autograd=autograd,
    ))


SWIGLU = _declare(swiglu, contracts.swiglu, autograd=(_swiglu_setup, _swiglu_backward))
SWIGLU_PER_TOKEN_CAST = _declare(swiglu_per_token_cast, contracts.swiglu_per_token_cast,
                                 unfused_steps=unfused.swiglu_cast_chain)
SWIGLU_BACKWARD = _declare(swiglu_backward, contracts.swiglu_backward)
