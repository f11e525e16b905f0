"""The CUDA element casts' (and ``fill_rand``'s) generated source, run on the CPU: each ``nearest_cast``,
``stochastic_cast`` and ``fill_rand`` specialisation is lowered for sm_90 as the backend lowers it, its kernel compiled with g++ against host
stand-ins of the few intrinsics it uses (``tests/fixtures/cuda-host/emulation.h``: ``__umulhi``, the
rounding-mode adds, the CUDA headers' own host fp8 / bf16 / fp16 conversions, tileplug's ``mul.wide``
helper) and run thread by thread over
the grid the launcher would use; its bytes must equal the reference's (any NaN equals any NaN).

Marker ``nvcc``: the CUDA headers come with nvcc (skipped without nvcc, g++ or those headers). What
this does not see: warps, the device's NaN canonicalisation, the 128-bit access instructions (the
compile test checks those); what it does see is every index, shift, mask and rounding the kernel
computes, bytewise, on a GPU-less machine.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import shutil
import subprocess

import pytest
import torch

from tileplug.core.ops.cast import cast, nearest_cast
from tileplug.core.ops.random import fill_rand
from tileplug.core.random import Generator
from tileplug.core.testing import assert_bytes_equal, canonical_nans

pytestmark = pytest.mark.nvcc

EMULATION_HEADER = os.path.join(os.path.dirname(__file__), "fixtures", "cuda-host")
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}
STOCHASTIC = [("float32", "bfloat16"), ("float32", "float8_e4m3fn"), ("bfloat16", "float8_e4m3fn")]
NEAREST = [(source, target) for source in TORCH for target in TORCH]
COUNT = 100_003  # not a multiple of a thread's run or a CTA's
SEEDS = [(0, 0), (2**64 - 1, 5), (0x243F6A8885A308D3, 2**32 + 7)]


def cuda_include_dir() -> str | None:
    """The CUDA headers nvcc itself uses (its ``--dryrun`` INCLUDES), else ``CUDA_HOME``'s or
    /usr/local/cuda's: the first folder holding ``cuda_fp8.h``."""
    candidates = []
    if shutil.which("nvcc"):
        dry = subprocess.run(["nvcc", "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True)
        candidates += re.findall(r'INCLUDES="-I([^"]+)"', dry.stdout + dry.stderr)
    candidates += [os.path.join(root, "include") for root in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda") if root]
    return next((folder for folder in candidates if os.path.exists(os.path.join(folder, "cuda_fp8.h"))), None)


def kernel_definition(source: str) -> tuple[str, int, str, str, list[str]]:
    """The kernel definition of a generated source, its includes dropped, its dynamic shared memory one
    static array of the block (the 228 KB an H100 / H200 SM has at most; blocks run one after another) →
    (definition, threads a block, the kernel's name, its parameter list as written, the parameter names
    in order)."""
    definition = source[source.index('extern "C" __global__ void __launch_bounds__'):]
    definition = re.sub(r"extern __shared__ __align__\((\d+)\) (\w+) (\w+)\[\];",
                        lambda found: f"alignas({found.group(1)}) static {found.group(2)} {found.group(3)}"
                                      f"[233472 / sizeof({found.group(2)})];", definition)
    match = re.match(r'extern "C" __global__ void __launch_bounds__\((\d+)(?:, \d+)?\) (\w+)\(([^)]*)\)', definition)
    assert match is not None, definition[:300]
    parameters = match.group(3)
    names = [parameter.split()[-1] for parameter in parameters.split(",")]
    return definition, int(match.group(1)), match.group(2), parameters, names


def host_harness(source: str) -> tuple[str, list[str], int]:
    """The kernel definition of a generated source (its includes dropped), wrapped in
    ``run_grid(<kernel parameters>, blocks)`` that runs every thread of every block in turn, a block's
    thread 0 first (a draw's one barrier, behind thread 0's read of the offset: ``emulation.h``) →
    (C++ source, the kernel's parameter names in order, threads a block)."""
    definition, threads, name, parameters, names = kernel_definition(source)
    harness = (f'#include "emulation.h"\n{definition}\n'
               f'extern "C" void run_grid({parameters}, int64_t blocks) {{\n'
               f'  for (int64_t block = 0; block < blocks; ++block)\n'
               f'    for (unsigned turn = 0; turn < {threads}; ++turn) {{\n'
               f'      emulated_block.x = (unsigned)block; emulated_thread.x = turn;\n'
               f'      {name}({", ".join(names)});\n'
               f'    }}\n}}\n')
    return harness, names, threads


def host_compiler(tmp_path_factory, folder_name: str, flags: tuple[str, ...] = ("-std=c++17",)):
    """``compile(stem, harness)`` → the ``run_grid`` of a host harness (C++ source) built with g++ against
    the CUDA headers and ``tests/fixtures/cuda-host``; skips the calling test without g++ or the headers."""
    include = cuda_include_dir()
    if shutil.which("g++") is None or include is None:
        pytest.skip("g++ or the CUDA headers (cuda_fp8.h) are missing")
    folder = tmp_path_factory.mktemp(folder_name)

    def compile_harness(stem: str, harness: str):
        path = folder / f"{stem}.cpp"
        path.write_text(harness)
        library = folder / f"{stem}.so"
        done = subprocess.run(["g++", "-O1", *flags, "-shared", "-fPIC", "-frounding-math", "-w",
                               f"-I{include}", f"-I{EMULATION_HEADER}", str(path), "-o", str(library)],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return ctypes.CDLL(str(library)).run_grid

    return compile_harness


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """``build(spec, source=None)`` → ``(run_grid, parameter names, threads)`` of ``spec``'s kernel (or of
    ``source``, an edited copy of it) compiled for the host."""
    compile_harness = host_compiler(tmp_path_factory, "cuda-host")
    from tileplug.backend_cuda import jit

    def compile_spec(spec, source: str | None = None):
        harness, names, threads = host_harness(jit.lower_source(spec) if source is None else source)
        stem = spec.name if source is None else f"{spec.name}_edited"
        return compile_harness(stem, harness), names, threads

    return compile_spec


def edge_values(dtype: torch.dtype) -> torch.Tensor:
    """``COUNT`` values over 42 binades, both signs, with the specials first: zeros, infinities, NaNs
    of several payloads (bf16-representable ones for a bf16 source), e4m3's saturation and smallest
    steps, fp32's largest and smallest."""
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(COUNT, generator=generator) * torch.exp2(
        torch.randint(-30, 12, (COUNT,), generator=generator).float())
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, 448.0, 464.0, 480.0, -1e6, 2.0**-10, 1e-45,
                             3.3895314e38, 1 + 2.0**-8, 2.0**-6, -2.0**-7, 2.0**-9 * 0.999, 2.0**-6 * 0.999])
    values[:specials.numel()] = specials
    nan_patterns = torch.tensor([0x7F810000, 0x7FFF0000, 0xFFC00000 - 2**32, 0x7FFFFFFF, 0x7F800001],
                                dtype=torch.int64).to(torch.int32).view(torch.float32)
    values[100:100 + nan_patterns.numel()] = nan_patterns
    if dtype == torch.float8_e4m3fn:
        return values.clamp(-448.0, 448.0).to(dtype)
    return values.to(dtype)


def draw_state(seed: int, offset: int) -> dict:
    """A generator's device state as a draw's kernel takes it: ``seed`` and ``offset`` (int64 ``[1]``,
    the seed's bits as signed) and the arrival counter at rest (int32 ``[1]``, 0)."""
    return {"seed": torch.tensor([seed - 2**64 if seed >= 2**63 else seed]), "offset": torch.tensor([offset]),
            "arrivals": torch.zeros(1, dtype=torch.int32)}


def assert_advanced(state: dict, offset: int, what: str) -> None:
    """The draw's last block advanced the offset by one and set the arrival counter back to 0."""
    assert int(state["offset"]) == offset + 1, f"{what}: offset {int(state['offset'])}, want {offset + 1}"
    assert int(state["arrivals"]) == 0, f"{what}: arrival counter left at {int(state['arrivals'])}"


def run_kernel(built, spec, tensors: dict, count: int, per_thread: int | None = None) -> None:
    """Every thread of the launcher's grid over ``count`` elements, ``per_thread`` a thread (default:
    the spec's run)."""
    run_grid, names, threads = built
    blocks = -(-count // (threads * (per_thread or spec.values_per_thread)))
    arguments = [ctypes.c_int64(count) if name == "N" else ctypes.c_void_p(tensors[name].data_ptr())
                 for name in names]
    run_grid(*arguments, ctypes.c_int64(blocks))


@pytest.mark.parametrize("vectorize", [True, False], ids=["v128", "scalar"])
@pytest.mark.parametrize("source, target", STOCHASTIC, ids=[f"{s}-{t}" for s, t in STOCHASTIC])
def test_stochastic_cast_kernel_source_gives_the_references_bytes(build, source, target, vectorize) -> None:
    from tileplug.backend_cuda.quant.element_cast import ElementCastSpec

    spec = ElementCastSpec("stochastic_cast", source, target, vectorize)
    built = build(spec)
    x = edge_values(TORCH[source])
    for seed, offset in SEEDS:
        generator = Generator("cpu", seed)
        generator.offset = offset
        want = cast(x, TORCH[target], stochastic_rounding=True, generator=generator)
        result = torch.empty(COUNT, dtype=TORCH[target])
        state = draw_state(seed, offset)
        run_kernel(built, spec, {"x": x, "result": result, **state}, COUNT)
        assert_bytes_equal(result, want, f"{spec.name}, seed {seed:#x}, offset {offset}", nan_equal=True)
        assert_advanced(state, offset, spec.name)


@pytest.mark.parametrize("source, target", NEAREST, ids=[f"{s}-{t}" for s, t in NEAREST])
def test_nearest_cast_kernel_source_gives_the_references_bytes(build, source, target) -> None:
    from tileplug.backend_cuda.quant.element_cast import ElementCastSpec

    spec = ElementCastSpec("nearest_cast", source, target)
    built = build(spec)
    x = edge_values(TORCH[source])
    want = torch.empty(COUNT, dtype=TORCH[target])
    nearest_cast(want, x)
    result = torch.empty(COUNT, dtype=TORCH[target])
    run_kernel(built, spec, {"x": x, "result": result}, COUNT)
    assert_bytes_equal(result, want, spec.name, nan_equal=True)


def test_a_kernel_that_misplaces_a_field_is_caught(build) -> None:
    """The check can fail: the fp32 → e4m3 kernel with its field shifted one bit too far down
    (``>> 11`` for ``>> 12``) differs from the reference on a tenth of the elements or more."""
    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.quant.element_cast import ElementCastSpec

    spec = ElementCastSpec("stochastic_cast", "float32", "float8_e4m3fn")
    source = jit.lower_source(spec)
    shift = re.search(r"\) >> \(uint\)12\) & \(uint\)1044480\)", source)
    assert shift is not None, "the field extraction of the 8-bit fields (bits 12-19)"
    built = build(spec, source.replace(") >> (uint)12) & (uint)1044480)", ") >> (uint)11) & (uint)1044480)"))
    x = edge_values(torch.float32)
    want = cast(x, torch.float8_e4m3fn, stochastic_rounding=True, generator=Generator("cpu", 0))
    result = torch.empty(COUNT, dtype=torch.float8_e4m3fn)
    run_kernel(built, spec, {"x": x, "result": result, **draw_state(0, 0)}, COUNT)
    differing = canonical_nans(result).view(torch.uint8) != canonical_nans(want).view(torch.uint8)
    assert int(differing.sum()) > COUNT // 10


@pytest.mark.parametrize("vectorize", [True, False], ids=["v128", "scalar"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_fill_rand_kernel_source_gives_the_references_values(build, dtype, vectorize) -> None:
    """The uniform draw's kernel (Philox4x32-10 in TileLang integer arithmetic, ``(r >> 8) · 2^-24``)
    against the reference's stream, element for element, for three seeds and offsets."""
    from tileplug.backend_cuda.random.spec import RandomKernelSpec

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    spec = RandomKernelSpec("fill_rand", dtype, vectorize)
    built = build(spec)
    per_thread = spec.run_bytes // torch_dtype.itemsize
    for seed, offset in SEEDS:
        state = draw_state(seed, offset)
        want = torch.empty(COUNT, dtype=torch_dtype)
        fill_rand(want, state["seed"].clone(), state["offset"].clone())
        values = torch.full((COUNT,), float("nan"), dtype=torch_dtype)
        run_kernel(built, spec, {"values": values, **state}, COUNT, per_thread)
        assert_bytes_equal(values, want, f"{spec.name}, seed {seed:#x}, offset {offset}", nan_equal=True)
        assert_advanced(state, offset, spec.name)


def test_a_draw_whose_first_block_advances_the_offset_is_caught(build) -> None:
    """The check can fail: ``fill_rand`` with the offset advanced by the first block to arrive instead of
    the last (each block then finds the counter at 0 again, so the blocks after the first draw with later
    offsets) gives other values than the reference, and another offset."""
    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.random.spec import RandomKernelSpec

    spec = RandomKernelSpec("fill_rand", "float32")
    source = jit.lower_source(spec)
    assert source.count("if (arrived[0] == (") == 2, "the last block's test, once for each of its two stores"
    built = build(spec, source.replace("if (arrived[0] == (", "if (arrived[0] == 0 && ("))
    state = draw_state(0, 0)
    want = torch.empty(COUNT)
    fill_rand(want, state["seed"].clone(), state["offset"].clone())
    values = torch.full((COUNT,), float("nan"))
    run_kernel(built, spec, {"values": values, **state}, COUNT, spec.run_bytes // 4)
    assert int(state["offset"]) > 1
    assert int((values != want).sum()) > COUNT // 2
