"""rms_norm_rope and rms_norm_rope_per_token_cast (SPEC §6): bytewise the unfused chain
rms_norm (per head) → apply_rotary → per_token_cast, for every sf layout option and both
device families' layouts; golden values; containment; out=; torch.compile."""

from __future__ import annotations

import itertools

import pytest
import torch

from tileplug import core
from tileplug.core.ops.quant import compare_quant
from tileplug.core.ops.rope import make_cos_sin_cache
from tileplug.core.testing import activation, assert_bytes_equal

ops = core.ops


def heads(tokens: int, count: int, width: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    return activation(tokens, count * width, dtype, seed=seed).view(tokens, count, width)


def weight_of(width: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (1.0 + 0.1 * torch.randn(width, generator=generator)).to(dtype)


def chain(x, weight, cache, positions=None, eps=1e-6, interleaved=False, weight_offset=0.0, seqlen_offset=0):
    """The unfused chain through the public ops: per-head rms_norm, then apply_rotary in place."""
    y = ops.rms_norm(x, weight, eps, weight_offset=weight_offset)
    ops.apply_rotary(y, cache, positions=positions, interleaved=interleaved, seqlen_offset=seqlen_offset)
    return y


CONFIGS = [  # (dtype, heads, D, R, interleaved, positions, offset, weight_offset, strided)
    (torch.bfloat16, 9, 64, 64, False, "int64", 0, 0.0, False),
    (torch.bfloat16, 4, 128, 128, True, None, 5, 1.0, True),
    (torch.float16, 3, 192, 64, False, "int32", 2, 0.0, False),
    (torch.float32, 2, 128, 32, True, "int64", 0, 0.0, True),
]


def _inputs(dtype, count, width, rotary, positions, strided, tokens=37, seed=0):
    x = heads(tokens, count, width + (8 if strided else 0), dtype, seed)[..., :width] if strided else \
        heads(tokens, count, width, dtype, seed)
    cache = make_cos_sin_cache(64, rotary)
    given = None
    if positions is not None:
        given = torch.randint(0, 50, (tokens,), generator=torch.Generator().manual_seed(seed + 7)).to(
            getattr(torch, positions))
    return x, weight_of(width, dtype), cache, given


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-N{c[1]}-D{c[2]}-R{c[3]}")
def test_rms_norm_rope_is_the_chain_bytewise(config):
    dtype, count, width, rotary, interleaved, positions, offset, weight_offset, strided = config
    x, weight, cache, given = _inputs(dtype, count, width, rotary, positions, strided)
    before = x.clone()
    fused = ops.rms_norm_rope(x, weight, cache, given, interleaved=interleaved, weight_offset=weight_offset,
                              seqlen_offset=offset)
    expected = chain(x, weight, cache, given, interleaved=interleaved, weight_offset=weight_offset,
                     seqlen_offset=offset)
    assert_bytes_equal(fused, expected, strides=True)
    assert fused.is_contiguous() and fused.dtype == dtype
    assert_bytes_equal(x, before)  # x is only read
    if rotary < width:  # the tail is the norm's output alone
        assert_bytes_equal(fused[..., rotary:], ops.rms_norm(x, weight, weight_offset=weight_offset)[..., rotary:])


LAYOUTS = [{}, {"round_sf": True}, {"round_sf": True, "use_packed_ue8m0": True},
           {"use_tma_aligned_col_major_sf": True},
           {"round_sf": True, "use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True}]


@pytest.mark.parametrize("family", ["cuda", "ascend"])
@pytest.mark.parametrize("fmt,group", [("e4m3", 128), ("e4m3", 32), ("e2m1", 16), ("e2m1", 64)])
def test_quantized_op_is_the_chain_bytewise_for_every_sf_layout(family, fmt, group):
    tokens, count, width = 29, 3, 192
    x, weight, cache, given = _inputs(torch.bfloat16, count, width, 64, "int64", False, tokens, seed=3)
    with core.config.host_layout(family):
        for flags in LAYOUTS:
            arguments = dict(fmt=fmt, num_per_channels=group, **flags)
            q, sf, y = ops.rms_norm_rope_per_token_cast(x, weight, cache, given, interleaved=True,
                                                        return_unquantized=True, **arguments)
            expected_y = chain(x, weight, cache, given, interleaved=True)
            assert_bytes_equal(y, expected_y, strides=True)
            expected = list(ops.per_token_cast(expected_y.view(tokens, count * width), **arguments))
            case = core.Case.of("per_token_cast", count * width, **arguments)
            compare_quant(case, tokens, [q, sf], expected)  # bytewise, strides and sf layout included
            alone = ops.rms_norm_rope_per_token_cast(x, weight, cache, given, interleaved=True, **arguments)
            assert len(alone) == 2
            compare_quant(case, tokens, list(alone), expected)


def test_golden_norm_then_quarter_and_half_turn():
    """One head x = [2, 2, 2, 2], eps = 1e-30: mean square 4 (+ eps, lost in fp32), rstd = 1/2
    exactly, so the norm gives weight = [1, 2, 3, 4]; position 1 turns the NeoX pairs (0, 2)
    by 90° and (1, 3) by 180°: [1, 2, 3, 4] → [−3, −2, 1, −4]."""
    x = torch.full((1, 1, 4), 2.0)
    weight = torch.tensor([1.0, 2.0, 3.0, 4.0])
    cache = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, -1.0, 1.0, 0.0]])
    y = ops.rms_norm_rope(x, weight, cache, torch.tensor([1]), eps=1e-30)
    assert torch.equal(y, torch.tensor([[[-3.0, -2.0, 1.0, -4.0]]]))
    gemma = ops.rms_norm_rope(x, weight - 1.0, cache, torch.tensor([0]), eps=1e-30, weight_offset=1.0)
    assert torch.equal(gemma, torch.tensor([[[1.0, 2.0, 3.0, 4.0]]]))  # position 0: no turn; (w - 1) + 1 = w
    # D = 16, position 0 (no turn), weight [1, 2, 4, 8] × 4: y = weight, amax 8, sf = 8/448,
    # q = y · 56 = [56, 112, 224, 448] (1.75 · 2^k, exact in e4m3)
    wide = torch.full((1, 2, 16), 2.0)
    powers = torch.tensor([1.0, 2.0, 4.0, 8.0]).repeat(4)
    identity = torch.cat([torch.ones(1, 8), torch.zeros(1, 8)], dim=1)
    q, sf = ops.rms_norm_rope_per_token_cast(wide, powers, identity, eps=1e-30, num_per_channels=16)
    assert sf.shape == (1, 2) and torch.equal(sf, torch.full((1, 2), 8.0) / 448.0)  # the fp32 division
    assert q.float().view(2, 16)[0].tolist() == [56.0, 112.0, 224.0, 448.0] * 4


def test_each_token_alone_gives_the_bytes_it_gives_in_a_batch():
    x, weight, cache, given = _inputs(torch.bfloat16, 4, 128, 128, "int64", False, tokens=33, seed=5)
    q, sf, y = ops.rms_norm_rope_per_token_cast(x, weight, cache, given, return_unquantized=True)
    for token in (0, 16, 32):
        part = slice(token, token + 1)
        q1, sf1, y1 = ops.rms_norm_rope_per_token_cast(x[part], weight, cache, given[part], return_unquantized=True)
        assert_bytes_equal(q1, q[part])
        assert_bytes_equal(sf1, sf[part])
        assert_bytes_equal(y1, y[part])


def test_out_of_range_positions_and_non_finite_inputs_stay_in_their_token():
    x, weight, cache, _ = _inputs(torch.bfloat16, 2, 128, 64, None, False, tokens=6, seed=6)
    x[4, 1, 7] = float("inf")
    positions = torch.tensor([1, 64, 2, -3, 5, 0])  # L = 64: tokens 1 and 3 out of range
    q, sf, y = ops.rms_norm_rope_per_token_cast(x, weight, cache, positions, num_per_channels=64,
                                                return_unquantized=True)
    for token in (1, 3):
        assert torch.isnan(y[token, :, :64].float()).all()
        assert torch.isfinite(y[token, :, 64:].float()).all()  # the tail is the norm's, never rotated
        assert torch.isnan(sf[token, ::2]).all()  # the groups holding the NaN channels: visible damage
    assert not torch.isfinite(y[4, 1].float()).all()  # the inf: its own head's norm
    clean = [0, 2, 5]
    fine_positions = positions.clone()
    fine_positions[[1, 3]] = 0
    x_clean = x.clone()
    x_clean[4, 1, 7] = 0.0
    q2, sf2, y2 = ops.rms_norm_rope_per_token_cast(x_clean, weight, cache, fine_positions, num_per_channels=64,
                                                   return_unquantized=True)
    assert_bytes_equal(y[clean], y2[clean])
    assert_bytes_equal(q[clean], q2[clean])
    assert_bytes_equal(sf[clean], sf2[clean])
    assert_bytes_equal(y[4, 0], y2[4, 0])  # the other head of the token with the inf


def test_out_is_written_and_checked():
    x, weight, cache, given = _inputs(torch.bfloat16, 3, 64, 64, "int32", False, tokens=5)
    out = torch.empty(5, 3, 64, dtype=torch.bfloat16)
    result = ops.rms_norm_rope(x, weight, cache, given, out=out)
    assert result is out
    assert_bytes_equal(out, chain(x, weight, cache, given))
    with pytest.raises(core.ContractError, match="'out'"):
        ops.rms_norm_rope(x, weight, cache, given, out=torch.empty(5, 3, 63, dtype=torch.bfloat16))
    with pytest.raises(core.ContractError, match="'out'.*sharing no memory"):
        ops.rms_norm_rope(x, weight, cache, given, out=x)


def test_torch_compile_fullgraph_of_the_qk_path():
    torch._dynamo.reset()
    cache = make_cos_sin_cache(64, 128)
    weight = weight_of(128, torch.bfloat16)

    def qk_path(qkv: torch.Tensor, positions: torch.Tensor):
        q = qkv[:, :512].view(-1, 4, 128)
        k = qkv[:, 512:768].view(-1, 2, 128)
        q8, q_sf = ops.rms_norm_rope_per_token_cast(q, weight, cache, positions, round_sf=True, use_packed_ue8m0=True)
        return q8, q_sf, ops.rms_norm_rope(k, weight, cache, positions, interleaved=True)

    compiled = torch.compile(qk_path, fullgraph=True, dynamic=True)
    for tokens in (3, 21):
        qkv = activation(tokens, 1024, torch.bfloat16, seed=tokens)
        positions = torch.randint(0, 60, (tokens,), generator=torch.Generator().manual_seed(tokens))
        for have, want in zip(compiled(qkv, positions), qk_path(qkv, positions)):
            assert_bytes_equal(have, want, strides=True)
    torch._dynamo.reset()


def test_ledger_of_the_fused_op_against_its_chain():
    """The fused op reads x once and writes q and sf once; the chain also writes y, reads it
    back twice (rotate in place, then quantize) and writes the rotated y once."""
    tokens, count, width = 4096, 32, 128
    x = torch.empty(tokens, count, width, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(width, dtype=torch.bfloat16, device="meta")
    cache = torch.empty(4096, width, device="meta")
    positions = torch.empty(tokens, dtype=torch.int64, device="meta")
    ledger = core.opdefs.get("rms_norm_rope_per_token_cast").ledger
    call, _ = core.describe_call("rms_norm_rope_per_token_cast", x, weight, cache, positions)
    fused = ledger(call, core.CUDA_LAYOUT)
    activation_bytes = tokens * count * width * 2
    assert fused.bytes_read == activation_bytes + width * 2 + tokens * width * 4 + tokens * 8
    assert fused.bytes_written == tokens * count * width + tokens * count * 4  # e4m3 q, one fp32 sf per 128
    norm = core.opdefs.get("rms_norm").ledger(core.describe_call("rms_norm", x, weight)[0], core.CUDA_LAYOUT)
    rope = core.opdefs.get("apply_rotary").ledger(core.describe_call("apply_rotary", x, cache, positions=positions)[0],
                                                  core.CUDA_LAYOUT)
    cast = core.opdefs.get("per_token_cast").ledger(
        core.describe_call("per_token_cast", x.view(tokens, count * width))[0], core.CUDA_LAYOUT)
    unfused = norm.bytes_total + rope.bytes_total + cast.bytes_total
    assert 2.5 < unfused / fused.bytes_total < 4.0


@pytest.mark.parametrize("flags", list(itertools.islice(LAYOUTS, 3)), ids=["plain", "round", "ue8m0"])
def test_fp32_input_chain(flags):
    x, weight, cache, given = _inputs(torch.float32, 2, 64, 64, "int64", True, tokens=11, seed=9)
    q, sf, y = ops.rms_norm_rope_per_token_cast(x, weight, cache, given, num_per_channels=32, fmt="e2m1",
                                                return_unquantized=True, **flags)
    assert_bytes_equal(y, chain(x, weight, cache, given))
    expected = list(ops.per_token_cast(y.view(11, 128), fmt="e2m1", num_per_channels=32, **flags))
    compare_quant(core.Case.of("per_token_cast", 128, fmt="e2m1", num_per_channels=32, **flags), 11, [q, sf], expected)
