"""Quantization ops (SPEC §3, docs/spec.md): the public functions and their op-table declarations.

Shapes: ``x`` is ``[T, H]`` bf16/fp32 (any row stride, unit last stride) or a quantized
pair ``(xq, sf)``; ``q`` is ``[T, H]`` float8_e4m3fn or ``[T, H/2]`` int8 (e2m1, two per
byte); ``sf`` is ``[ceil(T/bm), ceil(H/bn)]`` groups in the layout the flags ask for
(packed UE8M0 shrinks the packed axis by the backend's pack factor).

The casts are not differentiable: outputs never carry autograd history, whatever the
input's ``requires_grad``.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.compiler import is_compiling

from tileplug.core import config
from tileplug.core.call import IN_PLACE_PLAN, QuantMode
from tileplug.core.contracts import quant as contracts
from tileplug.core.errors import ContractError
from tileplug.core.generator import SEED_LIMIT, Generator
from tileplug.core.opdefs import (
    BenchCase,
    Case,
    OpDef,
    allocate_without_backend,
    bound_contract,
    declare,
    run,
)
from tileplug.core.opdefs import get as get_opdef

QuantizedPair = tuple[torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------- per token


def per_token_cast(
    x: torch.Tensor | QuantizedPair,
    fmt: str = "e4m3",
    num_per_channels: int = 128,
    x_block_size: tuple[int, int] | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    use_e4m3_sf: bool = False,
    stochastic_rounding: bool = False,
    generator: Generator | None = None,
    out: QuantizedPair | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [T, H] in groups of ``1 × num_per_channels`` → ``(q, sf)``.

    ``fmt``: "e4m3" or "e2m1". ``num_per_channels``: 16, 32, 64 or 128. ``x`` may be a
    quantized pair ``(xq, sf_in)`` whose grouping ``x_block_size`` gives (re-quantization).
    ``round_sf``: power-of-two scales; ``use_packed_ue8m0``: store them as packed UE8M0
    bytes; ``use_e4m3_sf``: store scales as e4m3; ``use_tma_aligned_col_major_sf``:
    column-major sf. ``stochastic_rounding``: the narrowing of ``x · inv`` rounds
    stochastically (docs/spec.md §10.2) with the bits of ``generator`` (None: the default
    generator of x's device), whose offset then advances by one. ``out``: optional
    preallocated ``(q, sf)`` of exactly that layout.
    sf: [T, ceil(H/num_per_channels)] (packed: last dim / pack factor).
    """
    if is_compiling():
        return PER_TOKEN_CAST.traced(x, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf,
                                     round_sf, use_packed_ue8m0, use_e4m3_sf, stochastic_rounding,
                                     _traced_generator(stochastic_rounding, generator, x), out=out)
    call, inputs = contracts.per_token_cast(
        x, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, use_e4m3_sf,
        stochastic_rounding=stochastic_rounding, generator=generator,
    )
    return run(call, inputs, out)  # (a stochastic cast's kernels advance the generator's offset)


def per_token_cast_with_sf_only(
    x: torch.Tensor | QuantizedPair,
    fmt: str = "e4m3",
    num_per_channels: int = 128,
    x_block_size: tuple[int, int] | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    use_e4m3_sf: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Only the scales ``per_token_cast`` would return for the same arguments: sf."""
    if is_compiling():
        return PER_TOKEN_CAST_WITH_SF_ONLY.traced(x, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf,
                                                  round_sf, use_packed_ue8m0, use_e4m3_sf, out=out)
    call, inputs = contracts.per_token_cast(
        x, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, use_e4m3_sf,
        QuantMode.SF_ONLY, name="per_token_cast_with_sf_only",
    )
    return run(call, inputs, out)


def per_token_cast_with_precomputed_sf(
    x: torch.Tensor | QuantizedPair,
    fmt: str = "e4m3",
    num_per_channels: int = 128,
    sf: torch.Tensor | None = None,
    x_block_size: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize ``x`` with the caller's scales ``sf`` (any layout §2 defines, read off its
    dtype and strides): ``inv = 1 / sf``, nothing else computed → q [T, H] (or [T, H/2])."""
    if is_compiling():
        return PER_TOKEN_CAST_WITH_PRECOMPUTED_SF.traced(x, fmt, num_per_channels, sf, x_block_size, out=out)
    call, inputs = _precomputed_token(x, fmt, num_per_channels, x_block_size, sf)
    return run(call, inputs, out)


# ---------------------------------------------------------------------- per block


def per_block_cast(
    x: torch.Tensor | QuantizedPair,
    fmt: str = "e4m3",
    block_size: tuple[int, int] = (128, 128),
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    x_block_size: tuple[int, int] | None = None,
    stochastic_rounding: bool = False,
    generator: Generator | None = None,
    out: QuantizedPair | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [T, H] in ``bm × bn`` blocks (each side 16, 32, 64 or 128) → ``(q, sf)``
    with sf [ceil(T/bm), ceil(H/bn)]. Flags (``stochastic_rounding`` and ``generator``
    included) as in :func:`per_token_cast`."""
    if is_compiling():
        return PER_BLOCK_CAST.traced(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0,
                                     x_block_size, stochastic_rounding,
                                     _traced_generator(stochastic_rounding, generator, x), out=out)
    call, inputs = contracts.per_block_cast(
        x, fmt, block_size, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0,
        stochastic_rounding=stochastic_rounding, generator=generator,
    )
    return run(call, inputs, out)  # (a stochastic cast's kernels advance the generator's offset)


def _traced_generator(stochastic_rounding: Any, generator: Any, x: Any) -> Any:
    """The generator a compiled stochastic cast reads (the default one of x's device when None)."""
    if stochastic_rounding is not True or generator is not None:
        return generator
    from tileplug.core.random import default_generator

    data = x[0] if isinstance(x, (tuple, list)) else x
    return default_generator(data.device)


def per_block_cast_with_sf_only(
    x: torch.Tensor | QuantizedPair,
    fmt: str = "e4m3",
    block_size: tuple[int, int] = (128, 128),
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    x_block_size: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Only the scales :func:`per_block_cast` would return: sf [ceil(T/bm), ceil(H/bn)]."""
    if is_compiling():
        return PER_BLOCK_CAST_WITH_SF_ONLY.traced(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf,
                                                  use_packed_ue8m0, x_block_size, out=out)
    call, inputs = contracts.per_block_cast(
        x, fmt, block_size, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, QuantMode.SF_ONLY,
        name="per_block_cast_with_sf_only",
    )
    return run(call, inputs, out)


def per_block_cast_with_precomputed_sf(
    x: torch.Tensor | QuantizedPair,
    fmt: str = "e4m3",
    block_size: tuple[int, int] = (128, 128),
    sf: torch.Tensor | None = None,
    x_block_size: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize ``x`` in ``bm × bn`` blocks with the caller's scales ``sf`` → q."""
    if is_compiling():
        return PER_BLOCK_CAST_WITH_PRECOMPUTED_SF.traced(x, fmt, block_size, sf, x_block_size, out=out)
    call, inputs = _precomputed_block(x, fmt, block_size, x_block_size, sf)
    return run(call, inputs, out)


# ---------------------------------------------------------------------- per channel, cast back


def per_channel_cast(
    x: torch.Tensor | QuantizedPair,
    fmt: str = "e4m3",
    num_per_tokens: int = 128,
    round_sf: bool = False,
    num_per_channels: int | None = None,
    use_packed_ue8m0: bool = False,
    out: QuantizedPair | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [T, H] in groups of ``num_per_tokens × 1`` (32 or 128) → ``(q, sf)``
    with sf [ceil(T/num_per_tokens), H] (packed UE8M0: packed along tokens).
    ``num_per_channels`` is the per-token grouping of a quantized pair input."""
    if is_compiling():
        return PER_CHANNEL_CAST.traced(x, fmt, num_per_tokens, round_sf, num_per_channels, use_packed_ue8m0, out=out)
    call, inputs = contracts.per_channel_cast(x, fmt, num_per_tokens, round_sf, num_per_channels, use_packed_ue8m0)
    return run(call, inputs, out)


def cast_back(
    x: QuantizedPair,
    fmt: str = "bf16",
    x_block_size: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize ``(q, sf)`` of any layout §3 produces: ``float(q) * sf`` expanded over
    ``x_block_size`` groups, rounded once to ``fmt`` ("bf16" or "fp32") → [T, H]."""
    if is_compiling():
        return CAST_BACK.traced(x, fmt, x_block_size, out=out)
    call, inputs = contracts.cast_back(x, fmt, x_block_size)
    return run(call, inputs, out)


def per_token_cast_and_cast_back(
    x: torch.Tensor,
    fmt: str = "e4m3",
    num_per_channels: int = 128,
    round_sf: bool = False,
    use_e4m3_sf: bool = False,
) -> None:
    """Fake-quantize ``x`` [T, H] (bf16/fp32, any row stride) in place, in one pass: each group
    of ``1 × num_per_channels`` values becomes what ``cast_back(per_token_cast(x, fmt,
    num_per_channels, round_sf=round_sf, use_e4m3_sf=use_e4m3_sf), x.dtype)`` returns, bytewise
    (QAT). ``fmt``: "e4m3" or "e2m1"; ``round_sf``: power-of-two scales; ``use_e4m3_sf``:
    scales rounded to e4m3. Only the ``[T, H]`` elements are written (a padded row's tail is
    untouched). Returns None."""
    if is_compiling():
        return PER_TOKEN_CAST_AND_CAST_BACK.traced(x, fmt, num_per_channels, round_sf, use_e4m3_sf)
    call, inputs = contracts.per_token_cast_and_cast_back(x, fmt, num_per_channels, round_sf, use_e4m3_sf)
    return run(call, inputs)


# ---------------------------------------------------------------------- declarations

SF_MODES: dict[str, dict[str, bool]] = {
    "plain": {},
    "round": {"round_sf": True},
    "ue8m0": {"round_sf": True, "use_packed_ue8m0": True},
    "e4m3sf": {"use_e4m3_sf": True},
}
"""Scale modes SPEC §2 allows (e4m3-stored sf only for per-token)."""

_MODE_OF_SF = {"fp32": "plain", "e4m3": "e4m3sf", "ue8m0": "ue8m0"}
"""The scale mode (``SF_MODES``) that stores scales of each ``input_sf`` kind."""


def block_of(op: str, kwargs: dict[str, Any]) -> tuple[int, int]:
    """The output group shape of a quant op called with ``kwargs`` (cast_back: its input's;
    a re-blocking op: its ``out_block_size``)."""
    if "out_block_size" in kwargs:
        return tuple(kwargs["out_block_size"])
    if op.startswith("per_token"):
        return 1, kwargs.get("num_per_channels", 128)
    if op.startswith("per_block"):
        return tuple(kwargs.get("block_size", (128, 128)))
    if op == "per_channel_cast":
        return kwargs.get("num_per_tokens", 128), 1
    return tuple(kwargs["x_block_size"])


def _input_block(op: str, kwargs: dict[str, Any]) -> tuple[int, int] | None:
    """The group shape of the quantized input a call with ``kwargs`` reads (None: plain x)."""
    if op == "per_channel_cast":
        group = kwargs.get("num_per_channels")
        return None if group is None else (1, group)
    block = kwargs.get("x_block_size")
    return None if block is None else tuple(block)


def producer_of(block: tuple[int, int], fmt: str, sf: str, col_major: bool) -> tuple[str, dict[str, Any]]:
    """The op and kwargs that make a quantized tensor with ``block`` groups, ``fmt`` data and
    ``sf`` ("fp32", "e4m3" or "ue8m0") scales."""
    flags = dict(SF_MODES[_MODE_OF_SF[sf]])
    if block[0] == 1:
        return "per_token_cast", {"fmt": fmt, "num_per_channels": block[1], "use_tma_aligned_col_major_sf": col_major,
                                  **flags}
    flags.pop("use_e4m3_sf", None)
    if block[1] == 1:
        return "per_channel_cast", {"fmt": fmt, "num_per_tokens": block[0], **flags}
    return "per_block_cast", {"fmt": fmt, "block_size": block, "use_tma_aligned_col_major_sf": col_major, **flags}


def produce(op: str, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    """``op(x, **kwargs)``: run by the backend in force, or only allocated for meta inputs
    (so shapes are made anywhere, no backend needed)."""
    if x.device.type == "meta":
        return allocate_without_backend(op, config.current().host_layout, x, **kwargs)
    from tileplug.core import ops

    return getattr(ops, op)(x, **kwargs)


INPUT_OPTIONS: dict[str, str] = {
    "row_stride_pad": "int >= 0: x is a view of [T, H + pad] (a padded row stride)",
    "input_fmt": "'e4m3' or 'e2m1': the format of a quantized input",
    "input_sf": "'fp32', 'e4m3' or 'ue8m0': the scales of a quantized input or of the given sf",
    "input_col_major": "bool: those scales are stored column-major",
    "generator_seed": "int in [0, 2^64): the seed of the generator a stochastic cast (stochastic_rounding=True) "
                      "draws from; its offset starts at 0",
}
_INPUT_CHOICES: dict[str, tuple] = {
    "input_fmt": ("e4m3", "e2m1"), "input_sf": ("fp32", "e4m3", "ue8m0"), "input_col_major": (False, True),
}


def _check_input_options(op: str, inputs: dict[str, Any]) -> None:
    for key, value in inputs.items():
        if key not in INPUT_OPTIONS:
            raise ContractError(op, f"inputs.{key}", f"one of {', '.join(INPUT_OPTIONS)}", key)
        choices = _INPUT_CHOICES.get(key)
        if choices is not None and (value not in choices or type(value) is not type(choices[0])):
            raise ContractError(op, f"inputs.{key}", f"one of {', '.join(map(repr, choices))}", repr(value))
        if key == "row_stride_pad" and (type(value) is not int or value < 0):
            raise ContractError(op, "inputs.row_stride_pad", "an int >= 0", repr(value))
        if key == "generator_seed" and (type(value) is not int or not 0 <= value < SEED_LIMIT):
            raise ContractError(op, "inputs.generator_seed", "an int in [0, 2^64)", repr(value))


def quant_arguments(op: str, tokens: int, hidden: int, dtype: torch.dtype, kwargs: dict[str, Any],
                    inputs: dict[str, Any], device: torch.device, seed: int) -> tuple[tuple, dict]:
    """(args, kwargs) of a quant op at ``[tokens, hidden]`` on ``device``.

    ``inputs`` options: ``row_stride_pad`` (x is a view of ``[T, H + pad]``), and for a
    quantized input (``x_block_size`` / per-channel ``num_per_channels`` in kwargs, or
    cast_back) or the given ``sf`` of a precomputed-sf op: ``input_fmt`` ("e4m3"/"e2m1"),
    ``input_sf`` ("fp32"/"e4m3"/"ue8m0") and ``input_col_major``; with
    ``stochastic_rounding=True`` in kwargs, ``generator_seed`` (default: the case seed) seeds
    the call's own generator. Values are a realistic
    activation (``tileplug.core.testing.activation``) quantized by the backend in force;
    on ``meta`` only shapes are made.
    """
    from tileplug.core.testing import activation

    _check_input_options(op, inputs)
    kwargs = dict(kwargs)
    pad = inputs.get("row_stride_pad", 0)
    if device.type == "meta":
        x = torch.empty(tokens, hidden + pad, dtype=dtype, device=device)
    else:
        x = activation(tokens, hidden + pad, dtype, seed=seed).to(device)
        if "x" in get_opdef(op).mutates:  # written in place: its own copy (activations may be shared)
            x = x.clone()
    x = plain = x[:, :hidden]
    fmt, sf_kind = inputs.get("input_fmt", "e4m3"), inputs.get("input_sf", "fp32")
    col_major = inputs.get("input_col_major", False)
    block = (1, 128) if op == "cast_back" and "x_block_size" not in kwargs else _input_block(op, kwargs)
    if op == "cast_back":
        kwargs.setdefault("x_block_size", block)
    if block is not None:  # a quantized (xq, sf) input made from the activation
        producer, producer_kwargs = producer_of(block, fmt, sf_kind, col_major)
        x = tuple(produce(producer, plain, producer_kwargs))
    if op.endswith("_with_precomputed_sf"):  # the given scales: the activation's own, in the asked layout
        producer, producer_kwargs = producer_of(block_of(op, kwargs), kwargs.get("fmt", "e4m3"), sf_kind, col_major)
        kwargs["sf"] = produce(producer + "_with_sf_only", plain, producer_kwargs)
    if kwargs.get("stochastic_rounding") is True:  # a generator of its own (offset 0)
        kwargs["generator"] = Generator(device, inputs.get("generator_seed", seed % SEED_LIMIT))
    return (x,), kwargs


def compare_quant(case: Case, tokens: int, actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Outputs equal bytewise (strides too); scales equal on every byte that holds a group
    (padding of a partly filled packed integer or a padded column is unspecified)."""
    from tileplug.core.testing import assert_bytes_equal, assert_sf_equal, cpu_copy, require

    kwargs = dict(case.kwargs)
    require(len(actual) == len(expected), f"{case.id}: {len(actual)} outputs, expected {len(expected)}")
    for index, (have, want) in enumerate(zip(actual, expected)):
        is_sf = case.op != "cast_back" and (index == 1 or case.op.endswith("_sf_only"))
        if is_sf:
            assert_sf_equal(cpu_copy(have), cpu_copy(want), block_of(case.op, kwargs), tokens, case.hidden,
                            what=f"{case.id} T={tokens} sf")
        else:
            assert_bytes_equal(cpu_copy(have), cpu_copy(want), what=f"{case.id} T={tokens} output {index}",
                               strides=True)


def _cast_grid(hidden: int) -> list[Case]:
    """Every flag combination SPEC §3 allows for the three casts at one hidden size."""
    cases = []
    for fmt, group, mode, col_major in itertools.product(("e4m3", "e2m1"), (16, 32, 64, 128), SF_MODES, (False, True)):
        flags = {"fmt": fmt, "num_per_channels": group, "use_tma_aligned_col_major_sf": col_major, **SF_MODES[mode]}
        cases.append(Case.of("per_token_cast", hidden, **flags))
        cases.append(Case.of("per_token_cast_with_sf_only", hidden, **flags))
    for fmt, block, mode, col_major in itertools.product(("e4m3", "e2m1"), ((32, 32), (128, 128)), SF_MODES,
                                                         (False, True)):
        if mode == "e4m3sf":
            continue
        flags = {"fmt": fmt, "block_size": block, "use_tma_aligned_col_major_sf": col_major, **SF_MODES[mode]}
        cases.append(Case.of("per_block_cast", hidden, **flags))
        cases.append(Case.of("per_block_cast_with_sf_only", hidden, **flags))
    for fmt, group, mode in itertools.product(("e4m3", "e2m1"), (32, 128), ("plain", "round", "ue8m0")):
        cases.append(Case.of("per_channel_cast", hidden, fmt=fmt, num_per_tokens=group, **SF_MODES[mode]))
    return cases


def _input_grid(hidden: int) -> list[Case]:
    """fp32 inputs, strided rows, given scales of every encoding, re-quantized inputs of
    every sf layout, cast_back of every layout family."""
    f32 = torch.float32
    cases = [
        Case.of("per_token_cast", hidden, f32, fmt="e4m3", num_per_channels=64),
        Case.of("per_token_cast", hidden, f32, fmt="e2m1", num_per_channels=64, round_sf=True),
        Case.of("per_token_cast_with_sf_only", hidden, f32, fmt="e2m1", num_per_channels=64, use_e4m3_sf=True),
        Case.of("per_block_cast", hidden, f32, fmt="e4m3"),
        Case.of("per_block_cast", hidden, f32, fmt="e2m1", round_sf=True),
        Case.of("per_channel_cast", hidden, f32, fmt="e4m3"),
        Case.of("per_token_cast", hidden, inputs={"row_stride_pad": 48}, num_per_channels=32),
        Case.of("per_token_cast", hidden, f32, inputs={"row_stride_pad": 3}, num_per_channels=128),
        Case.of("per_block_cast", hidden, inputs={"row_stride_pad": 8}, block_size=(32, 32)),
        Case.of("per_channel_cast", hidden, inputs={"row_stride_pad": 1}, num_per_tokens=32),
    ]
    for sf_kind, fmt, group, col_major in (("fp32", "e4m3", 128, False), ("e4m3", "e2m1", 16, False),
                                           ("ue8m0", "e4m3", 32, False), ("ue8m0", "e2m1", 64, True),
                                           ("fp32", "e4m3", 64, True)):
        cases.append(Case.of("per_token_cast_with_precomputed_sf", hidden,
                             inputs={"input_sf": sf_kind, "input_col_major": col_major}, fmt=fmt, num_per_channels=group))
    for sf_kind, fmt, block, col_major in (("fp32", "e4m3", (128, 128), False), ("ue8m0", "e4m3", (32, 32), False),
                                           ("ue8m0", "e2m1", (128, 128), True), ("fp32", "e2m1", (32, 32), False)):
        cases.append(Case.of("per_block_cast_with_precomputed_sf", hidden,
                             inputs={"input_sf": sf_kind, "input_col_major": col_major}, fmt=fmt, block_size=block))
    requant = (
        ("per_token_cast", {"x_block_size": (1, 32)}, {}),
        ("per_token_cast", {"x_block_size": (1, 64), "fmt": "e2m1", "round_sf": True},
         {"input_fmt": "e2m1", "input_sf": "ue8m0", "input_col_major": True}),
        ("per_token_cast", {"x_block_size": (128, 1), "num_per_channels": 64}, {}),
        ("per_token_cast", {"x_block_size": (128, 128), "num_per_channels": 64, "round_sf": True},
         {"input_col_major": True}),
        ("per_token_cast", {"x_block_size": (1, 16), "num_per_channels": 128}, {"input_fmt": "e2m1"}),
        ("per_token_cast_with_sf_only", {"x_block_size": (1, 16)}, {"input_sf": "e4m3"}),
        ("per_token_cast_with_precomputed_sf", {"x_block_size": (1, 32)}, {}),
        ("per_block_cast", {"x_block_size": (1, 128)}, {}),
        ("per_block_cast", {"x_block_size": (1, 128), "fmt": "e2m1", "round_sf": True, "use_packed_ue8m0": True},
         {"input_sf": "ue8m0"}),
        ("per_channel_cast", {"num_per_channels": 128}, {}),
        ("per_channel_cast", {"num_per_channels": 32, "num_per_tokens": 32}, {"input_sf": "ue8m0"}),
    )
    for op, kwargs, options in requant:
        cases.append(Case.of(op, hidden, inputs=options, **kwargs))
    for block, options in (((1, 128), {}), ((128, 128), {}), ((128, 1), {}), ((1, 32), {"input_fmt": "e2m1",
                           "input_sf": "ue8m0"}), ((32, 1), {"input_sf": "ue8m0"}),
                           ((1, 16), {"input_fmt": "e2m1", "input_sf": "e4m3", "input_col_major": True})):
        for out in ("bf16", "fp32"):
            cases.append(Case.of("cast_back", hidden, inputs=options, fmt=out, x_block_size=block))
    return cases


def quant_cases() -> list[Case]:
    """The quant family's grid: every flag combination at H = 576 (partial 128-groups) and
    2048, the input kinds, odd group shapes and model sizes (7168, odd multiples of 16)."""
    cases: list[Case] = []
    for hidden in (576, 2048):
        cases += _cast_grid(hidden) + _input_grid(hidden)
    cases += [
        Case.of("per_block_cast", 576, block_size=(16, 64), round_sf=True),
        Case.of("per_block_cast", 576, block_size=(64, 16), round_sf=True, use_packed_ue8m0=True,
                use_tma_aligned_col_major_sf=True),
        Case.of("per_block_cast", 576, block_size=(16, 16)),
        Case.of("per_block_cast", 576, block_size=(64, 128), fmt="e2m1"),
        Case.of("per_block_cast", 576, block_size=(128, 32), round_sf=True, use_packed_ue8m0=True),
        Case.of("per_token_cast", 7168),
        Case.of("per_token_cast", 7168, round_sf=True, use_packed_ue8m0=True, use_tma_aligned_col_major_sf=True),
        Case.of("per_token_cast", 7168, fmt="e2m1", num_per_channels=16),
        Case.of("per_block_cast", 7168),
        Case.of("per_channel_cast", 7168),
        Case.of("cast_back", 7168, fmt="bf16", x_block_size=(1, 128)),
        Case.of("per_token_cast", 592, torch.float32, fmt="e2m1", num_per_channels=16, round_sf=True,
                use_packed_ue8m0=True),
        Case.of("per_token_cast", 1040, num_per_channels=128),
        Case.of("per_block_cast", 1040, torch.float32, block_size=(64, 64), round_sf=True),
        Case.of("per_channel_cast", 592, torch.float32, num_per_tokens=32),
        Case.of("per_token_cast", 16, num_per_channels=16),
        Case.of("cast_back", 1040, fmt="fp32", x_block_size=(1, 64)),
    ]
    cases += fake_quant_cases() + stochastic_cases()
    return cases


def stochastic_cases() -> list[Case]:
    """``stochastic_rounding=True`` on the main per-token and per-block casts: both formats, the
    scale encodings, a re-quantized input, a padded row stride, fp32 inputs, model sizes;
    generator seeds with both key words set."""
    f32, rounding = torch.float32, {"stochastic_rounding": True}
    return [
        Case.of("per_token_cast", 576, **rounding),
        Case.of("per_token_cast", 576, f32, inputs={"generator_seed": 2**64 - 1}, num_per_channels=32, round_sf=True,
                use_packed_ue8m0=True, use_tma_aligned_col_major_sf=True, **rounding),
        Case.of("per_token_cast", 576, inputs={"generator_seed": 0x243F6A8885A308D3}, fmt="e2m1", num_per_channels=16,
                use_e4m3_sf=True, **rounding),
        Case.of("per_token_cast", 576, inputs={"input_fmt": "e2m1"}, x_block_size=(1, 32), num_per_channels=64,
                **rounding),
        Case.of("per_token_cast", 592, f32, inputs={"row_stride_pad": 3}, fmt="e2m1", num_per_channels=16,
                round_sf=True, **rounding),
        Case.of("per_token_cast", 7168, **rounding),
        Case.of("per_block_cast", 576, **rounding),
        Case.of("per_block_cast", 576, inputs={"generator_seed": 0xA4093822299F31D0}, block_size=(32, 32),
                fmt="e2m1", round_sf=True, **rounding),
        Case.of("per_block_cast", 1040, f32, block_size=(64, 64), use_packed_ue8m0=True, round_sf=True, **rounding),
        Case.of("per_block_cast", 7168, **rounding),
    ]


def fake_quant_cases() -> list[Case]:
    """``per_token_cast_and_cast_back``: every format with every scale mode, every group size,
    at H = 576 (partial 128-groups); fp32 inputs, padded rows, model sizes. (Not the full
    format × group × mode product: each kernel specialisation costs the CI compile grid a few
    seconds, and the group size and the scale mode are independent paths of the tile.)"""
    cases = [Case.of("per_token_cast_and_cast_back", 576, fmt=fmt, num_per_channels=group, **SF_MODES[mode])
             for fmt, group in (("e4m3", 128), ("e2m1", 16)) for mode in ("plain", "round", "e4m3sf")]
    cases += [Case.of("per_token_cast_and_cast_back", 576, fmt=fmt, num_per_channels=group)
              for fmt, group in (("e4m3", 16), ("e4m3", 32), ("e4m3", 64), ("e2m1", 32), ("e2m1", 64), ("e2m1", 128))]
    f32 = torch.float32
    return cases + [
        Case.of("per_token_cast_and_cast_back", 576, f32, fmt="e4m3", num_per_channels=64),
        Case.of("per_token_cast_and_cast_back", 576, f32, fmt="e2m1", num_per_channels=16, use_e4m3_sf=True),
        Case.of("per_token_cast_and_cast_back", 576, inputs={"row_stride_pad": 48}, num_per_channels=32),
        Case.of("per_token_cast_and_cast_back", 592, f32, inputs={"row_stride_pad": 3}, fmt="e2m1",
                num_per_channels=16, round_sf=True),
        Case.of("per_token_cast_and_cast_back", 7168),
        Case.of("per_token_cast_and_cast_back", 7168, fmt="e2m1", num_per_channels=16, use_e4m3_sf=True),
        Case.of("per_token_cast_and_cast_back", 16, num_per_channels=16),
    ]


def _bench(name: str) -> list[BenchCase]:
    """The configurations ``tileplug bench`` times (SPEC defaults, DeepGEMM-style UE8M0)."""
    return {
        "per_token_cast": [
            BenchCase.of("per_token_cast", "per_token_cast"),
            BenchCase.of("per_token_cast/ue8m0-col", "per_token_cast", round_sf=True, use_packed_ue8m0=True,
                         use_tma_aligned_col_major_sf=True),
            BenchCase.of("per_token_cast/e2m1-g16", "per_token_cast", fmt="e2m1", num_per_channels=16),
            BenchCase.of("per_token_cast/stochastic", "per_token_cast", stochastic_rounding=True),
        ],
        "per_block_cast": [BenchCase.of("per_block_cast", "per_block_cast", block_size=(128, 128)),
                           BenchCase.of("per_block_cast/stochastic", "per_block_cast", block_size=(128, 128),
                                        stochastic_rounding=True)],
        "per_channel_cast": [BenchCase.of("per_channel_cast", "per_channel_cast", num_per_tokens=128)],
        "cast_back": [BenchCase.of("cast_back", "cast_back", fmt="bf16", x_block_size=(1, 128))],
        "per_token_cast_and_cast_back": [
            BenchCase.of("per_token_cast_and_cast_back", "per_token_cast_and_cast_back"),
            BenchCase.of("per_token_cast_and_cast_back/e2m1-g16-e4m3sf", "per_token_cast_and_cast_back", fmt="e2m1",
                         num_per_channels=16, use_e4m3_sf=True),
        ],
    }.get(name, [])


def _declare(function: Any, kernel: str, contract: Any, advances: str = "") -> OpDef:
    name = function.__name__
    return declare(OpDef(
        name=name,
        kernel=kernel,
        family="quant",
        function=function,
        contract=contract,
        outputs=contracts.QuantCall.allocation_plan,  # (call, traits) -> AllocationPlan
        result=contracts.QuantCall.result,  # (call, outputs) -> (q, sf) / sf / q
        ledger=contracts.QuantCall.ledger,  # (call, traits) -> Ledger
        cases=lambda: [case for case in quant_cases() if case.op == name],
        bench=lambda: _bench(name),
        arguments=lambda *args: quant_arguments(name, *args),
        compare=compare_quant,
        input_options=INPUT_OPTIONS,
        advances=advances,
    ))


def _precomputed_token(x: Any, fmt: Any, group: Any, x_block_size: Any, sf: Any) -> Any:
    return contracts.per_token_cast(x, fmt, group, x_block_size, False, False, False, False,
                                    QuantMode.PRECOMPUTED_SF, sf, name="per_token_cast_with_precomputed_sf")


def _precomputed_block(x: Any, fmt: Any, block: Any, x_block_size: Any, sf: Any) -> Any:
    return contracts.per_block_cast(x, fmt, block, x_block_size, False, False, False, QuantMode.PRECOMPUTED_SF, sf,
                                    name="per_block_cast_with_precomputed_sf")


_TOKEN = ("x", "fmt", "num_per_channels", "x_block_size", "use_tma_aligned_col_major_sf", "round_sf",
          "use_packed_ue8m0", "use_e4m3_sf")
_BLOCK = ("x", "fmt", "block_size", "x_block_size", "use_tma_aligned_col_major_sf", "round_sf", "use_packed_ue8m0")
_ROUNDING = ("stochastic_rounding", "generator")  # the main casts' rounding option

PER_TOKEN_CAST = _declare(per_token_cast, "per_token_cast",
                          bound_contract(per_token_cast, contracts.per_token_cast, _TOKEN + _ROUNDING, by_name=True),
                          advances="generator")
PER_TOKEN_CAST_WITH_SF_ONLY = _declare(
    per_token_cast_with_sf_only, "per_token_cast",
    bound_contract(per_token_cast_with_sf_only, contracts.per_token_cast, _TOKEN, mode=QuantMode.SF_ONLY,
                   name="per_token_cast_with_sf_only"))
PER_TOKEN_CAST_WITH_PRECOMPUTED_SF = _declare(
    per_token_cast_with_precomputed_sf, "per_token_cast",
    bound_contract(per_token_cast_with_precomputed_sf, _precomputed_token,
                   ("x", "fmt", "num_per_channels", "x_block_size", "sf")))
PER_BLOCK_CAST = _declare(per_block_cast, "per_block_cast",
                          bound_contract(per_block_cast, contracts.per_block_cast, _BLOCK + _ROUNDING, by_name=True),
                          advances="generator")
PER_BLOCK_CAST_WITH_SF_ONLY = _declare(
    per_block_cast_with_sf_only, "per_block_cast",
    bound_contract(per_block_cast_with_sf_only, contracts.per_block_cast, _BLOCK, mode=QuantMode.SF_ONLY,
                   name="per_block_cast_with_sf_only"))
PER_BLOCK_CAST_WITH_PRECOMPUTED_SF = _declare(
    per_block_cast_with_precomputed_sf, "per_block_cast",
    bound_contract(per_block_cast_with_precomputed_sf, _precomputed_block,
                   ("x", "fmt", "block_size", "x_block_size", "sf")))
PER_CHANNEL_CAST = _declare(
    per_channel_cast, "per_channel_cast",
    bound_contract(per_channel_cast, contracts.per_channel_cast,
                   ("x", "fmt", "num_per_tokens", "round_sf", "num_per_channels", "use_packed_ue8m0")))
CAST_BACK = _declare(cast_back, "cast_back",
                     bound_contract(cast_back, contracts.cast_back, ("x", "fmt", "x_block_size")))
PER_TOKEN_CAST_AND_CAST_BACK = declare(OpDef(
    name="per_token_cast_and_cast_back",
    family="quant",
    function=per_token_cast_and_cast_back,
    contract=bound_contract(per_token_cast_and_cast_back, contracts.per_token_cast_and_cast_back,
                            ("x", "fmt", "num_per_channels", "round_sf", "use_e4m3_sf")),
    outputs=lambda call, traits: IN_PLACE_PLAN,
    result=lambda call, outputs: None,
    ledger=contracts.QuantCall.ledger,
    cases=lambda: [case for case in quant_cases() if case.op == "per_token_cast_and_cast_back"],
    bench=lambda: _bench("per_token_cast_and_cast_back"),
    arguments=lambda *args: quant_arguments("per_token_cast_and_cast_back", *args),
    input_options=INPUT_OPTIONS,
    mutates=("x",),
))
