"""Random numbers (SPEC §9, docs/spec.md "Random numbers"): the draws a backend serves.

``fill_rand(values, seed, offset)`` / ``fill_randn(values, seed, offset)`` write one draw of
the Philox4x32-10 generator whose state is ``(seed, offset)`` into ``values`` (any shape,
contiguous, fp32 / bf16 / fp16; element ``i`` in row-major order is draw element ``i``) and
advance ``offset`` by one, on the device: the kernel reads the offset and writes it back, so
a captured graph draws fresh numbers on every replay. ``seed`` and ``offset`` are int64
``[1]`` tensors on the values' device. An empty ``values`` launches nothing and leaves the
offset as it is (SPEC §0).

Users call :mod:`tileplug.core.random` (``rand``, ``randn``, ``Generator``, ``manual_seed``),
which allocates the values and passes its generator's state tensors here.

In the op table a case is a draw of ``[T, hidden]`` values of the case's dtype; the ``seed``
input option names the generator's seed (default: the case's test seed), the offset starts
at 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.compiler import is_compiling

from tileplug.core.call import IN_PLACE_PLAN
from tileplug.core.contracts import random as contracts
from tileplug.core.generator import SEED_LIMIT, as_int64_word
from tileplug.core.opdefs import BenchCase, Case, OpDef, checked_case_inputs, declare, run



def fill_rand(values: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor) -> None:
    """Uniform draws in ``[0, 1)`` into ``values`` in place, then ``offset += 1``.

    ``values`` contiguous, any shape, fp32 / bf16 / fp16: element ``i`` is
    ``(r_i >> 8) · 2^-24`` (exact in fp32; a 16-bit dtype rounds it once, so 1.0 may occur),
    ``r_i`` word ``i mod 4`` of Philox4x32-10 block ``i // 4`` under key ``seed`` and counter
    ``(block, offset)``. ``seed``, ``offset``: int64 ``[1]`` on the values' device.
    """
    if is_compiling():
        return FILL_RAND.traced(values, seed, offset)
    call, inputs = contracts.fill(contracts.FILL_RAND, values, seed, offset, False)
    run(call, inputs)
    return None


def fill_randn(values: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor) -> None:
    """Standard normal draws into ``values`` in place, then ``offset += 1``.

    As :func:`fill_rand`, with Box–Muller on each block's pairs ``(r0, r1)``, ``(r2, r3)``:
    ``a = ((r_even >> 8) + 1) · 2^-24``, ``t = (r_odd >> 8) · 2^-24``, ``z_even =
    sqrt(−2 ln a) · cos(2πt)``, ``z_odd = sqrt(−2 ln a) · sin(2πt)`` in fp32, rounded once to
    a 16-bit dtype.
    """
    if is_compiling():
        return FILL_RANDN.traced(values, seed, offset)
    call, inputs = contracts.fill(contracts.FILL_RANDN, values, seed, offset, True)
    run(call, inputs)
    return None


# ---------------------------------------------------------------------- declarations

INPUT_OPTIONS: dict[str, str] = {
    "seed": "int in [0, 2^64): the generator's seed (the offset starts at 0)",
}


def random_arguments(op: str, tokens: int, hidden: int, dtype: torch.dtype, kwargs: dict[str, Any],
                     inputs: dict[str, Any], device: torch.device, seed: int) -> tuple[tuple, dict]:
    """``(values [T, hidden] of dtype, seed [1], offset [1] = 0)``; the values start as NaN so
    that an element a kernel leaves unwritten shows."""
    checked_case_inputs(op, inputs, INPUT_OPTIONS, {})
    generator_seed = inputs.get("seed", seed) % SEED_LIMIT
    if device.type == "meta":
        values = torch.empty(tokens, hidden, dtype=dtype, device=device)
    else:
        values = torch.full((tokens, hidden), float("nan"), dtype=dtype, device=device)
    return (values, *generator_state(generator_seed, device)), dict(kwargs)


def generator_state(seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A case's generator: ``(seed [1], offset [1] = 0)`` int64 tensors on ``device``."""
    return (torch.tensor([as_int64_word(seed)], dtype=torch.int64, device=device),
            torch.zeros(1, dtype=torch.int64, device=device))


def compare_random(case: Case, tokens: int, actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """SPEC §9 against the reference: ``fill_rand``'s values bytewise; ``fill_randn``'s within
    2 ulp in fp32 (the transcendentals), within 1 ulp of a 16-bit dtype (the 2 fp32 ulp may
    cross one rounding boundary); the advanced offset bytewise."""
    from tileplug.core.testing import assert_bytes_equal, assert_within_ulps, require

    what = f"{case.id} T={tokens}"
    require(len(actual) == len(expected) == 2, f"{what}: {len(actual)} outputs, expected {len(expected)}")
    (values, offset), (want_values, want_offset) = actual, expected
    if case.op == contracts.FILL_RANDN:
        unwritten = torch.isnan(values.float()).flatten().nonzero()
        require(unwritten.numel() == 0, f"{what} values differ from the reference's: NaN at element "
                f"{unwritten[:1].tolist()} (a draw is never NaN: unwritten or corrupted)")
        ulps = 2 if want_values.dtype == torch.float32 else 1
        assert_within_ulps(values, want_values, ulps, what=f"{what} values", nan_equal=False)
    else:
        assert_bytes_equal(values, want_values, what=f"{what} values")
    assert_bytes_equal(offset, want_offset, what=f"{what} offset")


_FP32, _BF16, _FP16 = torch.float32, torch.bfloat16, torch.float16


def random_cases() -> list[Case]:
    """Each draw at widths whose element counts leave a partial last block (7, 1001) and at
    576; every dtype; seeds with both key words set (and all 64 bits: 2^64 − 1)."""
    cases = []
    for op in (contracts.FILL_RAND, contracts.FILL_RANDN):
        cases += [
            Case.of(op, 7, _FP32),
            Case.of(op, 576, _BF16, inputs={"seed": 2**64 - 1}),
            Case.of(op, 1001, _FP16, inputs={"seed": 0x243F6A8885A308D3}),
            Case.of(op, 576, _FP32, inputs={"seed": 0xA4093822299F31D0}),
        ]
    return cases


def _bench(name: str) -> list[BenchCase]:
    """What ``tileplug bench`` times: one draw of ``[tokens, hidden]`` (dtype from ``--dtype``)."""
    return [BenchCase.of(name, name)]


def _contract(op: str, normal: bool) -> Any:
    def contract(values: Any, seed: Any, offset: Any) -> Any:
        return contracts.fill(op, values, seed, offset, normal)

    return contract


def _declare(function: Any, normal: bool) -> OpDef:
    name = function.__name__
    return declare(OpDef(
        name=name, family="random", function=function, contract=_contract(name, normal),
        outputs=lambda call, traits: IN_PLACE_PLAN, result=lambda call, outputs: None,
        ledger=lambda call, traits: call.ledger(traits),
        cases=lambda: [case for case in random_cases() if case.op == name],
        bench=lambda: _bench(name),
        arguments=lambda *args: random_arguments(name, *args),
        compare=compare_random, input_options=INPUT_OPTIONS, mutates=("values", "offset"),
    ))


FILL_RAND = _declare(fill_rand, normal=False)
FILL_RANDN = _declare(fill_randn, normal=True)
