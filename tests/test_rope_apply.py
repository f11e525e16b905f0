"""apply_rotary (SPEC §6) on the reference: hand-worked values, the pairings, conjugation,
tail RoPE, positions modes, 4-D, fused QKV views, out-of-range positions, non-finite
inputs, batch invariance, the fast path, torch.compile and the memory checks."""

from __future__ import annotations

import math

import pytest
import torch

from tileplug import core
from tileplug.core.call import has_internal_overlap, share_memory
from tileplug.core.ops.rope import make_cos_sin_cache
from tileplug.core.testing import activation, assert_bytes_equal, assert_within_ulps, ulp_distance

apply_rotary = core.ops.apply_rotary


def heads(tokens: int, count: int, width: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    return activation(tokens, count * width, dtype, seed=seed).view(tokens, count, width)


def rotated(x: torch.Tensor, cache: torch.Tensor, **kwargs) -> torch.Tensor:
    """A rotated copy of ``x`` (apply_rotary on a contiguous clone)."""
    copy = x.clone()
    apply_rotary(copy, cache, **kwargs)
    return copy


def angle_cache(angles: list[list[float]]) -> torch.Tensor:
    """fp32 [L, R] cache of exact cos / sin of the given angles (degrees, multiples of 90)."""
    table = torch.tensor(angles, dtype=torch.float64) * math.pi / 180
    return torch.cat([table.cos().round(), table.sin().round()], dim=1).to(torch.float32)


# ---------------------------------------------------------------------- hand-worked values


def test_neox_golden_quarter_and_half_turn():
    """x = [1, 2, 3, 4], position 1 of a cache with angles (90°, 180°): NeoX pairs (0, 2), (1, 3)."""
    cache = angle_cache([[0, 0], [90, 180]])
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    apply_rotary(x, cache, positions=torch.tensor([1]))
    # pair (0, 2) by 90°: (1, 3) → (1·0 − 3·1, 3·0 + 1·1) = (−3, 1); pair (1, 3) by 180°: (2, 4) → (−2, −4)
    assert torch.equal(x, torch.tensor([[[-3.0, -2.0, 1.0, -4.0]]]))


def test_gptj_golden_quarter_and_half_turn():
    cache = angle_cache([[0, 0], [90, 180]])
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    apply_rotary(x, cache, positions=torch.tensor([1]), interleaved=True)
    # pair (0, 1) by 90°: (1, 2) → (−2, 1); pair (2, 3) by 180°: (3, 4) → (−3, −4)
    assert torch.equal(x, torch.tensor([[[-2.0, 1.0, -3.0, -4.0]]]))


def test_bf16_golden_with_one_rounding_at_the_store():
    """c = 0.5, n = 0.75 (exact in fp32), NeoX pairs (0, 2) and (1, 3).
    Pair (1.5, 3): y1 = 0.75 − 2.25 = −1.5, y2 = 1.5 + 1.125 = 2.625 (exact).
    Pair (1 + 2^-7, 2^-7): y1 = 0.5 + 2^-8 − 1.5·2^-8 = 0.5 − 2^-9 (exact in bf16, whose ulp
    below 0.5 is 2^-9); y2 = 2^-8 + 0.75 + 1.5·2^-8 = 0.75 + 2.5·2^-8, exact in fp32 and a tie
    in bf16 (ulp 2^-8 there): to even, 0.75 + 2·2^-8 (round-half-up would give + 3·2^-8)."""
    cache = torch.tensor([[0.5, 0.5, 0.75, 0.75]])
    x = torch.tensor([[[1.5, 1 + 2**-7, 3.0, 2**-7]]]).to(torch.bfloat16)
    apply_rotary(x, cache)
    expected = torch.tensor([[[-1.5, 0.5 - 2**-9, 2.625, 0.75 + 2 * 2**-8]]]).to(torch.bfloat16)
    assert_bytes_equal(x, expected)


@pytest.mark.parametrize("dtype,roundoff", [(torch.bfloat16, 2**-8), (torch.float16, 2**-11), (torch.float32, 0.0)])
def test_matches_an_exact_rotation_within_the_contracts_rounding(dtype, roundoff):
    """An independent model: the rotation in fp64 from the cache's values. The contract's fp32
    arithmetic errs by at most ``3·2^-24·(|x1·c| + |x2·n|)`` and the store rounds once (half
    an ulp: ``u·|y|``); the cache itself is the fp64 table rounded once to fp32."""
    tokens, count, width = 37, 3, 128
    cache = make_cos_sin_cache(64, width)
    angles = torch.arange(64, dtype=torch.float64)[:, None] * (10000.0 ** (-torch.arange(64, dtype=torch.float64) / 64))
    assert torch.allclose(cache.double(), torch.cat([angles.cos(), angles.sin()], dim=1), rtol=0, atol=2**-24)
    positions = torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(1))
    x = heads(tokens, count, width, dtype, seed=2)
    rows = cache.double()[positions]
    cos, sin = rows[:, None, :64], rows[:, None, 64:]
    x1, x2 = x[..., :64].double(), x[..., 64:].double()
    exact = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    terms = torch.cat([(x1 * cos).abs() + (x2 * sin).abs(), (x2 * cos).abs() + (x1 * sin).abs()], dim=-1)
    apply_rotary(x, cache, positions=positions)
    bound = roundoff * exact.abs() + 3 * 2**-24 * terms + 2**-24
    assert ((x.double() - exact).abs() <= bound).all()


def test_identity_rotation_returns_x_bitwise():
    """cos = 1, sin = 0: every dtype, both pairings, R = D and R < D."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rotary in (128, 32):
            cache = torch.cat([torch.ones(8, rotary // 2), torch.zeros(8, rotary // 2)], dim=1)
            x = heads(5, 3, 128, dtype)
            for interleaved in (False, True):
                assert_bytes_equal(rotated(x, cache, interleaved=interleaved), x)


def test_neox_and_gptj_differ_and_each_keeps_its_pairs_norm():
    x = heads(9, 2, 64, torch.float32)
    cache = make_cos_sin_cache(32, 64)
    neox, gptj = rotated(x, cache, seqlen_offset=3), rotated(x, cache, seqlen_offset=3, interleaved=True)
    assert not torch.equal(neox, gptj)
    neox_norm = neox[..., :32] ** 2 + neox[..., 32:] ** 2
    gptj_norm = gptj[..., 0::2] ** 2 + gptj[..., 1::2] ** 2
    torch.testing.assert_close(neox_norm, x[..., :32] ** 2 + x[..., 32:] ** 2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gptj_norm, x[..., 0::2] ** 2 + x[..., 1::2] ** 2, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype,roundoff", [(torch.bfloat16, 2**-8), (torch.float16, 2**-11), (torch.float32, 2**-24)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_conjugate_undoes_the_rotation_within_rounding(dtype, roundoff, interleaved):
    """Rotating, then rotating back: each of the two stores rounds by at most ``u·|pair|``
    (a rotation keeps the pair's length), so the round trip is within ``2u·|pair|`` (+ the
    fp32 arithmetic, ``4·2^-24·|pair|``)."""
    x = heads(33, 4, 128, dtype, seed=5)
    cache = make_cos_sin_cache(64, 128)
    positions = torch.randint(0, 64, (33,), generator=torch.Generator().manual_seed(6))
    there = rotated(x, cache, positions=positions, interleaved=interleaved)
    back = rotated(there, cache, positions=positions, interleaved=interleaved, conjugate=True)
    assert not torch.equal(there, x)
    x32, back32 = x.float(), back.float()
    first, second = (slice(0, 128, 2), slice(1, 128, 2)) if interleaved else (slice(0, 64), slice(64, 128))
    pair = torch.sqrt(x32[..., first] ** 2 + x32[..., second] ** 2)
    bound = (2 * roundoff + 4 * 2**-24) * pair * 1.001
    assert ((back32[..., first] - x32[..., first]).abs() <= bound).all()
    assert ((back32[..., second] - x32[..., second]).abs() <= bound).all()


# ---------------------------------------------------------------------- tail RoPE, layouts


def test_tail_rope_leaves_the_other_channels_untouched_bytewise():
    x = heads(11, 3, 192, torch.float16, seed=3)
    cache = make_cos_sin_cache(16, 64)
    out = rotated(x, cache, seqlen_offset=2)
    assert_bytes_equal(out[..., 64:], x[..., 64:])
    assert_bytes_equal(out[..., :64], rotated(x[..., :64].contiguous(), cache, seqlen_offset=2))


def test_mla_rope_part_through_a_view_of_576_channel_heads():
    """DeepSeek MLA: each 576-channel head rotates its last 64 channels (a view); the first
    512 stay untouched bytewise; the view's result equals rotating a contiguous copy."""
    q = heads(13, 4, 576, seed=4)
    original = q.clone()
    cache = make_cos_sin_cache(32, 64)
    positions = torch.arange(13, dtype=torch.int64) * 2
    apply_rotary(q[..., -64:], cache, positions=positions)
    assert_bytes_equal(q[..., :512], original[..., :512])
    assert_bytes_equal(q[..., -64:], rotated(original[..., -64:].contiguous(), cache, positions=positions))


def test_fused_qkv_views_rotate_q_and_k_and_touch_nothing_else():
    tokens, query_heads, key_heads, width, pad = 7, 4, 2, 128, 8
    buffer = activation(tokens, (query_heads + 2 * key_heads) * width + pad, torch.bfloat16, seed=8)
    original = buffer.clone()
    q = buffer[:, :query_heads * width].view(tokens, query_heads, width)
    k = buffer[:, query_heads * width:(query_heads + key_heads) * width].view(tokens, key_heads, width)
    cache = make_cos_sin_cache(32, width)
    positions = torch.tensor([5, 0, 3, 3, 31, 1, 9], dtype=torch.int32)
    apply_rotary(q, cache, key=k, positions=positions, interleaved=True)
    value_part = slice((query_heads + key_heads) * width, None)
    assert_bytes_equal(buffer[:, value_part], original[:, value_part])  # v and the row padding
    q0 = original[:, :query_heads * width].reshape(tokens, query_heads, width)
    k0 = original[:, query_heads * width:(query_heads + key_heads) * width].reshape(tokens, key_heads, width)
    assert_bytes_equal(q, rotated(q0, cache, positions=positions, interleaved=True))
    assert_bytes_equal(k, rotated(k0, cache, positions=positions, interleaved=True))


def test_transposed_4d_layout_and_3d_flattening_agree():
    """[B, S, N, D] (a transposed [B, N, S, D] buffer: any strides) ≡ the same tokens as
    [B·S, N, D] with the positions flattened, bytewise."""
    batch, steps, count, width = 2, 5, 3, 64
    stored = activation(batch * count * steps, width, torch.bfloat16, seed=9).view(batch, count, steps, width)
    x4 = stored.transpose(1, 2)  # [B, S, N, D], not contiguous
    x3 = x4.reshape(batch * steps, count, width).clone()
    cache = make_cos_sin_cache(40, width)
    positions = torch.randint(0, 40, (batch, steps), generator=torch.Generator().manual_seed(10))
    apply_rotary(x4, cache, positions=positions)
    apply_rotary(x3, cache, positions=positions.reshape(-1))
    assert_bytes_equal(x4.reshape(batch * steps, count, width), x3)


def test_positions_modes_are_equivalent():
    """None + offset ≡ explicit arange (int32, int64) + offset ≡ arange + offset with offset 0;
    4-D None: the position is ``offset + s`` in every batch row."""
    x = heads(17, 2, 128, seed=11)
    cache = make_cos_sin_cache(40, 128)
    implicit = rotated(x, cache, seqlen_offset=6)
    for dtype in (torch.int32, torch.int64):
        steps = torch.arange(17, dtype=dtype)
        assert_bytes_equal(rotated(x, cache, positions=steps, seqlen_offset=6), implicit)
        assert_bytes_equal(rotated(x, cache, positions=steps + 6), implicit)
    x4 = torch.stack([x, heads(17, 2, 128, seed=12)])
    out4 = rotated(x4, cache, seqlen_offset=6)
    for row in range(2):
        assert_bytes_equal(out4[row], rotated(x4[row], cache, seqlen_offset=6))


def test_key_rotates_like_a_query():
    q, k = heads(6, 4, 64, seed=13), heads(6, 1, 64, seed=14)
    cache = make_cos_sin_cache(16, 64)
    q_alone, k_alone = rotated(q, cache, seqlen_offset=1), rotated(k, cache, seqlen_offset=1)
    apply_rotary(q, cache, key=k, seqlen_offset=1)
    assert_bytes_equal(q, q_alone)
    assert_bytes_equal(k, k_alone)


def test_each_token_alone_gives_the_bytes_it_gives_in_a_batch():
    x = heads(41, 3, 128, seed=15)
    cache = make_cos_sin_cache(64, 128)
    positions = torch.randint(0, 64, (41,), generator=torch.Generator().manual_seed(16))
    batch = rotated(x, cache, positions=positions)
    for token in (0, 17, 40):
        alone = rotated(x[token:token + 1], cache, positions=positions[token:token + 1])
        assert_bytes_equal(alone, batch[token:token + 1])


# ---------------------------------------------------------------------- damage stays contained


def test_out_of_range_positions_give_nan_rotated_channels_in_their_row_only():
    x = heads(6, 2, 128, seed=17)
    cache = make_cos_sin_cache(10, 64)  # R = 64 < D: the tail is never touched
    positions = torch.tensor([3, -1, 10, 9, 2**40, 0])
    out = rotated(x, cache, positions=positions)
    bad = torch.tensor([False, True, True, False, True, False])
    assert torch.isnan(out[bad][..., :64].float()).all()
    assert_bytes_equal(out[..., 64:], x[..., 64:])
    good_positions = positions.clone()
    good_positions[bad] = 0
    assert_bytes_equal(out[~bad], rotated(x, cache, positions=good_positions)[~bad])
    # an offset that pushes positions out of range (and one that brings them back)
    assert torch.isnan(rotated(x, cache, seqlen_offset=10).float()[..., :64]).all()
    assert_bytes_equal(rotated(x, cache, positions=positions + 5, seqlen_offset=-5), out, nan_equal=True)


def test_an_empty_cache_gives_nan_without_a_crash():
    x = heads(3, 1, 64, seed=18)
    out = rotated(x, torch.empty(0, 64))
    assert torch.isnan(out.float()).all()


def test_non_finite_inputs_stay_in_their_token():
    x = heads(5, 2, 64, torch.float32, seed=19)
    x[2, 1, 3] = float("inf")
    cache = make_cos_sin_cache(8, 64)
    out = rotated(x, cache)
    clean = x.clone()
    clean[2, 1, 3] = 0.0
    reference = rotated(clean, cache)
    others = torch.ones(5, 2, dtype=torch.bool)
    others[2, 1] = False
    assert_bytes_equal(out[others], reference[others])
    assert not torch.isfinite(out[2, 1, [3, 35]]).any()  # the pair (3, 35) of the infinite element


# ---------------------------------------------------------------------- fast path, compile


def test_the_fast_path_never_freezes_the_offset_or_the_overlap_answer():
    x = heads(4, 2, 64, seed=20)
    cache = make_cos_sin_cache(16, 64)
    first = rotated(x, cache, seqlen_offset=0)
    second = rotated(x, cache, seqlen_offset=3)  # the same signature: a memo hit
    assert not torch.equal(first, second)
    assert_bytes_equal(second, rotated(x, cache, positions=torch.arange(4) + 3))
    buffer = torch.zeros(4, 3 * 64, dtype=torch.bfloat16)
    q = buffer[:, :128].view(4, 2, 64)
    apply_rotary(q, cache, key=buffer[:, 128:].view(4, 1, 64))  # disjoint: accepted (and memoised)
    with pytest.raises(core.ContractError, match="'key'.*sharing no memory"):
        apply_rotary(q, cache, key=buffer[:, 64:128].view(4, 1, 64))  # same shapes, overlapping
    with pytest.raises(core.ContractError, match="'seqlen_offset'"):
        apply_rotary(q, cache, seqlen_offset=1.0)


def test_torch_compile_fullgraph_mutates_like_eager():
    torch._dynamo.reset()
    cache = make_cos_sin_cache(64, 128)

    def attention_prologue(qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = qkv[:, :512].view(-1, 4, 128)
        k = qkv[:, 512:768].view(-1, 2, 128)
        apply_rotary(q, cache, key=k, positions=positions, seqlen_offset=2)
        return qkv.sum()

    compiled = torch.compile(attention_prologue, fullgraph=True, dynamic=True)
    for tokens in (3, 19):
        buffer = activation(tokens, 1024, torch.bfloat16, seed=tokens)
        positions = torch.randint(0, 60, (tokens,), generator=torch.Generator().manual_seed(tokens))
        eager, traced = buffer.clone(), buffer.clone()
        attention_prologue(eager, positions)
        compiled(traced, positions)
        assert not torch.equal(traced, buffer)
        assert_bytes_equal(traced, eager)
    explanation = torch._dynamo.explain(attention_prologue)(buffer.clone(), positions)
    assert explanation.graph_break_count == 0
    torch._dynamo.reset()


def test_opcheck_on_fused_qkv_views():
    buffer = activation(5, 4 * 64, torch.bfloat16, seed=21)
    q, k = buffer[:, :128].view(5, 2, 64), buffer[:, 128:192].view(5, 1, 64)
    cache = make_cos_sin_cache(8, 32)
    arguments = (q, cache, k, torch.tensor([0, 1, 7, 3, 2]), True, False, 0)
    torch.library.opcheck(torch.ops.tileplug.apply_rotary.default, arguments)


def test_schema_declares_the_mutated_arguments():
    schema = core.opdefs.get("apply_rotary").schema
    assert schema.startswith("(Tensor(a!) query, Tensor cos_sin_cache, Tensor(b!)? key, Tensor? positions")
    assert schema.endswith("-> ()")


def test_ledger_counts_the_rotated_channels_only():
    query, key = heads(10, 4, 192), heads(10, 2, 192)
    call, _ = core.describe_call("apply_rotary", query, make_cos_sin_cache(16, 64), key=key,
                                 positions=torch.arange(10, dtype=torch.int32))
    ledger = core.opdefs.get("apply_rotary").ledger(call, core.CUDA_LAYOUT)
    moved = 10 * 6 * 64 * 2
    assert ledger.bytes_written == moved
    assert ledger.bytes_read == moved + 10 * 4 + 10 * 64 * 4


# ---------------------------------------------------------------------- the memory checks


def test_share_memory_is_exact_for_views_of_one_buffer():
    buffer = torch.zeros(6, 8 * 64)
    view = lambda start, count: buffer[:, start * 64:(start + count) * 64].view(6, count, 64)  # noqa: E731
    assert not share_memory(view(0, 4), view(4, 2))  # q and k of a QKV buffer
    assert not share_memory(view(4, 2), view(0, 4))
    assert share_memory(view(0, 4), view(3, 2))  # the last query head is the first key head
    assert share_memory(view(0, 4), view(0, 4))
    assert not share_memory(buffer[0:3].view(3, 8, 64), buffer[3:6].view(3, 8, 64))
    assert share_memory(buffer[0:4].view(4, 8, 64), buffer[3:6].view(3, 8, 64))
    halves = buffer.view(6, 8, 64)
    assert not share_memory(halves[..., :32], halves[..., 32:])  # interleaved columns
    assert share_memory(halves[..., :33], halves[..., 32:])
    assert not share_memory(halves[:, 0::2], halves[:, 1::2])  # alternate heads
    assert share_memory(halves[:, 0::2], halves[:, 2::4])
    assert not share_memory(torch.zeros(3, 2, 4), torch.zeros(3, 2, 4))


def test_internal_overlap_is_detected():
    assert has_internal_overlap(torch.zeros(1, 2, 64).expand(4, 2, 64))
    assert has_internal_overlap(torch.zeros(300).as_strided((4, 2, 64), (64, 32, 1)))
    assert not has_internal_overlap(torch.zeros(2, 5, 3, 64).transpose(1, 2))


def test_ulp_distance_counts_representable_values():
    one = torch.tensor([1.0], dtype=torch.bfloat16)
    next_up = torch.tensor([1.0 + 2**-7], dtype=torch.bfloat16)
    assert int(ulp_distance(one, next_up)) == 1
    assert int(ulp_distance(torch.tensor([-0.0]), torch.tensor([0.0]))) == 0
    smallest = torch.tensor([2**-149], dtype=torch.float32)
    assert int(ulp_distance(-smallest, smallest)) == 2
    with pytest.raises(AssertionError, match="more than 1 ulp apart"):
        assert_within_ulps(torch.tensor([1.0 + 2**-6], dtype=torch.bfloat16), one, 1)
    with pytest.raises(AssertionError, match="NaN mismatch"):
        assert_within_ulps(torch.tensor([float("nan")]), torch.tensor([1.0]), 1)
    assert_within_ulps(torch.tensor([float("nan")]), torch.tensor([float("nan")]), 1)
    assert_within_ulps(next_up, one, 1)
