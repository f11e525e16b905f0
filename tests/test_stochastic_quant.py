"""``stochastic_rounding=True`` on ``per_token_cast`` / ``per_block_cast`` on the reference
(docs/spec.md §10.2): the narrowing of ``x · inv`` against an independent model (SPEC §2's
plain scale computed here, tests/test_stochastic_cast.py's pure-Python Philox and exact
rounding rule, e2m1's table of its own), the scales untouched by the rounding, unbiasedness of
the quantized values, the generator's offset, ``torch.compile``, and the refusals."""

from __future__ import annotations

import bisect
import math
from fractions import Fraction

import pytest
import torch

from tileplug import core
from tileplug.core import ContractError
from tileplug.core.ops import per_block_cast, per_token_cast
from tileplug.core.quant import formats
from tileplug.core.random import Generator
from test_stochastic_cast import E4M3_VALUES, _model_fields

E2M1_VALUES = [Fraction(v) for v in (0, 1, 2, 3, 4, 6, 8, 12)]
E2M1_VALUES = [v / 2 for v in E2M1_VALUES]  # 0, 0.5, 1, 1.5, 2, 3, 4, 6
LARGEST = {"e4m3": Fraction(448), "e2m1": Fraction(6)}
TABLES = {"e4m3": E4M3_VALUES, "e2m1": E2M1_VALUES}


FIELD_BITS = 8
"""The random bits an element of a stochastic per-token / per-block cast takes (the spec's ``w``,
written out here): four fields a word, the first at its top."""


def _model_narrowing(value: float, field: int, fmt: str) -> float:
    """The spec's rule on exact fractions onto ``fmt``'s grid (saturating at its largest value):
    ``hi`` iff ``floor(p · 2^w) + f ≥ 2^w``."""
    table = TABLES[fmt]
    sign = -1.0 if math.copysign(1.0, value) < 0 else 1.0
    magnitude = min(Fraction(abs(value)), LARGEST[fmt])
    index = bisect.bisect_right(table, magnitude) - 1
    low = table[index]
    if index + 1 == len(table):
        return sign * float(low)
    high = table[index + 1]
    if math.floor((magnitude - low) / (high - low) * 2**FIELD_BITS) + field >= 2**FIELD_BITS:
        return sign * float(high)
    return sign * float(low)


def _plain_values(x: torch.Tensor, block: tuple[int, int], fmt: str) -> torch.Tensor:
    """``x · inv`` of SPEC §2's plain scales, computed here: ``inv = max / max(amax, 1e-4)`` in
    fp32 per ``block`` group, one fp32 product per element."""
    tokens, hidden = x.shape
    values = x.float()
    inverse = torch.empty_like(values)
    for row in range(0, tokens, block[0]):
        for col in range(0, hidden, block[1]):
            group = values[row:row + block[0], col:col + block[1]]
            amax = torch.maximum(group.abs().max(), torch.tensor(1e-4))
            inverse[row:row + block[0], col:col + block[1]] = torch.tensor(float(LARGEST[fmt])) / amax
    return values * inverse


def _decoded(q: torch.Tensor, fmt: str) -> list[float]:
    return formats.decode(q, formats.QUANT_FORMATS[fmt]).flatten().tolist()


CASES = [
    (per_token_cast, {"fmt": "e4m3", "num_per_channels": 128}, (1, 128)),
    (per_token_cast, {"fmt": "e2m1", "num_per_channels": 16}, (1, 16)),
    (per_block_cast, {"fmt": "e4m3", "block_size": (128, 128)}, (128, 128)),
    (per_block_cast, {"fmt": "e2m1", "block_size": (32, 16)}, (32, 16)),
]
CASE_IDS = ["per_token-e4m3", "per_token-e2m1", "per_block-e4m3", "per_block-e2m1"]


@pytest.mark.parametrize("op, kwargs, block", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("seed", [0, 2**64 - 1])
def test_equals_an_independent_model(op, kwargs, block, seed) -> None:
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(seed % 97)) * 3
    x[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 5.0, -5.0, 1e-3, 2.0])
    generator = Generator("cpu", seed)
    generator.offset = 3
    q, sf = op(x, stochastic_rounding=True, generator=generator, **kwargs)
    assert generator.offset == 4
    deterministic_q, deterministic_sf = op(x, **kwargs)
    assert torch.equal(sf, deterministic_sf), "the rounding never changes the scales"
    fmt = kwargs["fmt"]
    values = _plain_values(x, block, fmt).flatten().tolist()
    bits = _model_fields(seed, 3, len(values), FIELD_BITS)
    got = _decoded(q, fmt)
    for index, (have, value, r) in enumerate(zip(got, values, bits)):
        want = _model_narrowing(value, r, fmt)
        assert have == want and math.copysign(1, have) == math.copysign(1, want), (
            f"element {index} (x·inv = {value!r}, f = {r}): {have} != {want}")
    assert not torch.equal(q.view(torch.uint8), deterministic_q.view(torch.uint8))


@pytest.mark.parametrize("fmt, group, constant", [("e4m3", 128, 0.7), ("e2m1", 16, 0.7)])
def test_quantized_values_are_unbiased(fmt, group, constant) -> None:
    """A row of ``group`` values whose largest is 1: ``inv`` maps ``constant`` strictly between
    two grid values, and the mean over 10^5 of them equals ``constant · inv`` within 5 σ."""
    rows = 100_000 // group
    x = torch.full((rows, group), constant)
    x[:, 0] = 1.0
    q, _ = per_token_cast(x, fmt=fmt, num_per_channels=group, stochastic_rounding=True,
                          generator=Generator("cpu", 77))
    decoded = formats.decode(q, formats.QUANT_FORMATS[fmt]).double()[:, 1:]
    exact = float(torch.tensor(constant) * (torch.tensor(float(LARGEST[fmt])) / torch.tensor(1.0)))
    low, high = decoded.min().item(), decoded.max().item()
    assert set(decoded.unique().tolist()) == {low, high} and low < exact < high
    share = (exact - low) / (high - low)
    sigma = (high - low) * math.sqrt(share * (1 - share) / decoded.numel())
    assert abs(decoded.mean().item() - exact) <= 5 * sigma


def test_the_offset_advances_and_the_default_generator_serves() -> None:
    x = torch.randn(8, 256)
    generator = Generator("cpu", 5)
    first, _ = per_token_cast(x, stochastic_rounding=True, generator=generator)
    second, _ = per_token_cast(x, stochastic_rounding=True, generator=generator)
    assert generator.offset == 2 and not torch.equal(first.view(torch.uint8), second.view(torch.uint8))
    generator.manual_seed(5)
    again, _ = per_token_cast(x, stochastic_rounding=True, generator=generator)
    assert torch.equal(again.view(torch.uint8), first.view(torch.uint8))
    per_block_cast(torch.empty(0, 256), stochastic_rounding=True, generator=generator)
    assert generator.offset == 1, "an empty x draws nothing"
    default = core.random.default_generator("cpu")
    before = default.offset
    per_block_cast(x, stochastic_rounding=True)
    assert default.offset == before + 1


def test_the_conformance_suite_sees_the_advanced_offset() -> None:
    """A stochastic cast produces ``(q, sf, offset)``: the conformance suite compares the generator's
    offset after the call with the reference's, so a backend that leaves it where it was (or advances
    it twice) fails, while one that advances it once, as the reference does, passes."""
    from tileplug.core import opdefs
    from tileplug.reference.conformance import check_case

    case = next(c for c in core.ops.quant.stochastic_cases() if c.op == "per_token_cast")
    check_case(case, 5, "reference", "cpu")
    opdef = opdefs.get("per_token_cast")
    x, generator = torch.randn(4, case.hidden), Generator("cpu", 3)
    produced = opdef.produced(per_token_cast(x, stochastic_rounding=True, generator=generator), x,
                              stochastic_rounding=True, generator=generator)
    assert len(produced) == 3 and produced[2] is generator.offset_state and generator.offset == 1
    assert len(opdef.produced(per_token_cast(x), x)) == 2, "no generator: (q, sf) only"
    for stale in (0, 2):
        with pytest.raises(AssertionError, match="output 2"):
            opdef.compare(case, 4, [*produced[:2], torch.tensor([stale])], produced)


def test_the_custom_ops_mark_the_generators_offset_mutated() -> None:
    """``advances="generator"``: the schema carries the generator as its two state tensors, the offset
    written (``Tensor(a!)?``), so ``torch.compile`` functionalizes the backend's advance; a parameter
    that is not a generator cannot be declared advanced."""
    from tileplug.core import opdefs

    for name in ("per_token_cast", "per_block_cast"):
        assert opdefs.get(name).schema.endswith(
            "bool stochastic_rounding, Tensor? generator_seed, Tensor(a!)? generator_offset) -> (Tensor, Tensor)")
    with pytest.raises(TypeError, match="advanced parameter 'x': not a Generator parameter"):
        opdefs._advanced_schema([("x", [("x", "Tensor")], None)], "x", 0)


def test_a_quantized_input_and_out_take_the_same_bits() -> None:
    x = torch.randn(5, 512)
    pair = per_token_cast(x, num_per_channels=32)
    fresh, fresh_sf = per_token_cast(pair, x_block_size=(1, 32), stochastic_rounding=True,
                                     generator=Generator("cpu", 8))
    out = (torch.empty_like(fresh), torch.empty_like(fresh_sf))
    per_token_cast(pair, x_block_size=(1, 32), stochastic_rounding=True, generator=Generator("cpu", 8), out=out)
    assert torch.equal(out[0].view(torch.uint8), fresh.view(torch.uint8)) and torch.equal(out[1], fresh_sf)


def test_compiled_equals_eager() -> None:
    x = torch.randn(16, 256)
    eager, eager_sf = per_token_cast(x, stochastic_rounding=True, generator=Generator("cpu", 21))
    generator = Generator("cpu", 21)
    compiled = torch.compile(lambda value: per_token_cast(value, stochastic_rounding=True, generator=generator),
                             fullgraph=True)
    q, sf = compiled(x)
    assert torch.equal(q.view(torch.uint8), eager.view(torch.uint8)) and torch.equal(sf, eager_sf)
    assert generator.offset == 1


REFUSALS = [
    (per_token_cast, {"stochastic_rounding": 1}, "stochastic_rounding"),
    (per_token_cast, {"generator": Generator("cpu")}, "generator"),
    (per_token_cast, {"stochastic_rounding": True, "generator": object()}, "generator"),
    (per_token_cast, {"stochastic_rounding": True, "generator": Generator("meta")}, "generator"),
    (per_block_cast, {"stochastic_rounding": "yes"}, "stochastic_rounding"),
    (per_block_cast, {"stochastic_rounding": False, "generator": Generator("cpu")}, "generator"),
    (per_block_cast, {"stochastic_rounding": True, "generator": 7}, "generator"),
]


@pytest.mark.parametrize("op, kwargs, argument", REFUSALS, ids=[f"{i}-{a}" for i, (_, _, a) in enumerate(REFUSALS)])
def test_refusals_name_the_argument(op, kwargs, argument) -> None:
    with pytest.raises(ContractError) as raised:
        op(torch.randn(2, 128), **kwargs)
    assert raised.value.op == op.__name__ and raised.value.argument == argument, str(raised.value)


def test_the_contract_keeps_each_calls_token_count_and_device() -> None:
    """The stochastic call is remembered per deterministic call with its token count and device
    (fields its equality leaves out): a second signature's rows never take the first one's."""
    from tileplug.core import opdefs

    contract = opdefs.get("per_token_cast").contract
    generator = Generator("cpu", 3)
    calls = {}
    for tokens in (2, 5, 2):
        x = torch.randn(tokens, 256)
        call, inputs = contract(x, "e4m3", 128, stochastic_rounding=True, generator=generator)
        assert call.tokens == tokens and call.device == x.device and call.cast.stochastic
        assert inputs.seed is generator.seed_state and inputs.offset is generator.offset_state
        calls.setdefault(tokens, call)
        assert call is calls[tokens]  # the same object once seen
    deterministic, _ = contract(torch.randn(2, 256), "e4m3", 128)
    assert not deterministic.cast.stochastic and deterministic.tokens == 2
