"""The CUDA quant tile kernel's generated source, run on the CPU CTA by CTA: each specialisation of
the stochastic per-token / per-block casts in the op table (``stochastic_cases``), and of the
deterministic casts of :data:`DETERMINISTIC_CASES` (the bench's main cases), is lowered for
sm_90 as the backend lowers it, compiled with g++ against ``tests/fixtures/cuda-host/cta_emulation.h``
(every thread of a CTA a host thread: ``__syncthreads`` a barrier, warp shuffles an exchange,
``__shared__`` one array of the CTA) and launched over the grid the launcher uses, with the
arguments the launcher passes (``quant.kernels.make_launcher`` itself hands them over, the
kernel's scalar shapes and strides read off its buffers); ``q`` and ``sf`` must equal the
reference's bytewise (SPEC §4: ``sf`` on every byte that holds a group); a stochastic cast's last CTA
must have advanced the generator's offset by one and left its arrival counter at 0.

Marker ``nvcc``: the CUDA headers come with nvcc (skipped without nvcc, g++ or those headers). What
this does not see: the device's memory model beyond the barriers, the 128-bit access instructions
(the compile test checks those), the device's NaN canonicalisation; what it does see is every
index, shift, mask, shuffle and rounding of the kernel, bytewise, on a GPU-less machine.
"""

from __future__ import annotations

import ctypes
import dataclasses
import re

import pytest
import torch

from test_cuda_element_cast_emulation import host_compiler, kernel_definition
from tileplug.core import describe_call, opdefs
from tileplug.core.opdefs import Case
from tileplug.core.contracts.quant import QuantOutputs
from tileplug.core.ops.quant import stochastic_cases
from tileplug.core.registry import use_backend
from tileplug.core.testing import assert_bytes_equal, assert_sf_equal

pytestmark = pytest.mark.nvcc

TOKENS = (1, 37, 130)  # a single row, a partial tile, more than one 128-row group


def host_harness(source: str) -> tuple[str, list[str], list[str], int]:
    """The kernel definition of a generated source (its includes dropped) wrapped in
    ``run_grid(<kernel parameters>, blocks_x, blocks_y)`` → (C++ source, parameter names, their C
    types, threads a CTA)."""
    definition, threads, name, parameters, names = kernel_definition(source)  # its shared memory static
    types = [parameter.strip().rsplit(" ", 1)[0] for parameter in parameters.split(",")]
    harness = (f'#include "cta_emulation.h"\n{definition}\n'
               f'extern "C" void run_grid({parameters}, unsigned blocks_x, unsigned blocks_y) {{\n'
               f'  emulated_launch(blocks_x, blocks_y, {threads}, [=] {{ {name}({", ".join(names)}); }});\n'
               f'}}\n')
    return harness, names, types, threads


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """``build(spec, source=None)`` → ``(run_grid, names, types)`` of ``spec``'s kernel (or of
    ``source``, an edited copy of it) compiled for the host."""
    compile_harness = host_compiler(tmp_path_factory, "cuda-cta", ("-std=c++20", "-pthread"))
    from tileplug.backend_cuda import jit

    def compile_spec(spec, source: str | None = None):
        harness, names, types, _ = host_harness(jit.lower_source(spec) if source is None else source)
        stem = spec.name if source is None else f"{spec.name}_edited"
        return compile_harness(stem, harness), names, types

    return compile_spec


def launch_arguments(spec, tensors: list[torch.Tensor], names: list[str], types: list[str]) -> list:
    """The kernel's C arguments: each buffer parameter's data pointer, each scalar (a dynamic
    shape or stride of some buffer) read off the tensor bound to that buffer."""
    from tileplug.backend_cuda import jit

    func = jit.prim_func(spec)
    buffers = [func.buffer_map[parameter] for parameter in func.params if parameter in func.buffer_map]
    assert len(buffers) == len(tensors), (len(buffers), len(tensors))
    pointers, scalars = {}, {}
    for buffer, tensor in zip(buffers, tensors):
        pointers[buffer.name] = pointers[buffer.data.name] = tensor.data_ptr()
        for extent, size in zip(buffer.shape, tensor.shape):
            if hasattr(extent, "name"):
                scalars.setdefault(extent.name, size)
        for stride, size in zip(buffer.strides, tensor.stride()):
            if hasattr(stride, "name"):
                scalars.setdefault(stride.name, size)
    arguments = []
    for name, kind in zip(names, types):
        if "*" in kind:
            arguments.append(ctypes.c_void_p(pointers[name]))
        else:
            assert name in scalars, f"{spec.name}: no buffer gives {name}"
            arguments.append(ctypes.c_int64(scalars[name]) if "int64" in kind else ctypes.c_int(scalars[name]))
    return arguments


def grid(spec, tokens: int, hidden: int) -> tuple[int, int]:
    """The launcher's grid: row tiles × column tiles, one dimension when column tiles are adjacent
    (``grid_cols``)."""
    rows, cols = -(-tokens // spec.tile_rows), -(-hidden // spec.tile_cols)
    return (rows * cols, 1) if spec.grid_cols else (rows, cols)


def run_case(built, spec, case, tokens: int, x: torch.Tensor | None = None) -> None:
    """``case`` at ``tokens`` rows on the reference and through the emulated kernel; bytes compared:
    ``q`` and ``sf`` of a cast, the result of ``cast_back``, ``x`` itself after fake quant. ``x``: the
    input instead of the case's."""
    from tileplug.backend_cuda.quant.kernels import make_launcher

    def arguments():
        args, kwargs = case.arguments(tokens, "cpu")
        return ((x.clone(), *args[1:]) if x is not None else args), kwargs

    want_args, kwargs = arguments()
    with use_backend("reference"):
        want = opdefs.get(case.op).function(*want_args, **kwargs)
    args, kwargs = arguments()  # the same inputs, the generator at its first offset
    call, inputs = describe_call(case.op, *args, **kwargs)
    in_place = case.op == "per_token_cast_and_cast_back"  # x is the result (the op returns None)
    if in_place:
        want = want_args[0]
    want_q, want_sf = (want, None) if isinstance(want, torch.Tensor) else want
    outputs = QuantOutputs(None if in_place else torch.zeros_like(want_q), None if want_sf is None else
                           torch.empty_strided(want_sf.shape, want_sf.stride(), dtype=want_sf.dtype).zero_())
    captured: list[torch.Tensor] = []
    make_launcher(spec, lambda *tensors: captured.extend(tensors))(inputs, outputs)
    offset = None if inputs.offset is None else int(inputs.offset)
    run_grid, names, types = built
    run_grid(*launch_arguments(spec, captured, names, types), *map(ctypes.c_uint, grid(spec, tokens, call.hidden)))
    what = f"{spec.name}, {case.id}, T = {tokens}"
    if offset is not None:  # a stochastic cast: its last CTA advanced the offset and put the counter back
        assert captured[-2] is inputs.offset and captured[-1].dtype == torch.int32
        assert int(inputs.offset) == offset + 1, f"{what}: offset {int(inputs.offset)}, want {offset + 1}"
        assert int(captured[-1]) == 0, f"{what}: arrival counter left at {int(captured[-1])}"
    assert_bytes_equal(inputs.x if in_place else outputs.q, want_q, f"{what}: q", nan_equal=True)
    if want_sf is not None:
        assert_sf_equal(outputs.sf, want_sf, call.cast.block, tokens, call.hidden, f"{what}: sf", nan_equal=True)


DETERMINISTIC_CASES = [
    Case.of("per_token_cast", 576),
    Case.of("per_token_cast", 576, round_sf=True, use_packed_ue8m0=True, use_tma_aligned_col_major_sf=True),
    Case.of("per_token_cast", 576, fmt="e2m1", num_per_channels=16),
    Case.of("per_block_cast", 576),
    Case.of("per_channel_cast", 576, num_per_tokens=128),
    Case.of("cast_back", 7168, fmt="bf16", x_block_size=(1, 128)),
    Case.of("per_token_cast_and_cast_back", 576, fmt="e2m1", num_per_channels=16, use_e4m3_sf=True),
]
"""The deterministic modes run here too: the bench's per-token (1 × 128 e4m3, packed UE8M0
column-major, e2m1 1 × 16), per-block 128 × 128, per-channel 128 × 1 and ``cast_back`` cases, and
fake quant (in place, e2m1 with e4m3-rounded scales)."""


def _tile_specs() -> list[tuple[str, object, object]]:
    """(spec name, spec, first case it serves) of every specialisation (small-T tiers included) of
    the stochastic casts of the op table and of :data:`DETERMINISTIC_CASES`; a stochastic one also
    with its Philox products split (``philox_wide`` off)."""
    from tileplug.backend_cuda.plugin import _KERNELS

    found: dict[str, tuple] = {}
    for case in stochastic_cases() + DETERMINISTIC_CASES:
        args, kwargs = case.arguments(3, "meta")
        call, _ = describe_call(case.op, *args, **kwargs)
        kernel = _KERNELS[call.op]
        if kernel.supports(call) is not None:
            continue
        for spec in kernel.specs(call):
            found.setdefault(spec.name, (spec, case))
            if spec.philox_wide:  # the split products as well (TILEPLUG_CUDA_PHILOX_WIDE_<OP>=0)
                split = dataclasses.replace(spec, philox_wide=False)
                found.setdefault(split.name, (split, case))
    return [(name, spec, case) for name, (spec, case) in found.items()]


SPECS = _tile_specs()


@pytest.mark.parametrize("name, spec, case", SPECS, ids=[name for name, _, _ in SPECS])
def test_tile_kernel_source_gives_the_references_bytes(build, name, spec, case) -> None:
    built = build(spec)
    for tokens in TOKENS:
        run_case(built, spec, case, tokens)


def test_a_tile_kernel_that_misplaces_a_field_is_caught(build) -> None:
    """The check can fail: the per-token 1 × 128 e4m3 kernel with its random field moved one bit
    down (``>> 13`` for ``>> 12``: half the field's weight) gives other bytes than the reference."""
    from tileplug.backend_cuda import jit

    name, spec, case = next(entry for entry in SPECS if "bfloat16_g1x128_e4m3" in entry[0])
    source = jit.lower_source(spec)
    edited = source.replace(">> (uint)12) & (uint)1044480)", ">> (uint)13) & (uint)1044480)")
    assert edited != source, "the field's shift is where this test expects it"
    with pytest.raises(AssertionError, match="differ"):
        run_case(build(spec, edited), spec, case, 37)


def test_a_tile_kernel_whose_lanes_keep_their_own_words_is_caught(build) -> None:
    """The check can fail: the stochastic per-token 1 × 128 e4m3 kernel whose lanes skip the exchange of their
    Philox blocks' parts (each keeps the words it would have sent: the neighbouring lane's part of its own
    block) gives other bytes than the reference."""
    from tileplug.backend_cuda import jit

    name, spec, case = next(entry for entry in SPECS if "bfloat16_g1x128_e4m3" in entry[0] and "_sr" in entry[0])
    source = jit.lower_source(spec)
    exchange = re.compile(r"__shfl_xor_sync\(\(uint\)4294967295, (\w+), 1, 32\)")
    sent = exchange.findall(source)
    assert len(sent) == 1, "one exchange of two lanes' parts (a loop over the part's two words)"
    with pytest.raises(AssertionError, match="differ"):
        run_case(build(spec, exchange.sub(sent[0], source)), spec, case, 37)


def test_a_tile_kernel_whose_first_cta_to_count_advances_is_caught(build) -> None:
    """The check can fail: the stochastic per-token 1 × 128 e4m3 kernel with the offset advanced by the first CTA
    to count itself instead of the last (each CTA then finds the counter at 0 again, so every CTA after the first
    draws with a later offset) gives other bytes than the reference, or another offset."""
    from tileplug.backend_cuda import jit

    name, spec, case = next(entry for entry in SPECS if "bfloat16_g1x128_e4m3" in entry[0] and "_sr" in entry[0])
    source = jit.lower_source(spec)
    assert source.count("if (arrived[0] == (") == 2, "the last CTA's test, once for each of its two stores"
    with pytest.raises(AssertionError, match="offset|differ"):
        run_case(build(spec, source.replace("if (arrived[0] == (", "if (arrived[0] == 0 && (")), spec, case, 37)


def stochastic_entry(kind: str) -> tuple[object, object, int, torch.dtype]:
    """(spec, case, H, x's dtype) of the first stochastic specialisation whose name starts with ``kind`` (the
    default tier: not the small-T ``h16`` one)."""
    _, spec, case = next(entry for entry in SPECS if entry[0].startswith(kind) and "_sr" in entry[0]
                         and "h16" not in entry[0])
    x = case.arguments(3, "meta")[0][0]
    return spec, case, x.shape[1], x.dtype


@pytest.mark.parametrize("kind", ["per_token_cast_bfloat16_g1x128_e4m3", "per_block_cast_bfloat16_g128x128_e4m3"])
def test_stochastic_e4m3_blocks_off_the_normal_steps_take_the_general_carry(build, kind) -> None:
    """A Philox block's 8 values all at ``|x · inv| ≥ 2^-6`` take the short carry, any other block (a value
    scaled below 2^-6, ±0, NaN, ±inf) the general one: rows mixing both, the special values at every
    place of a block, give the reference's bytes."""
    spec, case, hidden, _ = stochastic_entry(kind)
    tokens = 37
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, hidden, generator=generator)
    small = [3e-6, -3e-6, 0.0, -0.0, 1e-30]  # scaled below 2^-6 (their groups' scales stay finite)
    for row in range(tokens):
        for place in range(0, hidden - 64, 8 * 5):  # every fifth block of a row holds one of them
            x[row, place + (row + place // 40) % 8] = small[(row + place) % len(small)]
    for row in range(0, tokens, 3):  # the last group of columns: NaN and ±inf (that group's values NaN)
        x[row, hidden - 64 + row % 64] = (float("nan"), float("inf"), -float("inf"))[row % 3]
    x[3, 128:256] = 1e-7 * torch.randn(128, generator=generator)  # a whole group near zero: its own scale
    run_case(build(spec), spec, case, tokens, x.to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["per_token_cast_bfloat16_g1x16_e2m1", "per_token_cast_float32_g1x16_e2m1",
                                  "per_block_cast_bfloat16_g32x32_e2m1"])
def test_stochastic_e2m1_carry_at_every_binade(build, kind) -> None:
    """e2m1's carry codes (``a = min(|x · inv|, 6)``, ``a + 1`` below 1, the code read off the rounded pattern):
    groups whose values fill every binade of the grid — subnormal, [1, 2), [2, 4), [4, 6] and the largest
    itself — beside ±0 and tiny values, give the reference's bytes (an e4m3 scale may leave ``x · inv`` a little past 6). No NaN or inf here: a group
    holding one makes NaNs by invalid operations, which the host makes negative (x86's default NaN) and the GPU
    positive, and e2m1 keeps a NaN's sign (the GPU tests cover them)."""
    spec, case, hidden, dtype = stochastic_entry(kind)
    tokens = 37
    generator = torch.Generator().manual_seed(7)
    magnitude = torch.exp2(torch.empty(tokens, hidden).uniform_(-12, 3, generator=generator))  # 2^-12 … 8
    x = torch.where(torch.rand(tokens, hidden, generator=generator) < 0.5, -magnitude, magnitude)
    x[:, ::16] = 6.0  # each group's largest, on the grid once scaled
    x[1, 5], x[2, 6], x[4, 7], x[5, 9] = 0.0, -0.0, 1e-30, -3e-7
    run_case(build(spec), spec, case, tokens, x.to(dtype))


CHANNEL_GEOMETRIES = [(1, 16, 4), (2, 8, 4), (2, 16, 8), (4, 8, 8)]
"""(warps, rows a thread, lanes a row) of the per-channel tiles narrower than a warp's row: 8 rows of 4 lanes
(32 columns) or 4 rows of 8 lanes (64 columns) a warp, one or more warps stacked to the 128-row group."""


@pytest.mark.parametrize("sf", ["fp32", "ue8m0"])
@pytest.mark.parametrize("geometry", CHANNEL_GEOMETRIES, ids=[f"w{w}r{r}h{h}" for w, r, h in CHANNEL_GEOMETRIES])
def test_per_channel_tiles_of_fewer_lanes_a_row(build, geometry, sf) -> None:
    """A per-channel 128 × 1 tile whose warp holds several rows (``lanes_per_row`` 4 or 8: the rows of a slot
    reduced by shuffles, then the warps in shared memory) gives the reference's bytes, fp32 and packed UE8M0
    scales, at T = 1, 37, 130 and 300 (a partial group, more than two groups)."""
    import dataclasses

    from tileplug.backend_cuda.plugin import _KERNELS

    extra = {} if sf == "fp32" else {"round_sf": True, "use_packed_ue8m0": True}
    case = Case.of("per_channel_cast", 576, num_per_tokens=128, **extra)
    args, kwargs = case.arguments(3, "meta")
    call, _ = describe_call(case.op, *args, **kwargs)
    warps, rows, lanes = geometry
    spec = dataclasses.replace(_KERNELS[call.op].spec(call), warps=warps, rows_per_thread=rows, lanes_per_row=lanes)
    assert spec.tile_rows == 128 and spec.tile_cols == lanes * spec.vec
    built = build(spec)
    for tokens in (1, 37, 130, 300):
        run_case(built, spec, case, tokens)
