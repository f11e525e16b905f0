"""RoPE and the fused QK path (SPEC §6, docs/spec.md): the public functions and their declarations.

Shapes: ``query`` / ``key`` are ``[T, N, D]`` or ``[B, S, N, D]`` (bf16 / fp16 / fp32, unit
last stride, any other strides: views into a fused QKV buffer are the common case);
``cos_sin_cache`` is fp32 ``[L, R]`` (``R/2`` cos columns, then ``R/2`` sin columns, ``R`` even,
``R ≤ D``); ``positions`` int32 / int64 ``[T]`` or ``[B, S]``, or None.

In the op table, a case's ``hidden`` is the width of one token's heads, ``N·D`` (the
``head_dim`` input option gives ``D``, so ``N = hidden / D``). The ops are not
differentiable: ``apply_rotary`` writes its inputs without recording autograd history.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.compiler import is_compiling

from tileplug.core.call import IN_PLACE_PLAN
from tileplug.core.contracts import rope as contracts
from tileplug.core.errors import ContractError
from tileplug.core import unfused
from tileplug.core.opdefs import BenchCase, Case, OpDef, bound_contract, checked_case_inputs, declare, run


def apply_rotary(
    query: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    interleaved: bool = False,
    conjugate: bool = False,
    seqlen_offset: int = 0,
) -> None:
    """Rotate the first ``R`` channels of every head of ``query`` (and ``key``) in place.

    ``query`` ``[T, Nq, D]`` or ``[B, S, Nq, D]``; ``key`` the same leading dims and ``D``,
    ``Nk`` heads, sharing no memory with ``query``. ``cos_sin_cache`` fp32 ``[L, R]``.
    Position of a token: ``positions[t] + seqlen_offset`` (``positions`` ``[T]`` / ``[B, S]``,
    int32 or int64), or ``seqlen_offset + t`` (3-D) / ``seqlen_offset + s`` (4-D) when None.
    Pairs: NeoX ``(p, p + R/2)``, GPT-J ``(2p, 2p + 1)`` with ``interleaved``; ``conjugate``
    rotates backwards. A position outside ``[0, L)`` makes that token's rotated channels NaN.
    """
    if is_compiling():
        return APPLY_ROTARY.traced(query, cos_sin_cache, key, positions, interleaved, conjugate, seqlen_offset)
    call, inputs = contracts.apply_rotary(query, cos_sin_cache, key, positions, interleaved, conjugate, seqlen_offset)
    run(call, inputs)
    return None


def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor | None = None,
    eps: float = 1e-6,
    interleaved: bool = False,
    weight_offset: float = 0.0,
    seqlen_offset: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-head RMSNorm then RoPE (the QK-norm + RoPE of Qwen3 / DeepSeek attention) → ``y``.

    ``x`` ``[T, N, D]``, ``weight`` ``[D]``; ``y`` ``[T, N, D]`` in ``x.dtype`` equals, bytewise,
    ``rms_norm(x, weight, eps, weight_offset=weight_offset)`` (per head, rounded to ``x.dtype``)
    rotated by ``apply_rotary(y, cos_sin_cache, positions=..., interleaved=..., seqlen_offset=...)``.
    ``out``: an optional preallocated contiguous ``[T, N, D]``.
    """
    if is_compiling():
        return RMS_NORM_ROPE.traced(x, weight, cos_sin_cache, positions, eps, interleaved, weight_offset,
                                    seqlen_offset, out=out)
    call, inputs = contracts.rms_norm_rope(x, weight, cos_sin_cache, positions, eps, interleaved, weight_offset,
                                           seqlen_offset)
    return run(call, inputs, out)


def rms_norm_rope_per_token_cast(
    x: torch.Tensor,
    weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor | None = None,
    eps: float = 1e-6,
    interleaved: bool = False,
    weight_offset: float = 0.0,
    seqlen_offset: int = 0,
    fmt: str = "e4m3",
    num_per_channels: int = 128,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    use_tma_aligned_col_major_sf: bool = False,
    return_unquantized: bool = False,
) -> tuple[torch.Tensor, ...]:
    """:func:`rms_norm_rope` then the per-token cast of ``y.view(T, N·D)`` → ``(q, sf)``, or
    ``(q, sf, y)`` with ``return_unquantized``.

    Equals, bytewise, ``per_token_cast(rms_norm_rope(...).view(T, N·D), fmt, num_per_channels,
    round_sf=..., use_packed_ue8m0=..., use_tma_aligned_col_major_sf=...)``; ``num_per_channels``
    (16, 32, 64, 128) may not exceed ``D``. ``q`` ``[T, N·D]`` (e2m1: ``[T, N·D/2]``), ``sf`` as
    :func:`per_token_cast` lays it out.
    """
    if is_compiling():
        return RMS_NORM_ROPE_PER_TOKEN_CAST.traced(
            x, weight, cos_sin_cache, positions, eps, interleaved, weight_offset, seqlen_offset, fmt,
            num_per_channels, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf, return_unquantized)
    call, inputs = contracts.rms_norm_rope(
        x, weight, cos_sin_cache, positions, eps, interleaved, weight_offset, seqlen_offset, True, fmt,
        num_per_channels, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf, return_unquantized)
    return run(call, inputs)


def make_cos_sin_cache(length: int, rotary_dim: int, base: float = 10000.0,
                       device: str | torch.device | None = None) -> torch.Tensor:
    """The usual RoPE table, fp32 ``[length, rotary_dim]``: ``cos(p·θ_i)`` then ``sin(p·θ_i)``
    with ``θ_i = base^(−2i/rotary_dim)``, ``i < rotary_dim/2`` (angles and values in fp64,
    rounded once)."""
    if type(rotary_dim) is not int or rotary_dim < 2 or rotary_dim % 2:
        raise ContractError("make_cos_sin_cache", "rotary_dim", "an even int >= 2", rotary_dim)
    if type(length) is not int or length < 0:
        raise ContractError("make_cos_sin_cache", "length", "an int >= 0", length)
    half = rotary_dim // 2
    inverse_frequency = base ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inverse_frequency[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).to(torch.float32).to(device)


# ---------------------------------------------------------------------- the op table

INPUT_OPTIONS: dict[str, str] = {
    "head_dim": "int >= 1: channels per head D (N = hidden / D; default 128, else 64, else hidden: one head)",
    "rotary_dim": "even int <= D: the rotary width R of the cache (default: all of D, or tail_view)",
    "tail_view": "int >= 0: the op gets the view x[..., -tail_view:] of each head (MLA's rope part)",
    "query_heads_per_key": "int >= 0: a key of max(1, N // this) heads (0: no key)",
    "batch": "int >= 0: 4-D inputs [batch, T, N, D] (0: 3-D [T, N, D])",
    "positions": "'none', 'int32' or 'int64': implicit positions or explicit ones of that dtype",
    "qkv": "bool: query and key are views of one fused [rows, (N + 2 Nk) D] buffer",
    "row_stride_pad": "int >= 0: each token row of the buffer has this many extra elements",
}
_CHOICES: dict[str, tuple] = {"positions": ("none", "int32", "int64"), "qkv": (False, True)}


def _options(op: str, inputs: dict[str, Any], hidden: int) -> dict[str, Any]:
    """The input options checked, with defaults filled."""
    checked_case_inputs(op, inputs, INPUT_OPTIONS, _CHOICES, {"head_dim": 1})
    default_head = next((size for size in (128, 64) if hidden % size == 0), hidden)
    options = {"head_dim": default_head, "tail_view": 0, "query_heads_per_key": 0, "batch": 0, "positions": "none",
               "qkv": False, "row_stride_pad": 0, **inputs}
    head_dim = options["head_dim"]
    if hidden % head_dim:
        raise ContractError(op, "inputs.head_dim", f"a divisor of hidden = {hidden} (hidden is N·D)", head_dim)
    options["heads"] = heads = hidden // head_dim
    ratio = options["query_heads_per_key"]
    options["key_heads"] = max(1, heads // ratio) if ratio and heads else 0
    options.setdefault("rotary_dim", options["tail_view"] or head_dim)
    return options


def _values(rows: int, width: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    from tileplug.core.testing import activation

    if device.type == "meta":
        return torch.empty(rows, width, dtype=dtype, device=device)
    return activation(rows, width, dtype, seed=seed).to(device)


def _heads(buffer: torch.Tensor, column: int, heads: int, head_dim: int, batch: int, tail: int) -> torch.Tensor:
    """The ``[T, heads, D]`` (``[batch, T, heads, D]``) view of ``heads`` heads starting at ``column``."""
    width = heads * head_dim
    part = buffer[:, column:column + width]
    view = part.unflatten(1, (heads, head_dim))
    if batch:
        view = view.unflatten(0, (batch, buffer.shape[0] // batch))
    return view[..., head_dim - tail:] if tail else view


def rope_arguments(op: str, tokens: int, hidden: int, dtype: torch.dtype, kwargs: dict[str, Any],
                   inputs: dict[str, Any], device: torch.device, seed: int) -> tuple[tuple, dict]:
    """(args, kwargs) of a RoPE-family op with ``tokens`` rows of ``hidden = N·D`` channels.

    Values: a realistic activation (``tileplug.core.testing.activation``) for the heads, a
    weight near 1, the usual cos/sin table (:func:`make_cos_sin_cache`) long enough for every
    position, explicit positions drawn in range; on ``meta`` only shapes. The input options
    (``INPUT_OPTIONS``) choose the head layout: ``head_dim``, ``rotary_dim``, ``tail_view``,
    a key (``query_heads_per_key``), 4-D (``batch``: ``[batch, T, N, D]``), ``positions``, a
    fused ``qkv`` buffer and a padded row stride.
    """
    options = _options(op, inputs, hidden)
    kwargs = dict(kwargs)
    head_dim, heads, key_heads = options["head_dim"], options["heads"], options["key_heads"]
    batch, tail = options["batch"], options["tail_view"]
    rows = tokens * batch if batch else tokens
    pad = options["row_stride_pad"]
    query_width, key_width = heads * head_dim, key_heads * head_dim
    if options["qkv"]:
        buffer = _values(rows, query_width + 2 * key_width + pad, dtype, device, seed)
        key_buffer, key_column = buffer, query_width
    else:
        buffer = _values(rows, query_width + pad, dtype, device, seed)
        key_buffer, key_column = _values(rows, key_width + pad, dtype, device, seed + 1), 0
    query = _heads(buffer, 0, heads, head_dim, batch, tail)
    offset = kwargs.get("seqlen_offset", 0)
    span = tokens + 8  # positions are drawn in [0, span)
    length = span + max(offset, 0)
    if device.type == "meta":
        cache = torch.empty(length, options["rotary_dim"], dtype=torch.float32, device=device)
    else:
        cache = make_cos_sin_cache(length, options["rotary_dim"], device=device)
    positions = None
    if options["positions"] != "none":
        leading = tuple(query.shape[:-2])
        position_dtype = getattr(torch, options["positions"])
        if device.type == "meta":
            positions = torch.empty(leading, dtype=position_dtype, device=device)
        else:
            generator = torch.Generator().manual_seed(seed + 2)
            positions = torch.randint(0, span, leading, generator=generator).to(position_dtype).to(device)
    if op == "apply_rotary":
        if key_heads:
            kwargs["key"] = _heads(key_buffer, key_column, key_heads, head_dim, batch, tail)
        kwargs["positions"] = positions
        return (query, cache), kwargs
    width = query.shape[-1]
    if device.type == "meta":
        weight = torch.empty(width, dtype=dtype, device=device)
    else:
        generator = torch.Generator().manual_seed(seed + 3)
        weight = (1.0 + 0.1 * torch.randn(width, generator=generator)).to(dtype).to(device)
    kwargs["positions"] = positions
    return (query, weight, cache), kwargs


def compare_rotary(case: Case, tokens: int, actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """SPEC §6: the rotated tensors within 1 ulp of the reference's (NaN where it has NaN)."""
    from tileplug.core.testing import assert_within_ulps, require

    require(len(actual) == len(expected), f"{case.id}: {len(actual)} outputs, expected {len(expected)}")
    for index, (have, want) in enumerate(zip(actual, expected)):
        if have is None or want is None:  # no key
            require(have is None and want is None, f"{case.id} T={tokens} output {index}: {have!r} vs {want!r}")
            continue
        assert_within_ulps(have, want, 1, what=f"{case.id} T={tokens} output {index}")


def compare_norm_rope(case: Case, tokens: int, actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """``y`` within the chain's bound of the reference's (the norm's ulp carried through the
    rotation, :func:`tileplug.core.testing.assert_rotated_within_chain_bound`). ``(q, sf)``:
    with ``y`` returned, bytewise equal to the reference's per-token cast of the backend's own
    ``y`` (the fusion rule); without it, :func:`tileplug.core.testing.assert_quantized_close`
    to the reference's (the same bytes where the ``y`` agree)."""
    from tileplug.core import ops
    from tileplug.core.ops.quant import compare_quant
    from tileplug.core.registry import use_backend
    from tileplug.core.testing import assert_quantized_close, assert_rotated_within_chain_bound, require

    what = f"{case.id} T={tokens}"
    require(len(actual) == len(expected), f"{what}: {len(actual)} outputs, expected {len(expected)}")
    rotary_dim = dict(case.inputs).get("rotary_dim") or actual[-1].shape[-1]
    interleaved = bool(dict(case.kwargs).get("interleaved", False))
    if case.op == "rms_norm_rope":
        assert_rotated_within_chain_bound(actual[0], expected[0], rotary_dim, interleaved, what=f"{what} y")
        return
    kwargs = dict(case.kwargs)
    flags = {name: kwargs[name] for name in ("fmt", "num_per_channels", "round_sf", "use_packed_ue8m0",
                                             "use_tma_aligned_col_major_sf") if name in kwargs}
    if len(actual) == 3:
        y = actual[2]
        assert_rotated_within_chain_bound(y, expected[2], rotary_dim, interleaved, what=f"{what} y")
        with use_backend("reference"):
            # (the suite compares inside the backend's layout: config.host_layout is the backend's)
            chain = list(ops.per_token_cast(y.reshape(tokens, y.shape[1] * y.shape[2]), **flags))
        compare_quant(Case.of("per_token_cast", y.shape[1] * y.shape[2], **flags), tokens, list(actual[:2]), chain)
        return
    assert_quantized_close(actual[0], actual[1], expected[0], expected[1], flags.get("fmt", "e4m3"),
                           flags.get("num_per_channels", 128), case.dtype, what=f"{what} (q, sf)")


def rope_cases() -> list[Case]:
    """The family's grid: non-aligned head counts first, D in {64, 128, 192 (R = 64 tail), 576
    (MLA: the last 64 through a view)}, both pairings, conjugate, every positions mode, 4-D,
    a fused QKV buffer with padded rows; the fused ops with every sf layout option."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    rotary = "apply_rotary"
    cases = [
        Case.of(rotary, 576, bf16, inputs={"head_dim": 64, "query_heads_per_key": 3}),
        Case.of(rotary, 3 * 64, bf16, inputs={"head_dim": 64}),
        Case.of(rotary, 2 * 128, bf16, inputs={"query_heads_per_key": 2, "positions": "int64"}, seqlen_offset=5),
        Case.of(rotary, 5 * 192, fp16, inputs={"head_dim": 192, "rotary_dim": 64, "positions": "int32"},
                interleaved=True),
        Case.of(rotary, 2 * 576, bf16, inputs={"head_dim": 576, "tail_view": 64, "query_heads_per_key": 2,
                                               "positions": "int64"}),
        Case.of(rotary, 2 * 128, fp32, inputs={"batch": 2, "query_heads_per_key": 1}, seqlen_offset=7,
                conjugate=True),
        Case.of(rotary, 4 * 64, bf16, inputs={"head_dim": 64, "batch": 3, "positions": "int32"}, interleaved=True),
        Case.of(rotary, 4 * 128, bf16, inputs={"qkv": True, "query_heads_per_key": 2, "row_stride_pad": 8,
                                               "positions": "int64"}, interleaved=True, conjugate=True),
        Case.of(rotary, 3 * 64, fp32, inputs={"head_dim": 64, "rotary_dim": 32, "row_stride_pad": 3},
                conjugate=True, seqlen_offset=2),
    ]
    norm = "rms_norm_rope"
    cases += [
        Case.of(norm, 576, bf16, inputs={"head_dim": 64, "positions": "int64"}),
        Case.of(norm, 3 * 128, bf16),
        Case.of(norm, 2 * 192, fp16, inputs={"head_dim": 192, "rotary_dim": 64, "positions": "int32"},
                interleaved=True, seqlen_offset=3),
        Case.of(norm, 3 * 64, fp32, inputs={"head_dim": 64, "row_stride_pad": 5, "positions": "int64"},
                weight_offset=1.0, eps=1e-5),
    ]
    fused = "rms_norm_rope_per_token_cast"
    layouts = ({}, {"round_sf": True}, {"round_sf": True, "use_packed_ue8m0": True},
               {"use_tma_aligned_col_major_sf": True},
               {"round_sf": True, "use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True})
    cases.append(Case.of(fused, 576, bf16, inputs={"head_dim": 64}, num_per_channels=64, return_unquantized=True))
    for index, flags in enumerate(layouts):
        cases.append(Case.of(fused, 3 * 128, bf16, inputs={"positions": "int64"}, return_unquantized=index % 2 == 0,
                             **flags))
    cases += [
        Case.of(fused, 2 * 192, bf16, inputs={"head_dim": 192, "rotary_dim": 64}, num_per_channels=64,
                interleaved=True, return_unquantized=True),
        Case.of(fused, 3 * 64, fp32, inputs={"head_dim": 64, "positions": "int32"}, fmt="e2m1", num_per_channels=32,
                weight_offset=1.0),
        Case.of(fused, 5 * 64, bf16, inputs={"head_dim": 64, "row_stride_pad": 2}, num_per_channels=16,
                round_sf=True, use_packed_ue8m0=True, return_unquantized=True),
    ]
    return cases


def _bench(name: str) -> list[BenchCase]:
    """What ``tileplug bench`` times (hidden = N·128: at --hidden 4096, 32 heads × 128)."""
    return {
        "apply_rotary": [
            BenchCase.of("apply_rotary/neox", "apply_rotary", inputs={"positions": "int64"}),
            BenchCase.of("apply_rotary/gptj", "apply_rotary", inputs={"positions": "int64"}, interleaved=True),
            BenchCase.of("apply_rotary/neox-qk-gqa4", "apply_rotary",
                         inputs={"positions": "int64", "qkv": True, "query_heads_per_key": 4}),
        ],
        "rms_norm_rope": [BenchCase.of("rms_norm_rope", "rms_norm_rope", inputs={"positions": "int64"})],
        # groups of 64: within a head at every hidden the default head width divides (D = 128 or 64)
        "rms_norm_rope_per_token_cast": [
            BenchCase.of("rms_norm_rope_per_token_cast", "rms_norm_rope_per_token_cast",
                         inputs={"positions": "int64"}, num_per_channels=64),
            BenchCase.of("rms_norm_rope_per_token_cast/ue8m0-col", "rms_norm_rope_per_token_cast",
                         inputs={"positions": "int64"}, num_per_channels=64, round_sf=True, use_packed_ue8m0=True,
                         use_tma_aligned_col_major_sf=True),
        ],
    }.get(name, [])


def _declare(function: Any, contract: Any, outputs: Any, result: Any, compare: Any, mutates: tuple[str, ...] = (),
             kernel: str = "", unfused: Any = None) -> OpDef:
    name = function.__name__
    return declare(OpDef(
        name=name, kernel=kernel, family="rope", function=function, contract=contract, outputs=outputs, result=result,
        ledger=lambda call, traits: call.ledger(traits),
        cases=lambda: [case for case in rope_cases() if case.op == name],
        bench=lambda: _bench(name),
        arguments=lambda *args: rope_arguments(name, *args),
        compare=compare, input_options=INPUT_OPTIONS, mutates=mutates, unfused=unfused,
    ))


_NORM = ("x", "weight", "cos_sin_cache", "positions", "eps", "interleaved", "weight_offset", "seqlen_offset")

APPLY_ROTARY = _declare(
    apply_rotary,
    bound_contract(apply_rotary, contracts.apply_rotary,
                   ("query", "cos_sin_cache", "key", "positions", "interleaved", "conjugate", "seqlen_offset"),
                   by_name=True),
    outputs=lambda call, traits: IN_PLACE_PLAN, result=lambda call, outputs: None,
    compare=compare_rotary, mutates=("query", "key"), unfused=lambda call, traits: unfused.rotary_eager_steps(call))
RMS_NORM_ROPE = _declare(
    rms_norm_rope, bound_contract(rms_norm_rope, contracts.rms_norm_rope, _NORM, by_name=True),
    outputs=contracts.NormRopeCall.allocation_plan, result=contracts.NormRopeCall.result, compare=compare_norm_rope,
    unfused=unfused.norm_rope_chain)
RMS_NORM_ROPE_PER_TOKEN_CAST = _declare(
    rms_norm_rope_per_token_cast,
    bound_contract(rms_norm_rope_per_token_cast, contracts.rms_norm_rope,
                   _NORM + ("fmt", "num_per_channels", "round_sf", "use_packed_ue8m0", "use_tma_aligned_col_major_sf",
                            "return_unquantized"), by_name=True, quantize=True),
    outputs=contracts.NormRopeCall.allocation_plan, result=contracts.NormRopeCall.result, compare=compare_norm_rope,
    kernel="rms_norm_rope", unfused=unfused.norm_rope_chain)  # one kernel serves both: the call's cast says whether it quantizes
