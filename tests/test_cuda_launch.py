"""CUDA backend host side, without a GPU: declines, specialisation keys, and the launchers'
argument marshalling (packed sf as allocated, its byte layout, bf16 pairs, single-row strides, misaligned
``out=``), checked against the kernel's own sf indexing emulated in Python."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tileplug.backend_cuda.plugin import _KERNELS, make_backend
from tileplug.backend_cuda.quant.kernels import make_launcher
from tileplug import core
from tileplug.core import CUDA_LAYOUT, ops
from tileplug.core.lowering import describe_call
from tileplug.core.quant import layouts


def _call(op, *args, **kwargs):
    call, inputs = describe_call(op, *args, **kwargs)
    return _KERNELS[call.op].kernel(), call, inputs


def test_backend_registers_every_quant_op() -> None:
    backend = make_backend()
    assert set(backend.kernels) == core.opdefs.kernel_names()  # every family has a module: every op has an entry
    assert {"per_token_cast", "per_block_cast", "per_channel_cast", "cast_back"} <= set(backend.kernels)
    assert backend.lower is not None and "Declined" in backend.capabilities()


def test_hidden_not_multiple_of_16_declined() -> None:
    kernel, call, _ = _call(ops.per_token_cast, torch.empty(2, 584, dtype=torch.bfloat16))
    assert "multiple of 16" in kernel.supports(call)
    kernel, call, _ = _call(ops.per_block_cast, torch.empty(2, 592, dtype=torch.bfloat16))
    assert kernel.supports(call) is None


def test_specialisation_ignores_tokens_and_hidden() -> None:
    """One compiled kernel serves every T and H of a configuration."""
    specs = set()
    for tokens, hidden in ((1, 576), (4001, 7168), (3, 2048)):
        kernel, call, _ = _call(ops.per_token_cast, torch.empty(tokens, hidden, dtype=torch.bfloat16))
        specs.add(kernel.spec(call))
    assert len(specs) == 1


def test_misaligned_rows_take_the_scalar_variant() -> None:
    base = torch.empty(4, 577, dtype=torch.bfloat16)
    kernel, call, _ = _call(ops.per_token_cast, base[:, :576])
    assert call.input_alignment == 2 and not kernel.spec(call).vectorize
    kernel, call, _ = _call(ops.per_token_cast, torch.empty(4, 576, dtype=torch.bfloat16))
    assert kernel.spec(call).vectorize


class Recorder:
    def __init__(self):
        self.args = None

    def __call__(self, *args):
        self.args = args


def _launch(op, x, **kwargs):
    kernel, call, inputs = _call(op, x, **kwargs)
    outputs = call.allocate(CUDA_LAYOUT)
    recorder = Recorder()
    make_launcher(kernel.spec(call), recorder)(inputs, outputs)
    return kernel.spec(call), call, outputs, recorder.args


def _kernel_sf_write(spec, view, gr, gc, byte):
    """The kernel's packed-UE8M0 store (grouped.py), emulated on the tensor it receives."""
    if spec.block[1] == 1:
        view[gr // 4, gc * 4 + gr % 4] = byte
    elif spec.sf_col_major:
        view[gc // 4, gr * 4 + gc % 4] = byte
    else:
        view[gr, gc] = byte


@pytest.mark.parametrize(
    "op,kwargs",
    [
        (ops.per_token_cast, {"num_per_channels": 32}),
        (ops.per_token_cast, {"num_per_channels": 32, "use_tma_aligned_col_major_sf": True}),
        (ops.per_block_cast, {"block_size": (32, 64)}),
        (ops.per_block_cast, {"block_size": (32, 64), "use_tma_aligned_col_major_sf": True}),
        (ops.per_channel_cast, {"num_per_tokens": 32}),
    ],
)
@pytest.mark.parametrize("tokens", [1, 3, 37, 130])
def test_packed_sf_byte_view_matches_the_layout(op, kwargs, tokens: int) -> None:
    """The packed sf goes to the kernel as core allocated it (no host view); the kernel's byte
    alias (``sf_math.packed_sf_bytes``: ``[R, 4C]``, column-major ``[C, 4R]`` of the integers'
    bytes) and its stores land every group's byte where the layout puts it."""
    x = torch.empty(tokens, 576, dtype=torch.bfloat16)
    spec, call, outputs, args = _launch(op, x, round_sf=True, use_packed_ue8m0=True, **kwargs)
    assert args[-1] is outputs.sf and outputs.sf.dtype == torch.int32
    view = (outputs.sf.mT if spec.sf_col_major else outputs.sf).view(torch.uint8)  # the alias's shape and strides
    rows, cols = call.sf_rows_cols()
    expected = torch.randint(0, 255, (rows, cols), dtype=torch.uint8)
    for gr in range(rows):
        for gc in range(cols):
            _kernel_sf_write(spec, view, gr, gc, int(expected[gr, gc]))
    got = layouts.unpack_ue8m0(outputs.sf, call.cast.pack_axis, rows, cols)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("col_major", [False, True])
def test_fp32_and_e4m3_sf_are_written_by_strides(col_major: bool) -> None:
    for extra in ({}, {"use_e4m3_sf": True}):
        x = torch.empty(37, 576, dtype=torch.bfloat16)
        _, _, outputs, args = _launch(ops.per_token_cast, x, use_tma_aligned_col_major_sf=col_major, **extra)
        assert args[-1] is outputs.sf and args[1] is outputs.q


def test_per_block_bf16_is_handed_over_as_int32_pairs() -> None:
    x = torch.arange(3 * 576, dtype=torch.float32).reshape(3, 576).to(torch.bfloat16)
    spec, _, _, args = _launch(ops.per_block_cast, x, block_size=(32, 32))
    assert spec.bf16_pairs and args[0].dtype == torch.int32 and args[0].shape == (3, 288)
    words = args[0]
    low = (words << 16).view(torch.float32)
    high = (words & -65536).view(torch.float32)
    assert torch.equal(low, x[:, 0::2].float()) and torch.equal(high, x[:, 1::2].float())


def test_single_row_with_an_odd_stride_gets_a_checkable_stride() -> None:
    base = torch.empty(2, 7168 + 3, dtype=torch.bfloat16)
    x = base[:1, :7168]
    spec, _, _, args = _launch(ops.per_token_cast, x)
    assert spec.vectorize  # one row: alignment is the pointer's
    assert args[0].stride(0) % 8 == 0 and args[0].data_ptr() == x.data_ptr()


def test_prepare_binds_the_compiled_kernel_once_per_specialisation(monkeypatch) -> None:
    """The route keeps the launcher (one launcher cache); prepare itself reuses jit's compiled kernel."""
    from tileplug.backend_cuda import jit

    compiles = []
    monkeypatch.setattr(jit, "_compile", lambda spec, arch: compiles.append(spec) or Recorder())
    monkeypatch.setattr(jit, "device_arch", lambda: "sm_90")
    monkeypatch.setattr(jit, "_compiled", {})
    monkeypatch.setattr(jit, "_entries", {})
    monkeypatch.setenv(jit.INDEX_VARIABLE, "off")
    kernel, call, inputs = _call(ops.per_token_cast, torch.empty(3, 576, dtype=torch.bfloat16))
    fresh = type(kernel)()
    launch = fresh.prepare(call)
    fresh.prepare(call)
    assert len(compiles) == 1
    launch(inputs, call.allocate(CUDA_LAYOUT))


@pytest.mark.parametrize(("op", "kwargs", "bound"), [
    (ops.per_channel_cast, {"num_per_tokens": 128}, 4096),  # the half-width channel tile wins to 4096 (H100)
    (ops.per_block_cast, {}, 2048),
])
def test_a_call_runs_the_small_tile_up_to_its_ops_bound(monkeypatch, op, kwargs, bound: int) -> None:
    """A call of ``bound`` rows runs the op's small-T specialisation (16 lanes a row), one of ``bound + 1`` the default
    one; the launcher picks by the rows of each call (jit's compile stubbed)."""
    from tileplug.backend_cuda import jit

    ran: list[str] = []
    monkeypatch.setattr(jit, "entry", lambda spec: lambda *tensors: ran.append(spec.name))
    kernel, call, _ = _call(op, torch.empty(3, 7168, dtype=torch.bfloat16), **kwargs)
    (small_bound, small), (_, default) = kernel.token_tiers(call)
    assert small_bound == bound and small.lanes_per_row == 16 and default.lanes_per_row == 32
    launch = kernel.prepare(call)
    for rows in (bound, bound + 1, 1):
        _, rows_call, inputs = _call(op, torch.empty(rows, 7168, dtype=torch.bfloat16), **kwargs)
        launch(inputs, rows_call.allocate(CUDA_LAYOUT))
    assert ran == [small.name, default.name, small.name]


def test_concurrent_first_calls_build_one_launcher(monkeypatch) -> None:
    """Eight threads calling a new signature at once compile once (jit.compiled is stubbed)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tileplug.backend_cuda import jit

    compiled = []

    def fake_compile(spec, arch):
        time.sleep(0.05)
        compiled.append(spec)
        return Recorder()

    monkeypatch.setattr(jit, "_compile", fake_compile)
    monkeypatch.setattr(jit, "device_arch", lambda: "sm_90")
    monkeypatch.setattr(jit, "_compiled", {})
    monkeypatch.setattr(jit, "_entries", {})
    monkeypatch.setenv(jit.INDEX_VARIABLE, "off")
    kernel, call, inputs = _call(ops.per_token_cast, torch.empty(3, 576, dtype=torch.bfloat16), num_per_channels=16,
                                 fmt="e2m1")
    call = dataclasses.replace(call)
    fresh = type(kernel)()
    barrier = threading.Barrier(8)

    def run(_):
        barrier.wait()
        fresh(call, inputs, call.allocate(CUDA_LAYOUT))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(run, range(8)))
    assert len(compiled) == 1


# ---------------------------------------------------------------------- transpose_weight_sf


def _weight_scale_kernel(tensors: list[torch.Tensor], launches: list):
    """The CUDA ``transpose_weight_sf`` kernel emulated in Python (``jit.entry``'s stand-in):
    it takes the arguments of the compiled kernel — weight 0's scales (the anchor), the grid's
    chunk and weight extents, then each weight slot's three data pointers and ``G, R, C`` — and
    finds the tensors behind the pointers among ``tensors``. Its byte rule works on the scales'
    bit patterns (weight_scale_kernels.ue8m0_byte) and it packs into the outputs' ``[G, P, M]``
    memory order. Each launch's spec and arguments are appended to ``launches``."""
    from tileplug.backend_cuda.quant import weight_scale_kernels

    by_address = {tensor.data_ptr(): tensor for tensor in tensors if tensor.numel()}

    def byte(bits: torch.Tensor) -> torch.Tensor:
        magnitude = bits & 0x7FFFFFFF
        exponent, mantissa = magnitude >> 23, magnitude & 0x7FFFFF
        normal = exponent + (mantissa != 0).long()
        subnormal = (mantissa > 0x400000).long()
        invalid = (magnitude >= 0x7F800000) | ((bits != magnitude) & (magnitude != 0))
        return torch.where(invalid, 255, torch.where(exponent > 0, normal, subnormal))

    def packed(values: torch.Tensor, planes: int) -> torch.Tensor:  # [G, X, W] bytes -> [G, X, planes] integers
        padded = torch.zeros(*values.shape[:2], planes * 4, dtype=torch.long)
        padded[..., : values.shape[-1]] = values
        words = sum(padded[..., i::4] << (8 * i) for i in range(4))
        return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)

    def memory_order(tensor: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
        """The ``[G, P, M]`` integers ``tensor`` holds in memory order (a view of its storage)."""
        return tensor.as_strided(shape, (shape[1] * shape[2], shape[2], 1))

    def entry(spec):
        count = weight_scale_kernels.WEIGHT_ARGUMENTS.__len__()

        def run(anchor: torch.Tensor, grid_chunks: int, weights: int, *slots: int) -> None:
            launches.append((spec, anchor, grid_chunks, weights, slots))
            assert len(slots) == count * spec.capacity and weights <= spec.capacity
            assert anchor.dim() == (3 if spec.anchor_groups else 2) and anchor.data_ptr() == slots[0]
            assert not any(slots[count * weights:]), "unused slots are zeros"
            block = spec.block_size
            for slot in range(weights):
                scales_at, sf0_at, sf1_at, groups, rows, cols = slots[count * slot: count * (slot + 1)]
                assert weight_scale_kernels.chunks(block, (groups, rows, cols)) <= grid_chunks
                scales = by_address[scales_at]
                assert scales.is_contiguous() and scales.numel() == groups * rows * cols
                scales = scales.reshape(groups, rows, cols)
                sf0 = memory_order(by_address[sf0_at], (groups, -(-cols // 4), rows * block))
                sf1 = memory_order(by_address[sf1_at], (groups, -(-rows // 4), cols * block))
                values = byte(scales.view(torch.int32).long() & 0xFFFFFFFF)
                sf0.copy_(packed(values, sf0.shape[1]).repeat_interleave(block, dim=1).transpose(1, 2))
                sf1.copy_(packed(values.transpose(1, 2), sf1.shape[1]).repeat_interleave(block, dim=1).transpose(1, 2))

        return run

    return entry


def _special_scales(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    specials = torch.tensor([0.0, -0.0, 2.0 ** -149, 2.0 ** -128, 2.0 ** -127, 2.0 ** -127 * (1 + 2 ** -22),
                             2.0 ** -126, 2.0 ** -126 * (1 + 2 ** -23), 1.0, 1.5, 2.0 - 2 ** -23, 2.0 ** 127,
                             2.0 ** 127 * (1 + 2 ** -23), float("inf"), float("-inf"), float("nan"), -1.0,
                             -2.0 ** -140], dtype=torch.float32)
    picks = specials[torch.randint(0, specials.numel(), shape, generator=generator)]
    random = torch.ldexp(torch.rand(shape, generator=generator) + 0.5,
                         torch.randint(-150, 129, shape, generator=generator).float())
    return torch.where(torch.rand(shape, generator=generator) < 0.5, picks, random)


def _launch_weight_scales(monkeypatch, kernel, call, inputs, weights) -> tuple:
    """(outputs, launches): the CUDA launcher of ``call`` run on CPU tensors through the emulated
    kernel (``_weight_scale_kernel``), its outputs allocated as the op does and pre-filled with -1."""
    from tileplug.backend_cuda import jit

    outputs = call.allocation_plan(CUDA_LAYOUT).allocate(0, torch.device("cpu"))
    for tensor in outputs:
        tensor.fill_(-1)
    launches: list = []
    monkeypatch.setattr(jit, "entry", _weight_scale_kernel([*weights, *outputs], launches))
    type(kernel)().prepare(call)(inputs, outputs)
    return outputs, launches


def _assert_reference_weight_scales(outputs, weights, block: int, transpose_sf1: bool) -> None:
    """Every non-empty output bytewise (strides too) the reference's ``transpose_weight_sf``."""
    from tileplug.core.testing import assert_bytes_equal

    with core.use_backend("reference"):
        want = ops.transpose_weight_sf(weights, block, transpose_sf1)
    for index, (have, expected) in enumerate(zip(outputs, want)):
        if expected.numel():
            assert_bytes_equal(have, expected, f"output {index}", strides=True)


@pytest.mark.parametrize("block", (16, 32, 64, 128))
@pytest.mark.parametrize("transpose_sf1", (False, True))
def test_transpose_weight_sf_launcher_and_byte_rule_match_the_reference(monkeypatch, block: int,
                                                                        transpose_sf1: bool) -> None:
    """The launcher hands every weight to one launch (2-D and stacked scales, either sf1 view, as
    data pointers and sizes; an empty weight left out, the unused slot zeros) and the kernel's
    integer byte rule gives the reference's bytes on zeros, subnormals around 2^-127, 2^127 and
    above, infinities, NaN and negative scales."""
    weights = (_special_scales((7, 9), block), _special_scales((3, 5, 4), block + 1), torch.empty(0, 4),
               _special_scales((1, 1), block + 2))
    kernel, call, inputs = _call(ops.transpose_weight_sf, weights, block, transpose_sf1)
    assert kernel.supports(call) is None and [s.name for s in kernel.specs(call)] == [
        f"transpose_weight_sf_bs{block}_w4_t256"]  # three weights to write: four slots, a 2-D first weight
    outputs, launches = _launch_weight_scales(monkeypatch, kernel, call, inputs, weights)
    assert len(launches) == 1 and launches[0][3] == 3  # one launch, the empty weight left out
    _assert_reference_weight_scales(outputs, weights, block, transpose_sf1)


def test_transpose_weight_sf_launches_once_per_64_weights(monkeypatch) -> None:
    """70 weights: one launch of 64 slots and one of 8 (6 used), each weight in exactly one, with the
    reference's bytes; the grid's x extent covers the launch's largest weight."""
    weights = tuple(_special_scales((1 + index % 5, 2 + index % 3), index) for index in range(70))
    kernel, call, inputs = _call(ops.transpose_weight_sf, weights, 32)
    assert [s.name for s in kernel.specs(call)] == ["transpose_weight_sf_bs32_w64_t256", "transpose_weight_sf_bs32_w8_t256"]
    outputs, launches = _launch_weight_scales(monkeypatch, kernel, call, inputs, weights)
    assert [(spec.capacity, count) for spec, _, _, count, _ in launches] == [(64, 64), (8, 6)]
    assert launches[1][1] is weights[64]  # the second launch's anchor: its first weight
    _assert_reference_weight_scales(outputs, weights, 32, False)


def test_tuning_variables_reshape_the_per_channel_tile_and_the_philox_products(monkeypatch) -> None:
    """``TILEPLUG_CUDA_TILE_PER_CHANNEL`` (warps, -, CTAs an SM) with ``TILEPLUG_CUDA_LANES_PER_ROW_PER_CHANNEL``: the
    rows a thread follow so that the tile stays one 128-row group; a stochastic cast's kernel takes the wide Philox
    products by default (a deterministic one has none), ``TILEPLUG_CUDA_PHILOX_WIDE_PER_TOKEN=0`` the split ones."""
    x = torch.randn(3, 7168).to(torch.bfloat16)
    call, _ = describe_call(ops.per_channel_cast, x, num_per_tokens=128)
    default = _KERNELS["per_channel_cast"].spec(call)
    assert (default.warps, default.rows_per_thread, default.lanes_per_row, default.tile_cols) == (8, 16, 32, 256)
    monkeypatch.setenv("TILEPLUG_CUDA_TILE_PER_CHANNEL", "2,0,1")
    monkeypatch.setenv("TILEPLUG_CUDA_LANES_PER_ROW_PER_CHANNEL", "4")
    narrow = _KERNELS["per_channel_cast"].spec(call)
    assert (narrow.warps, narrow.rows_per_thread, narrow.lanes_per_row) == (2, 8, 4)
    assert narrow.tile_rows == 128 and narrow.tile_cols == 32 and narrow.name.endswith("_h4")
    stochastic = describe_call(ops.per_token_cast, x, stochastic_rounding=True)[0]
    assert _KERNELS["per_token_cast"].spec(stochastic).name.endswith("_sr_wide")  # the default
    assert not _KERNELS["per_token_cast"].spec(describe_call(ops.per_token_cast, x)[0]).philox_wide
    monkeypatch.setenv("TILEPLUG_CUDA_PHILOX_WIDE_PER_TOKEN", "0")
    split = _KERNELS["per_token_cast"].spec(stochastic)
    assert not split.philox_wide and split.name.endswith("_sr")


@pytest.mark.parametrize(("variable", "value", "expected"), [
    ("TILEPLUG_CUDA_LANES_PER_ROW_PER_CHANNEL", "6", "expected one of 4, 8, 16, 32"),
    ("TILEPLUG_CUDA_LANES_PER_ROW_PER_CHANNEL", "wide", "expected an integer"),
    ("TILEPLUG_CUDA_TILE_PER_CHANNEL", "4,0,1,2", "expected up to 3 comma-separated integers"),
    ("TILEPLUG_CUDA_TILE_PER_CHANNEL", "4,x", "expected up to 3 comma-separated integers"),
    ("TILEPLUG_CUDA_SPREAD_PER_CHANNEL", "yes", "expected 0 or 1"),
])
def test_a_tuning_variable_the_knob_cannot_take_is_an_error_naming_it(monkeypatch, variable, value, expected) -> None:
    """A tuning variable holding what its knob cannot take stops the kernel's choice with a ValueError naming the
    variable, its value and what it takes (no assert deep in a kernel build); unset, the defaults hold."""
    x = torch.randn(3, 7168).to(torch.bfloat16)
    call, _ = describe_call(ops.per_channel_cast, x, num_per_tokens=128)
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError) as raised:
        _KERNELS["per_channel_cast"].spec(call)
    assert str(raised.value) == f"{variable}={value!r}: {expected}"
    monkeypatch.delenv(variable)
    assert _KERNELS["per_channel_cast"].spec(call).lanes_per_row == 32
