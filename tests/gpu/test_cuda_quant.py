"""CUDA backend on a GPU: bytewise equal to the reference backend.

Run on the GPU host (compute capability >= 9.0)::

    hatch run python -m pytest tests/gpu/test_cuda_quant.py -m gpu -q

Every specialisation the module needs (about 220) is compiled up front by
``jit.precompile``: a spawned process pool over the host's cores fills TileLang's disk
cache, then the test process loads them.

Oracle: the reference backend. It runs on the CPU in the CUDA sf layout
(``config.host_layout("cuda")``) for T in {0, 1, 3} and for every non-finite case; for the
large sizes (T = 4001, 8001) it runs the same PyTorch code on the GPU (set
``TILEPLUG_ORACLE=cpu`` to use the CPU for everything), and ``test_gpu_oracle_matches_cpu``
checks that the two oracles agree bytewise on every op and flag family.

Non-finite inputs: the kernels follow SPEC §0 / docs/numerics.md. NaN *payloads and signs*
are not portable (x86 ``inf * 0`` is a negative NaN, NVIDIA arithmetic yields the canonical
positive NaN), so non-finite cases compare bytewise with the reference on the GPU, and with
the CPU reference up to NaN encodings.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tileplug.core.testing import cpu_copy

pytestmark = pytest.mark.gpu

TOKENS = (0, 1, 3, 1031, 4001, 8001)  # 1031: the tiers between 256 and 2048 rows (quant.kernels.token_tiers)
SMALL_T = (0, 1, 3)
BACKEND = "cuda"


class GridCase:
    """One case of the op table at one token count (the GPU grid is every case of every op
    at every count of ``TOKENS``)."""

    def __init__(self, case, tokens: int) -> None:
        self.case, self.tokens = case, tokens
        self.op, self.hidden = case.op, case.hidden
        self.id = f"{case.id}[T={tokens}]"


def _cases() -> list[GridCase]:
    """Every case of every quant op the CUDA kernel table holds (an op without a CUDA kernel yet
    runs on the reference there: nothing of the cuda backend to check; the norm family has its
    own module, tests/gpu/test_cuda_norm.py, with SPEC §5's comparisons)."""
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core import opdefs

    return [GridCase(case, tokens) for opdef in opdefs.all_ops() if opdef.family == "quant" and opdef.kernel in _KERNELS
            for case in opdef.cases() for tokens in TOKENS]


def _outputs(result) -> list:
    return list(result) if isinstance(result, tuple) else [result]


def _arguments(case, tokens: int, device: torch.device):
    """(args, kwargs) of an op-table case made on the CPU by the reference in the CUDA sf
    layout, moved to ``device`` with their strides."""
    from tileplug.core import config
    from tileplug.core.registry import use_backend
    from tileplug.core.testing import moved

    with use_backend("reference"), config.host_layout("cuda"):
        args, kwargs = case.arguments(tokens, "cpu")
    return moved(args, device), moved(kwargs, device)


def _spec_of(op, args, kwargs, alignment: int | None = None):
    import dataclasses

    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core.lowering import describe_call

    call, _ = describe_call(op, *args, **kwargs)
    if alignment is not None:
        call = dataclasses.replace(call, input_alignment=alignment)
    kernel = _KERNELS.get(call.op)  # None: the op has no CUDA kernel (it routes to the reference)
    return tuple(kernel.specs(call)) if kernel is not None and kernel.supports(call) is None else ()


def _case_specs(case_list) -> list:
    """Distinct kernel specialisations of the grid cases (contracts on CPU stand-ins)."""
    specs = {}
    for grid_case in case_list:
        if grid_case.tokens == 0:
            continue
        args, kwargs = _arguments(grid_case.case, 3, torch.device("cpu"))
        specs.update(dict.fromkeys(_spec_of(grid_case.op, args, kwargs)))
    specs.update(dict.fromkeys(_extra_specs()))
    return list(specs)


def _extra_specs() -> list:
    """Specialisations the tests below the grid use (scalar-load variants, re-quantization of
    every layout, non-finite cases in fp32), so they are compiled up front too."""
    from tileplug.core import ops

    found = []
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.empty(3, 576, dtype=dtype)
        for alignment in (2, 4, 16):
            for kwargs in ({"num_per_channels": 32}, {"fmt": "e2m1", "num_per_channels": 16, "round_sf": True,
                                                      "use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True}):
                found.extend(_spec_of(ops.per_token_cast, (x,), kwargs, alignment))
            found.extend(_spec_of(ops.per_block_cast, (x,), {"block_size": (32, 32)}, alignment))
        found.extend(_spec_of(ops.per_token_cast, (x,), {}, 2))
        for op_name, kwargs in NONFINITE_KWARGS:
            found.extend(_spec_of(getattr(ops, op_name), (x,), kwargs))
    x = torch.empty(3, 2048, dtype=torch.bfloat16)
    for kwargs in ({}, {"use_e4m3_sf": True}, {"round_sf": True, "use_packed_ue8m0": True}):
        for col in (False, True):
            sf = ops.per_token_cast_with_sf_only(x, num_per_channels=64, use_tma_aligned_col_major_sf=col, **kwargs)
            found.extend(_spec_of(ops.per_token_cast_with_precomputed_sf, (x,), {"num_per_channels": 64, "sf": sf}))
    for produce, block in _producers(x):
        pair = produce()
        for op, kwargs in _requant_ops(block):
            found.extend(_spec_of(op, (pair,), kwargs))
        if block[0] == 1:
            found.extend(_spec_of(ops.per_channel_cast, (pair,), {"num_per_channels": block[1]}))
        for fmt in ("bf16", "fp32"):
            found.extend(_spec_of(ops.cast_back, (pair,), {"fmt": fmt, "x_block_size": block}))
    return found


def _producers(x):
    from tileplug.core import ops
    from tileplug.core.registry import use_backend

    def under_reference(fn):
        def run():
            with use_backend("reference"):
                return fn()
        return run

    return [
        (under_reference(lambda: ops.per_token_cast(x, num_per_channels=32)), (1, 32)),
        (under_reference(lambda: ops.per_token_cast(x, fmt="e2m1", num_per_channels=16, use_e4m3_sf=True,
                                                    use_tma_aligned_col_major_sf=True)), (1, 16)),
        (under_reference(lambda: ops.per_token_cast(x, round_sf=True, use_packed_ue8m0=True,
                                                    use_tma_aligned_col_major_sf=True)), (1, 128)),
        (under_reference(lambda: ops.per_block_cast(x, round_sf=True, use_packed_ue8m0=True)), (128, 128)),
        (under_reference(lambda: ops.per_channel_cast(x, num_per_tokens=32, round_sf=True, use_packed_ue8m0=True)),
         (32, 1)),
    ]


def _requant_ops(block):
    from tileplug.core import ops

    return [
        (ops.per_token_cast, {"x_block_size": block, "num_per_channels": 64}),
        (ops.per_token_cast, {"x_block_size": block, "fmt": "e2m1", "num_per_channels": 16, "round_sf": True}),
        (ops.per_block_cast, {"x_block_size": block, "block_size": (32, 32)}),
    ]


@pytest.fixture(scope="module", autouse=True)
def _fake_quant_forced_on():
    """The CUDA ``per_token_cast_and_cast_back`` declines every call while
    ``quant.per_token_cast.FAKE_QUANT_VERIFIED`` is False: this module forces it on, so that its
    cases run the kernel (never the reference through the fallback) whatever the switch says."""
    from tileplug.backend_cuda.quant import per_token_cast

    saved = per_token_cast.FAKE_QUANT_VERIFIED
    per_token_cast.FAKE_QUANT_VERIFIED = True
    yield
    per_token_cast.FAKE_QUANT_VERIFIED = saved


@pytest.fixture(scope="module", autouse=True)
def _memoized_inputs():
    """The grid draws the same [T, H] activation for ~200 flag combinations; draw each once
    (the one op that writes its input, per_token_cast_and_cast_back, gets a copy: quant_arguments)."""
    import functools

    from tileplug.core import testing

    original = testing.activation
    testing.activation = functools.lru_cache(maxsize=24)(original)
    yield
    testing.activation = original


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
    specs = _case_specs(_cases())
    jit.precompile(specs)
    print(f"\nprecompiled {len(specs)} specialisations in {time.perf_counter() - started:.1f} s")
    yield


# ---------------------------------------------------------------------- the grid


def _oracle_device(case) -> str:
    if os.environ.get("TILEPLUG_ORACLE", "") == "cpu" or case.tokens in SMALL_T:
        return "cpu"
    return "cuda"


def pytest_generate_tests(metafunc):  # noqa: D103 - pytest hook
    if "case" in metafunc.fixturenames:
        suite = _cases()
        metafunc.parametrize("case", suite, ids=[c.id for c in suite])


def test_bytewise_equal_to_reference(case) -> None:
    """The conformance suite's check of the case on the cuda backend (inputs made on the CPU
    by the reference in the CUDA layout; the op's ``compare``)."""
    from tileplug.reference.conformance import CaseDeclined, check_case

    try:
        check_case(case.case, case.tokens, BACKEND, "cuda", oracle_device=_oracle_device(case))
    except CaseDeclined as declined:  # an op without a CUDA kernel, or a declined call: the reference serves it
        pytest.skip(str(declined))


def test_gpu_oracle_matches_cpu() -> None:
    """The reference on the GPU writes the bytes the reference on the CPU writes (finite
    inputs), so using it as the oracle for the large sizes is sound."""
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core import config, opdefs
    from tileplug.core.registry import use_backend
    from tileplug.core.testing import assert_bytes_equal, moved

    sample = [case for opdef in opdefs.all_ops() if opdef.family == "quant" and opdef.kernel in _KERNELS
              for case in opdef.cases()
              if case.hidden == 576][::7]
    for case in sample:
        args, kwargs = _arguments(case, 257, torch.device("cuda"))
        cpu_args, cpu_kwargs = moved(args, "cpu", fresh=True), moved(kwargs, "cpu", fresh=True)  # before an in-place op
        opdef = opdefs.get(case.op)
        with use_backend("reference"):
            on_gpu = opdef.produced(opdef.function(*args, **kwargs), *args, **kwargs)
        with use_backend("reference"), config.host_layout("cuda"):
            on_cpu = opdef.produced(opdef.function(*cpu_args, **cpu_kwargs), *cpu_args, **cpu_kwargs)
        for have, want in zip(on_gpu, on_cpu):
            if have is not None and have.stride() == want.stride():
                assert_bytes_equal(cpu_copy(have), want, what=case.id)


# ---------------------------------------------------------------------- strides, alignment


@pytest.mark.parametrize("pad", [1, 3, 8, 48])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_any_row_stride(pad: int, dtype: torch.dtype) -> None:
    """Row strides that break 16-byte alignment take the scalar-load variant; aligned ones
    the 128-bit one; both equal the reference."""
    from tileplug.core import config, ops
    from tileplug.core.registry import use_backend
    from tileplug.core.testing import activation, assert_bytes_equal, assert_sf_equal

    for tokens, hidden in ((1, 576), (3, 2048), (4001, 576)):
        base = activation(tokens, hidden + pad, dtype, device="cuda", seed=pad)
        x = base[:, :hidden]
        for kwargs in ({"num_per_channels": 32}, {"fmt": "e2m1", "num_per_channels": 16, "round_sf": True,
                                                  "use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True}):
            with use_backend(BACKEND):
                q, sf = ops.per_token_cast(x, **kwargs)
            with use_backend("reference"), config.host_layout("cuda"):
                q_ref, sf_ref = ops.per_token_cast(x.cpu(), **kwargs)
            assert_bytes_equal(cpu_copy(q), q_ref, "q")
            assert_sf_equal(cpu_copy(sf), sf_ref, (1, kwargs["num_per_channels"]), tokens, hidden)
        with use_backend(BACKEND):
            q, sf = ops.per_block_cast(x, block_size=(32, 32))
        with use_backend("reference"), config.host_layout("cuda"):
            q_ref, sf_ref = ops.per_block_cast(x.cpu(), block_size=(32, 32))
        assert_bytes_equal(cpu_copy(q), q_ref, "q")
        assert_sf_equal(cpu_copy(sf), sf_ref, (32, 32), tokens, hidden)


def test_misaligned_data_pointer_and_out() -> None:
    from tileplug.core import config, ops
    from tileplug.core.errors import ContractError
    from tileplug.core.registry import use_backend
    from tileplug.core.testing import activation, assert_bytes_equal

    base = activation(17, 2048 + 1, device="cuda").reshape(-1)
    x = base[1 : 1 + 17 * 2048].view(17, 2048)  # data pointer 2 bytes off: scalar loads
    with use_backend(BACKEND):
        q, sf = ops.per_token_cast(x)
        out_q, out_sf = torch.empty_like(q), torch.empty_like(sf)
        ops.per_token_cast(x, out=(out_q, out_sf))
        misaligned = torch.empty(17 * 2048 + 1, dtype=torch.float8_e4m3fn, device="cuda")[1:].view(17, 2048)
        with pytest.raises(ContractError):
            ops.per_token_cast(x, out=(misaligned, out_sf))
    with use_backend("reference"), config.host_layout("cuda"):
        q_ref, sf_ref = ops.per_token_cast(x.cpu())
    assert_bytes_equal(cpu_copy(q), q_ref, "q")
    assert_bytes_equal(cpu_copy(out_q), q_ref, "out q")
    assert_bytes_equal(cpu_copy(out_sf), sf_ref, "out sf")


def test_given_sf_in_any_layout() -> None:
    """Precomputed sf read by strides: fp32 / e4m3 / packed, row- and column-major."""
    from tileplug.core import config, ops
    from tileplug.core.registry import use_backend
    from tileplug.core.testing import activation, assert_bytes_equal

    x = activation(301, 2048, device="cuda")
    for kwargs in ({}, {"use_e4m3_sf": True}, {"round_sf": True, "use_packed_ue8m0": True}):
        for col in (False, True):
            with use_backend("reference"):
                sf = ops.per_token_cast_with_sf_only(x, num_per_channels=64, use_tma_aligned_col_major_sf=col, **kwargs)
            with use_backend(BACKEND):
                q = ops.per_token_cast_with_precomputed_sf(x, num_per_channels=64, sf=sf)
            with use_backend("reference"), config.host_layout("cuda"):
                q_ref = ops.per_token_cast_with_precomputed_sf(x.cpu(), num_per_channels=64, sf=cpu_copy(sf))
            assert_bytes_equal(cpu_copy(q), q_ref, f"q {kwargs} col={col}")


def test_requantization_of_every_input_layout() -> None:
    from tileplug.core import config, ops
    from tileplug.core.registry import use_backend
    from tileplug.core.testing import activation, assert_bytes_equal, assert_sf_equal

    tokens, hidden = 1001, 2048
    x = activation(tokens, hidden, device="cuda")
    for produce, block in _producers(x):
        pair = produce()
        cpu_pair = (pair[0].cpu(), pair[1].cpu())
        name = f"input {block}"
        for op, kwargs in _requant_ops(block):
            out_block = (1, kwargs.get("num_per_channels", 128)) if op is ops.per_token_cast else (32, 32)
            with use_backend(BACKEND):
                q, sf = op(pair, **kwargs)
            with use_backend("reference"), config.host_layout("cuda"):
                q_ref, sf_ref = op(cpu_pair, **kwargs)
            assert_bytes_equal(cpu_copy(q), q_ref, f"{name} -> {op.__name__} {kwargs} q")
            assert_sf_equal(cpu_copy(sf), sf_ref, out_block, tokens, hidden, f"{name} -> {op.__name__} {kwargs} sf")
        if block[0] == 1:
            with use_backend(BACKEND):
                q, sf = ops.per_channel_cast(pair, num_per_channels=block[1])
            with use_backend("reference"), config.host_layout("cuda"):
                q_ref, sf_ref = ops.per_channel_cast(cpu_pair, num_per_channels=block[1])
            assert_bytes_equal(cpu_copy(q), q_ref, f"{name} -> per_channel q")
            assert_sf_equal(cpu_copy(sf), sf_ref, (128, 1), tokens, hidden, f"{name} -> per_channel sf")
        for fmt in ("bf16", "fp32"):
            with use_backend(BACKEND):
                y = ops.cast_back(pair, fmt=fmt, x_block_size=block)
            with use_backend("reference"), config.host_layout("cuda"):
                y_ref = ops.cast_back(cpu_pair, fmt=fmt, x_block_size=block)
            assert_bytes_equal(cpu_copy(y), y_ref, f"{name} cast_back {fmt}")


# ---------------------------------------------------------------------- non-finite inputs


def _nonfinite_input(tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    from tileplug.core.testing import activation

    x = activation(tokens, hidden, dtype, device="cuda", seed=5).clone()
    x[0, 3] = float("inf")
    x[1, 200] = float("-inf")
    x[2, 130] = float("nan")
    x[min(tokens - 1, 40), 64:80] = float("inf")
    x[min(tokens - 1, 41), 500] = float("nan")
    return x


def _nan_blind(tensor: torch.Tensor) -> torch.Tensor:
    """Raw bytes (logical order) with every NaN encoding replaced by one canonical NaN."""
    from tileplug.core.quant.layouts import standard_strides

    t = standard_strides(tensor.cpu())
    if t.dtype == torch.float8_e4m3fn:
        raw = t.view(torch.uint8).clone()
        raw[(raw & 0x7F) == 0x7F] = 0x7F
        return raw
    if t.dtype in (torch.float32, torch.bfloat16):
        values = t.clone()
        values[torch.isnan(values)] = float("nan")
        return values.view(torch.uint8)
    return t.view(torch.uint8)


NONFINITE_KWARGS = [
    ("per_token_cast", {}),
    ("per_token_cast", {"round_sf": True}),
    ("per_token_cast", {"round_sf": True, "use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True}),
    ("per_token_cast", {"use_e4m3_sf": True, "num_per_channels": 16}),
    ("per_token_cast", {"fmt": "e2m1", "num_per_channels": 16}),
    ("per_token_cast", {"fmt": "e2m1", "num_per_channels": 32, "use_e4m3_sf": True}),
    ("per_block_cast", {"block_size": (32, 32)}),
    ("per_block_cast", {"block_size": (128, 128), "round_sf": True, "use_packed_ue8m0": True}),
    ("per_channel_cast", {"num_per_tokens": 32}),
    ("per_channel_cast", {"num_per_tokens": 128, "round_sf": True, "use_packed_ue8m0": True}),
    ("per_channel_cast", {"fmt": "e2m1", "num_per_tokens": 32, "round_sf": True}),
]


@pytest.mark.parametrize("op_name,kwargs", NONFINITE_KWARGS, ids=[f"{o}{k}" for o, k in NONFINITE_KWARGS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nonfinite_inputs(op_name: str, kwargs: dict, dtype: torch.dtype) -> None:
    from tileplug.core import config, ops
    from tileplug.core.registry import use_backend
    from tileplug.core.testing import assert_bytes_equal, assert_sf_equal

    op = getattr(ops, op_name)
    tokens, hidden = 259, 576
    x = _nonfinite_input(tokens, hidden, dtype)
    with use_backend(BACKEND):
        q, sf = op(x, **kwargs)
    torch.cuda.synchronize()
    with use_backend("reference"):  # same device: NaN encodings are the GPU's on both sides
        q_gpu_ref, sf_gpu_ref = op(x, **kwargs)
    block = {"per_token_cast": (1, kwargs.get("num_per_channels", 128)),
             "per_block_cast": kwargs.get("block_size", (128, 128)),
             "per_channel_cast": (kwargs.get("num_per_tokens", 128), 1)}[op_name]
    assert_bytes_equal(cpu_copy(q), cpu_copy(q_gpu_ref), "q vs GPU reference")
    assert_sf_equal(cpu_copy(sf), cpu_copy(sf_gpu_ref), block, tokens, hidden, "sf vs GPU reference")
    with use_backend("reference"), config.host_layout("cuda"):
        q_cpu_ref, sf_cpu_ref = op(x.cpu(), **kwargs)
    if q.dtype == torch.int8:  # e2m1: a NaN's sign bit is its only platform-dependent part
        nan_codes = (q_cpu_ref.view(torch.uint8) ^ cpu_copy(q).view(torch.uint8))
        assert bool(((nan_codes == 0) | (nan_codes & 0x77 == 0)).all()), "e2m1 codes differ beyond NaN signs"
    else:
        assert torch.equal(_nan_blind(q), _nan_blind(q_cpu_ref)), "q differs from the CPU reference beyond NaN encodings"
    if sf.dtype != torch.int32:
        assert torch.equal(_nan_blind(sf), _nan_blind(sf_cpu_ref)), "sf differs from the CPU reference beyond NaN encodings"
    else:
        assert_sf_equal(cpu_copy(sf), sf_cpu_ref, block, tokens, hidden, "packed sf vs CPU reference")


def test_e2m1_encoding_of_every_rounding_boundary() -> None:
    """The kernel's e2m1 encoder (bit arithmetic) against the reference on every fp32 whose
    low 16 bits are 0, 1, 0x7FFF, 0x8000 or 0xFFFF — every e2m1 tie and its neighbours, every
    exponent, ±0, denormals, ±inf and NaNs. With given scales of 1.0 the kernel encodes x
    itself (x · (1 / 1) is exact)."""
    from tileplug.core import config, ops
    from tileplug.core.registry import use_backend

    upper = torch.arange(1 << 16, dtype=torch.int64) << 16
    bits = torch.cat([upper | low for low in (0, 1, 0x7FFF, 0x8000, 0xFFFF)]).to(torch.int32)
    x = bits.view(torch.float32).reshape(-1, 1024).cuda()
    ones = torch.ones(x.shape[0], 1024 // 16, device="cuda")
    with use_backend(BACKEND):
        q = ops.per_token_cast_with_precomputed_sf(x, "e2m1", 16, sf=ones)
    with use_backend("reference"), config.host_layout("cuda"):
        q_ref = ops.per_token_cast_with_precomputed_sf(x.cpu(), "e2m1", 16, sf=ones.cpu())
    diff = q_ref.view(torch.uint8) ^ q.cpu().view(torch.uint8)
    # a NaN's sign bit is the only platform-dependent part of a code
    assert bool(((diff == 0) | (diff & 0x77 == 0)).all()), "e2m1 codes differ beyond NaN signs"
    finite = torch.isfinite(x.cpu()).reshape(-1, 512, 2).all(dim=-1)
    assert torch.equal(diff[finite], torch.zeros_like(diff[finite])), "finite values encode differently"


def test_nonfinite_cast_back() -> None:
    from tileplug.core import ops
    from tileplug.core.registry import use_backend
    from tileplug.core.testing import assert_bytes_equal

    x = _nonfinite_input(259, 576, torch.bfloat16)
    for kwargs, block in (({"round_sf": True, "use_packed_ue8m0": True}, (1, 128)), ({"use_e4m3_sf": True}, (1, 128)),
                          ({}, (1, 128))):
        with use_backend("reference"):
            pair = ops.per_token_cast(x, **kwargs)
        for fmt in ("bf16", "fp32"):
            with use_backend(BACKEND):
                y = ops.cast_back(pair, fmt=fmt, x_block_size=block)
            with use_backend("reference"):
                y_ref = ops.cast_back(pair, fmt=fmt, x_block_size=block)
            assert_bytes_equal(cpu_copy(y), cpu_copy(y_ref), f"cast_back {kwargs} {fmt}")
            assert not torch.isfinite(y[:3].float()).all()


# ---------------------------------------------------------------------- 2^31 elements


def test_past_two_to_the_31_elements() -> None:
    from tileplug.core import config, ops
    from tileplug.core.registry import use_backend
    from tileplug.core.testing import assert_bytes_equal

    hidden = 7168
    tokens = (2**31) // hidden + 130  # the last rows start past element 2^31
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    assert x.numel() > 2**31
    tail = 128 * ((tokens - 200) // 128)  # a block-row boundary before the end
    with use_backend(BACKEND):
        q, sf = ops.per_token_cast(x)
        qb, sfb = ops.per_block_cast(x)
        y = ops.cast_back((q, sf), fmt="bf16", x_block_size=(1, 128))
    with use_backend("reference"), config.host_layout("cuda"):
        q_ref, sf_ref = ops.per_token_cast(x[tail:].cpu())
        qb_ref, sfb_ref = ops.per_block_cast(x[tail:].cpu())
        y_ref = ops.cast_back((q_ref, sf_ref), fmt="bf16", x_block_size=(1, 128))
    assert_bytes_equal(q[tail:].cpu(), q_ref, "q tail")
    assert_bytes_equal(sf[tail:].cpu(), sf_ref, "sf tail")
    assert_bytes_equal(qb[tail:].cpu(), qb_ref, "per-block q tail")
    assert_bytes_equal(sfb[tail // 128:].cpu(), sfb_ref, "per-block sf tail")
    assert_bytes_equal(y[tail:].cpu(), y_ref, "cast_back tail")


# ---------------------------------------------------------------------- concurrency


def test_concurrent_first_calls_compile_once() -> None:
    from tileplug.backend_cuda import jit
    from tileplug.core import config, ops
    from tileplug.core.registry import use_backend
    from tileplug.core.testing import activation, assert_bytes_equal, assert_sf_equal

    # A clamp override nobody else uses makes a specialisation no other test compiled.
    clamps = {("e4m3", False): 3.0e-4}
    x = activation(777, 2048, torch.float32, device="cuda")
    kwargs = {"num_per_channels": 64, "use_tma_aligned_col_major_sf": True}
    before = jit.load_count
    barrier = threading.Barrier(8)

    def run(_):
        barrier.wait()
        with use_backend(BACKEND), config.amax_clamps(clamps):
            q, sf = ops.per_token_cast(x, **kwargs)
        torch.cuda.synchronize()
        return cpu_copy(q), cpu_copy(sf)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    assert jit.load_count == before + 1
    with use_backend("reference"), config.host_layout("cuda"), config.amax_clamps(clamps):
        q_ref, sf_ref = ops.per_token_cast(x.cpu(), **kwargs)
    for q, sf in results:
        assert_bytes_equal(q, q_ref, "q")
        assert_sf_equal(sf, sf_ref, (1, 64), 777, 2048)


def test_dispatch_cost_runs_through_the_cuda_backend() -> None:
    """The dispatch-cost measurement of ``tileplug bench`` works on CUDA (its numbers are
    reported by the benchmark scripts, never asserted here)."""
    from tileplug.core.benchmark import dispatch_cost

    cost = dispatch_cost(torch.device("cuda"), cases=["per_token_cast", "cast_back"])
    print(f"\nhost time per call at T=1: {cost}")
    assert set(cost) == {"per_token_cast", "cast_back"}
    for measured in cost.values():
        assert measured["backend"] == BACKEND and measured["core_call_us"] > 0
