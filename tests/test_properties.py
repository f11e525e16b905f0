"""Property tests of the quant ops (SPEC.md §0-3) with hypothesis.

Random T (0..40), H (1..300), input dtype (valid and invalid), input strides (row slices of
wider tensors, transposes, stride-0 expanded rows, column steps), op, mode and flags (valid and
invalid combinations). Every call either

- returns a correct result: the shapes, dtypes and strides SPEC promises, the same bytes as the
  same op on a ``.contiguous()`` copy of the input (and, for quantized pairs, on a row-major copy
  of its sf), and a ``cast_back`` within a sane error of the input; or
- raises ``core.ContractError`` naming one of the op's own parameters,

and never any other exception. For plain tensor inputs the test also predicts, from the SPEC
rules, whether the call is valid, and checks that exactly the invalid calls are rejected.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tileplug import core

from spec_helpers import PACK, align, ceil_div, raw  # tests/: SPEC-derived layout math

OPS = core.ops
SETTINGS = settings(
    # 60 per test in the suite; raise it for a longer hunt: TILEPLUG_HYPOTHESIS_EXAMPLES=2000
    max_examples=int(os.environ.get("TILEPLUG_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.int8, torch.float8_e4m3fn, torch.int32, torch.float64]
FLOAT_DTYPES = (torch.bfloat16, torch.float32)
STRIDE_KINDS = ["contiguous", "row_slice", "transposed", "expanded", "overlapping", "column_step"]
# a flag is a bool most of the time, occasionally something that is not a bool
FLAG = st.sampled_from([False, True, False, True, False, True, 0, 1, None])
SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0]


@pytest.fixture(autouse=True)
def _reference_backend():
    with core.use_backend("reference"):
        yield


# ---------------------------------------------------------------------- small SPEC helpers


def is_bool(value: Any) -> bool:
    return value is True or value is False


def group_bytes(sf: torch.Tensor, block: tuple[int, int], tokens: int, hidden: int) -> torch.Tensor:
    """Bytes of ``sf`` holding groups [rows, cols, itemsize] (packing pad bytes dropped)."""
    bm, bn = block
    rows, cols = ceil_div(tokens, bm), ceil_div(hidden, bn)
    data = raw(sf)
    if sf.dtype in (torch.int32, torch.int16):
        factor = sf.element_size()
        if bn != 1:
            return data[:, :cols].reshape(rows, cols, 1)
        per_int = data.reshape(sf.shape[0], cols, factor).permute(0, 2, 1).reshape(sf.shape[0] * factor, cols)
        return per_int[:rows].reshape(rows, cols, 1)
    return data.reshape(rows, cols, sf.element_size())


def expected_sf_layout(block, tokens, hidden, packed, e4m3_sf, col_major, layout):
    bm, bn = block
    rows, cols = ceil_div(tokens, bm), ceil_div(hidden, bn)
    if packed:
        factor, dtype = PACK[layout]
        shape = (rows, ceil_div(cols, factor)) if bn != 1 else (ceil_div(rows, factor), cols)
    else:
        dtype = torch.float8_e4m3fn if e4m3_sf else torch.float32
        shape = (rows, cols)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not col_major:
        stride = (shape[1], 1)
    elif layout == "cuda":
        stride = (1, align(shape[0], 16 // itemsize))
    else:
        stride = (1, shape[0])
    return shape, dtype, stride


def make_values(tokens: int, hidden: int, seed: int, scale: float, specials: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(tokens, hidden, generator=generator) * scale
    if tokens * hidden and specials:
        index = torch.randint(0, tokens * hidden, (specials,), generator=generator)
        pick = torch.randint(0, len(SPECIALS), (specials,), generator=generator)
        values.view(-1)[index] = torch.tensor(SPECIALS)[pick]
    return values


def make_input(values: torch.Tensor, dtype: torch.dtype, stride_kind: str) -> torch.Tensor:
    """``values`` [T, H] as ``dtype`` stored with the requested stride pattern."""
    tokens, hidden = values.shape
    if dtype in (torch.int8, torch.int32):
        values = values.nan_to_num(0.0, 0.0, 0.0).clamp(-100, 100)
    if dtype == torch.float8_e4m3fn:
        values = values.clamp(-448, 448)
    if stride_kind == "row_slice":
        big = torch.full((tokens, hidden + 37), 3e4, dtype=torch.float32)
        big[:, :hidden] = values
        return big.to(dtype)[:, :hidden]
    if stride_kind == "transposed":
        return values.t().contiguous().to(dtype).t()
    if stride_kind == "expanded":
        return values[:1].to(dtype).expand(tokens, hidden) if tokens else values.to(dtype)
    if stride_kind == "overlapping":  # rows that share memory: row stride < H (any row stride is allowed)
        step = max(1, hidden // 3)
        base = torch.randn(max(tokens - 1, 0) * step + hidden, generator=torch.Generator().manual_seed(tokens + hidden))
        return base.to(dtype).as_strided((tokens, hidden), (step, 1))
    if stride_kind == "column_step":
        big = torch.zeros(tokens, 2 * hidden, dtype=torch.float32)
        big[:, ::2] = values
        return big.to(dtype)[:, ::2]
    return values.to(dtype)


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    a, r = actual.double(), reference.double()
    denominator = r.norm().item()
    return (a - r).norm().item() / denominator if denominator else (a - r).norm().item()


# ---------------------------------------------------------------------- a random call


@dataclass
class Call:
    op: str  # per_token / per_block / per_channel
    mode: str  # cast / sf_only / precomputed
    fmt: Any
    group: Any  # num_per_channels / block_size / num_per_tokens
    round_sf: Any
    packed: Any
    e4m3_sf: Any
    col_major: Any
    layout: str

    @property
    def block(self) -> tuple[int, int]:
        if self.op == "per_token":
            return (1, self.group)
        if self.op == "per_block":
            return tuple(self.group)
        return (self.group, 1)

    def function(self):
        name = self.op + "_cast" + {"cast": "", "sf_only": "_with_sf_only", "precomputed": "_with_precomputed_sf"}[self.mode]
        return getattr(OPS, name)

    def run(self, x, sf=None, x_block_size=None):
        if self.op == "per_token":
            if self.mode == "precomputed":
                return OPS.per_token_cast_with_precomputed_sf(x, self.fmt, self.group, sf=sf, x_block_size=x_block_size)
            return self.function()(
                x, self.fmt, self.group, x_block_size=x_block_size, use_tma_aligned_col_major_sf=self.col_major,
                round_sf=self.round_sf, use_packed_ue8m0=self.packed, use_e4m3_sf=self.e4m3_sf,
            )
        if self.op == "per_block":
            if self.mode == "precomputed":
                return OPS.per_block_cast_with_precomputed_sf(x, self.fmt, self.group, sf=sf, x_block_size=x_block_size)
            return self.function()(
                x, self.fmt, self.group, use_tma_aligned_col_major_sf=self.col_major, round_sf=self.round_sf,
                use_packed_ue8m0=self.packed, x_block_size=x_block_size,
            )
        return OPS.per_channel_cast(
            x, self.fmt, self.group, round_sf=self.round_sf, num_per_channels=x_block_size,
            use_packed_ue8m0=self.packed,
        )

    # what the SPEC says about the flags alone
    def flags_valid(self) -> bool:
        if self.fmt not in ("e4m3", "e2m1"):
            return False
        if self.op == "per_token" and not (type(self.group) is int and self.group in (16, 32, 64, 128)):
            return False
        if self.op == "per_block" and not (
            isinstance(self.group, tuple) and all(type(s) is int and s in (16, 32, 64, 128) for s in self.group)
        ):
            return False
        if self.op == "per_channel" and not (type(self.group) is int and self.group in (32, 128)):
            return False
        if self.mode == "precomputed":
            return True
        flags = [self.round_sf, self.packed] + ([self.e4m3_sf] if self.op == "per_token" else [])
        flags += [self.col_major] if self.op != "per_channel" else []
        if not all(is_bool(f) for f in flags):
            return False
        if self.op == "per_token" and self.round_sf and self.e4m3_sf:
            return False
        return not (self.packed and not self.round_sf)

    # the effective flags of the output sf
    def out_flags(self) -> tuple[bool, bool, bool]:
        """(packed, e4m3 sf, column-major) of the sf the call writes."""
        e4m3 = bool(self.e4m3_sf) if self.op == "per_token" else False
        col = bool(self.col_major) if self.op != "per_channel" else False
        return bool(self.packed), e4m3, col


CORRUPTIONS = [
    "fmt", "group", "round_sf_type", "packed_type", "e4m3_sf_type", "col_major_type", "packed_without_round",
    "round_and_e4m3",
]


@st.composite
def calls(draw, modes=("cast", "sf_only", "precomputed")) -> Call:
    """A valid call most of the time; about one in four carries one corruption."""
    op = draw(st.sampled_from(["per_token", "per_block", "per_channel"]))
    mode = draw(st.sampled_from(modes)) if op != "per_channel" else "cast"
    fmt = draw(st.sampled_from(["e4m3", "e2m1"]))
    if op == "per_token":
        group = draw(st.sampled_from([16, 32, 64, 128]))
    elif op == "per_block":
        side = st.sampled_from([16, 32, 64, 128])
        group = (draw(side), draw(side))
    else:
        group = draw(st.sampled_from([32, 128]))
    round_sf = draw(st.booleans())
    packed = round_sf and draw(st.booleans())
    e4m3_sf = op == "per_token" and not round_sf and draw(st.booleans())
    col_major = op != "per_channel" and draw(st.booleans())
    corruption = draw(st.sampled_from([None] * 24 + CORRUPTIONS))  # 1 in 4 corrupted
    bad_flag = st.sampled_from([0, 1, None, "yes", 1.0])
    if corruption == "fmt":
        fmt = draw(st.sampled_from(["bf16", "fp32", "E4M3", "e5m2", None]))
    elif corruption == "group":
        if op == "per_token":
            group = draw(st.sampled_from([48, 256, 0, 8, True, 128.0, "128"]))
        elif op == "per_block":
            group = draw(st.sampled_from([(128, 1), (1, 128), (48, 48), (256, 256), (1, 1), (128.0, 128)]))
        else:
            group = draw(st.sampled_from([64, 16, 1, True, 32.0]))
    elif corruption == "round_sf_type":
        round_sf = draw(bad_flag)
    elif corruption == "packed_type":
        packed = draw(bad_flag)
    elif corruption == "e4m3_sf_type" and op == "per_token":
        e4m3_sf = draw(bad_flag)
    elif corruption == "col_major_type" and op != "per_channel":
        col_major = draw(bad_flag)
    elif corruption == "packed_without_round":
        round_sf, packed, e4m3_sf = False, True, False
    elif corruption == "round_and_e4m3" and op == "per_token":
        round_sf, packed, e4m3_sf = True, False, True
    return Call(op, mode, fmt, group, round_sf, packed, e4m3_sf, col_major, draw(st.sampled_from(["cuda", "ascend"])))


def check_contract_error(call: Call, error: core.ContractError) -> None:
    parameters = inspect.signature(call.function()).parameters
    assert error.argument in parameters, f"ContractError names {error.argument!r}, not a parameter: {error}"
    assert f"'{error.argument}'" in str(error)


def check_cast_back(q, sf, block, x_values: torch.Tensor, fmt: str) -> None:
    """cast_back of a result: right shape, and within a sane error of the input when finite."""
    tokens, hidden = x_values.shape
    y = OPS.cast_back((q, sf), "fp32", block)
    assert y.shape == (tokens, hidden) and y.dtype == torch.float32
    # (below ~1e-2 the amax clamps of SPEC §2 dominate and flush tiny data, by design)
    if tokens and torch.isfinite(x_values).all() and 1e-2 <= x_values.abs().max() < 1e30:
        error = relative_error(y, x_values)
        bound = 0.1 if fmt == "e4m3" else 0.5
        if sf.dtype == torch.float8_e4m3fn:
            # an e4m3-stored sf below 2^-6 is subnormal (step 2^-9): for group maxima under
            # 448 * 2^-6 = 7 (e2m1: 6 * 2^-6) it may round down by up to a third, and the group
            # maximum then saturates (SPEC §2: inv = 1 / float(sf8)).
            bound = 0.5
        assert error < bound, f"cast_back relative error {error}"
    # the group damage of non-finite input shows up: a non-finite element never comes back finite
    bad = ~torch.isfinite(x_values)
    if bad.any():
        assert not torch.isfinite(y[bad]).any()


# ---------------------------------------------------------------------- properties


@SETTINGS
@given(
    call=calls(),
    tokens=st.integers(0, 40),
    hidden=st.integers(1, 300) | st.integers(1, 150).map(lambda h: 2 * h),  # even H half the time (e2m1)
    dtype=st.sampled_from(list(FLOAT_DTYPES) * 12 + DTYPES),  # 1 in 6 not bf16/fp32
    stride_kind=st.sampled_from(["contiguous", "row_slice", "expanded", "overlapping"] * 3 + STRIDE_KINDS),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([1.0, 1e-3, 1e3, 1e-7, 0.0]),
    specials=st.sampled_from([0, 0, 0, 1, 3]),
)
def test_plain_input_is_correct_or_contract_error(call, tokens, hidden, dtype, stride_kind, seed, scale, specials):
    values = make_values(tokens, hidden, seed, scale, specials)
    x = make_input(values, dtype, stride_kind)
    contiguous = x.contiguous()
    x_values = contiguous.float()
    valid = (
        call.flags_valid()
        and dtype in FLOAT_DTYPES
        and (x.stride(1) == 1 or hidden <= 1)
        and not (call.fmt == "e2m1" and hidden % 2)
    )
    with core.config.host_layout(call.layout):
        given_sf = None
        if call.mode == "precomputed":
            # the caller's sf: what the sf-only op gives for this data with random valid flags
            round_sf = bool(seed & 1)
            sf_fmt = call.fmt if call.fmt in ("e4m3", "e2m1") else "e4m3"
            sf_call = Call(call.op, "sf_only", sf_fmt, call.group, round_sf, round_sf and bool(seed & 2),
                           (not round_sf) and bool(seed & 4) and call.op == "per_token", bool(seed & 8), call.layout)
            try:
                given_sf = sf_call.run(x_values if dtype in FLOAT_DTYPES else torch.zeros(tokens, hidden))
            except core.ContractError:
                given_sf = torch.ones(max(tokens, 1), 1)  # a wrong shape: the call below must refuse it
                valid = False
        try:
            result = call.run(x, sf=given_sf)
        except core.ContractError as error:
            event(f"ContractError {error.argument}")
            check_contract_error(call, error)
            assert not valid, f"a valid call was refused: {error}"
            return
        event(f"accepted {call.op} {call.mode}")
        assert valid, "an invalid call was accepted"
        again = call.run(contiguous, sf=given_sf.contiguous() if given_sf is not None else None)

        packed, e4m3_sf, col_major = call.out_flags()
        block = call.block
        q_width = hidden if call.fmt == "e4m3" else hidden // 2
        q_dtype = torch.float8_e4m3fn if call.fmt == "e4m3" else torch.int8
        if call.mode == "cast":
            q, sf = result
            q2, sf2 = again
        elif call.mode == "sf_only":
            q, sf, q2, sf2 = None, result, None, again
        else:
            q, sf, q2, sf2 = result, None, again, None
        if q is not None:
            assert q.shape == (tokens, q_width) and q.dtype == q_dtype and q.is_contiguous()
            assert torch.equal(raw(q), raw(q2)), "q differs from the op on a contiguous copy"
        if sf is not None:
            shape, sf_dtype, stride = expected_sf_layout(block, tokens, hidden, packed, e4m3_sf, col_major, call.layout)
            assert tuple(sf.shape) == shape and sf.dtype == sf_dtype
            if tokens:
                assert sf.stride() == stride
            assert sf2.stride() == sf.stride()
            assert torch.equal(group_bytes(sf, block, tokens, hidden), group_bytes(sf2, block, tokens, hidden))
        if q is not None:
            check_cast_back(q, sf if sf is not None else given_sf, block, x_values, call.fmt)


@st.composite
def input_pairs(draw):
    """A quantized (xq, sf_in) pair: its op, format, grouping and sf layout."""
    op = draw(st.sampled_from(["per_token", "per_block", "per_channel"]))
    fmt = draw(st.sampled_from(["e4m3", "e2m1"]))
    round_sf = draw(st.booleans())
    if op == "per_token":
        group = draw(st.sampled_from([16, 32, 64, 128]))
    elif op == "per_block":
        group = (draw(st.sampled_from([16, 32, 64, 128])), draw(st.sampled_from([16, 32, 64, 128])))
    else:
        group = draw(st.sampled_from([32, 128]))
    packed = round_sf and draw(st.booleans())
    e4m3_sf = op == "per_token" and not round_sf and draw(st.booleans())
    col_major = op != "per_channel" and draw(st.booleans())
    return Call(op, "cast", fmt, group, round_sf, packed, e4m3_sf, col_major, draw(st.sampled_from(["cuda", "ascend"])))


@SETTINGS
@given(
    source=input_pairs(),
    target=calls(modes=("cast", "sf_only", "precomputed", "cast_back")),
    tokens=st.integers(0, 40),
    half_hidden=st.integers(1, 150),
    seed=st.integers(0, 2**31 - 1),
    block_choice=st.sampled_from(["own", "own", "own", "other", "none"]),
    other_block=st.sampled_from([(1, 16), (1, 128), (128, 1), (32, 32), (1, 1), (16, 64), 128]),
    specials=st.sampled_from([0, 0, 0, 1]),
)
def test_quantized_pair_input_is_correct_or_contract_error(
    source, target, tokens, half_hidden, seed, block_choice, other_block, specials
):
    hidden = 2 * half_hidden  # the pair itself must be producible (e2m1 needs an even H)
    values = make_values(tokens, hidden, seed, 1.0, specials)
    with core.config.host_layout(source.layout):
        xq, sf_in = source.run(values)
        x_values = OPS.cast_back((xq, sf_in), "fp32", source.block)
    input_block = {"own": source.block, "other": other_block, "none": None}[block_choice]
    if target.op == "per_channel" and block_choice == "own":
        input_block = source.block[1] if source.op == "per_token" else 128  # its x grouping argument is an int
    # the same pair with a plain row-major sf: the input sf layout is read off its strides
    sf_row_major = torch.empty(sf_in.shape, dtype=sf_in.dtype).copy_(sf_in)
    with core.config.host_layout(target.layout):
        try:
            if target.mode == "cast_back":
                out_fmt = "bf16" if seed & 1 else "fp32"
                result = OPS.cast_back((xq, sf_in), out_fmt, input_block)
                again = OPS.cast_back((xq, sf_row_major), out_fmt, input_block)
                assert result.shape == (tokens, hidden) and torch.equal(raw(result), raw(again))
                if input_block == source.block:
                    assert torch.equal(raw(result), raw(x_values.to(result.dtype)))
                event("accepted cast_back")
                return
            given_sf = None
            if target.mode == "precomputed":
                given_sf = torch.full(
                    (ceil_div(tokens, target.block[0]), ceil_div(hidden, target.block[1])), 0.25
                ) if target.flags_valid() else torch.ones(1, 1)
            result = target.run((xq, sf_in), sf=given_sf, x_block_size=input_block)
        except core.ContractError as error:
            parameters = inspect.signature(
                OPS.cast_back if target.mode == "cast_back" else target.function()
            ).parameters
            assert error.argument in parameters, f"ContractError names {error.argument!r}: {error}"
            event(f"ContractError {error.argument}")
            return
        event(f"accepted {target.op} {target.mode}")
        again = target.run((xq, sf_row_major), sf=given_sf, x_block_size=input_block)
        # accepted: a valid group shape for the input and valid flags for the output
        assert target.flags_valid()
        outputs = result if isinstance(result, tuple) else (result,)
        others = again if isinstance(again, tuple) else (again,)
        for a, b in zip(outputs, others):
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            if a.dtype in (torch.int32, torch.int16):
                assert torch.equal(group_bytes(a, target.block, tokens, hidden), group_bytes(b, target.block, tokens, hidden))
            else:
                assert torch.equal(raw(a), raw(b)), "result depends on the input sf's storage order"
        if target.mode == "cast" and input_block in (source.block, source.block[1]):
            q, sf = result
            assert q.shape == (tokens, hidden if target.fmt == "e4m3" else hidden // 2)
            check_cast_back(q, sf, target.block, x_values, target.fmt)


@SETTINGS
@given(
    tokens=st.integers(1, 40),
    hidden=st.integers(1, 300),
    group=st.sampled_from([16, 32, 64, 128]),
    seed=st.integers(0, 2**31 - 1),
    bad_row=st.integers(0, 39),
    bad_col=st.integers(0, 299),
    bad=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    round_sf=st.booleans(),
    e4m3_sf=st.booleans(),
)
def test_non_finite_stays_in_its_group(tokens, hidden, group, seed, bad_row, bad_col, bad, round_sf, e4m3_sf):
    # SPEC §0: a non-finite input never crashes, never touches other rows or groups, and the
    # affected group's scale or values are non-finite.
    e4m3_sf = e4m3_sf and not round_sf
    values = make_values(tokens, hidden, seed, 1.0, 0)
    r, c = bad_row % tokens, bad_col % hidden
    poisoned = values.clone()
    poisoned[r, c] = bad
    q_bad, sf_bad = OPS.per_token_cast(poisoned, "e4m3", group, round_sf=round_sf, use_e4m3_sf=e4m3_sf)
    q_ok, sf_ok = OPS.per_token_cast(values, "e4m3", group, round_sf=round_sf, use_e4m3_sf=e4m3_sf)
    g = c // group
    mask = torch.ones(tokens, hidden, dtype=torch.bool)
    mask[r, g * group : (g + 1) * group] = False
    assert torch.equal(raw(q_bad)[mask], raw(q_ok)[mask])
    sf_mask = torch.ones(sf_ok.shape, dtype=torch.bool)
    sf_mask[r, g] = False
    assert torch.equal(raw(sf_bad).reshape(*sf_ok.shape, -1)[sf_mask], raw(sf_ok).reshape(*sf_ok.shape, -1)[sf_mask])
    group_q = q_bad[r, g * group : (g + 1) * group].float()
    assert not math.isfinite(sf_bad[r, g].float().item()) or not torch.isfinite(group_q).all()


@SETTINGS
@given(
    tokens=st.integers(0, 40),
    half_hidden=st.integers(1, 150),
    fmt=st.sampled_from(["e4m3", "e2m1"]),
    group=st.sampled_from([16, 32, 64, 128]),
    sf_kind=st.sampled_from(["plain", "round", "packed", "e4m3"]),
    col_major=st.booleans(),
    layout=st.sampled_from(["cuda", "ascend"]),
    alignment=st.sampled_from([None, None, 4, 32, 64]),
    perturb=st.sampled_from([None, None, "q_shape", "q_dtype", "sf_shape", "sf_dtype", "sf_stride", "q_stride", "count"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_out_argument_is_checked_and_written(
    tokens, half_hidden, fmt, group, sf_kind, col_major, layout, alignment, perturb, seed
):
    # per_token_cast(out=...): an out of exactly the promised layout (column length padded to the
    # configured token alignment, or the family's own) is written in place with the same bytes
    # as a fresh result; any other shape / dtype / stride is a ContractError naming 'out'.
    hidden = 2 * half_hidden
    x = make_values(tokens, hidden, seed, 1.0, 0)
    round_sf, packed, e4m3_sf = sf_kind in ("round", "packed"), sf_kind == "packed", sf_kind == "e4m3"
    kwargs = dict(
        use_tma_aligned_col_major_sf=col_major, round_sf=round_sf, use_packed_ue8m0=packed, use_e4m3_sf=e4m3_sf
    )
    with core.config.host_layout(layout), core.config.token_alignment(alignment):
        q_fresh, sf_fresh = OPS.per_token_cast(x, fmt, group, **kwargs)
        shape, sf_dtype, stride = expected_sf_layout((1, group), tokens, hidden, packed, e4m3_sf, col_major, layout)
        if col_major and alignment is not None:
            itemsize = torch.empty((), dtype=sf_dtype).element_size()
            stride = (1, align(shape[0], max(1, alignment // itemsize)))
        if tokens:
            assert sf_fresh.stride() == stride
        q_out = torch.empty_like(q_fresh)
        sf_out = torch.empty_strided(sf_fresh.shape, sf_fresh.stride(), dtype=sf_fresh.dtype)
        out: Any = (q_out, sf_out)
        if perturb == "q_shape":
            out = (torch.empty(tokens + 1, q_fresh.shape[1], dtype=q_fresh.dtype), sf_out)
        elif perturb == "q_dtype":
            out = (torch.empty(q_fresh.shape, dtype=torch.uint8), sf_out)
        elif perturb == "q_stride":
            out = (torch.empty(tokens, q_fresh.shape[1] + 16, dtype=q_fresh.dtype)[:, : q_fresh.shape[1]], sf_out)
        elif perturb == "sf_shape":
            out = (q_out, torch.empty(sf_fresh.shape[0], sf_fresh.shape[1] + 1, dtype=sf_fresh.dtype))
        elif perturb == "sf_dtype":
            out = (q_out, torch.empty_strided(sf_fresh.shape, sf_fresh.stride(), dtype=torch.float64))
        elif perturb == "sf_stride":
            rows, cols = sf_fresh.shape
            flipped = torch.empty(cols, rows, dtype=sf_fresh.dtype).t() if col_major is False else torch.empty(rows, cols + 3, dtype=sf_fresh.dtype)[:, :cols]
            out = (q_out, flipped)
        elif perturb == "count":
            out = (q_out,)
        try:
            q, sf = OPS.per_token_cast(x, fmt, group, out=out, **kwargs)
        except core.ContractError as error:
            assert error.argument == "out", str(error)
            # a perturbation that happens to keep the layout (e.g. strides of a size-1 dim) may pass
            assert perturb is not None, f"a correct out= was refused: {error}"
            event(f"out refused ({perturb})")
            return
        event("out accepted" if perturb is None else f"out accepted despite {perturb}")
        if perturb in ("q_shape", "q_dtype", "sf_shape", "sf_dtype", "count"):
            raise AssertionError(f"out with a wrong {perturb} was accepted")
        assert q is out[0] and sf is out[1]
        assert torch.equal(raw(q), raw(q_fresh))
        assert torch.equal(group_bytes(sf, (1, group), tokens, hidden), group_bytes(sf_fresh, (1, group), tokens, hidden))
