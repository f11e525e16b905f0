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
from tileplug.core.quant.formats import saturate_e4m3

TARGET_NAMES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}


def stochastic_cast(result: torch.Tensor, x: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor) -> None:
    """``result = x`` narrowed with stochastic rounding, in place, then ``offset += 1``.

    ``x``: contiguous fp32 (to bf16 or e4m3 ``result``) or bf16 (to e4m3), any shape; ``result``:
    contiguous, x's shape. Element ``i`` (row-major) of ``a = |x|`` (``min(a, 448)`` for e4m3)
    between the neighbouring targets ``lo ≤ a < hi`` becomes ``hi`` iff
    ``floor((a − lo) / (hi − lo) · 2^24) + (word_i >> 8) ≥ 2^24``, with ``word_i`` word ``i``
    of the Philox draw under ``(seed, offset)``; the sign is kept, NaN stays NaN.
    """
    if is_compiling():
        return STOCHASTIC_CAST.traced(result, x, seed, offset)
    call, inputs = contracts.stochastic_cast(result, x, seed, offset)
    run(call, inputs)
    return None


def cast(x: torch.Tensor, dtype: torch.dtype, stochastic_rounding: bool = False, generator: Any = None
         ) -> torch.Tensor:
    """``x`` converted to ``dtype`` → a fresh contiguous tensor of x's shape.

    Deterministic (``stochastic_rounding=False``): any pair of fp32 / bf16 / float8_e4m3fn,
    round to nearest even, e4m3 saturating at ±448 (NaN stays NaN). Stochastic: fp32 → bf16,
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
        return _nearest(x, dtype)
    if dtype not in contracts.STOCHASTIC_TARGETS.get(x.dtype, ()):
        raise ContractError("cast", "dtype", "a stochastic narrowing: float32 → bfloat16 or float8_e4m3fn, "
                            "bfloat16 → float8_e4m3fn", f"{x.dtype} → {dtype}")
    from tileplug.core.random import generator_of_draw

    generator = generator_of_draw("cast", generator, x.device)
    result = torch.empty(x.shape, dtype=dtype, device=x.device)
    stochastic_cast(result, x if x.is_contiguous() else x.contiguous(), generator.seed_state, generator.offset_state)
    return result


def _nearest(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round to nearest even; an e4m3 target saturates first (torch's conversion would give
    NaN past 448). Widening and identity casts are exact."""
    if dtype == torch.float8_e4m3fn and x.dtype != dtype:
        return saturate_e4m3(x).contiguous()
    return x.to(dtype, memory_format=torch.contiguous_format, copy=True)  # fresh even for an identity cast


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
