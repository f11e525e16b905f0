"""Hand-worked golden values of the sf math and the formats (SPEC.md §1-3).

Every expected value here is written out by hand (the comments show the arithmetic) or
computed with a single plain fp32 torch operation that mirrors the SPEC sentence; nothing
is taken from tileplug's own helpers. Every op goes through the public ``core.ops`` entry
points with the reference backend pinned, and quantized outputs are compared on their bytes.

e4m3 bytes used below (sign | 4-bit exponent, bias 7 | 3-bit mantissa):
    0x00 +0      0x80 -0      0x01 2^-9 (smallest subnormal)
    0x30 0.5     0x38 1.0     0x39 1.125   0x3A 1.25   0x40 2.0   0xC0 -2.0
    0x49 4.5     0x76 224     0x7E 448     0xFE -448   0xE8 -64
    0x26 0.21875 (= 1.75 * 2^-3)
"""

from __future__ import annotations

import math

import pytest
import torch

from tileplug import core

F32 = torch.float32
E4M3 = torch.float8_e4m3fn
NAN = float("nan")
INF = float("inf")


@pytest.fixture(autouse=True)
def _reference_backend():
    with core.use_backend("reference"):
        yield


def f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=F32)


def div32(a: float, b: float) -> float:
    """The fp32 quotient of the fp32 values a and b, correctly rounded: Python divides in fp64
    (53 bits ≥ 2 * 24 + 2, so rounding that quotient to fp32 is the exact fp32 rounding)."""
    a32, b32 = f32(a).item(), f32(b).item()
    return f32(a32 / b32).item()


def u8(tensor: torch.Tensor) -> list:
    """Raw bytes of a tensor (row-major logical order) as nested Python lists."""
    standard = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)  # plain row-major strides
    return standard.view(torch.uint8).tolist()


def f32_bytes(values) -> list:
    """Bytes of fp32 values, as produced by one fp32 store."""
    return torch.tensor(values, dtype=F32).view(torch.uint8).tolist()


def row(groups: list[list[float]], group: int, fill: float = 0.0) -> list[float]:
    """One row made of groups: each listed prefix padded with ``fill`` up to ``group`` values."""
    out: list[float] = []
    for values in groups:
        out.extend(values + [fill] * (group - len(values)))
    return out


# ====================================================================== plain scales


def test_plain_scales_and_values_per_token_e4m3():
    # Row 0, group 0: amax 448 → c = 448, sf = 448/448 = 1, inv = 448/448 = 1 → q = e4m3(x).
    # Row 0, group 1: amax 3.5 → sf = 3.5/448 = 1/128 = 0.0078125, inv = 448/3.5 = 128.
    #   3.5*128 = 448 → 0x7E; (1/128)*128 = 1 → 0x38; -0.5*128 = -64 → 0xE8.
    # Row 1, group 0: all zeros → amax 0 → c = clamp_min = 1e-4 → sf = fp32(1e-4)/448; q = 0.
    # Row 1, group 1: amax 1e-6 < 1e-4 → c = 1e-4, inv = 448/1e-4 = 4.48e6;
    #   1e-6 * 4.48e6 = 4.48 → e4m3 step in [4, 8) is 0.5 → 4.5 → 0x49.
    g0 = [448.0, -448.0, 1.0, 0.5, 2.0, -2.0, 0.0, -0.0, 1.0625, 1.1875]
    # 1.0625 is the tie between 1.0 (mantissa 000) and 1.125 (001) → even → 1.0 (0x38)
    # 1.1875 is the tie between 1.125 (001) and 1.25 (010) → even → 1.25 (0x3A)
    g1 = [3.5, 1.0 / 128, -0.5]
    x = torch.tensor([row([g0, g1], 128), row([[], [1e-6]], 128)], dtype=F32)

    q, sf = core.ops.per_token_cast(x)

    assert q.dtype == E4M3 and q.shape == (2, 256)
    assert sf.dtype == F32 and sf.shape == (2, 2) and sf.stride() == (2, 1)
    clamp_sf = div32(1e-4, 448.0)  # one fp32 division, ≈ 2.2321e-7
    assert math.isclose(clamp_sf, 1e-4 / 448, rel_tol=1e-6)
    assert u8(sf) == [f32_bytes([1.0, 0.0078125]), f32_bytes([clamp_sf, clamp_sf])]
    bytes_ = u8(q)
    assert bytes_[0][:10] == [0x7E, 0xFE, 0x38, 0x30, 0x40, 0xC0, 0x00, 0x80, 0x38, 0x3A]
    assert bytes_[0][10:128] == [0] * 118
    assert bytes_[0][128:131] == [0x7E, 0x38, 0xE8]
    assert bytes_[1][:128] == [0] * 128
    assert bytes_[1][128] == 0x49


def test_plain_scales_bf16_input_amax_in_fp32():
    # bf16 input: amax of the bf16 values (exact in fp32). 3.0 is exact in bf16:
    # sf = 3/448 (one fp32 division), inv = 448/3 = 149.333..; 3 * inv → 448 → 0x7E;
    # 1 * 149.333 → e4m3 step in [128, 256) is 16 → 144 = 1.125 * 2^7 (149.33 is nearer 144
    # than 160) → exponent field 14, mantissa 001 → 0x71.
    x = torch.tensor([[3.0, 1.0] + [0.0] * 126], dtype=torch.bfloat16)
    q, sf = core.ops.per_token_cast(x)
    assert u8(sf) == [f32_bytes([div32(3.0, 448.0)])]
    assert u8(q)[0][:3] == [0x7E, 0x71, 0x00]


@pytest.mark.parametrize("group", [16, 32, 64, 128])
def test_plain_scale_group_sizes(group):
    # H = 2*group: group 0 amax 7, group 1 amax 14 → sf = 7/448 = 1/64, 14/448 = 1/32.
    x = torch.zeros(1, 2 * group)
    x[0, group - 1] = -7.0
    x[0, 2 * group - 1] = 14.0
    q, sf = core.ops.per_token_cast(x, num_per_channels=group)
    assert sf.shape == (1, 2)
    assert u8(sf) == [f32_bytes([1 / 64, 1 / 32])]
    # -7 * 64 = -448 → 0xFE; 14 * 32 = 448 → 0x7E
    assert u8(q)[0][group - 1] == 0xFE and u8(q)[0][2 * group - 1] == 0x7E


def test_clamp_min_override_through_config():
    # With clamp_min 1e-2 the all-zero group gets sf = fp32(1e-2)/448 (same op, same flags).
    x = torch.zeros(1, 128)
    with core.config.amax_clamps({("e4m3", False): 1e-2}):
        sf = core.ops.per_token_cast_with_sf_only(x)
    assert u8(sf) == [f32_bytes([div32(1e-2, 448.0)])]


def test_e2m1_plain_scales_and_default_clamp():
    # e2m1: sf = c/6. amax 6 → sf 1; amax 3 → sf 0.5 (inv 2); zeros → c = 6*2^-126 → sf = 2^-126
    # exactly (6*2^-126 / 6 is exact in fp32: 2^-126 is the smallest normal).
    x = torch.tensor([row([[6.0], [3.0, 1.0], []], 16)], dtype=F32)
    q, sf = core.ops.per_token_cast(x, fmt="e2m1", num_per_channels=16)
    assert q.dtype == torch.int8 and q.shape == (1, 24)
    assert u8(sf) == [f32_bytes([1.0, 0.5, 2.0**-126])]
    # group 0: 6 → code 7, rest 0 → byte 0 = 0x07; group 1: 3*2 = 6 → code 7, 1*2 = 2 → code 4
    # → byte 8 = 0x47 (element 16 low nibble, element 17 high nibble).
    b = u8(q)[0]
    assert b[0] == 0x07 and b[1:8] == [0] * 7
    assert b[8] == 0x47 and b[9:] == [0] * 15


# ====================================================================== round_sf


# (amax, exponent e) worked by hand: s = c * fp32(1/448), e = ceil(log2(s)).
#   448          → s = 448 * fp32(1/448) = 1.0 exactly (the product rounds back to 1) → e = 0
#   449          → s = 1.00223 > 1 → e = 1
#   1            → s = fp32(1/448) ≈ 0.00223, 2^-9 = 0.00195 < s ≤ 2^-8 = 0.0039 → e = -8
#   896 = 448*2  → s = 2 exactly → e = 1 (a power of two stays put)
#   224 = 448/2  → s = 0.5 → e = -1
#   56 = 448/8   → s = 0.125 → e = -3
#   nextafter(448, inf) = 448 + 2^-15 → s = 1 + 2^-23 > 1 → e = 1
#   0 → c = clamp 1e-4 → s ≈ 2.232e-7; 2^-23 ≈ 1.19e-7 < s ≤ 2^-22 ≈ 2.38e-7 → e = -22
ROUND_SF_CASES = [
    (448.0, 0),
    (449.0, 1),
    (1.0, -8),
    (896.0, 1),
    (224.0, -1),
    (56.0, -3),
    (448.0 + 2.0**-15, 1),
    (0.0, -22),
]


def _round_sf_input(group: int = 128) -> torch.Tensor:
    return torch.tensor([row([[a] for a, _ in ROUND_SF_CASES], group)], dtype=F32)


def test_round_sf_exponent_by_hand():
    s = f32(448.0) * f32(div32(1.0, 448.0))  # fp32(1/448) = 0x3B124925, a hair above 1/448
    assert f32(div32(1.0, 448.0)).view(torch.int32).item() == 0x3B124925
    assert s.item() == 1.0  # the premise of the first case: 448 * fp32(1/448) rounds to 1
    x = _round_sf_input()
    q, sf = core.ops.per_token_cast(x, round_sf=True)
    assert sf.dtype == F32 and sf.shape == (1, 8)
    assert sf[0].tolist() == [2.0**e for _, e in ROUND_SF_CASES]
    # q = e4m3(x * 2^-e): 448 → 448 (0x7E); 449/2 = 224.5 → 224 (0x76); 1*256 = 256 (exp 15, 0x78);
    # 896/2 = 448; 224*2 = 448; 56*8 = 448; (448+2^-15)/2 = 224 (0x76); 0 → 0.
    b = u8(q)[0]
    assert [b[128 * i] for i in range(8)] == [0x7E, 0x76, 0x78, 0x7E, 0x7E, 0x7E, 0x76, 0x00]


@pytest.mark.parametrize("k", [-20, -9, -1, 0, 1, 5, 20])
def test_round_sf_exact_powers_of_two(k):
    # amax = 448 * 2^k → s = 2^k exactly → e = k; one ulp above → e = k + 1; one ulp below → e = k.
    amax = 448.0 * 2.0**k
    above = torch.nextafter(f32(amax), f32(INF)).item()
    below = torch.nextafter(f32(amax), f32(0.0)).item()
    x = torch.tensor([row([[amax], [above], [below]], 128)], dtype=F32)
    sf = core.ops.per_token_cast_with_sf_only(x, round_sf=True)
    assert sf[0].tolist() == [2.0**k, 2.0 ** (k + 1), 2.0**k]


def test_round_sf_e2m1():
    # e2m1, max 6: amax 6 → s = 6 * fp32(1/6) = 1 → e = 0; amax 7 → e = 1; amax 0.75 → s = 0.125 → e = -3.
    x = torch.tensor([row([[6.0], [7.0], [0.75]], 16)], dtype=F32)
    q, sf = core.ops.per_token_cast(x, fmt="e2m1", num_per_channels=16, round_sf=True)
    assert sf[0].tolist() == [1.0, 2.0, 0.125]
    # 6 → code 7; 7/2 = 3.5 → tie → round_half_even(3.5) = 4 → code 6 (4.0); 0.75*8 = 6 → code 7
    b = u8(q)[0]
    assert (b[0], b[8], b[16]) == (0x07, 0x06, 0x07)


# ====================================================================== packed UE8M0


BYTES = [e + 127 for _, e in ROUND_SF_CASES]  # [127, 128, 119, 128, 126, 124, 128, 105]


def test_ue8m0_bytes_by_hand():
    assert BYTES == [127, 128, 119, 128, 126, 124, 128, 105]


def test_packed_ue8m0_cuda_layout_int32_little_endian():
    x = _round_sf_input()
    q, sf = core.ops.per_token_cast(x, round_sf=True, use_packed_ue8m0=True)
    assert sf.dtype == torch.int32 and sf.shape == (1, 2) and sf.stride() == (2, 1)
    assert u8(sf) == [BYTES]  # little endian: group 4j+k is byte k of integer j
    # the same as integers: b0 | b1 << 8 | b2 << 16 | b3 << 24 (as a signed int32)
    def pack(b):
        v = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
        return v - (1 << 32) if v >= 1 << 31 else v

    assert sf[0].tolist() == [pack(BYTES[:4]), pack(BYTES[4:])]
    # the data does not depend on how the scales are stored
    q_unpacked, _ = core.ops.per_token_cast(x, round_sf=True)
    assert u8(q) == u8(q_unpacked)


def test_packed_ue8m0_ascend_layout_int16():
    x = _round_sf_input()
    with core.config.host_layout("ascend"):
        q, sf = core.ops.per_token_cast(x, round_sf=True, use_packed_ue8m0=True)
    assert sf.dtype == torch.int16 and sf.shape == (1, 4) and sf.stride() == (4, 1)
    assert u8(sf) == [BYTES]

    def pack(b):
        v = b[0] | b[1] << 8
        return v - (1 << 16) if v >= 1 << 15 else v

    assert sf[0].tolist() == [pack(BYTES[2 * i : 2 * i + 2]) for i in range(4)]


def test_packed_ue8m0_partial_integer_only_group_bytes_compared():
    # H = 576, g = 128 → 5 groups → CUDA: 2 int32 (bytes 5..7 are padding, unspecified);
    # Ascend: 3 int16 (byte 5 is padding).
    x = torch.tensor([row([[a] for a, _ in ROUND_SF_CASES[:4]] + [[2.0**-4 * 448]], 128)[:576]], dtype=F32)
    expected = BYTES[:4] + [127 - 4]  # last group: s = 2^-4 → e = -4 → byte 123
    sf = core.ops.per_token_cast_with_sf_only(x, round_sf=True, use_packed_ue8m0=True)
    assert sf.shape == (1, 2) and u8(sf)[0][:5] == expected
    with core.config.host_layout("ascend"):
        sf = core.ops.per_token_cast_with_sf_only(x, round_sf=True, use_packed_ue8m0=True)
    assert sf.shape == (1, 3) and sf.dtype == torch.int16 and u8(sf)[0][:5] == expected


def test_packed_ue8m0_per_block():
    # per_block (32, 32) on [64, 160]: 2 x 5 groups. Group (i, j) gets amax 448 * 2^(i + j - 3)
    # → e = i + j - 3 → byte 124 + i + j. Packed along channels: 5 → 2 int32.
    x = torch.zeros(64, 160)
    for i in range(2):
        for j in range(5):
            x[32 * i + 31, 32 * j + 7] = 448.0 * 2.0 ** (i + j - 3)
    q, sf = core.ops.per_block_cast(x, block_size=(32, 32), round_sf=True, use_packed_ue8m0=True)
    assert sf.dtype == torch.int32 and sf.shape == (2, 2)
    for i in range(2):
        assert u8(sf)[i][:5] == [124 + i + j for j in range(5)]
    assert (q.float().abs().amax() == 448.0).item()


def test_per_channel_packing_along_tokens():
    # per_channel, groups 32 x 1, T = 130 → 5 token groups (the last covers rows 128, 129);
    # H = 2. Column 0: token group r has amax 448 * 2^r → e = r → byte 127 + r.
    # Column 1: token group r has amax 448 * 2^-r → byte 127 - r.
    # CUDA: the 5 bytes of a column are packed along tokens, 4 per int32 → sf [2, 2] int32;
    # sf[p, c] holds groups 4p .. 4p+3 of column c, little endian.
    x = torch.zeros(130, 2)
    for r in range(5):
        x[min(32 * r + 5, 129), 0] = 448.0 * 2.0**r
        x[min(32 * r + 9, 129), 1] = -448.0 * 2.0**-r
    q, sf = core.ops.per_channel_cast(x, num_per_tokens=32, round_sf=True, use_packed_ue8m0=True)
    assert q.shape == (130, 2) and sf.dtype == torch.int32 and sf.shape == (2, 2)
    b = torch.tensor(u8(sf), dtype=torch.uint8).reshape(2, 2, 4)  # [packed row, column, byte]
    assert b[0, 0].tolist() == [127, 128, 129, 130] and b[1, 0, 0].item() == 131
    assert b[0, 1].tolist() == [127, 126, 125, 124] and b[1, 1, 0].item() == 123
    with core.config.host_layout("ascend"):
        _, sf = core.ops.per_channel_cast(x, num_per_tokens=32, round_sf=True, use_packed_ue8m0=True)
    assert sf.dtype == torch.int16 and sf.shape == (3, 2)
    b = torch.tensor(u8(sf), dtype=torch.uint8).reshape(3, 2, 2)
    assert b[:, 0].flatten().tolist()[:5] == [127, 128, 129, 130, 131]
    assert b[:, 1].flatten().tolist()[:5] == [127, 126, 125, 124, 123]


def test_per_channel_plain_scales_partial_token_group():
    # per_channel g = 32 on T = 40: token group 1 covers rows 32..39 only. Rows past T hold
    # huge values in the underlying storage; they must not take part (x is big[:40]).
    big = torch.zeros(64, 3)
    big[3, :] = torch.tensor([7.0, 14.0, -28.0])  # group 0 → sf = 1/64, 1/32, 1/16
    big[39, :] = torch.tensor([-3.5, 0.0, 448.0])  # group 1 → sf = 1/128, clamp, 1
    big[40:, :] = 1e30
    x = big[:40]
    q, sf = core.ops.per_channel_cast(x, num_per_tokens=32)
    clamp_sf = div32(1e-4, 448.0)
    assert sf.shape == (2, 3)
    assert u8(sf) == [f32_bytes([1 / 64, 1 / 32, 1 / 16]), f32_bytes([1 / 128, clamp_sf, 1.0])]
    assert u8(q)[3] == [0x7E, 0x7E, 0xFE] and u8(q)[39] == [0xFE, 0x00, 0x7E]


# ====================================================================== e4m3-stored sf


def test_e4m3_stored_sf_by_hand():
    # sf8 = e4m3(c / 448), inv = 1 / float(sf8):
    #   amax 448 → 1.0 → sf8 = 0x38, inv = 1 → 448 → 0x7E, 2 → 0x40
    #   amax 100 → 0.22321 → e4m3 step in [0.125, 0.25) is 2^-6 → 14.29 steps → 14 → 0.21875 (0x26)
    #              inv = 1/0.21875 = 4.5714; 100 * 4.5714 = 457.1 → saturates to 448 (0x7E);
    #              50 * 4.5714 = 228.6 → step 16 in [128, 256) → 224 (0x76)
    #   amax 0 → c = clamp 448 * 2^-9 = 0.875 → c/448 = 2^-9 → sf8 = 0x01, inv = 512; q = 0
    x = torch.tensor([row([[448.0, 2.0], [100.0, 50.0], []], 128)], dtype=F32)
    q, sf = core.ops.per_token_cast(x, use_e4m3_sf=True)
    assert sf.dtype == E4M3 and sf.shape == (1, 3)
    assert u8(sf) == [[0x38, 0x26, 0x01]]
    assert sf.float()[0].tolist() == [1.0, 0.21875, 2.0**-9]
    b = u8(q)[0]
    assert b[0:2] == [0x7E, 0x40] and b[128:130] == [0x7E, 0x76] and b[256:] == [0] * 128


def test_e4m3_stored_sf_tiny_group_uses_clamp_inverse():
    # amax 2^-9 (= 0.00195) < clamp 0.875 → sf8 = 2^-9, inv = 512 → 2^-9 * 512 = 1 → 0x38
    x = torch.zeros(1, 128)
    x[0, 3] = 2.0**-9
    q, sf = core.ops.per_token_cast(x, use_e4m3_sf=True)
    assert u8(sf) == [[0x01]] and u8(q)[0][3] == 0x38


def test_e4m3_stored_sf_e2m1():
    # e2m1 with e4m3 sf: sf8 = e4m3(c/6). amax 6 → 1.0 (0x38), inv 1; amax 0 → clamp 6*2^-9 → 2^-9 (0x01).
    x = torch.tensor([row([[6.0, 1.0], []], 16)], dtype=F32)
    q, sf = core.ops.per_token_cast(x, fmt="e2m1", num_per_channels=16, use_e4m3_sf=True)
    assert u8(sf) == [[0x38, 0x01]]
    assert u8(q)[0][0] == 0x27  # 6 → code 7 (low nibble), 1 → code 2 (high nibble)


# ====================================================================== e2m1 codes


# value → nibble code (bit 3 = sign, bits 0-2 index into {0, .5, 1, 1.5, 2, 3, 4, 6}), by hand:
E2M1_CASES = [
    (0.25, 0x0),  # 2m = 0.5 → round_half_even → 0
    (0.75, 0x2),  # 2m = 1.5 → 2 → 1.0
    (1.25, 0x2),  # 2m = 2.5 → 2 → 1.0
    (1.75, 0x4),  # 2m = 3.5 → 4 → 2.0
    (2.5, 0x4),  # round_half_even(2.5) = 2, + 2 → 4 → 2.0
    (3.5, 0x6),  # round_half_even(3.5) = 4, + 2 → 6 → 4.0
    (5.0, 0x6),  # round_half_even(2.5) = 2, + 4 → 6 → 4.0
    (7.0, 0x7),  # clamped to 6 → round(3) + 4 = 7
    (1e9, 0x7),  # saturates
    (-INF, 0xF),  # clamped to 6, sign bit set
    (6.0, 0x7),
    (-0.0, 0x8),  # signbit(-0.0) → code 8
    (0.0, 0x0),
    (-0.25, 0x8),  # magnitude rounds to 0, sign kept
    (-1.0, 0xA),
    (0.3, 0x1),  # 2m = 0.6 → 1 → 0.5
    (2.6, 0x5),  # round(2.6) = 3, + 2 → 5 → 3.0
    (4.9, 0x6),  # round(2.45) = 2, + 4 → 6 → 4.0
    (5.1, 0x7),  # round(2.55) = 3, + 4 → 7 → 6.0
    (-3.5, 0xE),  # sign | 6
    (0.5, 0x1),
    (1.5, 0x3),
    (3.0, 0x5),
    (INF, 0x7),
]


def _pack(codes: list[int]) -> list[int]:
    # element 2i in the low nibble, 2i + 1 in the high nibble
    return [codes[2 * i] | codes[2 * i + 1] << 4 for i in range(len(codes) // 2)]


def test_e2m1_codes_with_unit_precomputed_sf():
    # with a caller-given sf of 1, inv = 1/1 = 1 and q = e2m1(x) exactly.
    values = [v for v, _ in E2M1_CASES]
    codes = [c for _, c in E2M1_CASES]
    x = torch.tensor([values], dtype=F32)  # H = 24 → 2 groups of 16 (the second partial)
    sf = torch.ones(1, 2)
    q = core.ops.per_token_cast_with_precomputed_sf(x, fmt="e2m1", num_per_channels=16, sf=sf)
    assert q.dtype == torch.int8 and q.shape == (1, 12)
    assert u8(q) == [_pack(codes)]


def test_e2m1_nan_saturates_to_six():
    # NaN counts as 6: magnitude code 7 (its sign is whatever signbit(NaN) says; only bits 0-2 checked)
    x = torch.tensor([[NAN, 1.0]], dtype=F32)
    q = core.ops.per_token_cast_with_precomputed_sf(x, fmt="e2m1", num_per_channels=16, sf=torch.ones(1, 1))
    byte = u8(q)[0][0]
    assert byte & 0x7 == 0x7 and byte >> 4 == 0x2


def test_e2m1_nibble_order():
    x = torch.tensor([[1.0, 6.0, 6.0, 1.0, 0.5, -0.0]], dtype=F32)
    q = core.ops.per_token_cast_with_precomputed_sf(x, fmt="e2m1", num_per_channels=16, sf=torch.ones(1, 1))
    # (1.0 → 2, 6 → 7) → 0x72; (6 → 7, 1 → 2) → 0x27; (0.5 → 1, -0 → 8) → 0x81
    assert u8(q) == [[0x72, 0x27, 0x81]]


def test_e2m1_full_cast_ties_and_signs():
    # the same codes through the full cast: each group of 16 also holds a 6 → amax 6, sf 1, inv 6/6 = 1.
    finite = [(v, c) for v, c in E2M1_CASES if math.isfinite(v) and abs(v) <= 6]
    assert len(finite) == 20
    values, codes = [], []
    for start in range(0, 20, 10):  # 10 cases + six 6.0 per group of 16
        values += [v for v, _ in finite[start : start + 10]] + [6.0] * 6
        codes += [c for _, c in finite[start : start + 10]] + [7] * 6
    x = torch.tensor([values], dtype=F32)
    q, sf = core.ops.per_token_cast(x, fmt="e2m1", num_per_channels=16)
    assert sf[0].tolist() == [1.0, 1.0]
    assert u8(q) == [_pack(codes)]


# ====================================================================== e4m3 saturation, RNE


def test_e4m3_saturation_and_rne_with_unit_sf():
    # sf = 1 → inv = 1 → q = saturate(x): clamp to ±448, then round to nearest even.
    values = [449.0, 464.0, 1e9, -1e9, INF, -INF, 447.0, 440.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-11]
    # 449, 464 (would round to 480, not an e4m3fn value) and 1e9 → 448 (0x7E); -1e9 → 0xFE
    # ±inf → clamp → ±448 (0x7E / 0xFE)
    # 447 → step 32 in [256, 512): 416 (0x7D) or 448 (0x7E); 447 is nearer 448 → 0x7E
    # 440 → between 416 and 448 → 448 (0x7E); 1.0625 → 0x38; 1.1875 → 0x3A
    # 2^-10 is the tie between 0 and 2^-9 → even → 0 (0x00)
    # 3*2^-11 = 1.5 * 2^-10... = 0.75 * 2^-9 → nearer 2^-9 → 0x01
    expected = [0x7E, 0x7E, 0x7E, 0xFE, 0x7E, 0xFE, 0x7E, 0x7E, 0x38, 0x3A, 0x00, 0x01]
    x = torch.tensor([values], dtype=F32)
    q = core.ops.per_token_cast_with_precomputed_sf(x, sf=torch.ones(1, 1))
    assert u8(q) == [expected]


def test_e4m3_nan_stays_nan_with_given_sf():
    x = torch.tensor([[NAN, 1.0]], dtype=F32)
    q = core.ops.per_token_cast_with_precomputed_sf(x, sf=torch.ones(1, 1))
    assert torch.isnan(q.float()[0, 0]) and u8(q)[0][1] == 0x38


def test_precomputed_sf_inverse_is_one_division():
    # given sf = 3 → inv = fp32(1/3) = 0.33333334; 3 * inv = 1.0000001 → e4m3 → 1.0 (0x38);
    # 448 * inv = 149.33 → 144 (0x71); given sf = 0.25 → inv = 4 → 2.0 * 4 = 8 → 0x50
    x = torch.tensor([row([[3.0, 448.0], [2.0]], 16)], dtype=F32)
    sf = torch.tensor([[3.0, 0.25]])
    q = core.ops.per_token_cast_with_precomputed_sf(x, num_per_channels=16, sf=sf)
    b = u8(q)[0]
    assert b[0:2] == [0x38, 0x71] and b[16] == 0x50


def test_precomputed_sf_packed_and_e4m3_given_scales():
    # a given packed UE8M0 sf (CUDA int32): bytes [128, 126] → sf 2, 0.5 → inv 0.5, 2
    x = torch.tensor([row([[4.0], [4.0]], 128)], dtype=F32)
    packed = torch.tensor([[128, 126, 0, 0]], dtype=torch.uint8).view(torch.int32)
    q = core.ops.per_token_cast_with_precomputed_sf(x, sf=packed)
    # 4 * 0.5 = 2 → 0x40; 4 * 2 = 8 → 0x50
    assert u8(q)[0][0] == 0x40 and u8(q)[0][128] == 0x50
    # a given e4m3 sf: 0x40 = 2.0 → inv 0.5 → 4 * 0.5 = 2 → 0x40
    sf8 = torch.tensor([[0x40, 0x40]], dtype=torch.uint8).view(E4M3)
    q = core.ops.per_token_cast_with_precomputed_sf(x, sf=sf8)
    assert u8(q)[0][0] == 0x40 and u8(q)[0][128] == 0x40


# ====================================================================== partial groups


def test_partial_last_group_h576_never_reads_past_h():
    # H = 576, g = 128: groups 0..3 cover 128 values, group 4 covers 64 (512..575).
    # x is big[:, :576] of a [2, 640] buffer whose columns 576..639 hold 1e6: a kernel that
    # read the last group as 128 wide would see them. amax of the last group is 2 → sf = 2/448.
    big = torch.zeros(2, 640)
    big[:, :512] = 448.0
    big[:, 512:576] = 0.5
    big[:, 575] = -2.0
    big[:, 576:] = 1e6
    x = big[:, :576]
    assert x.stride() == (640, 1)
    q, sf = core.ops.per_token_cast(x)
    assert sf.shape == (2, 5) and q.shape == (2, 576) and q.is_contiguous()
    last = div32(2.0, 448.0)  # = 1/224
    assert u8(sf) == [f32_bytes([1.0] * 4 + [last])] * 2
    # 0.5 * 224 = 112 (0x6E: 1.75 * 2^6 → exp 13, mant 110); -2 * 224 = -448 (0xFE)
    for r in range(2):
        b = u8(q)[r]
        assert b[:512] == [0x7E] * 512 and b[512:575] == [0x6E] * 63 and b[575] == 0xFE


def test_partial_last_group_per_block_both_directions():
    # per_block (32, 32) on x = big[:33, :40] of [64, 64]: groups 2 x 2; group (1, 1) covers
    # rows 32, columns 32..39 only. Everything else in big is 1e6 beyond the slice.
    big = torch.full((64, 64), 1e6)
    big[:33, :40] = 0.0
    big[0, 0] = 448.0  # group (0, 0): sf 1
    big[5, 35] = 7.0  # group (0, 1): sf 7/448 = 1/64
    big[32, 3] = -14.0  # group (1, 0): sf 1/32
    big[32, 39] = 3.5  # group (1, 1): sf 1/128
    x = big[:33, :40]
    q, sf = core.ops.per_block_cast(x, block_size=(32, 32))
    assert sf.shape == (2, 2) and q.shape == (33, 40)
    assert u8(sf) == [f32_bytes([1.0, 1 / 64]), f32_bytes([1 / 32, 1 / 128])]
    assert u8(q)[32][39] == 0x7E and u8(q)[32][3] == 0xFE


def test_per_block_sf_only_and_precomputed_by_hand():
    # per_block (16, 16) on [20, 24]: 2 x 2 groups, both partial in the second row / column.
    # amax: (0,0) 448 → sf 1; (0,1) 14 → 1/32; (1,0) 0 → clamp → fp32(1e-4)/448; (1,1) 0.875 → 1/512.
    x = torch.zeros(20, 24)
    x[15, 15] = -448.0
    x[0, 23] = 14.0
    x[19, 23] = 0.875
    sf = core.ops.per_block_cast_with_sf_only(x, block_size=(16, 16))
    assert u8(sf) == [f32_bytes([1.0, 1 / 32]), f32_bytes([div32(1e-4, 448.0), 1 / 512])]
    q_full, sf_full = core.ops.per_block_cast(x, block_size=(16, 16))
    assert u8(sf_full) == u8(sf)
    # 14 * 32 = 448 → 0x7E; 0.875 * 512 = 448 → 0x7E; -448 → 0xFE
    assert (u8(q_full)[15][15], u8(q_full)[0][23], u8(q_full)[19][23]) == (0xFE, 0x7E, 0x7E)
    # the caller's sf: 2 everywhere → inv = 0.5 → -448 * 0.5 = -224 (0xF6), 14 * 0.5 = 7 (0x4E:
    # 1.75 * 2^2, exponent field 9), 0.875 * 0.5 = 0.4375 (0x2E: 1.75 * 2^-2, exponent field 5)
    q = core.ops.per_block_cast_with_precomputed_sf(x, block_size=(16, 16), sf=torch.full((2, 2), 2.0))
    assert (u8(q)[15][15], u8(q)[0][23], u8(q)[19][23]) == (0xF6, 0x4E, 0x2E)
    # the same sf given column-major (read off its strides) gives the same bytes
    col = torch.full((2, 2), 2.0).t().contiguous().t()
    assert col.stride() == (1, 2)
    assert u8(core.ops.per_block_cast_with_precomputed_sf(x, block_size=(16, 16), sf=col)) == u8(q)


# ====================================================================== non-finite inputs


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_non_finite_input_poisons_its_group_only(bad):
    # rows 0 and 2 are normal; row 1 has a non-finite value in group 1 only.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 384, generator=g)
    x[1, 200] = bad
    q, sf = core.ops.per_token_cast(x)
    # the affected group: amax NaN → sf NaN; amax inf → sf = inf/448 = inf
    assert not math.isfinite(sf[1, 1].item())
    if math.isnan(bad):
        assert torch.isnan(q[1, 128:256].float()).all()  # inv = NaN
    else:
        assert torch.isnan(q[1, 200].float())  # inf * (448 / inf = 0) = NaN
    # every other group and row is exactly what a cast of the clean data gives
    clean = x.clone()
    clean[1, 200] = 0.0
    q_clean, sf_clean = core.ops.per_token_cast(clean)
    keep = torch.ones(3, 3, dtype=torch.bool)
    keep[1, 1] = False
    assert torch.equal(sf.view(torch.int32)[keep], sf_clean.view(torch.int32)[keep])
    assert u8(q)[0] == u8(q_clean)[0] and u8(q)[2] == u8(q_clean)[2]
    assert u8(q)[1][:128] == u8(q_clean)[1][:128] and u8(q)[1][256:] == u8(q_clean)[1][256:]


@pytest.mark.parametrize("bad", [NAN, INF])
def test_non_finite_input_round_sf_packed_byte_ff(bad):
    x = torch.ones(2, 256)
    x[0, 130] = bad
    sf = core.ops.per_token_cast_with_sf_only(x, round_sf=True, use_packed_ue8m0=True)
    # amax 1 → e = -8 → byte 119; the poisoned group → non-finite scale → byte 0xFF
    assert u8(sf)[0][:2] == [119, 0xFF] and u8(sf)[1][:2] == [119, 119]
    sf32 = core.ops.per_token_cast_with_sf_only(x, round_sf=True)
    assert not math.isfinite(sf32[0, 1].item()) and sf32[1].tolist() == [2.0**-8] * 2


def test_non_finite_per_channel_stays_in_its_column():
    x = torch.ones(40, 3)
    x[33, 1] = NAN
    q, sf = core.ops.per_channel_cast(x, num_per_tokens=32)
    one = div32(1.0, 448.0)
    assert math.isnan(sf[1, 1].item())
    assert sf[0].tolist() == [one] * 3 and sf[1, 0].item() == one and sf[1, 2].item() == one
    # 1 * 448 → 0x7E everywhere outside the poisoned group
    b = torch.tensor(u8(q))
    assert (b[:, 0] == 0x7E).all() and (b[:, 2] == 0x7E).all() and (b[:32, 1] == 0x7E).all()


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_non_finite_input_with_e4m3_sf_is_visible(bad, fmt):
    # SPEC §0: inside an affected group the written scale or values must be non-finite.
    # e4m3fn has no inf, so a non-finite c / max is stored as sf8 = NaN (docs/numerics.md);
    # a saturating cast would have stored a finite 448 and hidden the damage.
    x = torch.ones(2, 32)
    x[0, 3] = bad
    q, sf = core.ops.per_token_cast(x, fmt=fmt, num_per_channels=16, use_e4m3_sf=True)
    assert math.isnan(sf.float()[0, 0].item())
    if fmt == "e4m3":
        assert torch.isnan(q.float()[0, :16]).all()  # inv = 1 / NaN = NaN
    # the other group of row 0 and all of row 1 are untouched
    _, sf_clean = core.ops.per_token_cast(torch.ones(1, 32), fmt=fmt, num_per_channels=16, use_e4m3_sf=True)
    assert u8(sf)[1] == u8(sf_clean)[0] and u8(sf)[0][1] == u8(sf_clean)[0][1]


def test_e4m3_stored_sf_finite_ratio_above_448_saturates():
    # a finite ratio c / 448 > 448 (amax > 200704) saturates to sf8 = 448 (0x7E), inv = 1/448:
    # 3e5 / 448 = 669.6 → clamp 448 → 0x7E; q = e4m3(3e5 / 448) = 669.6 → clamp → 448 → 0x7E.
    x = torch.zeros(1, 128)
    x[0, 0] = 3e5
    q, sf = core.ops.per_token_cast(x, use_e4m3_sf=True)
    assert u8(sf) == [[0x7E]] and u8(q)[0][0] == 0x7E


# ====================================================================== column-major sf


@pytest.mark.parametrize(
    "kwargs, dtype, shape, cuda_stride",
    [
        ({}, F32, (5, 5), (1, 8)),  # fp32: align(5, 16/4 = 4) = 8
        ({"round_sf": True}, F32, (5, 5), (1, 8)),
        ({"round_sf": True, "use_packed_ue8m0": True}, torch.int32, (5, 2), (1, 8)),  # pack first: 5 → 2 ints
        ({"use_e4m3_sf": True}, E4M3, (5, 5), (1, 16)),  # 1-byte sf: align(5, 16) = 16
    ],
)
def test_col_major_sf_strides_cuda(kwargs, dtype, shape, cuda_stride):
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(1))
    q_row, sf_row = core.ops.per_token_cast(x, **kwargs)
    q, sf = core.ops.per_token_cast(x, use_tma_aligned_col_major_sf=True, **kwargs)
    assert sf.dtype == dtype and sf.shape == shape and sf.stride() == cuda_stride
    assert sf_row.stride() == (shape[1], 1)
    assert u8(q) == u8(q_row)
    a, b = torch.tensor(u8(sf)), torch.tensor(u8(sf_row))
    if dtype == torch.int32:  # only the 5 group bytes per row are specified
        a, b = a[:, :5], b[:, :5]
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, dtype, shape",
    [
        ({}, F32, (5, 5)),
        ({"round_sf": True, "use_packed_ue8m0": True}, torch.int16, (5, 3)),  # 5 groups → 3 int16
    ],
)
def test_col_major_sf_strides_ascend(kwargs, dtype, shape):
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(1))
    with core.config.host_layout("ascend"):
        _, sf = core.ops.per_token_cast(x, use_tma_aligned_col_major_sf=True, **kwargs)
    assert sf.dtype == dtype and sf.shape == shape and sf.stride() == (1, 5)  # unpadded: (1, rows)


def test_col_major_sf_per_block_cuda_and_ascend():
    # per_block (128, 128) on [300, 576]: groups 3 x 5; CUDA stride (1, align(3, 4) = 4).
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(2))
    _, sf = core.ops.per_block_cast(x, use_tma_aligned_col_major_sf=True)
    assert sf.shape == (3, 5) and sf.stride() == (1, 4)
    _, sf_row = core.ops.per_block_cast(x)
    assert torch.equal(sf, sf_row)
    with core.config.host_layout("ascend"):
        _, sf = core.ops.per_block_cast(x, use_tma_aligned_col_major_sf=True)
    assert sf.shape == (3, 5) and sf.stride() == (1, 3)


def test_col_major_token_alignment_override():
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(3))
    with core.config.token_alignment(64):
        _, sf = core.ops.per_token_cast(x, use_tma_aligned_col_major_sf=True)
    assert sf.stride() == (1, 16)  # align(5, 64/4 = 16)


# ====================================================================== cast_back


def test_cast_back_by_hand():
    # q = e4m3 bytes [0x38 (1), 0x40 (2), 0xE8 (-64), 0x01 (2^-9)], with x_block_size (1, 128)
    # on H = 130: group 0 is columns 0..127 (sf 3), group 1 is columns 128, 129 (sf 0.5).
    q_bytes = torch.zeros(1, 130, dtype=torch.uint8)
    q_bytes[0, :4] = torch.tensor([0x38, 0x40, 0xE8, 0x01], dtype=torch.uint8)
    q_bytes[0, 128:] = torch.tensor([0x38, 0xC0], dtype=torch.uint8)
    q = q_bytes.view(E4M3)
    sf = torch.tensor([[3.0, 0.5]])
    y = core.ops.cast_back((q, sf), "fp32", (1, 128))
    # 1*3 = 3, 2*3 = 6, -64*3 = -192, 2^-9*3; group 1: 1*0.5, -2*0.5
    assert y.dtype == F32 and y.shape == (1, 130)
    assert y[0, :4].tolist() == [3.0, 6.0, -192.0, 3 * 2.0**-9] and y[0, 128:].tolist() == [0.5, -1.0]
    # bf16: one rounding of the fp32 product; 3 * 2^-9 is exact in bf16
    yb = core.ops.cast_back((q, sf), "bf16", (1, 128))
    assert yb.dtype == torch.bfloat16 and yb.float()[0, :4].tolist() == [3.0, 6.0, -192.0, 3 * 2.0**-9]


def test_cast_back_bf16_rounds_once():
    # q = 1.125 (0x39), sf = 1 + 2^-8 (fp32): product 1.125 + 1.125 * 2^-8 = 1.12939453125.
    # bf16 has 8 significant bits: in [1, 2) the step is 2^-7 = 0.0078125 → candidates 1.125 and
    # 1.1328125; 1.12939 - 1.125 = 0.00439 > half step 0.0039 → 1.1328125.
    q = torch.tensor([[0x39]], dtype=torch.uint8).view(E4M3)
    sf = torch.tensor([[1.0 + 2.0**-8]])
    y = core.ops.cast_back((q, sf), "bf16", (1, 128))
    assert y.float().item() == 1.1328125


def test_cast_back_packed_ue8m0_and_e2m1():
    # e2m1 data [code 2 (1.0), code 0xF (-6)] = byte 0xF2; packed sf bytes [128] → 2^(128-127) = 2
    q = torch.tensor([[0xF2]], dtype=torch.uint8).view(torch.int8)
    sf = torch.tensor([[128, 0, 0, 0]], dtype=torch.uint8).view(torch.int32)
    y = core.ops.cast_back((q, sf), "fp32", (1, 16))
    assert y.tolist() == [[2.0, -12.0]]
    # per-channel packed along tokens: q [3, 1] all 1.0, sf groups of (32, 1): one group, byte 125 → 0.25
    q = torch.full((3, 1), 0x38, dtype=torch.uint8).view(E4M3)
    sf = torch.tensor([[125, 0, 0, 0]], dtype=torch.uint8).view(torch.int32)
    assert sf.shape == (1, 1)
    y = core.ops.cast_back((q, sf), "fp32", (32, 1))
    assert y.tolist() == [[0.25], [0.25], [0.25]]


def test_cast_back_ue8m0_byte_ff_reads_as_nan():
    # UE8M0 reserves 0xFF for NaN: a group whose stored byte is 0xFF comes back NaN;
    # the neighbouring group (byte 127 → 2^0 = 1) is untouched.
    q = torch.full((1, 32), 0x38, dtype=torch.uint8).view(E4M3)  # all 1.0
    sf = torch.tensor([[0xFF, 127, 0, 0]], dtype=torch.uint8).view(torch.int32)
    y = core.ops.cast_back((q, sf), "fp32", (1, 16))
    assert torch.isnan(y[0, :16]).all() and y[0, 16:].tolist() == [1.0] * 16


def test_requantize_multiplies_scales_first():
    # xq = 1.0 (0x38) with sf_in = 3 in groups (1, 128); re-quantize per token with g = 128:
    # values float(xq) * sf_in = 3 → amax 3 → inv = 448/3 → q = e4m3(1 * (3 * (448/3))).
    # 3 * fp32(448/3) = 3 * 149.33333 = 448.0 (rounds to 448) → 0x7E; sf = 3/448.
    xq = torch.full((1, 128), 0x38, dtype=torch.uint8).view(E4M3)
    sf_in = torch.tensor([[3.0]])
    q, sf = core.ops.per_token_cast((xq, sf_in), x_block_size=(1, 128))
    assert u8(sf) == [f32_bytes([div32(3.0, 448.0)])]
    assert u8(q) == [[0x7E] * 128]
