"""``per_token_cast_and_cast_back`` (docs/spec.md §10.1): fake quant in place, equal byte for byte
to ``cast_back(per_token_cast(x))`` written over ``x``; checked against an independent Python
model of the e4m3 / e2m1 grids on golden rows, and its refusals."""

from __future__ import annotations

import math

import pytest
import torch

from tileplug.core import ContractError, ops, opdefs

BF16, FP32 = torch.bfloat16, torch.float32


def _composition(x: torch.Tensor, fmt: str, group: int, **flags) -> torch.Tensor:
    return ops.cast_back(ops.per_token_cast(x, fmt, group, **flags), "bf16" if x.dtype == BF16 else "fp32",
                         (1, group))


def _round_to_grid(value: float, grid: list[float]) -> float:
    """Round-half-to-even onto a sorted grid of non-negative magnitudes (saturating at its top)."""
    magnitude = min(abs(value), grid[-1])
    for lower, upper in zip(grid, grid[1:]):
        if lower <= magnitude <= upper:
            if magnitude - lower < upper - magnitude:
                chosen = lower
            elif magnitude - lower > upper - magnitude:
                chosen = upper
            else:  # a tie: the grid value with the even code (every other one)
                chosen = lower if grid.index(lower) % 2 == 0 else upper
            return math.copysign(chosen, value)
    return math.copysign(magnitude, value)


E4M3_GRID = sorted({m * 2.0 ** -9 for m in range(8)}
                   | {(1 + k / 8) * 2.0 ** e for e in range(-6, 9) for k in range(8) if (1 + k / 8) * 2.0 ** e <= 448})
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _model_row(values: list[float], fmt: str, group: int, round_sf: bool = False) -> list[float]:
    """The definition on Python floats: per group, amax → scale (plain fp32 ratio, or the power of
    two ≥ it) → quantize onto the format's grid → multiply back (rounded to fp32 per step)."""
    grid, largest = (E4M3_GRID, 448.0) if fmt == "e4m3" else (E2M1_GRID, 6.0)
    clamp = 1e-4 if fmt == "e4m3" else 6 * 2.0 ** -126
    f32 = lambda v: float(torch.tensor(v, dtype=FP32))  # noqa: E731 - one fp32 rounding
    out = []
    for start in range(0, len(values), group):
        chunk = values[start:start + group]
        c = f32(max(max(abs(v) for v in chunk), f32(clamp)))
        if round_sf:
            scale = 2.0 ** math.ceil(math.log2(f32(c * f32(1 / largest))))
            inverse = 1 / scale
        else:
            scale, inverse = f32(c / largest), f32(largest / c)
        out += [f32(_round_to_grid(f32(v * inverse), grid) * scale) for v in chunk]
    return out


@pytest.mark.parametrize("fmt, group, round_sf", [("e4m3", 16, False), ("e4m3", 32, True), ("e2m1", 16, False),
                                                   ("e2m1", 64, True)])
def test_golden_rows_match_an_independent_model(fmt: str, group: int, round_sf: bool) -> None:
    generator = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 4 * group, generator=generator) * torch.tensor([0.01, 1.0, 300.0])[:, None]).to(FP32)
    x[1, 5] = 3 * x[1].abs().max()  # a group with an outlier
    expected = torch.tensor([_model_row(row.tolist(), fmt, group, round_sf) for row in x], dtype=FP32)
    ops.per_token_cast_and_cast_back(x, fmt, group, round_sf=round_sf)
    assert torch.equal(x, expected)


def test_a_hand_computed_group() -> None:
    """1 … 16 in one e4m3 group: amax 16, inv 28; 3 · 28 = 84 lies halfway between 80 and 88, so it
    rounds to the even 80, and comes back as 80 · (16 / 448)."""
    x = torch.arange(1, 17, dtype=FP32)[None].clone()
    ops.per_token_cast_and_cast_back(x, "e4m3", 16)
    scale = float(torch.tensor(16 / 448, dtype=FP32))
    assert x[0, 2].item() == float(torch.tensor(80 * scale, dtype=FP32))
    assert x[0, 15].item() == float(torch.tensor(448 * scale, dtype=FP32))  # the maximum maps to 448


@pytest.mark.parametrize("case", [c for c in opdefs.get("per_token_cast_and_cast_back").cases()],
                         ids=lambda c: c.id)
def test_equals_the_composition_bytewise(case) -> None:
    for tokens in (1, 3, 129):
        args, kwargs = case.arguments(tokens, "cpu")
        x = args[0]
        expected = _composition(x, **{"fmt": "e4m3", "group": 128, **{("group" if k == "num_per_channels" else k): v
                                                                        for k, v in kwargs.items()}})
        base = x._base if x._base is not None else x
        untouched = base[:, x.shape[1]:].clone()
        assert ops.per_token_cast_and_cast_back(x, **kwargs) is None
        assert torch.equal(x.view(torch.int16 if x.dtype == BF16 else torch.int32),
                           expected.view(torch.int16 if x.dtype == BF16 else torch.int32)), case.id
        assert torch.equal(base[:, x.shape[1]:], untouched)  # a padded row's tail keeps its bytes


def test_non_finite_values_follow_the_composition() -> None:
    x = torch.randn(4, 64).to(BF16)
    x[0, 3], x[1, 0], x[2, 63] = float("nan"), float("inf"), -float("inf")
    expected = _composition(x, "e4m3", 32)
    ops.per_token_cast_and_cast_back(x, "e4m3", 32)
    assert torch.equal(torch.isnan(x), torch.isnan(expected))
    assert torch.equal(torch.nan_to_num(x, 0.0).view(torch.int16), torch.nan_to_num(expected, 0.0).view(torch.int16))


def test_under_torch_compile_the_write_reaches_the_caller() -> None:
    x = torch.randn(5, 256).to(BF16)
    expected = _composition(x, "e2m1", 16, use_e4m3_sf=True)
    compiled = torch.compile(lambda t: ops.per_token_cast_and_cast_back(t, "e2m1", 16, use_e4m3_sf=True),
                             fullgraph=True)
    compiled(x)
    assert torch.equal(x.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("make, kwargs, argument, expected", [
    (lambda: (torch.zeros(2, 64, dtype=torch.float8_e4m3fn), torch.ones(2, 1)), {}, "x", "not a quantized pair"),
    (lambda: torch.zeros(64, dtype=BF16), {}, "x", "2-D"),
    (lambda: torch.zeros(2, 64, dtype=torch.float16), {}, "x", "dtype"),
    (lambda: torch.zeros(1, 64, dtype=BF16).expand(4, 64), {}, "x", "do not overlap"),
    (lambda: torch.zeros(2, 33, dtype=BF16), {"fmt": "e2m1", "num_per_channels": 16}, "x", "even hidden size"),
    (lambda: torch.zeros(2, 64, dtype=BF16), {"num_per_channels": 48}, "num_per_channels", "one of"),
    (lambda: torch.zeros(2, 64, dtype=BF16), {"fmt": "e5m2"}, "fmt", "e4m3"),
    (lambda: torch.zeros(2, 64, dtype=BF16), {"round_sf": True, "use_e4m3_sf": True}, "use_e4m3_sf", "round_sf"),
    (lambda: torch.zeros(2, 64, dtype=BF16), {"round_sf": 1}, "round_sf", "bool"),
])
def test_refusals_name_the_argument(make, kwargs, argument, expected) -> None:
    with pytest.raises(ContractError) as raised:
        ops.per_token_cast_and_cast_back(make(), **kwargs)
    message = str(raised.value)
    assert f"argument '{argument}'" in message and expected in message, message
