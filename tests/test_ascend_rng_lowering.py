"""Ascend random-number kernels (``fill_rand``, ``fill_randn``): LOWERING tests and a CPU
emulation of their word arithmetic and numerics. Nothing here runs on an NPU.

* Every op-table case lowers to Ascend C (disk-cached, as tests/test_ascend_lowering.py) and
  passes the three checks; the source holds the Philox constants and ten rounds; each check
  fails on a bad variant; declines carry their reasons.
* The emulation: the kernels' Philox rounds, element interleave, uniform transform and
  Box–Muller are plain Python over an ``ops`` object (``backend_ascend/random/vector_ops.py``);
  :class:`NumpyOps` implements the same methods with what each instruction is assumed to do,
  and the very functions the kernels are traced from run on it: Random123's known-answer
  vectors, the reference's words and uniform values bytewise, the normal values within 2 ulp
  of fp32 (1 ulp with a correctly rounded ``vln``). What it cannot show: that the hardware
  instructions behave as assumed (vector_ops.py lists the assumptions).

No ``from __future__ import annotations``: TileLang parses the bad kernel's macro source.
"""

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
import torch

from tileplug import core
from tileplug.core.ops.random import as_int64_word

pytestmark = pytest.mark.ascend_lower

META = "meta"
RANDOM_OPS = ("fill_rand", "fill_randn")
MASK = 0xFFFFFFFF


def _kernels() -> dict:
    from tileplug.backend_ascend.plugin import kernel_table

    return kernel_table()


def _describe(case):
    with core.config.host_layout("ascend"):
        args, kwargs = case.arguments(5, META)
        call, _ = core.describe_call(case.op, *args, **kwargs)
    return call


def _draw_call(op, count, dtype=torch.float32):
    state = [torch.zeros(1, dtype=torch.int64, device=META) for _ in range(2)]
    with core.config.host_layout("ascend"):
        call, _ = core.describe_call(getattr(core.ops, op), torch.empty(count, dtype=dtype, device=META), *state)
    return call


def _grid() -> list:
    """``[(specialisation, first case it serves)]`` of every random-number case of the op table."""
    table = _kernels()
    grid = {}
    for op in RANDOM_OPS:
        for case in core.opdefs.get(op).cases():
            grid.setdefault(table[op].describe(_describe(case)), case)
    return list(grid.items())


def lower_and_check(entry) -> dict:
    """Worker: lower the case's specialisation (disk-cached) and run the checks on it."""
    from tileplug.backend_ascend import lowering_checks as checks

    name, case = entry
    call = _describe(case)
    kernel = _kernels()[call.op]
    result = {"name": name, "declined": kernel.supports(call)}
    if result["declined"] is not None:
        return result
    (lowering,) = kernel.lowerings(call)
    lowered = lowering.lowered
    result["source"] = lowered.source
    result["checks"] = {
        "ub": checks.check_ub(lowered.compiler_ub_bytes, lowered.primfunc_ub_bytes, lowering.plan_bytes,
                              lowering.budget),
        "pipelined": checks.check_pipelined(lowered.source),
        "vector": checks.check_vector(lowered.source),
        "nonempty": ("__gm__" in lowered.source, "kernel has __gm__ parameters"),
    }
    return result


CASES = _grid()


@pytest.fixture(scope="module")
def lowered() -> dict:
    with ProcessPoolExecutor(min(2, os.cpu_count() or 1)) as pool:
        return {result["name"]: result for result in pool.map(lower_and_check, CASES)}


def test_every_case_of_the_op_table_is_served():
    """Each op's cases make one specialisation per dtype (the element count is dynamic)."""
    assert sorted(name for name, _ in CASES) == sorted(
        f"{op} [N] {dtype} tile=4096" for op in RANDOM_OPS for dtype in ("float32", "bfloat16", "float16"))


@pytest.mark.parametrize("case", CASES, ids=[name for name, _ in CASES])
def test_lowering_passes_checks(lowered, case):
    result = lowered[case[0]]
    assert result["declined"] is None, result["declined"]
    failed = {name: detail for name, (ok, detail) in result["checks"].items() if not ok}
    assert not failed, failed


@pytest.mark.parametrize("case", CASES, ids=[name for name, _ in CASES])
def test_source_holds_the_philox_rounds(lowered, case):
    """The multipliers and Weyl constants (as C literals), ten rounds per group of 64 blocks
    (two ``vmull`` each, the key grown nine times), the state read from GM, no scalar GM write."""
    source = lowered[case[0]]["source"]
    for constant in (0xD2511F53, 0xCD9E8D57):
        assert f"(uint32_t){constant}" in source, hex(constant)
    for constant in (0x9E3779B9, 0xBB67AE85):
        assert source.count(f"(uint32_t){constant}") == 9, hex(constant)
    assert source.count("simd_inst::vmull(") == 20
    assert "asc_copy_gm2ub_align" in source and "(&(SEED[0]))" in source and "(&(OFFSET[0]))" in source
    assert "OFFSET[0] =" not in source and "SEED[0] =" not in source
    if case[0].startswith("fill_randn"):
        assert "vln_1ulp_ftz_false" in source and "vsqrt_0ulp_ftz_false" in source


def test_core_lower_states_lowered_and_the_specialisation():
    state = [torch.zeros(1, dtype=torch.int64, device=META) for _ in range(2)]
    with core.config.host_layout("ascend"):
        source = core.lower(core.ops.fill_randn, torch.empty(3, 7, dtype=torch.bfloat16, device=META), *state,
                            backend="ascend")
    assert "LOWERED" in source and "not verified" in source and "stand-in" in source
    assert "specialisation: fill_randn [N] bfloat16 tile=4096" in source and "__global__" in source


def test_capabilities_say_lowered():
    from tileplug.backend_ascend import plugin

    text = plugin.capabilities()
    assert "fill_rand / fill_randn" in text and "Lowered, never run on an NPU" in text


def test_declines_carry_reasons():
    """Past ``2^31 − 4096`` elements the int32 index arithmetic would overflow: the reference serves it."""
    from tileplug.backend_ascend.random.draw import MAX_ELEMENTS

    table = _kernels()
    for op in RANDOM_OPS:
        assert table[op].supports(_draw_call(op, MAX_ELEMENTS)) is None
        why = table[op].supports(_draw_call(op, MAX_ELEMENTS + 1))
        assert why is not None and "int32" in why and "falls to the reference" in why, why


def test_launch_passes_the_state_words_and_advances_the_offset():
    """``__call__`` (CPU tensors, the compiled kernel replaced by a recorder): the int32 word
    views of seed and offset and the flat values in the prim_func's order, then offset + 1."""
    kernel = _kernels()["fill_rand"]
    values = torch.empty(3, 5)
    seed, offset = torch.tensor([-1], dtype=torch.int64), torch.tensor([2**32 - 1], dtype=torch.int64)
    call, inputs = core.describe_call(core.ops.fill_rand, values, seed, offset)
    launched = []

    def record(*args):  # what the kernel would see: the tensors' storage and their values at launch
        launched.append([(arg.data_ptr(), arg.dtype, arg.clone()) for arg in args])

    with core.config.override(ascend_vector_cores=8), mock.patch.object(kernel.compiled, "get",
                                                                        lambda spec: record):
        kernel(call, inputs, None)
    (seed_words, offset_words, flat), = launched
    assert seed_words[0] == seed.data_ptr() and seed_words[2].tolist() == [-1, -1]
    assert offset_words[0] == offset.data_ptr() and offset_words[2].tolist() == [-1, 0]
    assert flat[0] == values.data_ptr() and flat[2].shape == (15,)
    assert {seed_words[1], offset_words[1]} == {torch.int32}
    assert offset.tolist() == [2**32] and seed.tolist() == [-1]


# ---------------------------------------------------------------------- the checks can fail


def _scalar_rand_compute(spec, transform):
    """Per-element scalar ``fill_rand`` of one tile (the whole Philox block per element, uint64
    products on the scalar unit): no SIMD region."""
    from tileplug.backend_ascend.random import philox

    import tilelang.ascend.language as T

    W = spec.tile
    u32, u64 = "uint32", "uint64"

    @T.macro
    def compute(buffers, first_block, groups):
        c = T.alloc_local((4,), u32)
        k = T.alloc_local((2,), u32)
        for i in T.serial(W):
            c[0] = T.Cast(u32, first_block + i // 4)
            c[1] = T.uint32(0)
            c[2] = T.Cast(u32, buffers["offset_ub"][0])
            c[3] = T.Cast(u32, buffers["offset_ub"][1])
            k[0] = T.Cast(u32, buffers["seed_ub"][0])
            k[1] = T.Cast(u32, buffers["seed_ub"][1])
            for r in T.serial(philox.ROUNDS):
                p0 = T.Cast(u64, c[0]) * T.uint64(philox.MULTIPLIERS[0])
                p1 = T.Cast(u64, c[2]) * T.uint64(philox.MULTIPLIERS[1])
                c[0] = T.Cast(u32, p1 >> T.uint64(32)) ^ c[1] ^ k[0]
                c[1] = T.Cast(u32, p1)
                c[2] = T.Cast(u32, p0 >> T.uint64(32)) ^ c[3] ^ k[1]
                c[3] = T.Cast(u32, p0)
                k[0] = k[0] + T.uint32(philox.WEYL_CONSTANTS[0])
                k[1] = k[1] + T.uint32(philox.WEYL_CONSTANTS[1])
            buffers["out_ub"][i] = T.Cast("float32", c[i % 4] >> T.uint32(8)) * T.float32(2.0**-24)

    return compute


def test_checks_fail_on_bad_variants():
    """fill_rand fp32 passes every check; (a) an 8-version tile of 65536 fp32 values over the
    UB budget (the builder refuses it; forced through, the UB check fails), (b) a serial,
    single-buffered tile loop, (c) the draw in per-element scalar code each fail theirs
    ((a) and (b) patch ``rows.check_budget`` / ``rows.row_loop``, as for the row kernels)."""
    import ascend_bad_kernels as bad_kernels

    from tileplug.backend_ascend.device import UBBudgetError
    from tileplug.backend_ascend.random import draw
    from tileplug.backend_ascend.random.fill_rand import uniform_words
    from test_ascend_lowering import _checked  # the three checks on a traced prim_func

    spec = draw.spec_of(_draw_call("fill_rand", 1000))
    build = lambda s: draw.build(s, uniform_words)  # noqa: E731
    good = _checked(build(spec), spec)
    assert all(ok for ok, _ in good.values()), good

    wide = replace(spec, tile=65536, num_buffers=8)
    assert wide.footprint > wide.budget
    with pytest.raises(UBBudgetError):
        build(wide)
    ok, detail = _checked(bad_kernels.row_over_budget(build, wide), wide)["ub"]
    assert not ok and "over budget" in detail, detail

    ok, detail = _checked(bad_kernels.row_serial_loop(build, spec), spec)["pipelined"]
    assert not ok and "versions=[1]" in detail, detail

    with mock.patch.object(draw, "draw_compute", _scalar_rand_compute):
        scalar = build(spec)
    ok, detail = _checked(scalar, spec)["vector"]
    assert not ok and "scalar UB dereference" in detail, detail


# ---------------------------------------------------------------------- CPU emulation


def correctly_rounded_ln(values: np.ndarray) -> np.ndarray:
    """fp32 ``ln`` rounded once from fp64 (a stand-in for ``vln`` at its best)."""
    return np.log(values.astype(np.float64)).astype(np.float32)


def ln_within_one_ulp(seed: int):
    """fp32 ``ln`` off by −1, 0 or +1 ulp at random (``vln``'s documented bound; ln 1 = 0 kept)."""
    chooser = np.random.default_rng(seed)

    def ln(values: np.ndarray) -> np.ndarray:
        exact = correctly_rounded_ln(values)
        nudged = (exact.view(np.int32) + chooser.integers(-1, 2, exact.shape).astype(np.int32)).view(np.float32)
        return np.where(exact == 0, exact, nudged)

    return ln


class NumpyOps:
    """The methods of ``vector_ops.VectorOps`` on numpy lanes (``uint32`` words, ``float32``
    values, ``bool`` masks; the last axis is a register's 64 lanes, other axes are many
    registers at once), each doing what the instruction is assumed to do. fp32 arithmetic is
    numpy's: IEEE single precision, round to nearest even, nothing fused."""

    def __init__(self, ln=correctly_rounded_ln) -> None:
        self._ln = ln

    @staticmethod
    def bind(value, name):
        return value

    def ramp(self, first, name=""):
        return (np.asarray(first, dtype=np.uint32)[..., None] + np.arange(64, dtype=np.uint32)).astype(np.uint32)

    def splat(self, word, name=""):
        return np.uint32(word)

    def multiply_wide(self, a, b, name=""):
        product = np.asarray(a, dtype=np.uint64) * np.asarray(b, dtype=np.uint64)
        return (product & MASK).astype(np.uint32), (product >> np.uint64(32)).astype(np.uint32)

    def xor(self, a, b, name=""):
        return np.bitwise_xor(a, b)

    def add_word(self, a, word, name=""):
        return (np.asarray(a, dtype=np.uint64) + word).astype(np.uint32)

    def sub(self, a, b, name=""):
        if np.asarray(a).dtype == np.uint32:
            return (np.asarray(a, dtype=np.int64) - np.asarray(b, dtype=np.int64)).astype(np.uint32)
        return np.subtract(a, b, dtype=np.float32)

    def shift_right(self, a, bits, name=""):
        return np.right_shift(a, np.uint32(bits))

    def and_word(self, a, word, name=""):
        return np.bitwise_and(a, np.uint32(word))

    def bit_set(self, a, bit, name=""):
        return np.bitwise_and(a, np.uint32(1 << bit)) != 0

    def to_float(self, a, name=""):
        return np.asarray(a).astype(np.int32).astype(np.float32)

    def constant(self, value, name=""):
        return np.float32(value)

    def add(self, a, b, name=""):
        return np.add(a, b, dtype=np.float32)

    def mul(self, a, b, name=""):
        return np.multiply(a, b, dtype=np.float32)

    def scale(self, a, factor, name=""):
        return np.multiply(a, np.float32(factor), dtype=np.float32)

    def plus(self, a, addend, name=""):
        return np.add(a, np.float32(addend), dtype=np.float32)

    def divide(self, a, b, name=""):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.divide(a, b, dtype=np.float32)

    def ln(self, a, name=""):
        return self._ln(a)

    def sqrt(self, a, name=""):
        with np.errstate(invalid="ignore"):
            return np.sqrt(np.asarray(a, dtype=np.float32))

    def positive(self, a, name=""):
        return a > 0

    def select(self, mask, a, b, name=""):
        return np.where(mask, a, b)

    def interleave(self, a, b, name=""):
        a, b = np.broadcast_arrays(a, b)
        both = np.stack([a, b], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])
        return both[..., :64], both[..., 64:]


def emulated_words(ops, key, offset, first_blocks, counter_high=None):
    """``philox.block_words`` of the groups starting at ``first_blocks`` (numpy, ``[G]``) →
    four ``uint32 [G, 64]`` registers."""
    from tileplug.backend_ascend.random import philox

    key_words = tuple(np.uint32(word) for word in key)
    offset_words = (np.uint32(offset & MASK), np.uint32(offset >> 32))
    return philox.block_words(ops, philox.multiplier_registers(ops), np.asarray(first_blocks), key_words,
                              offset_words, counter_high)


def emulated_draw(ops, transform, seed: int, offset: int, count: int) -> torch.Tensor:
    """What the draw kernel writes for ``count`` elements (fp32): each group's words through
    ``transform`` and ``element_order``, the groups in order, cut at ``count``."""
    from tileplug.backend_ascend.random import philox

    groups = -(-count // philox.ELEMENTS_PER_GROUP)
    words = emulated_words(ops, (seed & MASK, seed >> 32), offset, np.arange(groups) * philox.BLOCKS_PER_GROUP)
    elements = philox.element_order(ops, transform(ops, words))
    flat = np.concatenate([np.broadcast_to(e, (groups, 64)) for e in elements], axis=1).reshape(-1)[:count]
    return torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32))


KNOWN_ANSWERS = [  # Random123's kat_vectors for philox4x32_10: counter, key, words
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK, MASK, MASK, MASK), (MASK, MASK), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS, ids=["zeros", "ones", "pi"])
def test_emulated_philox_reproduces_the_known_answers(counter, key, expected):
    """``philox.block_words`` on NumpyOps, lane 0 of a group starting at counter word 0 (the
    kernels pass counter word 1 = 0; here it is given, to reach every vector)."""
    c0, c1, c2, c3 = counter
    ops = NumpyOps()
    words = emulated_words(ops, key, c2 | (c3 << 32), [c0], None if c1 == 0 else ops.splat(c1))
    assert tuple(int(np.asarray(word)[0, 0]) for word in words) == expected


SEEDS_AND_OFFSETS = [(0, 0), (2**64 - 1, 2**64 - 1), (0x243F6A8885A308D3, 2**32 + 5), (0xA4093822299F31D0, 7)]


@pytest.mark.parametrize("seed, offset", SEEDS_AND_OFFSETS)
def test_emulated_uniform_draw_is_the_reference_bytewise(seed, offset):
    """Words, counter layout, element interleave and ``(r >> 8)·2^-24``: every element of a
    draw that spans two tiles and ends inside a block, bytewise, in fp32 and rounded once to
    bf16 / fp16."""
    from tileplug.backend_ascend.random.fill_rand import uniform_words
    from tileplug.reference.random import philox as reference
    from tileplug.reference.random.draw import uniform_from_words

    count = 4096 + 1001
    got = emulated_draw(NumpyOps(), uniform_words, seed, offset, count)
    state = [torch.tensor([as_int64_word(value)], dtype=torch.int64) for value in (seed, offset)]
    want = uniform_from_words(reference.words(*state, count))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(got.to(dtype).view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                           want.to(dtype).view(torch.int16 if dtype.itemsize == 2 else torch.int32)), dtype


def _reference_normals(seed, offset, count):
    from tileplug.reference.random import philox as reference
    from tileplug.reference.random.draw import normal_from_block_words

    state = [torch.tensor([as_int64_word(value)], dtype=torch.int64) for value in (seed, offset)]
    return normal_from_block_words(reference.block_words(*state, reference.block_count(count)))[:count]


@pytest.mark.parametrize("ln, ulps", [(correctly_rounded_ln, 1), (ln_within_one_ulp(3), 2)],
                         ids=["ln-correctly-rounded", "ln-within-1-ulp"])
def test_emulated_normal_draw_is_within_the_spec(ln, ulps):
    """Box–Muller as the kernel computes it, over 2^20 values (two seeds and offsets): within 2
    ulp of fp32 of the reference (SPEC §9) when ``vln`` is off by up to 1 ulp, within 1 ulp
    when it is correctly rounded; within 1 ulp of bf16 / fp16 after rounding; never NaN."""
    from tileplug.backend_ascend.random.fill_randn import normal_words
    from tileplug.core.testing import assert_within_ulps

    for seed, offset in ((2**64 - 1, 3), (0x243F6A8885A308D3, 2**40)):
        got = emulated_draw(NumpyOps(ln), normal_words, seed, offset, 2**19)
        want = _reference_normals(seed, offset, 2**19)
        assert not torch.isnan(got).any()
        assert_within_ulps(got, want, ulps, what="fp32", nan_equal=False)
        for dtype in (torch.bfloat16, torch.float16):
            assert_within_ulps(got.to(dtype), want.to(dtype), 1, what=str(dtype), nan_equal=False)


def test_emulated_normal_pairs_at_the_edges():
    """Angles on every quadrant and octant boundary and next to them, radii from ``a = 1``
    (zero) to ``a = 2^-24`` (the largest): within 1 ulp with a correctly rounded ``vln``;
    the exact zeros of ``cos`` / ``sin`` are zeros."""
    from tileplug.backend_ascend.random.fill_randn import normal_pair
    from tileplug.core.testing import assert_within_ulps
    from tileplug.reference.random.draw import normal_from_block_words

    codes = sorted({max(0, min(2**24 - 1, b * 2**21 + d)) for b in range(9) for d in (-1, 0, 1)})
    evens = [0, 1, 2**23, 2**24 - 2, 2**24 - 1]
    pairs = np.array([(e, s) for e in evens for s in codes], dtype=np.uint32)
    pairs = np.concatenate([pairs, np.zeros(((-len(pairs)) % 64, 2), dtype=np.uint32)])
    words = (pairs << np.uint32(8)) | np.uint32(0xAB)  # low bits never matter
    even, odd = words[:, 0].reshape(-1, 64), words[:, 1].reshape(-1, 64)
    z_even, z_odd = normal_pair(NumpyOps(), even, odd, "z")
    block = torch.from_numpy(np.stack([even.reshape(-1), odd.reshape(-1)] * 2, axis=1).astype(np.int64))
    want = normal_from_block_words(block).view(-1, 4)
    got_even, got_odd = torch.from_numpy(z_even.reshape(-1)), torch.from_numpy(z_odd.reshape(-1))
    assert_within_ulps(got_even, want[:, 0], 1, what="z_even", nan_equal=False)
    assert_within_ulps(got_odd, want[:, 1], 1, what="z_odd", nan_equal=False)
    zeros = want[:, :2] == 0
    assert torch.equal(torch.stack([got_even, got_odd], 1)[zeros], want[:, :2][zeros])
