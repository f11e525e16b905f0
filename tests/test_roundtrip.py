"""Round trips of every quant op and flag combination SPEC.md §2-3 allows, on the sizes kernels
get wrong: T in {0, 1, 3, 4001}, H in {576, 7168} (576 leaves a partial 128-group).

Per case: output shapes / dtypes / strides (T = 0 included: empty outputs of the right shape),
``cast_back`` relative error, ``_with_sf_only`` == the sf of the full cast (bytewise),
``_with_precomputed_sf`` with that sf == the q of the full cast, a non-contiguous row stride
input (``big[:, :H]`` with huge values past H) giving the same bytes as a contiguous copy,
re-quantization of ``(q, sf)`` pairs, and an independent plain-torch per-token e4m3 written
from the SPEC text that must match the op bytewise.

The 4001 x 7168 size runs a representative subset of the combinations (the reference is
plain PyTorch on a small CPU); every combination runs on the other sizes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from tileplug import core

from spec_helpers import PACK, align, ceil_div, raw  # tests/: SPEC-derived layout math

OPS = core.ops
SMALL_SHAPES = [(0, 576), (0, 7168), (1, 576), (1, 7168), (3, 576), (3, 7168)]
# cast_back relative-norm error bounds on normal data (SPEC §1 formats): e4m3 keeps 3 mantissa
# bits (≈ 2^-5 relative rounding), e2m1 only 1.
ERROR_BOUND = {"e4m3": 0.07, "e2m1": 0.25}


@pytest.fixture(autouse=True)
def _reference_backend():
    with core.use_backend("reference"):
        yield


# ---------------------------------------------------------------------- helpers written from the SPEC


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = raw(actual), raw(expected)
    bad = (a != e).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} byte(s) differ, first at {tuple(bad[0].tolist())}"


@dataclass(frozen=True)
class Case:
    """One op + flag combination. ``op`` in token / block / channel; ``sf_kind`` in
    plain / round / packed (round_sf + packed UE8M0) / e4m3 (e4m3-stored sf)."""

    op: str
    fmt: str
    block: tuple[int, int]
    sf_kind: str
    col_major: bool = False
    layout: str = "cuda"

    def __str__(self) -> str:
        cm = "-colmajor" if self.col_major else ""
        return f"{self.op}-{self.fmt}-{self.block[0]}x{self.block[1]}-{self.sf_kind}{cm}-{self.layout}"

    # flags
    @property
    def round_sf(self) -> bool:
        return self.sf_kind in ("round", "packed")

    @property
    def packed(self) -> bool:
        return self.sf_kind == "packed"

    @property
    def e4m3_sf(self) -> bool:
        return self.sf_kind == "e4m3"

    # the public ops
    def cast(self, x):
        if self.op == "token":
            return OPS.per_token_cast(
                x, self.fmt, self.block[1], use_tma_aligned_col_major_sf=self.col_major, round_sf=self.round_sf,
                use_packed_ue8m0=self.packed, use_e4m3_sf=self.e4m3_sf,
            )
        if self.op == "block":
            return OPS.per_block_cast(
                x, self.fmt, self.block, use_tma_aligned_col_major_sf=self.col_major, round_sf=self.round_sf,
                use_packed_ue8m0=self.packed,
            )
        return OPS.per_channel_cast(x, self.fmt, self.block[0], round_sf=self.round_sf, use_packed_ue8m0=self.packed)

    def requantize(self, pair, input_block):
        if self.op == "token":
            return OPS.per_token_cast(
                pair, self.fmt, self.block[1], x_block_size=input_block, use_tma_aligned_col_major_sf=self.col_major,
                round_sf=self.round_sf, use_packed_ue8m0=self.packed, use_e4m3_sf=self.e4m3_sf,
            )
        if self.op == "block":
            return OPS.per_block_cast(
                pair, self.fmt, self.block, use_tma_aligned_col_major_sf=self.col_major, round_sf=self.round_sf,
                use_packed_ue8m0=self.packed, x_block_size=input_block,
            )
        assert input_block[0] == 1, "per_channel re-quantizes per-token pairs"
        return OPS.per_channel_cast(
            pair, self.fmt, self.block[0], round_sf=self.round_sf, num_per_channels=input_block[1],
            use_packed_ue8m0=self.packed,
        )

    def sf_only(self, x):
        if self.op == "token":
            return OPS.per_token_cast_with_sf_only(
                x, self.fmt, self.block[1], use_tma_aligned_col_major_sf=self.col_major, round_sf=self.round_sf,
                use_packed_ue8m0=self.packed, use_e4m3_sf=self.e4m3_sf,
            )
        assert self.op == "block"
        return OPS.per_block_cast_with_sf_only(
            x, self.fmt, self.block, use_tma_aligned_col_major_sf=self.col_major, round_sf=self.round_sf,
            use_packed_ue8m0=self.packed,
        )

    def precomputed(self, x, sf):
        if self.op == "token":
            return OPS.per_token_cast_with_precomputed_sf(x, self.fmt, self.block[1], sf=sf)
        assert self.op == "block"
        return OPS.per_block_cast_with_precomputed_sf(x, self.fmt, self.block, sf=sf)

    # the layout SPEC §2-3 promises
    def expected_q(self, tokens: int, hidden: int) -> tuple[tuple[int, int], torch.dtype]:
        if self.fmt == "e4m3":
            return (tokens, hidden), torch.float8_e4m3fn
        return (tokens, hidden // 2), torch.int8

    def expected_sf(self, tokens: int, hidden: int) -> tuple[tuple[int, int], torch.dtype, tuple[int, int]]:
        bm, bn = self.block
        rows, cols = ceil_div(tokens, bm), ceil_div(hidden, bn)
        if self.packed:
            factor, dtype = PACK[self.layout]
            shape = (rows, ceil_div(cols, factor)) if bn != 1 else (ceil_div(rows, factor), cols)
        else:
            dtype = torch.float8_e4m3fn if self.e4m3_sf else torch.float32
            shape = (rows, cols)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not self.col_major:
            stride = (shape[1], 1)
        elif self.layout == "cuda":
            stride = (1, align(shape[0], 16 // itemsize))
        else:
            stride = (1, shape[0])
        return shape, dtype, stride

    def group_bytes(self, sf: torch.Tensor, tokens: int, hidden: int) -> torch.Tensor:
        """The bytes of ``sf`` that hold groups [rows, cols, itemsize] (pad bytes dropped)."""
        bm, bn = self.block
        rows, cols = ceil_div(tokens, bm), ceil_div(hidden, bn)
        if not self.packed:
            return raw(sf).reshape(rows, cols, sf.element_size())
        factor = sf.element_size()
        data = raw(sf)  # [stored rows, stored cols * factor]
        if bn != 1:
            return data[:, :cols].reshape(rows, cols, 1)
        per_int = data.reshape(sf.shape[0], cols, factor).permute(0, 2, 1).reshape(sf.shape[0] * factor, cols)
        return per_int[:rows].reshape(rows, cols, 1)


def token_cases(layout: str) -> list[Case]:
    cases = []
    for fmt, group, sf_kind, col_major in itertools.product(
        ("e4m3", "e2m1"), (16, 32, 64, 128), ("plain", "round", "packed", "e4m3"), (False, True)
    ):
        if layout == "ascend" and not (sf_kind == "packed" or (col_major and fmt == "e4m3")):
            continue  # identical to the CUDA layout (or covered by its e4m3 twin)
        cases.append(Case("token", fmt, (1, group), sf_kind, col_major, layout))
    return cases


def block_cases(layout: str) -> list[Case]:
    cases = []
    for fmt, block, sf_kind, col_major in itertools.product(
        ("e4m3", "e2m1"), ((128, 128), (32, 32), (16, 64)), ("plain", "round", "packed"), (False, True)
    ):
        if layout == "ascend" and not (sf_kind == "packed" or (col_major and fmt == "e4m3")):
            continue
        cases.append(Case("block", fmt, block, sf_kind, col_major, layout))
    return cases


def channel_cases(layout: str) -> list[Case]:
    cases = []
    for fmt, group, sf_kind in itertools.product(("e4m3", "e2m1"), (32, 128), ("plain", "round", "packed")):
        if layout == "ascend" and sf_kind != "packed":
            continue
        cases.append(Case("channel", fmt, (group, 1), sf_kind, False, layout))
    return cases


ALL_CASES = [c for layout in ("cuda", "ascend") for c in token_cases(layout) + block_cases(layout) + channel_cases(layout)]

# 4001 x 7168: a subset that still touches every op, format, sf encoding and layout once;
# (case, run the sf_only / precomputed variants, run the strided-input check).
BIG_CASES = [
    (Case("token", "e4m3", (1, 128), "plain"), True, True),
    (Case("token", "e2m1", (1, 16), "packed", True), False, False),
    (Case("token", "e4m3", (1, 64), "e4m3", True, "ascend"), True, False),
    (Case("block", "e4m3", (128, 128), "packed", True, "ascend"), True, False),
    (Case("channel", "e4m3", (128, 1), "round"), False, True),
]
# 4001 x 576: a wider subset.
MID_CASES = [
    Case("token", "e4m3", (1, 32), "round", True),
    Case("token", "e2m1", (1, 32), "e4m3"),
    Case("token", "e2m1", (1, 128), "plain", False, "ascend"),
    Case("block", "e2m1", (32, 32), "plain", True),
    Case("block", "e4m3", (64, 16), "packed"),
    Case("block", "e2m1", (128, 128), "round", True, "ascend"),
    Case("channel", "e2m1", (32, 1), "packed", False, "ascend"),
    Case("channel", "e4m3", (128, 1), "plain"),
]


def data(tokens: int, hidden: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + tokens * 7919 + hidden)
    return torch.randn(tokens, hidden, generator=generator).to(dtype)


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    a, r = actual.double(), reference.double()
    return ((a - r).norm() / r.norm()).item()


def assert_adjacent_codes(actual: torch.Tensor, expected: torch.Tensor, fmt: str, what: str) -> int:
    """``actual`` and ``expected`` differ at most by one code step, same sign; returns the count."""
    a, e = raw(actual).to(torch.int16), raw(expected).to(torch.int16)
    if fmt == "e2m1":  # unpack nibbles: element 2i low, 2i+1 high
        a = torch.stack((a & 0xF, a >> 4), -1).flatten()
        e = torch.stack((e & 0xF, e >> 4), -1).flatten()
        sign, magnitude = 0x8, 0x7
    else:
        sign, magnitude = 0x80, 0x7F
    differ = a != e
    if not differ.any():
        return 0
    assert ((a & sign) == (e & sign))[differ].all(), f"{what}: sign differs"
    step = ((a & magnitude) - (e & magnitude)).abs().max().item()
    assert step <= 1, f"{what}: codes {step} steps apart"
    return int(differ.sum())


# ---------------------------------------------------------------------- the round trip of one case


def check_case(
    case: Case, x: torch.Tensor, cast_back_fmts=("bf16", "fp32"), noncontiguous: bool = True, variants: bool = True
) -> None:
    tokens, hidden = x.shape
    with core.config.host_layout(case.layout):
        q, sf = case.cast(x)
        q_shape, q_dtype = case.expected_q(tokens, hidden)
        sf_shape, sf_dtype, sf_stride = case.expected_sf(tokens, hidden)
        assert q.dtype == q_dtype and tuple(q.shape) == q_shape, f"{case} q {q.dtype} {tuple(q.shape)}"
        assert q.is_contiguous(), f"{case}: q must be contiguous"
        assert sf.dtype == sf_dtype and tuple(sf.shape) == sf_shape, f"{case} sf {sf.dtype} {tuple(sf.shape)}"
        if tokens:
            assert sf.stride() == sf_stride, f"{case}: sf stride {sf.stride()} != {sf_stride}"

        # sf_only and precomputed_sf (per-token and per-block have them)
        if case.op != "channel" and variants:
            sf_only = case.sf_only(x)
            assert sf_only.dtype == sf.dtype and sf_only.shape == sf.shape, str(case)
            if tokens:
                assert sf_only.stride() == sf.stride(), str(case)
            assert torch.equal(case.group_bytes(sf_only, tokens, hidden), case.group_bytes(sf, tokens, hidden)), (
                f"{case}: sf_only differs from the sf of the full cast"
            )
            q_given = case.precomputed(x, sf)
            assert q_given.dtype == q.dtype and q_given.shape == q.shape and q_given.is_contiguous(), str(case)
            if case.sf_kind == "plain":
                # SPEC §2: the full cast uses inv = max / c, the cast-only mode inv = 1 / sf with
                # sf = c / max; the two fp32 inverses may differ by an ulp, so a few values may land
                # one code apart (never more). Bytewise equality holds for power-of-two and e4m3 sf.
                differ = assert_adjacent_codes(q_given, q, case.fmt, f"{case} precomputed")
                assert differ <= max(8, q.numel() // 1000), f"{case}: {differ} codes differ"
            else:
                assert_same_bytes(q_given, q, f"{case}: precomputed-sf q vs full-cast q")

        # cast_back
        for out_fmt in cast_back_fmts:
            y = OPS.cast_back((q, sf), out_fmt, case.block)
            assert y.dtype == {"bf16": torch.bfloat16, "fp32": torch.float32}[out_fmt]
            assert tuple(y.shape) == (tokens, hidden) and y.is_contiguous(), str(case)
            if tokens:
                error = relative_error(y, x.float())
                assert error < ERROR_BOUND[case.fmt], f"{case}: cast_back relative error {error:.4f}"

        # a row stride wider than H (x = big[:, :H]); huge values past H must not leak in
        if noncontiguous and tokens:
            big = torch.full((tokens, hidden + 64), 1e30, dtype=x.dtype)
            big[:, :hidden] = x
            view = big[:, :hidden]
            assert view.stride() == (hidden + 64, 1)
            q2, sf2 = case.cast(view)
            assert_same_bytes(q2, q, f"{case}: q of a strided input")
            assert sf2.stride() == sf.stride()
            assert torch.equal(case.group_bytes(sf2, tokens, hidden), case.group_bytes(sf, tokens, hidden)), (
                f"{case}: sf of a strided input"
            )


@pytest.mark.parametrize("case", ALL_CASES, ids=str)
def test_round_trip_small_shapes(case):
    for tokens, hidden in SMALL_SHAPES:
        # T = 1 in bf16 (cast back to bf16), T = 3 in fp32 (cast back to fp32); the strided
        # input check on H = 576, where the partial last group sits next to the huge values.
        x = data(tokens, hidden, torch.bfloat16 if tokens != 3 else torch.float32)
        check_case(case, x, cast_back_fmts=("fp32",) if tokens == 3 else ("bf16",), noncontiguous=hidden == 576)


@pytest.mark.parametrize("case", MID_CASES, ids=str)
def test_round_trip_4001x576(case):
    check_case(case, data(4001, 576))


@pytest.mark.parametrize("case, variants, strided", BIG_CASES, ids=[str(c[0]) for c in BIG_CASES])
def test_round_trip_4001x7168(case, variants, strided):
    check_case(case, data(4001, 7168), cast_back_fmts=("bf16",), noncontiguous=strided, variants=variants)


# ---------------------------------------------------------------------- empty inputs


@pytest.mark.parametrize("hidden", [576, 7168])
def test_empty_input_every_op(hidden):
    x = torch.empty(0, hidden, dtype=torch.bfloat16)
    q, sf = OPS.per_token_cast(x)
    assert q.shape == (0, hidden) and sf.shape == (0, ceil_div(hidden, 128))
    q, sf = OPS.per_token_cast(x, "e2m1", 16, round_sf=True, use_packed_ue8m0=True, use_tma_aligned_col_major_sf=True)
    assert q.shape == (0, hidden // 2) and q.dtype == torch.int8
    assert sf.shape == (0, ceil_div(ceil_div(hidden, 16), 4)) and sf.dtype == torch.int32
    assert OPS.per_token_cast_with_sf_only(x).shape == (0, ceil_div(hidden, 128))
    assert OPS.per_token_cast_with_precomputed_sf(x, sf=torch.empty(0, ceil_div(hidden, 128))).shape == (0, hidden)
    q, sf = OPS.per_block_cast(x)
    assert q.shape == (0, hidden) and sf.shape == (0, ceil_div(hidden, 128))
    q, sf = OPS.per_channel_cast(x, num_per_tokens=32, round_sf=True, use_packed_ue8m0=True)
    assert q.shape == (0, hidden) and sf.shape == (0, hidden) and sf.dtype == torch.int32
    y = OPS.cast_back((q, sf), "fp32", (32, 1))
    assert y.shape == (0, hidden) and y.dtype == torch.float32


# ---------------------------------------------------------------------- re-quantization


LOSSLESS_CASES = [
    Case("token", "e4m3", (1, 128), "round"),
    Case("token", "e4m3", (1, 16), "packed", True),
    Case("token", "e2m1", (1, 32), "round", True),
    Case("token", "e2m1", (1, 64), "packed"),
    Case("token", "e4m3", (1, 32), "packed", True, "ascend"),
    Case("token", "e2m1", (1, 128), "packed", False, "ascend"),
    Case("block", "e4m3", (128, 128), "packed"),
    Case("block", "e4m3", (32, 32), "round", True),
    Case("block", "e2m1", (16, 64), "packed", True),
    Case("block", "e2m1", (128, 128), "round"),
    Case("block", "e4m3", (32, 32), "packed", True, "ascend"),
]


def _lossless_check(case: Case, x: torch.Tensor) -> None:
    # round_sf: re-quantizing (q, sf) with the same grouping multiplies each value by a power
    # of two (sf_in * inv = 2^(e - e')), which is exact: cast_back must give the same bytes.
    with core.config.host_layout(case.layout):
        q, sf = case.cast(x)
        q2, sf2 = case.requantize((q, sf), case.block)
        assert q2.shape == q.shape and q2.dtype == q.dtype and sf2.shape == sf.shape and sf2.stride() == sf.stride()
        before = OPS.cast_back((q, sf), "fp32", case.block)
        after = OPS.cast_back((q2, sf2), "fp32", case.block)
    assert_same_bytes(after, before, f"{case}: re-quantized pair")


@pytest.mark.parametrize("case", LOSSLESS_CASES, ids=str)
def test_requantize_round_sf_same_grouping_is_lossless(case):
    for tokens, hidden in ((3, 7168), (130, 576)):
        _lossless_check(case, data(tokens, hidden, torch.float32, seed=1))


def test_requantize_round_sf_lossless_4001x7168():
    _lossless_check(Case("token", "e4m3", (1, 128), "packed", True), data(4001, 7168, seed=2))


@pytest.mark.parametrize(
    "source, target",
    [
        (Case("token", "e4m3", (1, 128), "plain"), Case("block", "e4m3", (128, 128), "plain")),
        (Case("token", "e4m3", (1, 32), "packed", True), Case("token", "e2m1", (1, 16), "round")),
        (Case("token", "e2m1", (1, 16), "e4m3"), Case("token", "e4m3", (1, 128), "e4m3", True)),
        (Case("token", "e4m3", (1, 128), "round"), Case("channel", "e4m3", (128, 1), "packed")),
        (Case("token", "e2m1", (1, 64), "packed", False, "ascend"), Case("channel", "e4m3", (32, 1), "plain", False, "ascend")),
        (Case("block", "e4m3", (128, 128), "packed", True), Case("token", "e4m3", (1, 128), "round")),
        (Case("block", "e4m3", (32, 32), "plain", True, "ascend"), Case("block", "e2m1", (16, 128), "packed", True, "ascend")),
        (Case("channel", "e4m3", (128, 1), "packed"), Case("token", "e4m3", (1, 64), "plain")),
        (Case("channel", "e4m3", (32, 1), "plain"), Case("block", "e4m3", (64, 16), "round", True)),
    ],
    ids=lambda c: str(c),
)
def test_requantize_other_grouping(source, target):
    # a quantized pair in any layout §3 produces goes back in as x with its x_block_size;
    # the input sf layout is read off its dtype and strides.
    for tokens, hidden in ((0, 576), (3, 576), (4001, 576)):
        x = data(tokens, hidden, seed=3)
        with core.config.host_layout(source.layout):
            pair = source.cast(x)
            q, sf = target.requantize(pair, source.block)
            q_shape, q_dtype = target.expected_q(tokens, hidden)
            sf_shape, sf_dtype, sf_stride = target.expected_sf(tokens, hidden)
            assert tuple(q.shape) == q_shape and q.dtype == q_dtype
            assert tuple(sf.shape) == sf_shape and sf.dtype == sf_dtype
            if tokens:
                assert sf.stride() == sf_stride
                y = OPS.cast_back((q, sf), "fp32", target.block)
                error = relative_error(y, x.float())
                bound = ERROR_BOUND[source.fmt] + ERROR_BOUND[target.fmt]
                assert error < bound, f"{source} → {target}: relative error {error:.4f}"


def test_requantize_bytes_match_independent_formula():
    # SPEC §2: q = saturate(float(xq) * (sf_in * inv)), the two scales multiplied first;
    # amax over the values the pair represents, float(xq) * sf_in. Written here in plain torch.
    x = data(37, 576, torch.float32, seed=4) * 3
    xq, sf_in = OPS.per_token_cast(x, "e4m3", 32)
    q, sf = OPS.per_token_cast((xq, sf_in), "e4m3", 128, x_block_size=(1, 32))
    scale_in = sf_in.repeat_interleave(32, dim=1)[:, :576]
    values = xq.float() * scale_in
    amax = torch.nn.functional.pad(values.abs(), (0, 64)).reshape(37, 5, 128).amax(-1)
    c = torch.maximum(amax, torch.tensor(1e-4))
    inv = fp32_div(torch.full_like(c, 448.0), c).repeat_interleave(128, dim=1)[:, :576]
    expected = (xq.float() * (scale_in * inv)).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert_same_bytes(sf, fp32_div(c, torch.full_like(c, 448.0)), "requantized sf")
    assert_same_bytes(q, expected, "requantized q")


# ---------------------------------------------------------------------- independent per-token e4m3


def fp32_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 a / b: the quotient in fp64 (53 bits ≥ 2 * 24 + 2, so rounding it
    again to fp32 is exact rounding), element by element — never torch's ``scalar / tensor``,
    which computes ``tensor.reciprocal() * scalar`` (two roundings)."""
    return (a.double() / b.double()).float()


def independent_per_token_e4m3(x: torch.Tensor, group: int, round_sf: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC §2 per-token e4m3 in plain torch: amax per 1 x g group (partial last group over the
    valid values only), c = max(amax, 1e-4); plain: sf = c / 448, inv = 448 / c; round_sf:
    s = c * fp32(1/448), e = ((bits(s) - 1) >> 23) + 1 - 127, sf = 2^e, inv = 2^-e;
    q = e4m3(clamp(x * inv, ±448))."""
    tokens, hidden = x.shape
    values = x.float()
    cols = ceil_div(hidden, group)
    padded = torch.zeros(tokens, cols * group)
    padded[:, :hidden] = values.abs()
    amax = padded.reshape(tokens, cols, group).amax(dim=2)
    c = torch.maximum(amax, torch.tensor(1e-4, dtype=torch.float32))
    if round_sf:
        s = c * fp32_div(torch.ones_like(c), torch.full_like(c, 448.0))
        e = ((s.view(torch.int32) - 1) >> 23) + 1 - 127
        sf = torch.pow(2.0, e.double()).float()
        inv = torch.pow(2.0, (-e).double()).float()
    else:
        sf = fp32_div(c, torch.full_like(c, 448.0))
        inv = fp32_div(torch.full_like(c, 448.0), c)
    factor = inv.repeat_interleave(group, dim=1)[:, :hidden]
    q = (values * factor).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, sf


@pytest.mark.parametrize(
    "tokens, hidden, group, round_sf, dtype",
    [
        (1, 576, 128, False, torch.bfloat16),
        (3, 7168, 16, False, torch.float32),
        (4001, 576, 64, True, torch.float32),
        (257, 7168, 32, True, torch.bfloat16),
        (4001, 7168, 128, False, torch.bfloat16),
    ],
)
def test_independent_per_token_e4m3_matches(tokens, hidden, group, round_sf, dtype):
    x = data(tokens, hidden, dtype, seed=5)
    x[0, :7] = torch.tensor([0.0, -0.0, 1e-6, -3.0, 100.0, -100.0, 7.5]).to(dtype)  # zeros and outliers
    if tokens > 2:
        x[2] = 0  # a row of all-zero groups → the clamp
    q, sf = OPS.per_token_cast(x, "e4m3", group, round_sf=round_sf)
    q_ind, sf_ind = independent_per_token_e4m3(x, group, round_sf)
    assert_same_bytes(sf, sf_ind, "sf")
    assert_same_bytes(q, q_ind, "q")
