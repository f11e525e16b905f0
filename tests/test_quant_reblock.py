"""SPEC §11 on the reference: per_block_cast_lossless (golden values, the lossless proof on
random and extreme inputs, the 14-binade bound is tight, the defined lossy results) and
transpose_weight_sf (golden bytes against loops, layouts, several weights, out= reuse), and
every refusal with its message."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from tileplug import core
from tileplug.core import CUDA_LAYOUT, opdefs
from tileplug.core.opdefs import describe_call
from tileplug.core.quant import formats, layouts
from tileplug.core.testing import assert_bytes_equal

lossless = core.ops.per_block_cast_lossless
transpose_weight_sf = core.ops.transpose_weight_sf
cast_back = core.ops.cast_back

# e2m1 nibble codes: bit 3 the sign, bits 0-2 index (0, .5, 1, 1.5, 2, 3, 4, 6)
CODE = {value: code for code, value in enumerate(formats.E2M1_MAGNITUDES)}


# ---------------------------------------------------------------------- building inputs


def e2m1_pair(codes: torch.Tensor, exponents: torch.Tensor, block: tuple[int, int], sf_kind: str = "ue8m0",
              col_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``(xq, sf)`` pair holding exactly ``codes`` (uint8 [T, H]) and the scales
    ``2^exponents`` ([ceil(T/bm), ceil(H/bn)]), in the layout the quant ops produce for
    ``block`` (UE8M0 packed, or fp32), so every value and scale is chosen by the test."""
    tokens, hidden = codes.shape
    template = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
    flags = {"round_sf": True, "use_packed_ue8m0": sf_kind == "ue8m0"}
    if block[0] == 1:
        xq, sf = core.ops.per_token_cast(template, "e2m1", block[1], use_tma_aligned_col_major_sf=col_major, **flags)
    elif block[1] == 1:
        xq, sf = core.ops.per_channel_cast(template, "e2m1", block[0], **flags)
    else:
        xq, sf = core.ops.per_block_cast(template, "e2m1", block, use_tma_aligned_col_major_sf=col_major, **flags)
    xq.copy_(formats.pack_nibbles(codes))
    if sf_kind == "ue8m0":
        exponent_bytes = (exponents + 127).to(torch.uint8)
        sf.copy_(layouts.pack_ue8m0(exponent_bytes, CUDA_LAYOUT.ue8m0_pack_factor, layouts.pack_axis_of_block(block)))
    else:
        sf.copy_(torch.ldexp(torch.ones(exponents.shape), exponents.float()))
    return xq, sf


def group_grid(tokens: int, hidden: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-tokens // block[0]), -(-hidden // block[1])


def assert_lossless(pair, x_block, result, out_block, what: str) -> None:
    for fmt in ("fp32", "bf16"):
        before = cast_back(pair, fmt, x_block)
        after = cast_back(result, fmt, out_block)
        assert_bytes_equal(after, before, what=f"{what} cast_back {fmt}")


def exponent_bytes_of(sf: torch.Tensor, block: tuple[int, int], tokens: int, hidden: int) -> torch.Tensor:
    """The exponent (e of 2^e) of every output group, whatever the sf's storage."""
    rows, cols = group_grid(tokens, hidden, block)
    if sf.dtype == torch.float32:
        mantissa, exponent = torch.frexp(sf.contiguous())
        assert torch.all(mantissa == 0.5), "fp32 output scales are powers of two"
        return (exponent - 1).to(torch.int32)
    raw = layouts.unpack_ue8m0(sf, layouts.pack_axis_of_block(block), rows, cols)
    return raw.to(torch.int32) - 127


# ---------------------------------------------------------------------- golden small cases


def test_golden_two_groups_into_one():
    """Row of 64: group 0 (scale 2^0) holds 6, -1.5, 0.5; group 1 (scale 2^-3) holds 0.5, 4.
    e_max = 0 → sf_out = 2^-6; values times 2^6 and 2^3: 384, -96, 32, 4, 32."""
    codes = torch.zeros(1, 64, dtype=torch.uint8)
    codes[0, 0], codes[0, 1], codes[0, 2] = CODE[6.0], CODE[1.5] | 8, CODE[0.5]
    codes[0, 32], codes[0, 33] = CODE[0.5], CODE[4.0]
    pair = e2m1_pair(codes, torch.tensor([[0, -3]]), (1, 32))
    for flags, expected_sf in (({}, torch.tensor([[2.0**-6]])),
                               ({"round_sf": True, "use_packed_ue8m0": True}, torch.tensor([[121]], dtype=torch.int32))):
        q, sf = lossless(pair, "e4m3", (1, 32), (1, 64), **flags)
        assert q.dtype == torch.float8_e4m3fn and q.shape == (1, 64)
        assert q.float()[0, :3].tolist() == [384.0, -96.0, 32.0]
        assert q.float()[0, 32:34].tolist() == [4.0, 32.0]
        assert torch.count_nonzero(q.float()) == 5
        assert torch.equal(sf, expected_sf), sf
        assert_lossless(pair, (1, 32), (q, sf), (1, 64), "golden")


def test_golden_fourteen_binades_reach_the_smallest_subnormal():
    """Scales 2^0 and 2^-14 in one output group: sf_out = 2^-6, the small group shrinks by
    2^-8: 0.5 → 2^-9 (byte 0x01), 1.5 → 3·2^-9 (0x03), 6 → 1.5·2^-6 (0x0C), all exact."""
    codes = torch.zeros(1, 64, dtype=torch.uint8)
    codes[0, 0] = CODE[6.0]
    codes[0, 32], codes[0, 33], codes[0, 34] = CODE[0.5], CODE[1.5] | 8, CODE[6.0]
    pair = e2m1_pair(codes, torch.tensor([[0, -14]]), (1, 32), "fp32")
    q, sf = lossless(pair, "e4m3", (1, 32), (1, 64))
    assert sf.item() == 2.0**-6
    assert q.view(torch.uint8)[0, 32:35].tolist() == [0x01, 0x83, 0x0C]
    assert_lossless(pair, (1, 32), (q, sf), (1, 64), "14 binades")


def test_fifteen_binades_lose_values_as_the_formula_rounds():
    """One binade more and 0.5 · 2^-9 = 2^-10 lies halfway between 0 and 2^-9: ties to even, 0;
    1.5 · 2^-9 is halfway between 2^-9 and 2 · 2^-9: ties to even, 2 · 2^-9 (byte 0x02). The
    bound of SPEC §11 is tight."""
    codes = torch.zeros(1, 64, dtype=torch.uint8)
    codes[0, 0] = CODE[6.0]
    codes[0, 32], codes[0, 33] = CODE[0.5], CODE[1.5]
    pair = e2m1_pair(codes, torch.tensor([[0, -15]]), (1, 32))
    q, sf = lossless(pair, "e4m3", (1, 32), (1, 64))
    assert q.view(torch.uint8)[0, 32:34].tolist() == [0x00, 0x02]
    assert not torch.equal(cast_back((q, sf), "fp32", (1, 64)), cast_back(pair, "fp32", (1, 32)))


def test_scales_at_the_bottom_clamp_to_two_to_the_minus_127():
    """All input scales 2^-127 (UE8M0 byte 0): e_out = max(-127 - 6, -127) = -127, so each
    value is kept as it is (6 → 6) and the fp32 scale is the subnormal 2^-127, not zero."""
    codes = torch.full((2, 32), CODE[6.0], dtype=torch.uint8)
    pair = e2m1_pair(codes, torch.tensor([[-127], [-127]]), (1, 32))
    q, sf = lossless(pair, "e4m3", (1, 32), (128, 128))
    assert torch.all(q.float() == 6.0)
    assert sf.item() == 2.0**-127 and sf.item() > 0
    q8, sf8 = lossless(pair, "e4m3", (1, 32), (128, 128), round_sf=True, use_packed_ue8m0=True)
    assert sf8.view(torch.uint8)[0, 0].item() == 0
    assert_lossless(pair, (1, 32), (q, sf), (128, 128), "bottom fp32")
    assert_lossless(pair, (1, 32), (q8, sf8), (128, 128), "bottom ue8m0")


def test_scales_at_the_top():
    """2^127 (byte 254): sf_out = 2^121, 6 → 384."""
    codes = torch.full((1, 32), CODE[6.0] | 8, dtype=torch.uint8)
    pair = e2m1_pair(codes, torch.tensor([[127]]), (1, 32))
    q, sf = lossless(pair, "e4m3", (1, 32), (1, 128), round_sf=True, use_packed_ue8m0=True)
    assert torch.all(q.float() == -384.0)
    assert sf.view(torch.uint8)[0, 0].item() == 121 + 127
    assert_lossless(pair, (1, 32), (q, sf), (1, 128), "top")


def test_a_nan_scale_makes_its_output_group_nan_and_no_other():
    codes = torch.full((1, 256), CODE[1.0], dtype=torch.uint8)
    pair = e2m1_pair(codes, torch.tensor([[0] * 8]), (1, 32))
    raw = pair[1].view(torch.uint8)
    raw[0, 1] = 0xFF  # the second input group's scale: NaN
    q, sf = lossless(pair, "e4m3", (1, 32), (1, 128))
    assert sf[0, 0].item() == math.inf and sf[0, 1].item() == 2.0**-6
    back = cast_back((q, sf), "fp32", (1, 128))
    assert torch.isnan(back[0, :128]).all() and torch.equal(back[0, 128:], torch.ones(128))
    q8, sf8 = lossless(pair, "e4m3", (1, 32), (1, 128), round_sf=True, use_packed_ue8m0=True)
    assert sf8.view(torch.uint8)[0, :2].tolist() == [0xFF, 121]


def test_zero_and_negative_fp32_scales():
    """A zero scale is kept (its values are zeros of their sign); a negative one counts as
    not finite (SPEC §11): its output group decodes to NaN."""
    codes = torch.full((1, 64), CODE[3.0] | 8, dtype=torch.uint8)
    pair = e2m1_pair(codes, torch.tensor([[0, 0]]), (1, 32), "fp32")
    pair[1][0, 1] = 0.0
    q, sf = lossless(pair, "e4m3", (1, 32), (1, 64))
    assert_lossless(pair, (1, 32), (q, sf), (1, 64), "zero scale")
    assert torch.all(torch.signbit(q.float()[0, 32:]))  # -3 · 0 = -0
    pair[1][0, 1] = -1.0
    q, sf = lossless(pair, "e4m3", (1, 32), (1, 64))
    assert sf.item() == math.inf and torch.isnan(cast_back((q, sf), "fp32", (1, 64))).all()


def test_non_power_of_two_fp32_scales_follow_the_formula():
    """fp32 scales that are not powers of two: E = ceil(log2 s), q = e4m3(v · (s · inv)),
    computed here independently (fp64, then e4m3)."""
    generator = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (3, 128), generator=generator, dtype=torch.uint8)
    scales = torch.tensor([[1.9, 0.3, 5.0, 0.7]] * 3)
    pair = e2m1_pair(codes, torch.zeros(3, 4, dtype=torch.int32), (1, 32), "fp32")
    pair[1].copy_(scales)
    q, sf = lossless(pair, "e4m3", (1, 32), (128, 128))
    e_max = max(math.ceil(math.log2(s)) for s in (1.9, 0.3, 5.0, 0.7))  # 3
    assert sf.item() == 2.0 ** (e_max - 6)
    values = formats.decode_e2m1_codes(codes).double()
    expected = (values * scales.double().repeat_interleave(32, dim=1) * 2.0 ** (6 - e_max)).float()
    assert torch.equal(q.float(), expected.clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert (q.float().abs() < 448).all()  # rounded, never saturated


# ---------------------------------------------------------------------- the lossless proof


SIDES = (1, 16, 32, 64, 128)
BLOCKS = [block for block in itertools.product(SIDES, SIDES) if block != (1, 1)]
OUTPUT_MODES = ({}, {"round_sf": True}, {"round_sf": True, "use_packed_ue8m0": True},
                {"round_sf": True, "use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True},
                {"use_tma_aligned_col_major_sf": True})


def _input_layouts(block):
    if block[0] > 1 and block[1] == 1:  # per channel: row-major sf only
        return [("fp32", False), ("ue8m0", False)]
    return [("fp32", False), ("ue8m0", False), ("ue8m0", True), ("fp32", True)]


def _lossless_trials(count: int, seed: int):
    chooser = random.Random(seed)
    for trial in range(count):
        x_block, out_block = chooser.choice(BLOCKS), chooser.choice(BLOCKS)
        if x_block[1] == 1 and x_block[0] not in (32, 128):
            continue  # (the test's producer of per-channel layouts, per_channel_cast, makes 32 and 128 only)
        tokens = chooser.choice((1, 3, 17, 130, 257))
        hidden = 2 * chooser.choice((8, 40, 72, 200, 288))
        sf_kind, col_major = chooser.choice(_input_layouts(x_block))
        low = chooser.choice((-127, -120, -60, 0, 50, 113))  # 113 + 14 = 127: the top window
        yield trial, x_block, out_block, tokens, hidden, sf_kind, col_major, chooser.choice(OUTPUT_MODES), low


@pytest.mark.parametrize("trial, x_block, out_block, tokens, hidden, sf_kind, col_major, flags, low",
                         list(_lossless_trials(60, seed=11)), ids=lambda v: str(v))
def test_lossless_on_random_inputs(trial, x_block, out_block, tokens, hidden, sf_kind, col_major, flags, low):
    """Every e2m1 code at random, input exponents at random inside one 14-binade window
    (anywhere from the bottom, 2^-127, to the top, 2^127): cast_back before == after, bytewise;
    the output scales are 2^max(e_max - 6, -127) of their groups, checked by loops."""
    generator = torch.Generator().manual_seed(trial)
    codes = torch.randint(0, 16, (tokens, hidden), generator=generator, dtype=torch.uint8)
    rows, cols = group_grid(tokens, hidden, x_block)
    exponents = torch.randint(low, low + 15, (rows, cols), generator=generator, dtype=torch.int32)
    pair = e2m1_pair(codes, exponents, x_block, sf_kind, col_major)
    q, sf = lossless(pair, "e4m3", x_block, out_block, **flags)
    assert_lossless(pair, x_block, (q, sf), out_block, f"trial {trial}")
    got = exponent_bytes_of(sf, out_block, tokens, hidden)
    out_rows, out_cols = group_grid(tokens, hidden, out_block)
    for row, col in itertools.product(range(out_rows), range(out_cols)):
        t0, h0 = row * out_block[0], col * out_block[1]
        covered = exponents[t0 // x_block[0]: (min(t0 + out_block[0], tokens) - 1) // x_block[0] + 1,
                            h0 // x_block[1]: (min(h0 + out_block[1], hidden) - 1) // x_block[1] + 1]
        assert got[row, col].item() == max(int(covered.max()) - 6, -127), (row, col)


@pytest.mark.parametrize("x_block, out_block", [((1, 32), (128, 128)), ((32, 32), (1, 128)), ((1, 16), (16, 64))])
def test_every_code_at_the_widest_spread(x_block, out_block):
    """Each input group holds all 16 codes (both signs of every magnitude, ±0) and the scales
    alternate between the two ends of a 14-binade window."""
    tokens, hidden = 130, 288
    codes = torch.arange(16, dtype=torch.uint8).repeat(tokens, hidden // 16)
    codes = codes.roll(shifts=3, dims=1) if x_block[0] > 1 else codes
    rows, cols = group_grid(tokens, hidden, x_block)
    exponents = torch.where((torch.arange(rows)[:, None] + torch.arange(cols)) % 2 == 0, 20, 6).to(torch.int32)
    pair = e2m1_pair(codes, exponents, x_block)
    for flags in OUTPUT_MODES:
        result = lossless(pair, "e4m3", x_block, out_block, **flags)
        assert_lossless(pair, x_block, result, out_block, f"{flags}")


def test_lossless_matches_what_the_case_grid_runs():
    """The op table's own cases (activations quantized by per-token / per-block / per-channel
    casts with power-of-two scales) are lossless at a tail token count."""
    for case in opdefs.get("per_block_cast_lossless").cases():
        if dict(case.inputs).get("input_round_sf", True) is False:
            continue
        (pair,), kwargs = case.arguments(37, "cpu")
        result = lossless(pair, **kwargs)
        assert_lossless(pair, kwargs["x_block_size"], result, kwargs["out_block_size"], case.id)


def test_ledger_counts_fp4_in_and_fp8_out():
    """T = 4096, H = 7168, 1 × 32 UE8M0 in, 128 × 128 UE8M0 out (CUDA: 4 bytes an int32)."""
    xq = torch.empty(4096, 3584, dtype=torch.int8, device="meta")
    sf = torch.empty(4096, 56, dtype=torch.int32, device="meta")
    call, _ = describe_call("per_block_cast_lossless", (xq, sf), "e4m3", (1, 32), (128, 128), round_sf=True,
                            use_packed_ue8m0=True)
    ledger = opdefs.get("per_block_cast_lossless").ledger(call, CUDA_LAYOUT)
    assert ledger.bytes_read == 4096 * 3584 + 4096 * 56 * 4
    assert ledger.bytes_written == 4096 * 7168 + 32 * 14 * 4


# ---------------------------------------------------------------------- transpose_weight_sf


def _expected_bytes(scales: torch.Tensor, block: int, factor: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sf0 [N, P0·f] and sf1 [K, P1·f] bytes by loops over rows, from SPEC §11."""
    rows, cols = scales.shape
    def byte(value: float) -> int:
        if math.isnan(value) or value < 0 or value > 2.0**127:
            return 0xFF
        if value <= 2.0**-127:
            return 0
        return math.ceil(math.log2(value)) + 127
    sf0 = torch.zeros(rows * block, -(-cols // factor) * factor, dtype=torch.uint8)
    sf1 = torch.zeros(cols * block, -(-rows // factor) * factor, dtype=torch.uint8)
    for n in range(rows * block):
        for j in range(cols):
            sf0[n, j] = byte(scales[n // block, j].item())
    for k in range(cols * block):
        for i in range(rows):
            sf1[k, i] = byte(scales[i, k // block].item())
    return sf0, sf1


def _bytes_by_row(packed: torch.Tensor) -> torch.Tensor:
    """[M, P] packed integers (any strides) → [M, P·f] uint8 (little-endian)."""
    return layouts.standard_strides(packed).view(torch.uint8)


@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("family", ["cuda", "ascend"])
def test_transpose_weight_sf_golden_against_loops(block, family):
    exponents = torch.tensor([[0, 1, -2, 3, -127], [127, -5, 6, -7, 8], [2, 2, 2, 2, 2]], dtype=torch.float32)
    scales = torch.ldexp(torch.ones(3, 5), exponents)
    with core.config.host_layout(family):
        sf0, sf1 = transpose_weight_sf(scales, block)
    factor = 4 if family == "cuda" else 2
    dtype = torch.int32 if family == "cuda" else torch.int16
    packed_k, packed_n = -(-5 // factor), -(-3 // factor)
    assert (sf0.dtype, sf0.shape, sf0.stride()) == (dtype, (3 * block, packed_k), (1, 3 * block))
    assert (sf1.dtype, sf1.shape, sf1.stride()) == (dtype, (5 * block, packed_n), (1, 5 * block))
    want0, want1 = _expected_bytes(scales, block, factor)
    assert torch.equal(_bytes_by_row(sf0), want0)
    assert torch.equal(_bytes_by_row(sf1), want1)
    assert _bytes_by_row(sf0)[0].tolist()[:8 if family == "cuda" else 6] == \
        ([127, 128, 125, 130, 0, 0, 0, 0] if family == "cuda" else [127, 128, 125, 130, 0, 0])  # pad: 0


def test_transposed_sf1_is_the_same_bytes_viewed_transposed():
    scales = torch.ldexp(torch.ones(4, 9), torch.randint(-20, 20, (4, 9)).float())
    sf0, sf1 = transpose_weight_sf(scales, 32)
    sf0_t, sf1_t = transpose_weight_sf(scales, 32, transpose_sf1=True)
    assert torch.equal(sf0_t, sf0)
    assert sf1_t.shape == (1, 288) and sf1_t.stride() == (288, 1)
    assert torch.equal(sf1_t, sf1.t())


def test_scales_that_are_not_powers_of_two_round_up_and_invalid_ones_give_ff():
    scales = torch.tensor([[3.0, 0.0, -0.0, float("nan"), float("inf"), -2.0, 2.0**-130, 2.0**127 * 1.5,
                            2.0**-127, 2.0**127, 2.0**-126 * 1.25, 0.75]])
    sf0, _ = transpose_weight_sf(scales, 16)
    assert _bytes_by_row(sf0)[0].tolist() == [129, 0, 0, 0xFF, 0xFF, 0xFF, 0, 0xFF, 0, 254, 2, 127]


def test_several_weights_and_groups_in_one_call_equal_one_call_each():
    generator = torch.Generator().manual_seed(3)
    weights = (torch.ldexp(torch.ones(2, 7, 3), torch.randint(-9, 9, (2, 7, 3), generator=generator).float()),
               torch.ldexp(torch.ones(1, 1), torch.tensor([[4.0]])),
               torch.ldexp(torch.ones(12, 4), torch.randint(-9, 9, (12, 4), generator=generator).float()))
    together = transpose_weight_sf(weights, 128)
    assert len(together) == 6
    for index, scales in enumerate(weights):
        for have, want in zip(together[2 * index: 2 * index + 2], transpose_weight_sf(scales, 128)):
            assert_bytes_equal(have, want, strides=True)
    sf0, sf1 = together[:2]
    assert sf0.shape == (2, 896, 1) and sf0.stride() == (896, 1, 896)
    assert sf1.shape == (2, 384, 2) and sf1.stride() == (768, 1, 384)
    for group in range(2):
        assert_bytes_equal(sf0[group], transpose_weight_sf(weights[0][group].contiguous(), 128)[0], strides=True)


def test_out_is_reused():
    scales = torch.ldexp(torch.ones(3, 6), torch.randint(-9, 9, (3, 6)).float())
    other = torch.ldexp(torch.ones(2, 2), torch.zeros(2, 2))
    out = transpose_weight_sf((scales, other), 64)
    kept = [tensor.data_ptr() for tensor in out]
    scales.mul_(2.0)
    again = transpose_weight_sf((scales, other), 64, out=out)
    assert [tensor.data_ptr() for tensor in again] == kept
    for have, want in zip(again, transpose_weight_sf((scales, other), 64)):
        assert_bytes_equal(have, want, strides=True)


def test_compiled_call_gives_the_eager_bytes():
    weights = (torch.ldexp(torch.ones(3, 5), torch.randint(-9, 9, (3, 5)).float()), torch.ones(2, 2, 2))
    eager = transpose_weight_sf(weights, 32)
    compiled = torch.compile(lambda w: transpose_weight_sf(w, 32), fullgraph=True)(weights)
    for have, want in zip(compiled, eager):
        assert_bytes_equal(have, want, strides=True)


def test_weight_scale_ledger():
    call, _ = describe_call("transpose_weight_sf", torch.empty(56, 56, device="meta"), 128)
    ledger = opdefs.get("transpose_weight_sf").ledger(call, CUDA_LAYOUT)
    assert ledger.bytes_read == 56 * 56 * 4
    assert ledger.bytes_written == 2 * 7168 * 14 * 4


# ---------------------------------------------------------------------- refusals


def _pair():
    return core.ops.per_token_cast(torch.ones(4, 64), "e2m1", 32, round_sf=True, use_packed_ue8m0=True)


SCALES = torch.ones(2, 3)

REFUSALS = [
    ("fmt e2m1", lambda: lossless(_pair(), "e2m1", (1, 32), (128, 128)), "fmt", "'e4m3'"),
    ("fmt not a str", lambda: lossless(_pair(), 4, (1, 32), (128, 128)), "fmt", "'e4m3'"),
    ("x plain", lambda: lossless(torch.ones(4, 64), "e4m3", (1, 32), (128, 128)), "x", "a pair \\(xq, sf\\)"),
    ("x e4m3 data", lambda: lossless(core.ops.per_token_cast(torch.ones(4, 64), "e4m3", 32, round_sf=True),
                                     "e4m3", (1, 32), (128, 128)), "x", "e2m1 data"),
    ("x e4m3 scales", lambda: lossless(core.ops.per_token_cast(torch.ones(4, 64), "e2m1", 32, use_e4m3_sf=True),
                                       "e4m3", (1, 32), (128, 128)), "x", "power-of-two scales"),
    ("x_block_size None", lambda: lossless(_pair(), "e4m3", None, (128, 128)), "x_block_size", "group shape"),
    ("x_block_size bad", lambda: lossless(_pair(), "e4m3", (3, 32), (128, 128)), "x_block_size", "a pair \\(bm, bn\\)"),
    ("x_block_size mismatch", lambda: lossless(core.ops.per_token_cast(torch.ones(4, 64), "e2m1", 32, round_sf=True),
                                               "e4m3", (1, 16), (128, 128)), "x", "scales of shape"),
    ("out_block_size 1x1", lambda: lossless(_pair(), "e4m3", (1, 32), (1, 1)), "out_block_size", "a pair \\(bm, bn\\)"),
    ("out_block_size 256", lambda: lossless(_pair(), "e4m3", (1, 32), (256, 128)), "out_block_size", "bm in"),
    ("packed without round", lambda: lossless(_pair(), "e4m3", (1, 32), (128, 128), use_packed_ue8m0=True),
     "use_packed_ue8m0", "unless round_sf=True"),
    ("round_sf not bool", lambda: lossless(_pair(), "e4m3", (1, 32), (128, 128), round_sf=1), "round_sf", "a bool"),
    ("col major not bool", lambda: lossless(_pair(), "e4m3", (1, 32), (128, 128), use_tma_aligned_col_major_sf="y"),
     "use_tma_aligned_col_major_sf", "a bool"),
    ("lossless out wrong", lambda: lossless(_pair(), "e4m3", (1, 32), (128, 128),
                                            out=(torch.empty(4, 64, dtype=torch.float8_e4m3fn), torch.empty(1, 2))),
     "out", "shape=\\(1, 1\\)"),
    ("sf not a tensor", lambda: transpose_weight_sf([SCALES, "scales"]), "sf", "a torch.Tensor \\(weight 1\\)"),
    ("sf empty tuple", lambda: transpose_weight_sf(()), "sf", "non-empty tuple"),
    ("sf bf16", lambda: transpose_weight_sf(SCALES.bfloat16()), "sf", "float32 power-of-two scales"),
    ("sf 1-D", lambda: transpose_weight_sf(torch.ones(5)), "sf", "2-D \\[rows, cols\\] or 3-D"),
    ("sf 4-D", lambda: transpose_weight_sf(torch.ones(1, 1, 2, 2)), "sf", "2-D \\[rows, cols\\] or 3-D"),
    ("sf not contiguous", lambda: transpose_weight_sf(torch.ones(3, 4).t()), "sf", "contiguous"),
    ("sf on two devices", lambda: transpose_weight_sf((SCALES, torch.ones(2, 3, device="meta"))), "sf",
     "a tensor on cpu"),
    ("block_size 48", lambda: transpose_weight_sf(SCALES, 48), "block_size", "one of 16, 32, 64, 128"),
    ("block_size float", lambda: transpose_weight_sf(SCALES, 128.0), "block_size", "one of 16, 32, 64, 128"),
    ("transpose_sf1 not bool", lambda: transpose_weight_sf(SCALES, 128, 1), "transpose_sf1", "a bool"),
    ("weight out count", lambda: transpose_weight_sf(SCALES, 128, out=(torch.empty(256, 1, dtype=torch.int32),)),
     "out", "2 tensor"),
    ("weight out strides", lambda: transpose_weight_sf(SCALES, 128, out=(torch.empty(256, 1, dtype=torch.int32),
                                                                         torch.empty(384, 1, dtype=torch.int32))),
     "out", "stride=\\(1, 256\\)"),
]


@pytest.mark.parametrize("what, call, argument, message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_name_the_argument(what, call, argument, message):
    with pytest.raises(core.ContractError, match=message) as caught:
        call()
    assert caught.value.argument == argument, (what, str(caught.value))
    assert f"'{argument}'" in str(caught.value)


def test_the_lossless_contract_memo_keeps_every_check():
    from tileplug.core.contracts import quant as quant_contracts
    from tileplug.core.contracts import quant_reblock as contracts

    pair = _pair()
    first, _ = contracts.per_block_cast_lossless(pair, "e4m3", (1, 32), (128, 128), False, True, True)
    size = len(quant_contracts.recent_calls)
    again, inputs = contracts.per_block_cast_lossless(pair, "e4m3", (1, 32), (128, 128), False, True, True)
    assert again is first and len(quant_contracts.recent_calls) == size  # the second call hit the memo
    assert inputs.x is pair[0] and inputs.input_sf is pair[1]
    with pytest.raises(core.ContractError, match="'round_sf'"):  # 1 == True, but not a bool: not the memo's entry
        contracts.per_block_cast_lossless(pair, "e4m3", (1, 32), (128, 128), False, 1, True)
    with pytest.raises(core.ContractError, match="'use_packed_ue8m0'"):  # other flags: another key, checked
        contracts.per_block_cast_lossless(pair, "e4m3", (1, 32), (128, 128), False, False, True)
    with pytest.raises(core.ContractError, match="'x'"):  # an sf of another shape: another key, checked
        contracts.per_block_cast_lossless((pair[0], pair[1][:, :0]), "e4m3", (1, 32),
                                          (128, 128), False, True, True)
    listed, _ = contracts.per_block_cast_lossless(pair, "e4m3", [1, 32], (128, 128), False, True, True)
    assert listed == first  # a list is checked (not memoized) and gives the same call
    with core.config.host_layout("ascend"):  # another config in force: checked again, another call
        other, _ = contracts.per_block_cast_lossless(pair, "e4m3", (1, 32), (128, 128), False, True, True)
    assert other.host_layout != first.host_layout


def test_the_weight_scale_contract_memo_keeps_every_check():
    from tileplug.core.contracts import quant as quant_contracts
    from tileplug.core.contracts import quant_reblock as contracts

    weights = (torch.ones(2, 3), torch.ones(4, 2, 5))
    first, inputs = contracts.transpose_weight_sf(weights, 64, False)
    size = len(quant_contracts.recent_calls)
    again, _ = contracts.transpose_weight_sf(weights, 64, False)
    assert again is first and len(quant_contracts.recent_calls) == size  # the second call hit the memo
    assert inputs[0] is weights[0] and inputs[1] is weights[1]
    with pytest.raises(core.ContractError, match="'transpose_sf1'"):  # 0 == False, but not a bool
        contracts.transpose_weight_sf(weights, 64, 0)
    with pytest.raises(core.ContractError, match="'block_size'"):  # 64.0 == 64, but not an int
        contracts.transpose_weight_sf(weights, 64.0, False)
    with pytest.raises(core.ContractError, match="contiguous"):  # other strides: another key, checked
        contracts.transpose_weight_sf((weights[0], torch.ones(4, 5, 2).transpose(1, 2)), 64, False)
    one, _ = contracts.transpose_weight_sf(weights[0], 64, False)
    assert one.shapes == ((2, 3),)
    listed, _ = contracts.transpose_weight_sf(list(weights), 64, False)  # a list: checked, the same call
    assert listed == first
