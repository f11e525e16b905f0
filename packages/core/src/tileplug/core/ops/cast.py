"""Element-wise casts (docs/spec.md §10.2): ``cast`` (deterministic or stochastic rounding)
and the op-table op behind its stochastic form, ``stochastic_cast``.

Shapes: any; ``x`` and the result have one shape. ``stochastic_cast(result, x, seed, offset)``
writes ``result`` in place from contiguous ``x`` with the words of one Philox draw under the
generator state ``(seed, offset)`` (int64 ``[1]`` tensors on x's device) and advances
``offset`` by one on the device (a captured graph rounds with fresh bits on every replay).
Users call :func:`cast`, which allocates ``result`` and passes its generator's state tensors.

In the op table a case is ``x [T, hidden]`` of the case's dtype narrowed to the ``target``
input option (``"bf16"`` or ``"e4m3"``); the ``seed`` option names the generator's seed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.compiler import is_compiling

from tileplug.core.call import IN_PLACE_PLAN
from tileplug.core.contracts import cast as contracts
from tileplug.core.contracts.checks import describe
from tileplug.core.errors import ContractError
from tileplug.core.opdefs import BenchCase, Case, OpDef, checked_case_inputs, declare, run
from tileplug.core.ops.random import SEED_LIMIT, generator_state

TARGET_NAMES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}


def stochastic_cast(result: torch.Tensor, x: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor) -> None:
    """``result = x`` narrowed with stochastic rounding, in place, then ``offset += 1``.

    ``x``: contiguous fp32 (to bf16 or e4m3 ``result``) or bf16 (to e4m3), any shape; ``result``:
    contiguous, x's shape. Element ``i`` (row-major) of ``a = |x|`` (``min(a, 448)`` for e4m3)
    between the neighbouring targets ``lo ≤ a < hi`` becomes ``hi`` iff
    ``floor((a − lo) / (hi − lo) · 2^w) + f_i ≥ 2^w``, with ``f_i`` element ``i``'s ``w``-bit
    field of the Philox draw under ``(seed, offset)``: ``w`` = 16 (fp32 → bf16 and fp32 →
    e4m3), 8 (bf16 → e4m3), field ``i mod k`` of word ``i // k``, ``k = 32 // w``, the first at
    the word's top (``contracts.cast.RANDOM_FIELD_BITS``); the sign is kept, NaN stays NaN.
    """
    if is_compiling():
        return STOCHASTIC_CAST.traced(result, x, seed, offset)
    call, inputs = contracts.stochastic_cast(result, x, seed, offset)
    run(call, inputs)
    return None


def nearest_cast(result: torch.Tensor, x: torch.Tensor) -> None:
    """``result = x`` converted with round to nearest even, in place.

    ``x`` and ``result``: contiguous, one shape, each fp32, bf16 or float8_e4m3fn (any pair).
    An e4m3 result saturates at ±448 (an infinity too; only NaN gives NaN); widening and
    identity conversions are exact.
    """
    if is_compiling():
        return NEAREST_CAST.traced(result, x)
    call, inputs = contracts.nearest_cast(result, x)
    run(call, inputs)
    return None


def cast(x: torch.Tensor, dtype: torch.dtype, stochastic_rounding: bool = False, generator: Any = None
         ) -> torch.Tensor:
    """``x`` converted to ``dtype`` → a fresh contiguous tensor of x's shape.

    Deterministic (``stochastic_rounding=False``): any pair of fp32 / bf16 / float8_e4m3fn,
    round to nearest even, e4m3 saturating at ±448 (NaN stays NaN), through the op
    :func:`nearest_cast`. Stochastic: fp32 → bf16,
    fp32 → e4m3, bf16 → e4m3 as :func:`stochastic_cast` defines, with the bits of
    ``generator`` (a :class:`tileplug.core.random.Generator` on x's device; None: the device's
    default generator), whose offset advances by one (not for an empty ``x``). A
    non-contiguous ``x`` is read through a contiguous copy.
    """
    if not isinstance(x, torch.Tensor):
        raise ContractError("cast", "x", "a torch.Tensor", describe(x))
    if dtype not in contracts.CAST_DTYPES:
        raise ContractError("cast", "dtype", contracts.CAST_DTYPE_NAMES, describe(dtype))
    if x.dtype not in contracts.CAST_DTYPES:
        raise ContractError("cast", "x", f"dtype {contracts.CAST_DTYPE_NAMES}", describe(x))
    if stochastic_rounding.__class__ is not bool:
        raise ContractError("cast", "stochastic_rounding", "a bool", describe(stochastic_rounding))
    if not stochastic_rounding:
        if generator is not None:
            raise ContractError("cast", "generator", "None (deterministic rounding draws no bits)",
                                describe(generator))
        result = torch.empty(x.shape, dtype=dtype, device=x.device)
        nearest_cast(result, x if x.is_contiguous() else x.contiguous())
        return result
    if dtype not in contracts.STOCHASTIC_TARGETS.get(x.dtype, ()):
        raise ContractError("cast", "dtype", "a stochastic narrowing: float32 → bfloat16 or float8_e4m3fn, "
                            "bfloat16 → float8_e4m3fn", f"{x.dtype} → {dtype}")
    from tileplug.core.random import generator_of_draw

    generator = generator_of_draw("cast", generator, x.device, "x")
    result = torch.empty(x.shape, dtype=dtype, device=x.device)
    stochastic_cast(result, x if x.is_contiguous() else x.contiguous(), generator.seed_state, generator.offset_state)
    return result


# ---------------------------------------------------------------------- declaration

INPUT_OPTIONS: dict[str, str] = {
    "target": "'bf16' or 'e4m3': the dtype x narrows to (bf16: from an fp32 x, whatever the case's dtype)",
    "seed": "int in [0, 2^64): the generator's seed (the offset starts at 0)",
}
INPUT_CHOICES: dict[str, tuple] = {"target": tuple(TARGET_NAMES)}


def cast_arguments(tokens: int, hidden: int, dtype: torch.dtype, kwargs: dict[str, Any], inputs: dict[str, Any],
                   device: torch.device, seed: int) -> tuple[tuple, dict]:
    """``(result [T, hidden] of the target dtype, x = activation [T, hidden] of dtype (fp32 for
    a bf16 target), seed [1], offset [1] = 0)``; on the CPU ``result`` starts as NaN bytes so an unwritten element shows."""
    from tileplug.core.testing import activation

    checked_case_inputs(contracts.STOCHASTIC_CAST, inputs, INPUT_OPTIONS, INPUT_CHOICES)
    target = TARGET_NAMES[inputs.get("target", "e4m3")]
    if target == torch.bfloat16:
        dtype = torch.float32  # the one narrowing to bf16
    generator_seed = inputs.get("seed", seed) % SEED_LIMIT
    if device.type == "meta":
        x = torch.empty(tokens, hidden, dtype=dtype, device=device)
        result = torch.empty(tokens, hidden, dtype=target, device=device)
    else:
        x = activation(tokens, hidden, dtype, device, seed)
        result = torch.full((tokens, hidden), float("nan"), device=device).to(target)
    return (result, x, *generator_state(generator_seed, device)), dict(kwargs)


def cast_cases() -> list[Case]:
    """Each pair, at widths whose element counts leave a partial Philox block (7, 1001) and at
    576, 7168; seeds with both key words set."""
    op = contracts.STOCHASTIC_CAST
    fp32, bf16 = torch.float32, torch.bfloat16
    return [
        Case.of(op, 7, fp32, inputs={"target": "bf16"}),
        Case.of(op, 576, fp32, inputs={"target": "bf16", "seed": 2**64 - 1}),
        Case.of(op, 1001, fp32, inputs={"target": "e4m3", "seed": 0x243F6A8885A308D3}),
        Case.of(op, 7168, fp32, inputs={"target": "e4m3"}),
        Case.of(op, 576, bf16, inputs={"target": "e4m3", "seed": 0xA4093822299F31D0}),
        Case.of(op, 7168, bf16, inputs={"target": "e4m3"}),
    ]


def compare_cast(case: Case, tokens: int, actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """docs/spec.md §10.2: ``result`` bytewise (any NaN equals any NaN: a NaN's sign and
    payload are unspecified) and the advanced offset bytewise."""
    from tileplug.core.testing import assert_bytes_equal, require

    what = f"{case.id} T={tokens}"
    require(len(actual) == len(expected) == 2, f"{what}: {len(actual)} outputs, expected {len(expected)}")
    (result, offset), (want_result, want_offset) = actual, expected
    assert_bytes_equal(result, want_result, what=f"{what} result", nan_equal=True)
    assert_bytes_equal(offset, want_offset, what=f"{what} offset")


def _contract(result: Any, x: Any, seed: Any, offset: Any) -> Any:
    return contracts.stochastic_cast(result, x, seed, offset)


STOCHASTIC_CAST = declare(OpDef(
    name=contracts.STOCHASTIC_CAST, family="quant", function=stochastic_cast, contract=_contract,
    outputs=lambda call, traits: IN_PLACE_PLAN, result=lambda call, outputs: None,
    ledger=lambda call, traits: call.ledger(traits),
    cases=cast_cases,
    bench=lambda: [BenchCase.of(f"stochastic_cast/{target}", contracts.STOCHASTIC_CAST, inputs={"target": target})
                   for target in TARGET_NAMES],
    arguments=cast_arguments,
    compare=compare_cast, input_options=INPUT_OPTIONS, mutates=("result", "offset"),
))


NEAREST_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}
NEAREST_OPTIONS: dict[str, str] = {
    "target": "'fp32', 'bf16' or 'e4m3': the dtype x converts to",
    "source": "'e4m3': x is the activation saturated to e4m3 (default: the case's dtype)",
}
NEAREST_CHOICES: dict[str, tuple] = {"target": tuple(NEAREST_NAMES), "source": ("e4m3",)}


def nearest_arguments(tokens: int, hidden: int, dtype: torch.dtype, kwargs: dict[str, Any], inputs: dict[str, Any],
                      device: torch.device, seed: int) -> tuple[tuple, dict]:
    """``(result [T, hidden] of the target dtype, x [T, hidden])``: x the activation of the case's
    dtype (or saturated to e4m3 for ``source='e4m3'``) with every special value in its first
    row; on the CPU ``result`` starts as NaN bytes so an unwritten element shows."""
    from tileplug.core.quant.formats import saturate_e4m3
    from tileplug.core.testing import activation

    checked_case_inputs(contracts.NEAREST_CAST, inputs, NEAREST_OPTIONS, NEAREST_CHOICES)
    target = NEAREST_NAMES[inputs.get("target", "e4m3")]
    source = torch.float8_e4m3fn if inputs.get("source") == "e4m3" else dtype
    if device.type == "meta":
        return (torch.empty(tokens, hidden, dtype=target, device=device),
                torch.empty(tokens, hidden, dtype=source, device=device)), dict(kwargs)
    x = activation(tokens, hidden, torch.float32, device, seed)
    if tokens:
        specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 448.0, 464.0, -1e6, 2.0**-10,
                                 1e-45, 3.3895314e38, 1.0 + 2.0**-8], device=device)
        x[0, :min(hidden, specials.numel())] = specials[:hidden]
    x = saturate_e4m3(x) if source == torch.float8_e4m3fn else x.to(source)
    result = torch.full((tokens, hidden), float("nan"), device=device).to(target)
    return (result, x), dict(kwargs)


def nearest_cases() -> list[Case]:
    """Every pair of fp32 / bf16 / e4m3, at widths whose element counts end inside a thread's
    run (7, 1001) and at 576 and 7168."""
    op, fp32, bf16 = contracts.NEAREST_CAST, torch.float32, torch.bfloat16
    cases = []
    for source, dtype in (("fp32", fp32), ("bf16", bf16), ("e4m3", bf16)):
        for target, hidden in (("fp32", 576), ("bf16", 1001), ("e4m3", 7), ("e4m3", 7168)):
            inputs = {"target": target, **({"source": "e4m3"} if source == "e4m3" else {})}
            cases.append(Case.of(op, hidden, dtype, inputs=inputs))
    return cases


def compare_nearest(case: Case, tokens: int, actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """docs/spec.md §10.2: ``result`` bytewise (any NaN equals any NaN)."""
    from tileplug.core.testing import assert_bytes_equal, require

    require(len(actual) == len(expected) == 1, f"{case.id}: {len(actual)} outputs, expected {len(expected)}")
    assert_bytes_equal(actual[0], expected[0], what=f"{case.id} T={tokens} result", nan_equal=True)


NEAREST_CAST = declare(OpDef(
    name=contracts.NEAREST_CAST, family="quant", function=nearest_cast,
    contract=lambda result, x: contracts.nearest_cast(result, x),
    outputs=lambda call, traits: IN_PLACE_PLAN, result=lambda call, outputs: None,
    ledger=lambda call, traits: call.ledger(traits),
    cases=nearest_cases,
    bench=lambda: [BenchCase.of("nearest_cast/e4m3", contracts.NEAREST_CAST, inputs={"target": "e4m3"}),
                   BenchCase.of("nearest_cast/bf16", contracts.NEAREST_CAST, inputs={"target": "bf16"})],
    arguments=nearest_arguments,
    compare=compare_nearest, input_options=NEAREST_OPTIONS, mutates=("result",),
))
