"""CUDA RoPE kernels on a GPU: ``apply_rotary`` within 1 ulp of the reference (SPEC §6),
untouched bytes untouched, containment of out-of-range positions, batch invariance and
determinism bytewise.

Run on the GPU host (compute capability >= 9.0)::

    hatch run python -m pytest tests/gpu/test_cuda_rope.py -m gpu -q

Every specialisation the module launches (about 90: vector and scalar paths, the norm and
cast kernels of the unfused chains) is compiled
up front by ``jit.precompile`` in a spawned process pool, so the tests themselves take
seconds. The oracle is the reference backend on the same GPU (its fp32 arithmetic is IEEE
there: separate products and sums, the order the kernel uses), run on a copy of the
buffer made before the CUDA kernel writes the original.

Each setup builds one buffer per tensor of heads (``[rows, heads·D + pad]``, a fused QKV
buffer when ``qkv``) and hands the op *views* of it, so every test also checks that the
bytes outside the rotated channels (tails past ``R``, the V part, row padding) are
unchanged.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

BACKEND = "cuda"


@dataclasses.dataclass(frozen=True)
class Setup:
    """One ``apply_rotary`` configuration: ``tokens`` (``S`` when ``batch``), query ``heads``,
    ``key_heads`` (0: no key), head width ``head_dim`` of the buffer, rotary width
    ``rotary``, ``tail`` (the op gets ``x[..., -tail:]`` of each head, MLA's rope part;
    0: the whole head), ``dtype``, pairing, conjugation, ``positions`` ('none' / 'int32' /
    'int64'), ``batch`` (4-D ``[batch, tokens, N, D]``; 0: 3-D), ``qkv`` (query, key and
    a V part in one buffer), ``pad`` (extra elements per buffer row), ``offset``."""

    tokens: int = 37
    heads: int = 8
    key_heads: int = 2
    head_dim: int = 128
    rotary: int = 128
    tail: int = 0
    dtype: torch.dtype = torch.bfloat16
    interleaved: bool = False
    conjugate: bool = False
    positions: str = "int64"
    batch: int = 0
    qkv: bool = False
    pad: int = 0
    offset: int = 3

    @property
    def rows(self) -> int:
        return self.tokens * self.batch if self.batch else self.tokens

    @property
    def cache_length(self) -> int:
        return self.tokens + 50 + max(self.offset, 0)

    def label(self) -> str:
        parts = [f"T{self.tokens}", f"N{self.heads}k{self.key_heads}", f"D{self.head_dim}", f"R{self.rotary}",
                 str(self.dtype).replace("torch.", ""), "gptj" if self.interleaved else "neox", self.positions]
        for flag, text in ((self.tail, f"tail{self.tail}"), (self.conjugate, "conj"), (self.batch, f"B{self.batch}"),
                           (self.qkv, "qkv"), (self.pad, f"pad{self.pad}")):
            if flag:
                parts.append(text)
        return "-".join(parts)


class Inputs:
    """The buffers of a setup and the op's arguments, which are views of them."""

    def __init__(self, setup: Setup, buffers: list[torch.Tensor], cache: torch.Tensor,
                 positions: torch.Tensor | None) -> None:
        self.setup, self.buffers, self.cache, self.positions = setup, buffers, cache, positions

    def views(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        s = self.setup
        q_width, k_width = s.heads * s.head_dim, s.key_heads * s.head_dim
        if s.qkv:
            query_part, key_part = self.buffers[0][:, :q_width], self.buffers[0][:, q_width:q_width + k_width]
        else:
            query_part = self.buffers[0][:, :q_width]
            key_part = self.buffers[1][:, :k_width] if s.key_heads else None

        def heads(part: torch.Tensor | None, count: int) -> torch.Tensor | None:
            if part is None:
                return None
            view = part.unflatten(1, (count, s.head_dim))
            if s.batch:
                view = view.unflatten(0, (s.batch, s.tokens))
            return view[..., s.head_dim - s.tail:] if s.tail else view

        return heads(query_part, s.heads), heads(key_part, s.key_heads)

    def run(self, backend: str) -> None:
        from tileplug.core import ops
        from tileplug.core.registry import use_backend

        query, key = self.views()
        s = self.setup
        with use_backend(backend):
            ops.apply_rotary(query, self.cache, key=key, positions=self.positions, interleaved=s.interleaved,
                             conjugate=s.conjugate, seqlen_offset=s.offset)

    def copy(self) -> "Inputs":
        return Inputs(self.setup, [b.clone() for b in self.buffers], self.cache, self.positions)

    def rotated_mask(self) -> list[torch.Tensor]:
        """Per buffer: True where the op may write (the first ``R`` channels of each viewed head)."""
        masks = []
        probe = Inputs(self.setup, [torch.zeros_like(b, dtype=torch.bool) for b in self.buffers], self.cache,
                       self.positions)
        query, key = probe.views()
        query[..., :self.setup.rotary] = True
        if key is not None:
            key[..., :self.setup.rotary] = True
        masks.extend(probe.buffers)
        return masks


def make_inputs(setup: Setup, device: str = "cuda", seed: int = 0, cache: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> Inputs:
    from tileplug.core.ops.rope import make_cos_sin_cache
    from tileplug.core.testing import activation

    s = setup
    q_width, k_width = s.heads * s.head_dim, s.key_heads * s.head_dim
    if s.qkv:
        buffers = [activation(s.rows, q_width + 2 * k_width + s.pad, s.dtype, device, seed=seed)]
    else:
        buffers = [activation(s.rows, q_width + s.pad, s.dtype, device, seed=seed)]
        if s.key_heads:
            buffers.append(activation(s.rows, k_width + s.pad, s.dtype, device, seed=seed + 1))
    if cache is None:
        cache = make_cos_sin_cache(s.cache_length, s.rotary, device=device)
    if positions is None and s.positions != "none":
        generator = torch.Generator().manual_seed(seed + 2)
        shape = (s.batch, s.tokens) if s.batch else (s.tokens,)
        positions = torch.randint(0, s.tokens + 50, shape, generator=generator).to(getattr(torch, s.positions))
        positions = positions.to(device)
    return Inputs(s, buffers, cache, positions)


def check_against_reference(inputs: Inputs, what: str) -> list[torch.Tensor]:
    """Run the CUDA kernel on ``inputs`` and the reference on a copy made before; the buffers
    must agree within 1 ulp (NaN where the reference has NaN) and every byte outside the
    rotated channels must be the original's. Returns the CUDA buffers."""
    from tileplug.core.testing import assert_bytes_equal, assert_within_ulps

    original = [b.clone() for b in inputs.buffers]
    oracle = inputs.copy()
    inputs.run(BACKEND)
    oracle.run("reference")
    torch.cuda.synchronize()
    for index, (have, want, before, mask) in enumerate(zip(inputs.buffers, oracle.buffers, original,
                                                             inputs.rotated_mask())):
        assert_within_ulps(have, want, 1, what=f"{what} buffer {index}")
        assert_bytes_equal(have[~mask], before[~mask], what=f"{what} buffer {index} outside the rotated channels")
    return inputs.buffers


# ---------------------------------------------------------------------- the setups

HEAD_SHAPES = [  # (head_dim of the buffer, R, tail view)
    (64, 64, 0),
    (128, 128, 0),
    (192, 64, 0),  # the rope on the first 64 channels, 128 channels untouched
    (576, 64, 64),  # MLA: the last 64 channels of each head through a view
]
GRID = [
    Setup(head_dim=d, rotary=r, tail=tail, heads=n, key_heads=max(1, n // 4), interleaved=inter, positions=pos)
    for d, r, tail in HEAD_SHAPES for n in (1, 8, 32) for inter in (False, True) for pos in ("none", "int32", "int64")
]
DTYPES = [
    Setup(dtype=torch.float16),
    Setup(dtype=torch.float16, interleaved=True, conjugate=True),
    Setup(dtype=torch.float32, conjugate=True),
    Setup(dtype=torch.float32, interleaved=True, positions="none"),
    Setup(dtype=torch.bfloat16, conjugate=True),
    Setup(dtype=torch.float32, head_dim=64, rotary=32, key_heads=0),
]
BATCHED = [
    Setup(batch=3, tokens=17, positions="none", offset=5),
    Setup(batch=3, tokens=17, positions="int32", interleaved=True),
    Setup(batch=2, tokens=129, positions="int64", qkv=True, heads=32, key_heads=8, pad=8),
    Setup(batch=2, tokens=5, positions="int64", qkv=True, pad=3),  # odd row stride: scalar path
]
QKV = [
    Setup(qkv=True, heads=32, key_heads=8, pad=0),
    Setup(qkv=True, heads=32, key_heads=8, pad=8),
    Setup(qkv=True, heads=32, key_heads=8, pad=3),  # rows not 16-byte aligned: scalar path
    Setup(qkv=True, heads=16, key_heads=1, head_dim=192, rotary=64, pad=2, interleaved=True),
    Setup(qkv=True, heads=4, key_heads=4, head_dim=64, rotary=64, dtype=torch.float32, pad=1, conjugate=True),
]
SCALAR_WIDTHS = [  # R/2 not a multiple of the values per 128-bit load: the scalar path only
    Setup(head_dim=64, rotary=6, interleaved=False),
    Setup(head_dim=64, rotary=6, interleaved=True),
    Setup(head_dim=64, rotary=36, interleaved=False, positions="int32"),
    Setup(head_dim=64, rotary=36, interleaved=True, positions="none"),
    Setup(head_dim=128, rotary=100, dtype=torch.float32, conjugate=True),
]
LARGE = [
    Setup(tokens=8001, heads=32, key_heads=8),
    Setup(tokens=4001, heads=128, key_heads=0, interleaved=True),
    Setup(tokens=16384, heads=32, key_heads=8, qkv=True, positions="none", offset=0),
]
NONFINITE = Setup(head_dim=192, rotary=64, heads=8, key_heads=2)
INVARIANCE = Setup(heads=8, key_heads=2)
ALL_SETUPS = GRID + DTYPES + BATCHED + QKV + SCALAR_WIDTHS + LARGE + [NONFINITE, INVARIANCE,
                                                                    dataclasses.replace(INVARIANCE, interleaved=True)]


def _specs(setups: list[Setup]) -> list:
    """Both specialisations (vector and scalar) of every setup's call signature."""
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core.lowering import describe_call

    found = {}
    kernel = _KERNELS["apply_rotary"]
    for setup in setups:
        inputs = make_inputs(dataclasses.replace(setup, tokens=2), device="cpu")
        query, key = inputs.views()
        call, _ = describe_call("apply_rotary", query, inputs.cache, key=key, positions=inputs.positions,
                                interleaved=setup.interleaved, conjugate=setup.conjugate, seqlen_offset=setup.offset)
        aligned = setup.pad * setup.dtype.itemsize % 16 == 0
        found[kernel.spec(call, vectorize=None if aligned else False)] = None
        if setup == Setup(key_heads=0):  # test_misaligned_data_pointer
            found[kernel.spec(call, vectorize=False)] = None
    from tileplug.core import opdefs
    from tileplug.core.registry import use_backend

    for case in opdefs.get("apply_rotary").cases():
        with use_backend("reference"):
            args, kwargs = case.arguments(3, "cpu")
        call, _ = describe_call("apply_rotary", *args, **kwargs)
        found.update(dict.fromkeys(kernel.specs(call)))
    return list(found)


@pytest.fixture(scope="module", autouse=True)
def _precompiled():
    """Compile every specialisation of the module up front, in parallel processes
    (``TILEPLUG_GPU_PRECOMPILE=0``: each kernel on its first call instead — for a run of a few
    tests, or under xdist, where each worker would otherwise compile the whole module)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if os.environ.get("TILEPLUG_GPU_PRECOMPILE") == "0":
        yield
        return
    from tileplug.backend_cuda import jit

    started = time.perf_counter()
    specs = _specs(ALL_SETUPS) + _norm_specs()
    jit.precompile(specs)
    print(f"\nprecompiled {len(specs)} RoPE-family specialisations in {time.perf_counter() - started:.1f} s")
    yield


# ---------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("setup", GRID, ids=[s.label() for s in GRID])
def test_grid_within_one_ulp(setup: Setup) -> None:
    """D in {64, 128, 192 (R = 64), 576 (last 64 through a view)}, N in {1, 8, 32} with a
    key of N/4 heads, both pairings, every positions mode."""
    check_against_reference(make_inputs(setup), setup.label())


@pytest.mark.parametrize("setup", DTYPES + BATCHED + QKV + SCALAR_WIDTHS,
                         ids=[s.label() for s in DTYPES + BATCHED + QKV + SCALAR_WIDTHS])
def test_dtypes_4d_qkv_views_and_scalar_widths(setup: Setup) -> None:
    """fp16/fp32 and conjugation; 4-D ``[B, S, N, D]`` (positions ``[B, S]`` or implicit
    ``offset + s``); query and key as views of one fused QKV buffer (V part and row padding
    untouched bytewise), aligned and not; rotary widths only the scalar path serves."""
    check_against_reference(make_inputs(setup), setup.label())


@pytest.mark.parametrize("setup", LARGE, ids=[s.label() for s in LARGE])
def test_large_token_counts(setup: Setup) -> None:
    check_against_reference(make_inputs(setup), setup.label())


def test_op_table_cases() -> None:
    """The op table's apply_rotary cases through the conformance check (T in {1, 3, 4001})."""
    from tileplug.core import opdefs
    from tileplug.reference.conformance import check_case

    for case in opdefs.get("apply_rotary").cases():
        for tokens in (1, 3, 4001):
            check_case(case, tokens, BACKEND, "cuda", oracle_device="cuda")


def test_4d_positions_with_strides() -> None:
    """Positions ``[B, S]`` that are a transposed view (non-unit strides)."""
    setup = Setup(batch=4, tokens=33, positions="int32", interleaved=True)
    positions = torch.randint(0, 60, (33, 4), dtype=torch.int32, device="cuda").t()
    check_against_reference(make_inputs(setup, positions=positions), "strided positions")


def test_misaligned_data_pointer() -> None:
    """A query whose data pointer is 2 bytes off 16-byte alignment takes the scalar path."""
    setup = Setup(key_heads=0)
    inputs = make_inputs(setup)
    flat = torch.empty(setup.rows * setup.heads * setup.head_dim + 1, dtype=setup.dtype, device="cuda")
    flat[1:] = inputs.buffers[0].reshape(-1)
    inputs.buffers[0] = flat[1:].view(setup.rows, setup.heads * setup.head_dim)
    assert inputs.buffers[0].data_ptr() % 16
    check_against_reference(inputs, "misaligned query")


# ---------------------------------------------------------------------- containment and self-checks


def test_out_of_range_positions_make_nan_rows_and_touch_nothing_else() -> None:
    """Positions -1, L, 2^40 and -2^40 (int64) are never read from the cache: those tokens'
    rotated channels are NaN in query and key, the tail channels (R = 64 of D = 192) and
    every other token are what the reference writes."""
    setup = NONFINITE
    length = setup.cache_length
    positions = torch.randint(0, length, (setup.tokens,), dtype=torch.int64)
    bad = [0, 5, 17, setup.tokens - 1]
    positions[bad] = torch.tensor([-1, length, 2**40, -(2**40)])
    inputs = make_inputs(setup, positions=(positions - setup.offset).cuda())
    check_against_reference(inputs, "out of range")
    query, key = inputs.views()
    for heads in (query, key):
        rotated = heads[..., :setup.rotary].float()
        assert torch.isnan(rotated[bad]).all()
        good = [t for t in range(setup.tokens) if t not in bad]
        assert not torch.isnan(rotated[good]).any()


def test_implicit_positions_past_the_cache() -> None:
    """``seqlen_offset`` pushing implicit positions past ``L``: the tokens past it are NaN."""
    setup = Setup(positions="none", offset=0, tokens=40)
    from tileplug.core.ops.rope import make_cos_sin_cache

    cache = make_cos_sin_cache(30, setup.rotary, device="cuda")
    inputs = make_inputs(setup, cache=cache)
    check_against_reference(inputs, "implicit past L")
    query, _ = inputs.views()
    assert torch.isnan(query[30:].float()).all() and not torch.isnan(query[:30].float()).any()


def test_empty_cache_gives_nan_rows() -> None:
    setup = Setup(positions="int32")
    inputs = make_inputs(setup, cache=torch.empty(0, setup.rotary, device="cuda"))
    check_against_reference(inputs, "empty cache")
    query, key = inputs.views()
    assert torch.isnan(query.float()).all() and torch.isnan(key.float()).all()


@pytest.mark.parametrize("interleaved", [False, True])
def test_cos_one_sin_zero_returns_x_bitwise(interleaved: bool) -> None:
    setup = Setup(interleaved=interleaved)
    cache = torch.cat([torch.ones(100, 64), torch.zeros(100, 64)], dim=1).cuda()
    inputs = make_inputs(setup, cache=cache)
    original = [b.clone() for b in inputs.buffers]
    inputs.run(BACKEND)
    for have, want in zip(inputs.buffers, original):
        assert torch.equal(have.view(torch.uint8), want.view(torch.uint8))


def test_pairings_differ() -> None:
    """NeoX and GPT-J rotate different pairs (c = 0, n = 1 makes the difference plain)."""
    cache = torch.cat([torch.zeros(100, 64), torch.ones(100, 64)], dim=1).cuda()
    outputs = []
    for interleaved in (False, True):
        inputs = make_inputs(Setup(interleaved=interleaved), cache=cache)
        check_against_reference(inputs, f"c=0 n=1 interleaved={interleaved}")
        outputs.append(inputs.buffers[0])
    assert not torch.equal(outputs[0], outputs[1])


# ---------------------------------------------------------------------- batch invariance, determinism


@pytest.mark.parametrize("interleaved", [False, True])
def test_batch_invariance_bytewise(interleaved: bool) -> None:
    """Each probe token alone (T = 1) writes the bytes it writes inside batches of 1, 7 and
    4001 tokens, at several positions in the batch."""
    from tileplug.core.ops.rope import make_cos_sin_cache

    setup = dataclasses.replace(INVARIANCE, interleaved=interleaved)
    cache = make_cos_sin_cache(5000, setup.rotary, device="cuda")
    probes = make_inputs(dataclasses.replace(setup, tokens=3), seed=11, cache=cache)
    alone = []
    for index in range(3):
        single = Inputs(dataclasses.replace(setup, tokens=1), [b[index:index + 1].clone() for b in probes.buffers],
                        probes.cache, probes.positions[index:index + 1].clone())
        single.run(BACKEND)
        alone.append([b[0] for b in single.buffers])
    for batch in (1, 7, 4001):
        for slots in ([0], [0, 3, 6], [0, 2000, 4000]):
            slots = [slot for slot in slots if slot < batch][:3]
            inputs = make_inputs(dataclasses.replace(setup, tokens=batch), seed=batch, cache=probes.cache)
            for probe, slot in enumerate(slots):
                for buffer, source in zip(inputs.buffers, probes.buffers):
                    buffer[slot] = source[probe]
                inputs.positions[slot] = probes.positions[probe]
            inputs.run(BACKEND)
            for probe, slot in enumerate(slots):
                for buffer, expected in zip(inputs.buffers, alone[probe]):
                    assert torch.equal(buffer[slot].view(torch.uint8), expected.view(torch.uint8)), \
                        f"probe {probe} at row {slot} of {batch}"


def test_deterministic() -> None:
    setup = Setup(tokens=4001, heads=32, key_heads=8, qkv=True)
    first = make_inputs(setup)
    second = first.copy()
    first.run(BACKEND)
    second.run(BACKEND)
    for a, b in zip(first.buffers, second.buffers):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---------------------------------------------------------------------- rms_norm_rope


@dataclasses.dataclass(frozen=True)
class NormSetup:
    """One ``rms_norm_rope`` configuration: ``x`` ``[T, heads, head_dim]`` as a view of rows
    padded by ``pad`` elements (odd pads: the scalar path)."""

    head_dim: int = 128
    rotary: int = 128
    heads: int = 8
    dtype: torch.dtype = torch.bfloat16
    interleaved: bool = False
    positions: str = "int64"
    weight_offset: float = 0.0
    eps: float = 1e-6
    pad: int = 0
    offset: int = 2

    def label(self) -> str:
        return (f"D{self.head_dim}-R{self.rotary}-N{self.heads}-{str(self.dtype).replace('torch.', '')}-"
                f"{'gptj' if self.interleaved else 'neox'}-{self.positions}-o{self.weight_offset}-pad{self.pad}")

    def arguments(self, tokens: int, seed: int = 0, cache: torch.Tensor | None = None,
                  device: str = "cuda") -> tuple[tuple, dict]:
        from tileplug.core.ops.rope import make_cos_sin_cache
        from tileplug.core.testing import activation

        width = self.heads * self.head_dim
        x = activation(tokens, width + self.pad, self.dtype, device, seed=seed)[:, :width]
        x = x.unflatten(1, (self.heads, self.head_dim))
        generator = torch.Generator().manual_seed(seed + 1)
        weight = (1.0 + 0.1 * torch.randn(self.head_dim, generator=generator)).to(self.dtype).to(device)
        if cache is None:
            cache = make_cos_sin_cache(tokens + 60, self.rotary, device=device)
        positions = None
        if self.positions != "none":
            positions = torch.randint(0, tokens + 50, (tokens,), generator=generator).to(getattr(torch, self.positions))
            positions = positions.to(device)
        kwargs = {"positions": positions, "eps": self.eps, "interleaved": self.interleaved,
                  "weight_offset": self.weight_offset, "seqlen_offset": self.offset}
        return (x, weight, cache), kwargs


NORM_SETUPS = [
    NormSetup(),
    NormSetup(interleaved=True, positions="none"),
    NormSetup(head_dim=64, rotary=64, heads=16, positions="int32", weight_offset=1.0, eps=1e-5),
    NormSetup(head_dim=192, rotary=64, heads=4, dtype=torch.float16, interleaved=True, positions="int32"),
    NormSetup(head_dim=576, rotary=64, heads=2),
    NormSetup(head_dim=128, rotary=64, heads=8, dtype=torch.float32, positions="none", weight_offset=1.0, pad=3),
    NormSetup(heads=32, pad=8),
    NormSetup(heads=8, pad=1, interleaved=True),  # rows not 16-byte aligned: scalar path
    NormSetup(head_dim=2048, rotary=128, heads=1),  # a row over several warps: block-wide barrier
]


def _unfused(x, weight, cache, positions, eps, interleaved, weight_offset, seqlen_offset) -> torch.Tensor:
    """This backend's chain: ``rms_norm`` per head, then ``apply_rotary`` on its output."""
    from tileplug.core import ops

    y = ops.rms_norm(x, weight, eps=eps, weight_offset=weight_offset)
    ops.apply_rotary(y, cache, positions=positions, interleaved=interleaved, seqlen_offset=seqlen_offset)
    return y


def _served_by_cuda(op: str, *args, **kwargs) -> None:
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core.lowering import describe_call

    call, _ = describe_call(op, *args, **kwargs)
    assert _KERNELS[call.op].supports(call) is None, f"{op} is declined by the CUDA kernel"


@pytest.mark.parametrize("tokens", [1, 3, 4001])
@pytest.mark.parametrize("setup", NORM_SETUPS, ids=[s.label() for s in NORM_SETUPS])
def test_rms_norm_rope_equals_the_unfused_chain_bytewise(setup: NormSetup, tokens: int) -> None:
    """SPEC §4 fusion rule: the fused kernel writes the bytes of this backend's ``rms_norm``
    followed by its ``apply_rotary``; and within the chain's bound of the reference (the
    norm's ulp carried through the rotation, then the rotation's)."""
    from tileplug.core import ops
    from tileplug.core.registry import use_backend
    from tileplug.core.testing import assert_bytes_equal, assert_rotated_within_chain_bound

    args, kwargs = setup.arguments(tokens)
    x, weight = args[0], args[1]
    _served_by_cuda("rms_norm_rope", *args, **kwargs)
    _served_by_cuda("rms_norm", x, weight, eps=setup.eps, weight_offset=setup.weight_offset)
    with use_backend(BACKEND):
        fused = ops.rms_norm_rope(*args, **kwargs)
        chain = _unfused(*args, **kwargs)
    with use_backend("reference"):
        expected = ops.rms_norm_rope(*args, **kwargs)
    assert_bytes_equal(fused, chain, what=f"{setup.label()} T={tokens} fused vs chain")
    assert_rotated_within_chain_bound(fused, expected, setup.rotary, setup.interleaved,
                                      what=f"{setup.label()} T={tokens} vs reference")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rms_norm_rope_weight_zeros_and_subnormals(dtype: torch.dtype) -> None:
    """A 16-bit weight holding ``-0``, ``+0`` and subnormals at offset 0 (its ``+ 0`` taken on
    the packed words, ``norm.rows.plus_zero``): the fused kernel, with and without the cast, writes the
    chain's bytes (``rms_norm``'s own bytes against the reference: test_cuda_norm's
    test_weight_zeros_and_subnormals)."""
    from tileplug.core import ops
    from tileplug.core.registry import use_backend
    from tileplug.core.testing import assert_bytes_equal, assert_sf_equal

    setup = NormSetup(dtype=dtype)
    tokens = 37
    args, kwargs = setup.arguments(tokens, seed=5)
    x, weight, cache = args
    tiny = torch.finfo(dtype).smallest_normal
    special = torch.tensor([-0.0, 0.0, tiny / 4, -tiny / 4, -tiny, tiny / 64]).to(dtype)
    weight[0:6] = special.cuda()
    weight[67:73] = special.cuda()
    cast = _cast_flags({})
    with use_backend(BACKEND):
        fused = ops.rms_norm_rope(x, weight, cache, **kwargs)
        chain = _unfused(x, weight, cache, **kwargs)
        assert_bytes_equal(fused, chain, what="rms_norm_rope vs chain")
        if dtype == torch.bfloat16:  # (the cast takes bf16 / fp32 x)
            q, sf = ops.rms_norm_rope_per_token_cast(x, weight, cache, **kwargs, **cast)
            q_chain, sf_chain = ops.per_token_cast(chain.view(tokens, -1), **cast)
            assert_bytes_equal(q, q_chain, what="q vs chain")
            assert_sf_equal(sf, sf_chain, (1, 128), tokens, setup.heads * setup.head_dim, what="sf vs chain")


def test_rms_norm_rope_out_of_range_positions() -> None:
    """Tokens at positions outside [0, L) get NaN in their rotated channels only; the other
    channels (R = 64 of D = 192) and the other tokens are the chain's bytes."""
    from tileplug.core import ops
    from tileplug.core.registry import use_backend
    from tileplug.core.testing import assert_bytes_equal

    setup = NormSetup(head_dim=192, rotary=64, heads=4, offset=0)
    args, kwargs = setup.arguments(64)
    length = args[2].shape[0]
    kwargs["positions"][[0, 9, 63]] = torch.tensor([-1, length, 2**40], device="cuda")
    with use_backend(BACKEND):
        fused = ops.rms_norm_rope(*args, **kwargs)
        chain = _unfused(*args, **kwargs)
    assert_bytes_equal(fused, chain, what="fused vs chain with out-of-range positions")
    assert torch.isnan(fused[[0, 9, 63], :, :64].float()).all()
    assert not torch.isnan(fused[:, :, 64:].float()).any()
    assert not torch.isnan(fused[1:9].float()).any()


FULL_ROTARY_SETUPS = [
    NormSetup(offset=0),  # NeoX pairs in one thread
    NormSetup(interleaved=True, positions="int32", offset=0),  # GPT-J
    NormSetup(heads=8, pad=1, offset=0),  # rows not 16-byte aligned: the scalar path
    NormSetup(head_dim=160, rotary=160, heads=4, offset=0),  # NeoX partners in other lanes (the shared exchange)
]


@pytest.mark.parametrize("empty", [False, True], ids=["outside", "empty-cache"])
@pytest.mark.parametrize("setup", FULL_ROTARY_SETUPS, ids=[s.label() for s in FULL_ROTARY_SETUPS])
def test_rms_norm_rope_full_rotary_out_of_range_rows(setup: NormSetup, empty: bool) -> None:
    """R = D: a token whose position is outside the cache (or every token, on an empty cache) is
    NaN in every channel, and ``rms_norm_rope`` and its cast write the chain's bytes on every token
    (NaN payloads aside), on each of the rotation's paths."""
    from tileplug.core import ops
    from tileplug.core.registry import use_backend
    from tileplug.core.testing import assert_bytes_equal, assert_sf_equal

    tokens = 40
    cache = torch.empty(0, setup.rotary, device="cuda") if empty else None
    args, kwargs = setup.arguments(tokens, seed=4, cache=cache)
    bad = list(range(tokens)) if empty else [0, 17, 39]
    if not empty:
        kwargs["positions"][bad] = torch.tensor([-1, args[2].shape[0], -(2**31)], device="cuda").to(
            kwargs["positions"].dtype)
    _served_by_cuda("rms_norm_rope", *args, **kwargs)
    _served_by_cuda("rms_norm_rope_per_token_cast", *args, **kwargs, num_per_channels=32)
    with use_backend(BACKEND):
        fused = ops.rms_norm_rope(*args, **kwargs)
        q, sf = ops.rms_norm_rope_per_token_cast(*args, **kwargs, num_per_channels=32)  # (32 divides every D here)
        chain = _unfused(*args, **kwargs)
        q_chain, sf_chain = ops.per_token_cast(chain.view(tokens, -1), num_per_channels=32)
    assert torch.isnan(fused[bad].float()).all(), "an outside token is NaN in every channel"
    good = [t for t in range(tokens) if t not in bad]
    assert not torch.isnan(fused[good].float()).any()
    assert_bytes_equal(fused, chain, what=f"{setup.label()} fused vs chain", nan_equal=True)
    assert_bytes_equal(q, q_chain, what=f"{setup.label()} q vs chain", nan_equal=True)
    assert_sf_equal(sf, sf_chain, (1, 32), tokens, setup.heads * setup.head_dim, what=f"{setup.label()} sf",
                    nan_equal=True)


def test_rms_norm_rope_batch_invariance_bytewise() -> None:
    from tileplug.core import ops
    from tileplug.core.ops.rope import make_cos_sin_cache
    from tileplug.core.registry import use_backend

    setup = NormSetup(heads=8)
    cache = make_cos_sin_cache(5000, setup.rotary, device="cuda")
    probe_args, probe_kwargs = setup.arguments(3, seed=5, cache=cache)
    alone = []
    with use_backend(BACKEND):
        for index in range(3):
            kwargs = dict(probe_kwargs, positions=probe_kwargs["positions"][index:index + 1].clone())
            alone.append(ops.rms_norm_rope(probe_args[0][index:index + 1].clone(), *probe_args[1:], **kwargs)[0])
        for batch in (1, 7, 4001):
            args, kwargs = setup.arguments(batch, seed=batch, cache=cache)
            slots = [slot for slot in (0, batch // 2, batch - 1)][:min(3, batch)]
            for probe, slot in enumerate(dict.fromkeys(slots)):
                args[0][slot] = probe_args[0][probe]
                kwargs["positions"][slot] = probe_kwargs["positions"][probe]
            y = ops.rms_norm_rope(args[0], *probe_args[1:], **kwargs)  # the probes' weight and cache
            for probe, slot in enumerate(dict.fromkeys(slots)):
                assert torch.equal(y[slot].view(torch.uint8), alone[probe].view(torch.uint8)), (batch, slot)


def test_rms_norm_rope_op_table_cases() -> None:
    from tileplug.core import opdefs
    from tileplug.reference.conformance import check_case

    for case in opdefs.get("rms_norm_rope").cases():
        for tokens in (1, 3, 4001):
            check_case(case, tokens, BACKEND, "cuda", oracle_device="cuda")


def _norm_specs() -> list:
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core import opdefs, ops
    from tileplug.core.lowering import describe_call
    from tileplug.core.registry import use_backend

    found = {}
    for setup in NORM_SETUPS + [NormSetup(head_dim=192, rotary=64, heads=4, offset=0)]:
        args, kwargs = setup.arguments(2, device="cpu")
        for op, op_args, op_kwargs in (
            ("rms_norm_rope", args, kwargs),
            ("rms_norm", args[:2], {"eps": setup.eps, "weight_offset": setup.weight_offset}),
        ):
            call, _ = describe_call(op, *op_args, **op_kwargs)
            kernel = _KERNELS[call.op]
            if kernel.supports(call) is None:
                found[kernel.spec(call)] = None  # rms_norm's spec follows the call's alignment
                if op == "rms_norm_rope" and setup.pad * setup.dtype.itemsize % 16:
                    found[kernel.spec(call, vectorize=False)] = None
    for setup, flags, unquantized in CAST_GRID + [(NormSetup(offset=0), {}, False)]:
        args, kwargs = setup.arguments(2, device="cpu")
        cast = _cast_flags(flags)
        call, _ = describe_call("rms_norm_rope_per_token_cast", *args, **kwargs, **cast,
                                return_unquantized=unquantized)
        aligned = setup.pad * setup.dtype.itemsize % 16 == 0
        found[_KERNELS["rms_norm_rope"].spec(call, vectorize=None if aligned else False)] = None
        with use_backend("reference"):
            y = ops.rms_norm_rope(*args, **kwargs)
        call, _ = describe_call("per_token_cast", y.view(2, -1), **cast)
        found[_KERNELS["per_token_cast"].spec(call)] = None
    for name in ("rms_norm_rope", "rms_norm_rope_per_token_cast"):
        for case in opdefs.get(name).cases():
            with use_backend("reference"):
                case_args, case_kwargs = case.arguments(3, "cpu")
            call, _ = describe_call(name, *case_args, **case_kwargs)
            if _KERNELS["rms_norm_rope"].supports(call) is None:
                found.update(dict.fromkeys(_KERNELS["rms_norm_rope"].specs(call)))
    return list(found)


# ---------------------------------------------------------------------- rms_norm_rope_per_token_cast

CAST_FLAGS = [
    {},
    {"round_sf": True},
    {"round_sf": True, "use_packed_ue8m0": True},
    {"use_tma_aligned_col_major_sf": True},
    {"round_sf": True, "use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True},
    {"fmt": "e2m1", "num_per_channels": 16},
    {"fmt": "e2m1", "num_per_channels": 32, "round_sf": True, "use_packed_ue8m0": True},
    {"num_per_channels": 64},
    {"num_per_channels": 32},
]
CAST_SETUPS = [
    NormSetup(),
    NormSetup(head_dim=64, rotary=64, heads=16, positions="int32", weight_offset=1.0),
    NormSetup(head_dim=192, rotary=64, heads=4, interleaved=True),
    NormSetup(head_dim=576, rotary=64, heads=2, positions="none"),
    NormSetup(head_dim=128, rotary=64, heads=8, dtype=torch.float32, pad=3),
    NormSetup(heads=32, pad=8, interleaved=True),
]
CAST_GRID = [  # each setup with three of the flag sets, in turn (every set meets several setups)
    (setup, CAST_FLAGS[(3 * index + turn) % len(CAST_FLAGS)], turn % 2 == 0)
    for index, setup in enumerate(CAST_SETUPS) for turn in range(3)
    if setup.head_dim % CAST_FLAGS[(3 * index + turn) % len(CAST_FLAGS)].get("num_per_channels", 128) == 0
] + [(CAST_SETUPS[3], {"num_per_channels": 64, "round_sf": True, "use_packed_ue8m0": True,
                       "use_tma_aligned_col_major_sf": True}, True)]


def _cast_flags(flags: dict) -> dict:
    return {"fmt": "e4m3", "num_per_channels": 128, "round_sf": False, "use_packed_ue8m0": False,
            "use_tma_aligned_col_major_sf": False, **flags}


@pytest.mark.parametrize("tokens", [1, 3, 4001])
@pytest.mark.parametrize("setup,flags,unquantized", CAST_GRID,
                         ids=[f"{s.label()}-{f}-y{u}" for s, f, u in CAST_GRID])
def test_rms_norm_rope_per_token_cast_equals_the_unfused_chain_bytewise(setup: NormSetup, flags: dict,
                                                                         unquantized: bool, tokens: int) -> None:
    """SPEC §6: ``(q, sf)`` are this backend's ``per_token_cast`` of ``y.view(T, N·D)`` with
    ``y`` its ``rms_norm`` + ``apply_rotary`` chain, bytewise (sf compared on every byte that
    holds a group); the returned ``y`` is that chain's bytes."""
    from tileplug.core import ops
    from tileplug.core.registry import use_backend
    from tileplug.core.testing import assert_bytes_equal, assert_sf_equal

    args, kwargs = setup.arguments(tokens, seed=tokens)
    cast = _cast_flags(flags)
    _served_by_cuda("rms_norm_rope_per_token_cast", *args, **kwargs, **cast, return_unquantized=unquantized)
    with use_backend(BACKEND):
        result = ops.rms_norm_rope_per_token_cast(*args, **kwargs, **cast, return_unquantized=unquantized)
        y = _unfused(*args, **kwargs)
        _served_by_cuda("per_token_cast", y.view(tokens, -1), **cast)
        q, sf = ops.per_token_cast(y.view(tokens, -1), **cast)
    what = f"{setup.label()} {flags} T={tokens}"
    assert_bytes_equal(result[0], q, what=f"{what} q")
    hidden = setup.heads * setup.head_dim
    assert_sf_equal(result[1], sf, (1, cast["num_per_channels"]), tokens, hidden, what=f"{what} sf")
    if unquantized:
        assert len(result) == 3
        assert_bytes_equal(result[2], y, what=f"{what} y")
    else:
        assert len(result) == 2


def test_rms_norm_rope_per_token_cast_op_table_cases() -> None:
    """The op table's cases through the conformance check (their compare: bytewise vs the
    reference's per_token_cast of the backend's own y where y is returned)."""
    from tileplug.core import opdefs
    from tileplug.reference.conformance import CaseDeclined, check_case

    for case in opdefs.get("rms_norm_rope_per_token_cast").cases():
        for tokens in (1, 3, 4001):
            try:
                check_case(case, tokens, BACKEND, "cuda", oracle_device="cuda")
            except CaseDeclined:  # D not a multiple of the group: the reference serves it
                pass


def test_rms_norm_rope_per_token_cast_nan_rows_stay_in_their_token() -> None:
    """An out-of-range position makes that token's scales non-finite; other tokens' bytes are
    the chain's."""
    from tileplug.core import ops
    from tileplug.core.registry import use_backend
    from tileplug.core.testing import assert_bytes_equal

    setup = NormSetup(offset=0)
    args, kwargs = setup.arguments(40, seed=3)
    kwargs["positions"][[0, 17]] = -1
    with use_backend(BACKEND):
        q, sf = ops.rms_norm_rope_per_token_cast(*args, **kwargs)
        y = _unfused(*args, **kwargs)
        q_chain, sf_chain = ops.per_token_cast(y.view(40, -1))
    assert not torch.isfinite(sf[[0, 17]]).all()
    good = [t for t in range(40) if t not in (0, 17)]
    assert_bytes_equal(q[good], q_chain[good], what="q of the other tokens")
    assert_bytes_equal(sf[good], sf_chain[good], what="sf of the other tokens")
