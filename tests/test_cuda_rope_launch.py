"""CUDA RoPE kernels, host side, without a GPU: specialisation keys, the launcher's choice of
the 128-bit or the scalar entry per call (pointer and stride alignment) and its argument
order, the empty-cache substitution, and (with nvcc) the scalar variants of the op-table
cases compile — the compile grid (test_cuda_compile.py) covers the vector ones."""

from __future__ import annotations

import pytest
import torch

from tileplug.backend_cuda import jit
from tileplug.backend_cuda.plugin import _KERNELS, make_backend
from tileplug.core.contracts.rope import RotaryInputs
from tileplug.core.lowering import describe_call


def _heads(tokens: int, heads: int, head_dim: int, dtype=torch.bfloat16, pad: int = 0) -> torch.Tensor:
    return torch.zeros(tokens, heads * head_dim + pad, dtype=dtype)[:, :heads * head_dim].unflatten(1, (heads, head_dim))


def _call(query, cache, **kwargs):
    call, inputs = describe_call("apply_rotary", query, cache, **kwargs)
    return _KERNELS["apply_rotary"], call, inputs


def test_registered_and_described() -> None:
    backend = make_backend()
    assert "apply_rotary" in backend.kernels
    assert "apply_rotary" in backend.capabilities()


def test_one_specialisation_serves_every_size_and_stride() -> None:
    """T, head counts, D, strides, cache length and offset are runtime values."""
    specs = set()
    for tokens, heads, head_dim, pad, length in ((1, 8, 128, 0, 10), (4001, 32, 192, 8, 9000), (3, 1, 576, 64, 5)):
        query = _heads(tokens, heads, head_dim, pad=pad)[..., :128]
        key = _heads(tokens, max(1, heads // 4), head_dim)[..., :128]
        kernel, call, _ = _call(query, torch.zeros(length, 64), key=key, seqlen_offset=tokens)
        specs.add(kernel.spec(call))
    assert len(specs) == 1


def test_flags_select_distinct_specialisations() -> None:
    query, key = _heads(3, 4, 128), _heads(3, 2, 128)
    cache = torch.zeros(10, 128)
    positions = torch.zeros(3, dtype=torch.int64)
    names = set()
    for kwargs in ({}, {"key": key}, {"positions": positions}, {"positions": positions.int()}, {"interleaved": True},
                   {"conjugate": True}):
        kernel, call, _ = _call(query, cache, **kwargs)
        names.add(kernel.spec(call).name)
    kernel, call, _ = _call(query.unsqueeze(0), cache)
    names.add(kernel.spec(call).name)
    kernel, call, _ = _call(query.float(), cache)
    names.add(kernel.spec(call).name)
    assert len(names) == 8


def test_scalar_only_rotary_widths() -> None:
    """R/2 not a multiple of the values per 128-bit load: one (scalar) specialisation, with the
    largest power-of-two slot that divides R/2."""
    kernel, call, _ = _call(_heads(3, 4, 64), torch.zeros(10, 36))
    assert kernel.specs(call) == [kernel.spec(call)]
    spec = kernel.spec(call)
    assert not spec.vectorize and spec.pairs == 2 and spec.slots == 9
    kernel, call, _ = _call(_heads(3, 4, 64), torch.zeros(10, 6))
    assert kernel.spec(call).pairs == 1 and kernel.spec(call).slots == 3
    kernel, call, _ = _call(_heads(3, 4, 128), torch.zeros(10, 128))
    assert [s.vectorize for s in kernel.specs(call)] == [True, False]
    assert kernel.supports(call) is None


class Recorder:
    def __init__(self, name: str) -> None:
        self.name, self.calls = name, []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.fixture
def entries(monkeypatch):
    """``jit.entry`` replaced by recorders named after the spec's load path."""
    made = {}

    def fake_entry(spec, arch=None):
        key = "vector" if spec.vectorize else "scalar"
        return made.setdefault(key, Recorder(key))

    monkeypatch.setattr(jit, "entry", fake_entry)
    return made


def test_launcher_takes_the_vector_entry_only_when_aligned(entries) -> None:
    cache = torch.zeros(10, 128)
    cases = [
        (_heads(5, 4, 128), _heads(5, 2, 128), "vector"),
        (_heads(5, 4, 128, pad=8), _heads(5, 2, 128), "vector"),
        (_heads(5, 4, 128, pad=3), _heads(5, 2, 128), "scalar"),  # odd row stride
        (_heads(5, 4, 128), _heads(5, 2, 128, pad=1), "scalar"),  # the key's rows
        (torch.zeros(5 * 4 * 128 + 1, dtype=torch.bfloat16)[1:].view(5, 4, 128), _heads(5, 2, 128), "scalar"),
    ]
    kernel, call, _ = _call(cases[0][0], cache, key=cases[0][1])
    launch = kernel.prepare(call)
    for query, key, expected in cases:
        inputs = RotaryInputs(query, key, cache, None, 7)
        before = {name: len(r.calls) for name, r in entries.items()}
        launch(inputs, ())
        used = [name for name, r in entries.items() if len(r.calls) > before.get(name, 0)]
        assert used == [expected], (query.stride(), key.stride(), used)
        args = entries[expected].calls[-1]
        assert args[0] is query and args[1] is key and args[2] is cache and args[3] == 7
    # a cache whose rows are not 16-byte aligned
    odd_cache = torch.zeros(10, 129)[:, :128]
    launch(RotaryInputs(cases[0][0], cases[0][1], odd_cache, None, 0), ())
    assert entries["scalar"].calls[-1][2] is odd_cache


def test_launcher_argument_order_with_positions_and_no_key(entries) -> None:
    query, cache = _heads(5, 4, 128), torch.zeros(10, 128)
    positions = torch.arange(5, dtype=torch.int32)
    kernel, call, _ = _call(query, cache, positions=positions)
    kernel.prepare(call)(RotaryInputs(query, None, cache, positions, -2), ())
    args = entries["vector"].calls[-1]
    assert len(args) == 4 and args[0] is query and args[1] is cache and args[2] is positions and args[3] == -2


def test_empty_cache_is_replaced_by_one_nan_row(entries) -> None:
    query = _heads(5, 4, 128)
    kernel, call, _ = _call(query, torch.zeros(0, 128))
    kernel.prepare(call)(RotaryInputs(query, None, torch.zeros(0, 128), None, 0), ())
    cache = entries["vector"].calls[-1][1]
    assert cache.shape == (1, 128) and torch.isnan(cache).all()


def test_rotary_wider_than_the_threads_is_declined() -> None:
    kernel, call, _ = _call(_heads(1, 1, 4100, torch.float32), torch.zeros(2, 4098))
    reason = kernel.supports(call)
    assert reason is not None and "threads per head" in reason


@pytest.mark.nvcc
def test_scalar_variants_of_the_op_table_lower_and_compile() -> None:
    """The scalar specialisations the launcher falls back to for misaligned views."""
    pytest.importorskip("tilelang")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_compile import nvcc

    from tileplug.core import opdefs
    from tileplug.core.registry import use_backend

    kernel = _KERNELS["apply_rotary"]
    specs = {}
    for case in opdefs.get("apply_rotary").cases():
        with use_backend("reference"):
            args, kwargs = case.arguments(3, "meta")
        call, _ = describe_call("apply_rotary", *args, **kwargs)
        spec = kernel.spec(call, vectorize=False)
        specs[spec.name] = spec
    sources = [jit.lower_source(spec) for spec in specs.values()]
    assert all("uint4" not in source for source in sources)
    error, _, _ = nvcc("\n".join(sources))
    assert error is None, error


@pytest.mark.parametrize("head_dim,rotary,heads,dtype,offset", [
    (128, 128, 8, torch.bfloat16, 0.0), (64, 64, 16, torch.bfloat16, 1.0), (192, 64, 4, torch.float16, 0.0),
    (576, 64, 2, torch.bfloat16, 0.0), (128, 64, 8, torch.float32, 1.0), (2048, 128, 1, torch.bfloat16, 0.0),
])
def test_rms_norm_rope_runs_the_rms_norm_kernels_norm(head_dim, rotary, heads, dtype, offset) -> None:
    """The fused kernel's norm is the ``NormKernelSpec`` the CUDA ``rms_norm`` kernel uses for the
    same per-head ``x`` (same constants, same macros) on the fused kernel's own row tile
    (``rope.spec.head_tile``), whose reduction adds in the reference's order as every tile's does
    (emulated here bit for bit): the precondition of fused ≡ unfused bytewise (checked on the GPU)."""
    import dataclasses

    from test_cuda_norm_host import emulate_row_sum

    from tileplug.backend_cuda.norm.spec import vector_width
    from tileplug.backend_cuda.rope.spec import head_tile
    from tileplug.core.norm.formulas import row_sum

    x = torch.zeros(3, heads, head_dim, dtype=dtype)
    weight = torch.ones(head_dim, dtype=dtype)
    call, _ = describe_call("rms_norm_rope", x, weight, torch.zeros(10, rotary), eps=1e-5, weight_offset=offset)
    fused = _KERNELS["rms_norm_rope"]
    assert fused.supports(call) is None
    norm_call, _ = describe_call("rms_norm", x, weight, eps=1e-5, weight_offset=offset)
    assert _KERNELS["rms_norm"].supports(norm_call) is None
    tile = head_tile(head_dim, rotary, dtype, False)
    for vectorize in (None, False):
        ours = fused.spec(call, vectorize=vectorize).norm
        theirs = _KERNELS["rms_norm"].spec(dataclasses.replace(norm_call, alignment=16 if vectorize is None else 2))
        assert ours == dataclasses.replace(theirs, tile=tile), (ours, theirs)
    generator = torch.Generator().manual_seed(head_dim)
    terms = torch.randn(4, head_dim, generator=generator) * torch.exp(4 * torch.randn(4, head_dim, generator=generator))
    actual = emulate_row_sum(terms, head_dim, tile, vector_width(dtype))
    assert torch.equal(actual.view(torch.int32), row_sum(terms).view(torch.int32)), tile


@pytest.mark.parametrize("head_dim,rotary,dtype,interleaved,tile", [
    (128, 128, torch.bfloat16, False, (4, 32, 4)),  # 32 values a lane; NeoX halves 64 apart: lane 4·8 divides 64
    (128, 64, torch.bfloat16, False, (4, 32, 4)),  # R/2 = 32 = 4 lanes × 8
    (64, 64, torch.bfloat16, False, (2, 64, 4)),
    (192, 64, torch.float16, False, (4, 32, 6)),  # 8 lanes would hold 24 values; R/2 = 32 needs 4
    (128, 128, torch.float32, False, (4, 32, 8)),
    (128, 128, torch.bfloat16, True, (4, 32, 4)),  # GPT-J: no pairing constraint
    (576, 64, torch.bfloat16, False, (32, 4, 3)),  # R/2 = 32 would need 4 lanes × 18 vectors: rms_norm's tile
    (2048, 128, torch.bfloat16, False, (128, 1, 2)),  # a row of 4 warps: rms_norm's tile
    (100, 100, torch.bfloat16, False, (16, 8, 1)),  # D not whole vectors: rms_norm's tile
])
def test_head_tile(head_dim, rotary, dtype, interleaved, tile) -> None:
    """The fused kernel's tile: about 32 values a lane where a head fits a warp, NeoX pairs within
    a lane where that stays within 64 values; rms_norm's tile otherwise."""
    from tileplug.backend_cuda.rope.spec import head_tile

    chosen = head_tile(head_dim, rotary, dtype, interleaved)
    assert (chosen.lanes, chosen.rows, chosen.chunks) == tile


def test_neox_pairs_within_a_lane_use_no_shared_memory() -> None:
    """Where the tile puts both halves of a NeoX pair in one lane the kernel exchanges nothing
    through shared memory (and still does where it cannot: D = 576, R = 64)."""
    fused = _KERNELS["rms_norm_rope"]
    sources = {}
    for head_dim, rotary, heads in ((128, 128, 8), (576, 64, 2)):
        x = torch.zeros(3, heads, head_dim, dtype=torch.bfloat16)
        call, _ = describe_call("rms_norm_rope", x, torch.ones(head_dim, dtype=torch.bfloat16),
                                torch.zeros(10, rotary), positions=torch.zeros(3, dtype=torch.int64))
        sources[head_dim] = jit.lower_source(fused.spec(call))
    assert "__shared__" not in sources[128] and "__syncwarp" not in sources[128]
    assert "__shared__" in sources[576]


def test_fused_cast_groups_must_not_straddle_heads() -> None:
    """``rms_norm_rope_per_token_cast`` is served when ``D`` is a multiple of the group and
    declined (the reference serves it) when a group would straddle two heads."""
    x = torch.zeros(3, 4, 192, dtype=torch.bfloat16)
    weight = torch.ones(192, dtype=torch.bfloat16)
    kernel = _KERNELS["rms_norm_rope"]
    call, _ = describe_call("rms_norm_rope_per_token_cast", x, weight, torch.zeros(10, 64), num_per_channels=64)
    assert kernel.supports(call) is None
    spec = kernel.spec(call)
    assert spec.quant.group == 64 and spec.norm.quant is None and spec.name != kernel.spec(
        describe_call("rms_norm_rope", x, weight, torch.zeros(10, 64))[0]).name
    call, _ = describe_call("rms_norm_rope_per_token_cast", x, weight, torch.zeros(10, 64))
    assert "straddle" in kernel.supports(call)


def test_fused_cast_launcher_argument_order(entries) -> None:
    """(x, weight, cache, positions, [y], q, sf, offset): packed UE8M0 sf is handed over as core
    allocated it, its int32 words column-major (the kernel writes their bytes)."""
    from tileplug.core import CUDA_LAYOUT
    from tileplug.core.opdefs import get

    x = torch.zeros(5, 4, 128, dtype=torch.bfloat16)
    weight = torch.ones(128, dtype=torch.bfloat16)
    cache = torch.zeros(10, 128)
    positions = torch.arange(5)
    for unquantized in (False, True):
        call, inputs = describe_call("rms_norm_rope_per_token_cast", x, weight, cache, positions=positions,
                                     round_sf=True, use_packed_ue8m0=True, use_tma_aligned_col_major_sf=True,
                                     return_unquantized=unquantized)
        outputs = get("rms_norm_rope_per_token_cast").outputs(call, CUDA_LAYOUT).allocate(5, None)
        _KERNELS["rms_norm_rope"].prepare(call)(inputs, outputs)
        args = entries["vector"].calls[-1]
        assert args[0] is x and args[1] is weight and args[2] is cache and args[3] is positions and args[-1] == 0
        written = args[4:-1]
        assert len(written) == (3 if unquantized else 2)
        if unquantized:
            assert written[0] is outputs.y
        assert written[-2] is outputs.q
        assert written[-1] is outputs.sf  # packed UE8M0 as allocated: the kernel writes its bytes through an alias


def test_rms_norm_rope_takes_the_vector_entry_only_with_an_aligned_cache(monkeypatch) -> None:
    """The vector specialisation of ``rms_norm_rope`` reads each vector's cos/sin as vector loads
    (R/2 a multiple of the values per 128-bit load), so it is launched only when the cache rows
    are 16-byte aligned; the vector source holds those loads and no per-value branch on the half."""
    from tileplug.core.contracts.rope import NormRopeInputs, NormRopeOutputs

    made: dict[str, Recorder] = {}

    def fake_entry(spec, arch=None):
        key = "vector" if spec.norm.vectorize else "scalar"
        return made.setdefault(key, Recorder(key))

    x, weight = torch.zeros(3, 4, 128, dtype=torch.bfloat16), torch.ones(128, dtype=torch.bfloat16)
    kernel = _KERNELS["rms_norm_rope"]
    call, _ = describe_call("rms_norm_rope", x, weight, torch.zeros(10, 128))
    source = kernel.source(call)
    assert source.count("= *(float4*)(cache + ") == 2, "a loop of 128-bit loads each for cos and sin"
    scalar_source = jit.lower_source(kernel.spec(call, vectorize=False))
    assert "(float4*)(cache" not in scalar_source and "cache[" in scalar_source
    monkeypatch.setattr(jit, "entry", fake_entry)
    launch = kernel.prepare(call)
    y = torch.empty_like(x)
    for cache, expected in ((torch.zeros(10, 128), "vector"), (torch.zeros(10, 132)[:, :128], "vector"),
                            (torch.zeros(10, 129)[:, :128], "scalar"), (torch.zeros(10 * 128 + 1)[1:].view(10, 128),
                                                                        "scalar")):
        before = {name: len(r.calls) for name, r in made.items()}
        launch(NormRopeInputs(x, weight, cache, None, 0), NormRopeOutputs(y))
        used = [name for name, r in made.items() if len(r.calls) > before.get(name, 0)]
        assert used == [expected], (cache.stride(), cache.data_ptr() % 16, used)
        assert made[expected].calls[-1][2] is cache


HEAD_DIMS = (32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 512, 576, 1024)
HEAD_CASES = [(head_dim, rotary, dtype, interleaved)
              for head_dim in HEAD_DIMS
              for rotary in sorted({head_dim, head_dim // 2 - head_dim // 2 % 2, 64, 32, 2} - {0})
              if rotary <= head_dim
              for dtype in (torch.bfloat16, torch.float32) for interleaved in (False, True)]


def _lane_columns(tile, vec: int, lane: int, chunk: int) -> range:
    return range((chunk * tile.lanes + lane) * vec, (chunk * tile.lanes + lane + 1) * vec)


@pytest.mark.parametrize("head_dim,rotary,dtype,interleaved", HEAD_CASES,
                         ids=[f"D{d}-R{r}-{str(t)[6:]}-{'gptj' if i else 'neox'}" for d, r, t, i in HEAD_CASES])
def test_head_tile_covers_the_head_and_pairs_within_a_lane(head_dim, rotary, dtype, interleaved) -> None:
    """On every head size a model uses (and odd ones) the fused kernel's tile covers the head
    within one CTA, adds in the reference's order (emulated bit for bit), and where it pairs NeoX
    halves inside a lane (``pair_chunks``) lane ``l``'s vector ``k + P`` holds exactly the partners
    of its vector ``k``, every pair of the rotated channels once."""
    from test_cuda_norm_host import emulate_row_sum

    from tileplug.backend_cuda.norm.spec import row_tile, vector_width
    from tileplug.backend_cuda.rope.spec import head_tile, pair_chunks
    from tileplug.core.norm.formulas import row_sum

    tile = head_tile(head_dim, rotary, dtype, interleaved)
    vec = vector_width(dtype)
    assert tile is not None and tile.lanes * tile.chunks * vec >= head_dim and tile.threads <= 1024
    if row_tile(head_dim, dtype).rows > 1:
        assert tile.threads == 128 and tile.lanes <= 32
    generator = torch.Generator().manual_seed(head_dim * 7 + rotary)
    terms = torch.randn(2, head_dim, generator=generator) * torch.exp(4 * torch.randn(2, head_dim, generator=generator))
    assert torch.equal(emulate_row_sum(terms, head_dim, tile, vec).view(torch.int32), row_sum(terms).view(torch.int32))
    pairs = pair_chunks(rotary, tile.lanes, vec, interleaved)
    if interleaved or (rotary // 2) % vec:
        assert pairs is None
        return
    if pairs is None:  # the exchange through shared memory: only where pairing would hold > 64 values a lane
        assert (rotary // 2) % (tile.lanes * vec)
        return
    half = rotary // 2
    firsts = []
    for lane in range(tile.lanes):
        for chunk in range(pairs):
            own, partner = _lane_columns(tile, vec, lane, chunk), _lane_columns(tile, vec, lane, chunk + pairs)
            assert own[-1] < half and list(partner) == [column + half for column in own]
            firsts.extend(own)
    assert sorted(firsts) == list(range(half))


GROUP_CASES = [(head_dim, dtype, group) for head_dim in HEAD_DIMS for dtype in (torch.bfloat16, torch.float32)
               for group in (16, 32, 64, 128) if head_dim % group == 0]


@pytest.mark.parametrize("head_dim,dtype,group", GROUP_CASES,
                         ids=[f"D{d}-{str(t)[6:]}-g{g}" for d, t, g in GROUP_CASES])
def test_cast_groups_are_whole_on_the_head_tile(head_dim, dtype, group) -> None:
    """``row_cast.group_layout`` on the fused kernel's tile: the columns a thread's group reads
    (its chunks, over the lanes its shuffles reach) are exactly the ``group`` columns of one
    quantization group, the one its first chunk's column names (where the scale is stored)."""
    from tileplug.backend_cuda.norm.row_cast import group_layout
    from tileplug.backend_cuda.norm.spec import vector_width
    from tileplug.backend_cuda.rope.spec import head_tile

    vec = vector_width(dtype)
    tile = head_tile(head_dim, head_dim, dtype, False)
    groups, steps = group_layout(group, tile.lanes, vec, tile.chunks)
    assert sorted(chunk for chunks in groups for chunk in chunks) == list(range(tile.chunks))
    for lane in range(tile.lanes):
        reached = {lane}
        for distance in steps:
            reached |= {other ^ distance for other in reached}
        assert all(other < tile.lanes for other in reached)
        for chunks in groups:
            first = _lane_columns(tile, vec, lane, chunks[0])[0]
            if first >= head_dim:
                continue
            columns = {column for other in reached for chunk in chunks
                       for column in _lane_columns(tile, vec, other, chunk) if column < head_dim}
            start = first // group * group
            assert columns == set(range(start, min(start + group, head_dim))), (lane, chunks)


@pytest.mark.parametrize("op", ["rms_norm_rope", "rms_norm_rope_per_token_cast"])
def test_norm_rope_ctas_per_sm_is_a_tuning_knob(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused QK kernels leave ptxas its register choice by default (``__launch_bounds__(threads, 1)``);
    ``TILEPLUG_CUDA_NORM_ROPE_CTAS_PER_SM`` asks for that many CTAs an SM; a non-integer is refused."""
    import re

    from tileplug import core
    from tileplug.core.benchmark import bench_cases

    case = bench_cases()[op]
    args, kwargs = case.arguments(4096, 7168, torch.bfloat16, torch.device("meta"))

    def bounds() -> list[str]:
        return re.findall(r"__launch_bounds__\(([^)]*)\)", core.lower(getattr(core.ops, case.op), *args, backend="cuda",
                                                                     **kwargs))

    assert bounds() == ["128, 1"]
    monkeypatch.setenv("TILEPLUG_CUDA_NORM_ROPE_CTAS_PER_SM", "8")
    assert bounds() == ["128, 8"]
    monkeypatch.setenv("TILEPLUG_CUDA_NORM_ROPE_CTAS_PER_SM", "eight")
    with pytest.raises(ValueError, match="TILEPLUG_CUDA_NORM_ROPE_CTAS_PER_SM='eight': expected an integer"):
        bounds()
