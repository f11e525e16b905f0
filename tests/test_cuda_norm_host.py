"""CUDA norm kernels, host side and without a GPU: the row tile, the reduction plan
(emulated here in fp32, it must add a row in the reference's order: bit-identical sums), the
rest of the kernels' row math (emulated in IEEE fp32: the reference's bytes for y, residual_out
and the statistics), declines, specialisation keys and the launchers' argument marshalling."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from tileplug.backend_cuda.norm.spec import MAX_VECTORS, RowTile, reduction_plan, row_tile, vector_width
from tileplug.core import Case
from tileplug.core.norm.formulas import row_sum

HIDDEN_SIZES = (1, 2, 3, 7, 8, 16, 63, 64, 100, 128, 576, 1000, 1024, 1536, 2048, 2880, 3072, 4096, 5120, 7168,
                8192, 12288, 16384)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def emulate_subtree_sum(terms: torch.Tensor, hidden: int, tile: RowTile, vec: int) -> torch.Tensor:
    """The kernel's warp-subtree form of ``rows.row_sum`` (``ReductionPlan.subtrees``), lane by
    lane in fp32: the values the tree starts from (as the shared-memory form writes them), then
    warp ``w`` lane ``l`` loading ``v[m] = tree[r + S·(l + 32·m)]`` for each of its subtrees ``r``,
    the in-thread levels, the shuffles down (lane ``l`` adds lane ``l + h``'s value), lane 0's
    subtree sums, and the last levels on the ``S`` sums."""
    from tileplug.backend_cuda.norm.spec import tree_levels

    plan = reduction_plan(hidden, tile, vec)
    subtrees, size = plan.subtrees
    warps = tile.lanes // 32
    tree = emulate_row_sum(terms, hidden, tile, vec, start_only=True)
    sums = torch.full((*terms.shape[:-1], subtrees), float("nan"), dtype=torch.float32)
    for warp in range(warps):
        for s in range(subtrees // warps):
            r = warp * (subtrees // warps) + s
            lanes = torch.stack([torch.stack([tree[..., r + subtrees * (lane + 32 * m)] for m in range(size // 32)], -1)
                                 for lane in range(32)], -2)  # [..., lane, m]
            h = size // 2
            while h >= 32:
                lanes[..., :, : h // 32] = lanes[..., :, : h // 32] + lanes[..., :, h // 32: 2 * (h // 32)]
                h //= 2
            value = lanes[..., :, 0].clone()
            while h >= 1:
                shifted = torch.cat([value[..., h:], value[..., 32 - h:]], -1)  # lanes past 31 read their own
                value = value + shifted
                h //= 2
            sums[..., r] = value[..., 0]
    for w, h, last in tree_levels(subtrees):
        before = sums.clone()
        for i in range(h):
            partner = last if (w % 2 == 0 and i == h - 1) else i + h
            sums[..., i] = before[..., i] + before[..., partner]
    return sums[..., 0]


def emulate_row_sum(terms: torch.Tensor, hidden: int, tile: RowTile, vec: int,
                    start_only: bool = False) -> torch.Tensor:
    """The kernel's ``rows.row_sum`` on rows of fp32 ``terms`` [..., D] → [...], step by step in
    fp32: the thread layout, the in-register folds, the shared-memory levels (each an IEEE fp32
    add; every row at once)."""
    plan = reduction_plan(hidden, tile, vec)
    lanes, chunks = tile.lanes, tile.chunks
    local = torch.zeros(*terms.shape[:-1], lanes, chunks * vec, dtype=torch.float32)
    for lane in range(lanes):
        for k in range(chunks):
            for j in range(vec):
                col = (k * lanes + lane) * vec + j
                if col < hidden:
                    local[..., lane, k * vec + j] = terms[..., col]
    if plan.local_steps is not None:
        values = local[..., 0, :].clone()
        for i, partner in plan.local_steps:
            values[..., i] = values[..., i] + values[..., partner]
        return values[..., 0]
    for i, partner in plan.fold_steps:
        local[..., i] = local[..., i] + local[..., partner]
    tree = torch.full((*terms.shape[:-1], plan.width), float("nan"), dtype=torch.float32)
    for lane in range(lanes):
        for c in range(plan.written_chunks):
            for j in range(vec):
                col = (c * lanes + lane) * vec + j
                if plan.exact or col < hidden:
                    tree[..., col] = local[..., lane, c * vec + j]
    if start_only:
        return tree
    for h, last, rounds in plan.levels:
        before = tree.clone()  # every lane reads before any writes (one barrier per level)
        for offset, _ in rounds:
            for lane in range(lanes):
                i = lane + offset
                if i < h:
                    partner = last if (last is not None and i == h - 1) else i + h
                    tree[..., i] = before[..., i] + before[..., partner]
    return tree[..., 0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_reduction_plan_adds_in_the_reference_order(hidden: int, dtype: torch.dtype) -> None:
    """Bit-identical to ``formulas.row_sum`` (values of mixed sign and magnitude, so any other
    order would show), on the tile the kernel uses for this D and dtype."""
    tile = row_tile(hidden, dtype)
    generator = torch.Generator().manual_seed(hidden)
    terms = (torch.randn(hidden, generator=generator) * torch.exp(4 * torch.randn(hidden, generator=generator)))
    expected = row_sum(terms.unsqueeze(0))[0]
    actual = emulate_row_sum(terms, hidden, tile, vector_width(dtype))
    assert actual.view(torch.int32) == expected.view(torch.int32), (hidden, dtype, tile, actual, expected)


SUBTREE_CASES = [(hidden, dtype) for hidden in HIDDEN_SIZES for dtype in DTYPES
                 if row_tile(hidden, dtype) is not None
                 and reduction_plan(hidden, row_tile(hidden, dtype), vector_width(dtype)).subtrees is not None]


def test_most_long_rows_split_into_warp_subtrees() -> None:
    """The model sizes whose long rows run the 2-barrier form (and the split chosen)."""
    splits = {(hidden, dtype): reduction_plan(hidden, row_tile(hidden, dtype), vector_width(dtype)).subtrees
              for hidden, dtype in SUBTREE_CASES}
    assert splits[(7168, torch.bfloat16)] == (7, 256)  # 7 warps, one subtree of 256 values each
    assert splits[(4096, torch.bfloat16)] == (4, 256) and splits[(16384, torch.bfloat16)] == (16, 256)
    assert splits[(576, torch.bfloat16)] == (9, 64)  # one warp, not an exact tile: width = D
    assert (2880, torch.bfloat16) not in splits  # 2880 = 45 · 64 over 4 warps: no split
    assert len(SUBTREE_CASES) >= 25


@pytest.mark.parametrize(("hidden", "dtype"), SUBTREE_CASES, ids=[f"{h}-{d}" for h, d in SUBTREE_CASES])
def test_warp_subtrees_add_in_the_reference_order(hidden: int, dtype: torch.dtype) -> None:
    """The warp-subtree form is bit-identical to ``formulas.row_sum`` (mixed signs and magnitudes)."""
    tile = row_tile(hidden, dtype)
    generator = torch.Generator().manual_seed(hidden + 1)
    terms = (torch.randn(3, hidden, generator=generator) * torch.exp(4 * torch.randn(3, hidden, generator=generator)))
    expected = row_sum(terms)
    actual = emulate_subtree_sum(terms, hidden, tile, vector_width(dtype))
    assert torch.equal(actual.view(torch.int32), expected.view(torch.int32)), (hidden, dtype, actual, expected)


def test_the_subtree_emulation_would_see_another_mapping() -> None:
    """Sanity of the test above: lanes holding consecutive ``j`` (``j = 8·l + m``) would add in
    another order and give other bits."""
    hidden, dtype = 7168, torch.bfloat16
    tile = row_tile(hidden, dtype)
    generator = torch.Generator().manual_seed(5)
    terms = torch.randn(64, hidden, generator=generator) * torch.exp(4 * torch.randn(64, hidden, generator=generator))
    tree = emulate_row_sum(terms, hidden, tile, vector_width(dtype), start_only=True)
    subtrees, size = reduction_plan(hidden, tile, vector_width(dtype)).subtrees
    wrong = torch.stack([tree[..., r::subtrees].reshape(*terms.shape[:-1], 32, size // 32).sum(-1).sum(-1)
                         for r in range(subtrees)], -1).sum(-1)
    assert not torch.equal(wrong.view(torch.int32), row_sum(terms).view(torch.int32))


def test_the_emulation_would_see_another_order() -> None:
    """Sanity of the test above: a sequential sum of the same values differs in its bits."""
    generator = torch.Generator().manual_seed(0)
    terms = torch.randn(7168, generator=generator) * torch.exp(4 * torch.randn(7168, generator=generator))
    sequential = torch.zeros((), dtype=torch.float32)
    for value in terms:
        sequential = sequential + value
    assert sequential.view(torch.int32) != row_sum(terms.unsqueeze(0))[0].view(torch.int32)


# ---------------------------------------------------------------------- the kernels' row math, emulated

# The rest of a row's arithmetic as the kernels (rms_norm.RmsNormMacros, which the fused
# rms_norm_per_token_cast uses for its y too, and layer_norm.build) write it: one IEEE fp32
# operation per __fadd_rn / __fsub_rn / __fmul_rn / __fdiv_rn / __fsqrt_rn of the generated
# source, in its order, emulated with numpy's fp32 arithmetic (IEEE, correctly rounded: an
# implementation independent of torch's), roundings to x.dtype by torch's conversions (RNE).
# The reference must give these bytes: that is the design claim the GPU tests check bytewise.
# (The H200 run of tests/gpu/test_cuda_norm.py found it broken by the reference: torch.sqrt
# on an AVX-512 CPU is not correctly rounded; these tests see that on the grid's own rows.)

F32 = np.float32


def _to_dtype(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """fp32 ``values`` rounded once to ``dtype`` (and read back as fp32)."""
    return torch.from_numpy(np.ascontiguousarray(values, dtype=F32)).to(dtype).to(torch.float32).numpy()


def _row_sum(terms: np.ndarray, hidden: int, dtype: torch.dtype) -> np.ndarray:
    return emulate_row_sum(torch.from_numpy(terms), hidden, row_tile(hidden, dtype), vector_width(dtype)).numpy()


def _rstd(total: np.ndarray, hidden: int, eps: float) -> np.ndarray:
    """``__fdiv_rn(1, __fsqrt_rn(__fadd_rn(__fdiv_rn(acc, D), eps)))``."""
    return F32(1.0) / np.sqrt(total / F32(hidden) + F32(eps))


def _input_rows(x: torch.Tensor, residual: torch.Tensor | None) -> np.ndarray:
    """``s`` [R, D] as fp32: ``x`` or ``round_to(x.dtype, __fadd_rn(x, residual))``."""
    s = x.reshape(-1, x.shape[-1]).float().numpy()
    if residual is None:
        return s
    return _to_dtype(s + residual.reshape(-1, x.shape[-1]).float().numpy(), x.dtype)


def emulate_rms_norm(x, weight, residual, eps, weight_offset, out_scale):
    """(y, residual_out, rstd) of the CUDA rms_norm kernel on ``x`` [..., D] (rows flattened)."""
    hidden, dtype = x.shape[-1], x.dtype
    s = _input_rows(x, residual)
    rstd = _rstd(_row_sum(s * s, hidden, dtype), hidden, eps)
    y = s * rstd[:, None]
    scale = F32(out_scale)
    if weight is not None:
        factor = weight.float().numpy() + F32(weight_offset)
        y = y * (factor if scale == F32(1.0) else factor * scale)
    elif scale != F32(1.0):
        y = y * scale
    return _to_dtype(y, dtype), s, rstd


def emulate_layer_norm(x, weight, bias, residual, eps):
    """(y, residual_out, mean, rstd) of the CUDA layer_norm kernel on ``x`` [..., D]."""
    hidden, dtype = x.shape[-1], x.dtype
    s = _input_rows(x, residual)
    mean = _row_sum(s.copy(), hidden, dtype) / F32(hidden)
    centered = s - mean[:, None]
    rstd = _rstd(_row_sum(centered * centered, hidden, dtype), hidden, eps)
    y = centered * rstd[:, None]
    if weight is not None:
        y = y * weight.float().numpy()
    if bias is not None:
        y = y + bias.float().numpy()
    return _to_dtype(y, dtype), s, mean, rstd


def _bits_equal(actual: np.ndarray, expected: torch.Tensor, what: str) -> None:
    want = expected.reshape(actual.shape).float().numpy()
    different = actual.view(np.int32) != want.view(np.int32)
    assert not different.any(), (f"{what}: {int(different.sum())} value(s) differ, first at "
                                 f"{tuple(int(i) for i in np.argwhere(different)[0])}")


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
EMULATED = [
    Case.of("rms_norm", 64, FP32),
    Case.of("rms_norm", 576, FP32, inputs={"residual": True}, return_rstd=True),
    Case.of("rms_norm", 100, FP16, inputs={"residual": True}, return_rstd=True),
    Case.of("rms_norm", 7, BF16, inputs={"residual": True}),
    Case.of("rms_norm", 128, BF16, inputs={"heads": 8}, return_rstd=True),
    Case.of("rms_norm", 576, BF16, weight_offset=1.0, out_scale=0.5),
    Case.of("rms_norm", 2048, FP32, return_rstd=True),
    Case.of("rms_norm", 7168, BF16, inputs={"residual": True, "weight": "fp32"}, return_rstd=True),
    Case.of("rms_norm", 7168, FP16, inputs={"weight": "none"}, out_scale=2.0),
    Case.of("layer_norm", 64, FP32, inputs={"bias": "fp32"}, return_stats=True),
    Case.of("layer_norm", 7, FP32, inputs={"bias": "fp32"}, return_stats=True),
    Case.of("layer_norm", 576, BF16, inputs={"bias": "fp32", "residual": True}, return_stats=True),
    Case.of("layer_norm", 1000, BF16, inputs={"bias": "bf16", "residual": True}, return_stats=True),
    Case.of("layer_norm", 5120, FP16, inputs={"weight": "none"}),
]


@pytest.mark.parametrize("case", EMULATED, ids=[case.id for case in EMULATED])
def test_kernel_row_math_equals_the_reference_bitwise(case: Case) -> None:
    """y, residual_out and the statistics of the kernels' operations (emulated) are the
    reference's bytes, on the GPU grid's own inputs (``Case.arguments``, T = 129; 3-D: T·N rows)."""
    from tileplug.core import ops
    from tileplug.core.registry import use_backend

    kwargs = dict(case.kwargs)
    args, arguments = case.arguments(129, "cpu")
    with use_backend("reference"):
        result = getattr(ops, case.op)(*args, **arguments)
    result = list(result) if isinstance(result, tuple) else [result]
    x, residual = args[0], arguments.get("residual")
    if case.op == "rms_norm":
        y, s, rstd = emulate_rms_norm(x, arguments.get("weight"), residual, arguments.get("eps", 1e-6),
                                      arguments.get("weight_offset", 0.0), arguments.get("out_scale", 1.0))
        statistics = [("rstd", rstd)]
    else:
        y, s, mean, rstd = emulate_layer_norm(x, arguments.get("weight"), arguments.get("bias"), residual,
                                              arguments.get("eps", 1e-5))
        statistics = [("mean", mean), ("rstd", rstd)]
    expected = [("y", y)] + ([("residual_out", s)] if residual is not None else [])
    if kwargs.get("return_rstd") or kwargs.get("return_stats"):
        expected += statistics
    assert len(result) == len(expected)
    for (name, emulated), reference in zip(expected, result):
        _bits_equal(emulated, reference, f"{case.id} {name}")


def test_the_row_math_emulation_sees_a_one_ulp_root() -> None:
    """Sanity of the test above: torch's own fp32 root where the kernel's is correctly rounded
    changes the bytes of y (the reference of before, on the first grid case it failed on the H200)."""
    case = Case.of("rms_norm", 64, FP32)
    (x,), arguments = case.arguments(129, "cpu")
    s = x.float().numpy()
    total = _row_sum(s * s, 64, torch.float32)
    faithful = torch.sqrt(torch.from_numpy(total / F32(64)) + F32(1e-6)).numpy()
    correct = np.sqrt(total / F32(64) + F32(1e-6))
    if np.array_equal(faithful.view(np.int32), correct.view(np.int32)):
        pytest.skip("this CPU's torch.sqrt is correctly rounded on these rows")
    y, _, _ = emulate_rms_norm(x, arguments["weight"], None, 1e-6, 0.0, 1.0)
    weight = arguments["weight"].float().numpy()
    other = _to_dtype((s * (F32(1.0) / faithful)[:, None]) * (weight + F32(0.0)), torch.float32)
    assert not np.array_equal(y.view(np.int32), other.view(np.int32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_tile_covers_every_size_up_to_the_limit(dtype: torch.dtype) -> None:
    """Every D from 1 to the largest served gets a tile of 32..512 threads whose capacity
    covers D (short rows: several rows per CTA; long rows: one, 4..16 warps)."""
    vec = vector_width(dtype)
    for hidden in list(range(1, 1100)) + list(range(1100, MAX_VECTORS * vec + 1, 97)) + [MAX_VECTORS * vec]:
        tile = row_tile(hidden, dtype)
        assert tile is not None, hidden
        assert tile.lanes * tile.chunks * vec >= hidden, (hidden, tile)
        assert tile.threads % 32 == 0 and 32 <= tile.threads <= 512, (hidden, tile)
        assert tile.rows == 1 or tile.lanes <= 32, (hidden, tile)
    assert row_tile(MAX_VECTORS * vec + 1, dtype) is None


def test_row_tiles_of_model_sizes() -> None:
    """The geometry of the sizes models use (bf16): D = 7168 is 7 warps × 4 vectors, no idle slot."""
    assert row_tile(64, torch.bfloat16) == RowTile(8, 16, 1)
    assert row_tile(576, torch.bfloat16) == RowTile(32, 4, 3)
    assert row_tile(4096, torch.bfloat16) == RowTile(128, 1, 4)
    assert row_tile(7168, torch.bfloat16) == RowTile(224, 1, 4)
    assert row_tile(16384, torch.bfloat16) == RowTile(512, 1, 4)
    assert row_tile(16384, torch.float32) == RowTile(512, 1, 8)


# ---------------------------------------------------------------------- declines and specs


def _kernel_call(op, *args, **kwargs):
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core.lowering import describe_call

    call, inputs = describe_call(op, *args, **kwargs)
    return _KERNELS[call.op], call, inputs


def test_norm_kernels_are_in_the_cuda_table() -> None:
    from tileplug.backend_cuda.plugin import make_backend

    backend = make_backend()
    assert {"rms_norm", "layer_norm", "rms_norm_per_token_cast"} <= set(backend.kernels)
    assert "rms_norm" in backend.capabilities() and "batch-invariant" in backend.capabilities()


def test_declines_name_their_reason() -> None:
    from tileplug.core import ops

    kernel, call, _ = _kernel_call(ops.rms_norm, torch.empty(2, 64, dtype=torch.float64))
    assert "float64" in kernel.supports(call)
    kernel, call, _ = _kernel_call(ops.rms_norm, torch.empty(2, 64), torch.empty(64, dtype=torch.float64))
    assert "weight dtype" in kernel.supports(call)
    kernel, call, _ = _kernel_call(ops.rms_norm, torch.empty(2, 16385, dtype=torch.float32))
    assert "does not fit" in kernel.supports(call)
    kernel, call, _ = _kernel_call(ops.layer_norm, torch.empty(2, 32768, dtype=torch.bfloat16))
    assert kernel.supports(call) is None
    kernel, call, _ = _kernel_call(ops.rms_norm_per_token_cast, torch.empty(2, 4, 96, dtype=torch.bfloat16),
                                   num_per_channels=64)
    assert "straddle" in kernel.supports(call)
    kernel, call, _ = _kernel_call(ops.rms_norm_per_token_cast, torch.empty(2, 4, 128, dtype=torch.bfloat16),
                                   num_per_channels=64)
    assert kernel.supports(call) is None


def test_specialisation_ignores_the_token_count() -> None:
    """One compiled kernel serves every T of a configuration (T is a runtime value)."""
    from tileplug.core import ops

    specs = set()
    for tokens in (1, 7, 4001):
        x = torch.empty(tokens, 7168, dtype=torch.bfloat16)
        kernel, call, _ = _kernel_call(ops.rms_norm, x, torch.empty(7168, dtype=torch.bfloat16), residual=x.clone())
        specs.add(kernel.spec(call))
    assert len(specs) == 1


def test_vectorized_only_where_every_row_is_aligned() -> None:
    from tileplug.core import ops

    weight = torch.empty(576, dtype=torch.bfloat16)
    kernel, call, _ = _kernel_call(ops.rms_norm, torch.empty(4, 576, dtype=torch.bfloat16), weight)
    assert kernel.spec(call).vectorize
    kernel, call, _ = _kernel_call(ops.rms_norm, torch.empty(4, 584, dtype=torch.bfloat16)[:, :576], weight)
    assert kernel.spec(call).vectorize  # a row stride of 584 values keeps 16-byte rows
    kernel, call, _ = _kernel_call(ops.rms_norm, torch.empty(4, 579, dtype=torch.bfloat16)[:, :576], weight)
    assert not kernel.spec(call).vectorize
    kernel, call, _ = _kernel_call(ops.rms_norm, torch.empty(4, 100, dtype=torch.bfloat16))
    assert not kernel.spec(call).vectorize  # D = 100 is no multiple of 8 bf16
    x = torch.empty(4, 576, dtype=torch.bfloat16)
    kernel, call, _ = _kernel_call(ops.rms_norm, x, weight, residual=torch.empty(4, 577, dtype=torch.bfloat16)[:, 1:])
    assert not kernel.spec(call).vectorize  # the residual's rows are not aligned


def test_backward_blocking_is_fixed_and_sizes_the_partial_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backward CTA runs a constant number of row iterations (never chosen by T: it fixes the
    weight gradient's order of additions), and the launcher hands the row kernel one partial row
    per row slot of each CTA, ``ceil(R / (rows · row_block)) · rows``, which the column sum adds."""
    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.norm.backward import ColumnSumSpec
    from tileplug.backend_cuda.norm.spec import BACKWARD_ROW_BLOCK
    from tileplug.core import CUDA_LAYOUT, ops

    recorders: dict[str, Recorder] = {}
    monkeypatch.setattr(jit, "entry", lambda spec: recorders.setdefault(spec.name, Recorder()))
    for hidden, tokens in ((576, 1), (576, 4001), (7168, 7), (7168, 4001)):
        grad = torch.randn(tokens, hidden, dtype=torch.bfloat16)
        kernel, call, inputs = _kernel_call(ops.rms_norm_backward, grad, grad.clone(),
                                            torch.ones(hidden, dtype=torch.bfloat16), torch.ones(tokens))
        spec = kernel.spec(call)
        assert spec.row_block == BACKWARD_ROW_BLOCK == 16 and "_rb" not in spec.name
        recorders.clear()
        kernel.kernel().prepare(call, split_below=0)(inputs, call.allocation_plan(CUDA_LAYOUT).allocate(call.tokens, None))
        partials = recorders[spec.name].args[-1]
        slots = spec.tile.rows
        assert partials.shape == (-(-tokens // (slots * 16)) * slots, hidden), (hidden, tokens)
        summed = recorders[ColumnSumSpec().name].args[0]
        assert summed is partials or summed.shape[0] == -(-partials.shape[0] // 64)
    monkeypatch.setenv("TILEPLUG_CUDA_NORM_BACKWARD_ROW_BLOCK", "8")
    kernel, call, _ = _kernel_call(ops.rms_norm_backward, grad, grad, torch.ones(7168, dtype=torch.bfloat16),
                                   torch.ones(4001))
    assert kernel.spec(call).row_block == 8 and "rb8" in kernel.spec(call).name.split("_")


@pytest.mark.parametrize(("op", "hidden", "heads"), [
    ("rms_norm_backward", 7168, None),  # one row a tile
    ("rms_norm_backward", 128, 4),  # 8 rows a tile (16 lanes of one vector), 3-D
    ("layer_norm_backward", 576, None),  # 4 rows a tile, two reduced vectors
])
def test_backward_runs_split_while_the_fused_grid_is_short(op: str, hidden: int, heads: int | None,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """More than one row tile and a fused grid under ``split_below`` CTAs: the half path where its
    grid (two CTAs a block) reaches ``split_below`` (the row kernel at half a block a CTA, a block's
    first sum then its later rows' one-row partials, the block sum of those into the fused kernel's
    partial rows, the column sum), else the split path (one row tile a CTA, one one-row partial per
    row slot, the block sum, the column sum); otherwise the fused row kernel. Without ``split_below``
    the bound is the environment variable's, else the default: 64 (since the split path ran on a GPU,
    2026-12-06). The half path only with ``TILEPLUG_CUDA_NORM_BACKWARD_HALF_PATH=1`` (timed: off by default)."""
    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.norm.backward import BlockLayout, ColumnSumSpec, RowBlockSumSpec
    from tileplug.backend_cuda.norm.spec import BACKWARD_SPLIT_BELOW
    from tileplug.core import CUDA_LAYOUT, ops

    split_below = 64
    launched: list[tuple[str, tuple]] = []
    monkeypatch.setattr(jit, "entry", lambda spec: lambda *args: launched.append((spec.name, args)))
    monkeypatch.setenv("TILEPLUG_CUDA_NORM_BACKWARD_HALF_PATH", "1")

    def run(tokens: int, **options) -> tuple:  # options: prepare's (split_below), else the environment's
        shape = (tokens, hidden) if heads is None else (tokens, heads, hidden)
        grad = torch.randn(shape, dtype=torch.bfloat16)
        stats = (torch.zeros(shape[:-1]),) if op == "layer_norm_backward" else ()
        kernel, call, inputs = _kernel_call(getattr(ops, op), grad, grad.clone(), torch.ones(hidden, dtype=torch.bfloat16),
                                            *stats, torch.ones(shape[:-1]))
        launched.clear()
        kernel.kernel().prepare(call, **options)(inputs, call.allocation_plan(CUDA_LAYOUT).allocate(call.tokens, None))
        return kernel.spec(call), kernel.split_spec(call), kernel.half_spec(call), list(launched)

    spec, split, half, _ = run(1)
    slots, reduced, block = spec.tile.rows, 2 if op == "layer_norm_backward" else 1, spec.row_block
    assert split.row_block == 1 and not split.prefetch and split.name == spec.name.replace("_pf", "_rb1")
    assert half.sub_block == block // 2 and half.prefetch and {"pf", f"sb{block // 2}"} <= set(half.name.split("_"))
    kept = BlockLayout(half).kept
    assert kept == 1 + block // 2
    rows_per_fused_cta = slots * block * (heads or 1)
    longest_split = (split_below - 1) * slots * (block // 2) // (heads or 1)  # the half path's grid short of 64
    longest_half = (split_below - 1) * slots * block // (heads or 1)
    for tokens, path in ((1, "fused"), (2, "split"), (rows_per_fused_cta + 1, "split"), (longest_split, "split"),
                         (longest_split + 1, "half"), (longest_split + slots * 7, "half"), (longest_half, "half"),
                         (longest_half + 1, "fused")):
        if tokens * (heads or 1) <= slots:
            path = "fused"  # one row tile: nothing to split
        _, _, _, calls = run(tokens, split_below=split_below)
        names = [name for name, _ in calls]
        tiles = -(-tokens * (heads or 1) // slots)
        blocks = -(-tiles // block)
        ran = {"fused": spec, "half": half, "split": split}[path]
        assert names[0] == ran.name and not {spec.name, half.name, split.name} - {ran.name} & set(names), (tokens, names)
        if path == "fused":
            assert calls[0][1][-1].shape == (blocks * slots, hidden)
            continue
        # split: one partial row per row tile and slot; half: per block its first CTA's sum and its later rows
        first_rows = tiles if path == "split" else sum(
            1 + max(0, min(block, tiles - first) - block // 2) for first in range(0, tiles, block))
        assert BlockLayout(ran).partial_rows(tiles) == first_rows
        assert calls[0][1][-1].shape == (first_rows * slots, hidden)
        block_sums = [args for name, args in calls
                      if name == RowBlockSumSpec(block if path == "split" else kept, slots).name]
        assert len(block_sums) == reduced
        for one_row, blocked in block_sums:
            assert one_row.shape == (first_rows * slots, hidden) and blocked.shape == (blocks * slots, hidden)
        assert names.count(ColumnSumSpec().name) == reduced
    monkeypatch.delenv("TILEPLUG_CUDA_NORM_BACKWARD_SPLIT_BELOW", raising=False)
    assert BACKWARD_SPLIT_BELOW == split_below and run(longest_split)[3][0][0] == split.name  # the default
    assert run(longest_half)[3][0][0] == half.name
    monkeypatch.setenv("TILEPLUG_CUDA_NORM_BACKWARD_SPLIT_BELOW", "0")
    assert run(longest_split)[3][0][0] == spec.name
    monkeypatch.setenv("TILEPLUG_CUDA_NORM_BACKWARD_SPLIT_BELOW", str(split_below))
    assert run(longest_split)[3][0][0] == split.name
    monkeypatch.delenv("TILEPLUG_CUDA_NORM_BACKWARD_HALF_PATH")  # the default: no half path, the split path instead
    assert run(longest_half)[3][0][0] == split.name and run(longest_half + 1)[3][0][0] == spec.name
    monkeypatch.setenv("TILEPLUG_CUDA_NORM_BACKWARD_HALF_PATH", "yes")
    with pytest.raises(ValueError, match="TILEPLUG_CUDA_NORM_BACKWARD_HALF_PATH='yes': expected one of 0, 1"):
        run(longest_half)


def _fused_order(terms: torch.Tensor, masked: torch.Tensor, row_block: int) -> torch.Tensor:
    """The fused row kernel's partial rows from ``terms [tiles, rows, D]`` (``masked [tiles, rows]``:
    a row slot past the last row, which adds nothing): each CTA's slot starts at +0 and adds its
    iterations in order."""
    tiles, rows, hidden = terms.shape
    out = []
    for first in range(0, tiles, row_block):
        for slot in range(rows):
            acc = torch.zeros(hidden)
            for tile in range(first, min(first + row_block, tiles)):
                if not masked[tile, slot]:
                    acc = acc + terms[tile, slot]
            out.append(acc)
    return torch.stack(out)


def test_split_block_sums_give_the_fused_partial_rows_bit_for_bit() -> None:
    """The claim the split path rests on, played in fp32 on the CPU (IEEE adds like the kernels'
    ``__fadd_rn``): one-row partials (``+0 + term``, +0 where the slot is masked) added by the
    block sum's order give the fused kernel's partial rows exactly, with −0, ±inf, NaN and
    cancelling terms among them, a partial last block, and several rows a tile; and so do the half
    path's (a block's first half added as the fused kernel adds it, its later rows' one-row partials
    after it), with last blocks shorter and longer than a half."""
    generator = torch.Generator().manual_seed(5)
    row_block = 16
    for tiles, rows in ((1, 1), (37, 1), (16, 4), (50, 8), (7, 2), (45, 1)):
        terms = torch.randn(tiles, rows, 64, generator=generator) * torch.logspace(-30, 30, 64)
        terms[..., 0] = -0.0
        terms[0, 0, 1], terms[-1, -1, 2], terms[tiles // 2, 0, 3] = float("inf"), float("-inf"), float("nan")
        terms[..., 4] = torch.where(torch.arange(tiles * rows).view(tiles, rows) % 2 == 0, 1e30, -1e30)
        terms[..., 5] = -1e-45  # the smallest negative subnormal: sums of them stay exact and negative
        masked = torch.zeros(tiles, rows, dtype=torch.bool)
        masked[-1, rows // 2:] = rows > 1  # the last tile's upper slots are past the last row
        one_row = torch.where(masked[..., None], torch.zeros(()), torch.zeros(()) + terms).reshape(tiles * rows, 64)
        blocked = []
        for out_row in range(-(-tiles // row_block) * rows):
            first_tile, slot = out_row // rows * row_block, out_row % rows
            count = min(row_block, tiles - first_tile)
            acc = one_row[first_tile * rows + slot].clone()
            for i in range(1, count):
                acc = acc + one_row[(first_tile + i) * rows + slot]
            blocked.append(acc)
        expected = _fused_order(terms, masked, row_block)
        assert torch.equal(torch.stack(blocked).view(torch.int32), expected.view(torch.int32)), (tiles, rows)
        assert torch.signbit(expected[:, 0]).logical_not().all() and torch.signbit(expected[:, 5]).all()
        assert torch.equal(_half_path_order(terms, masked, row_block).view(torch.int32), expected.view(torch.int32))


def _half_path_order(terms: torch.Tensor, masked: torch.Tensor, row_block: int) -> torch.Tensor:
    """The half path's partial rows played on the CPU: per block its first CTA's sum (from +0, its
    half of the block's tiles), then each later tile's one-row partial (``+0 + term``, +0 where masked),
    at the rows ``BlockLayout`` gives the kernel; then the block sum over ``kept`` rows a block."""
    from types import SimpleNamespace

    from tileplug.backend_cuda.norm.backward import BlockLayout

    tiles, rows, hidden = terms.shape
    layout = BlockLayout(SimpleNamespace(row_block=row_block, sub_block=row_block // 2))
    first_rows = torch.full((layout.partial_rows(tiles) * rows, hidden), float("nan"))
    for cta in range(-(-tiles // layout.sub)):
        first = cta * layout.sub
        for slot in range(rows):
            if cta % layout.per == 0:
                acc = torch.zeros(hidden)
                for tile in range(first, min(first + layout.sub, tiles)):
                    if not masked[tile, slot]:
                        acc = acc + terms[tile, slot]
                first_rows[layout.first_row(cta) * rows + slot] = acc
                continue
            for block_row, tile in enumerate(range(first, min(first + layout.sub, tiles))):
                term = torch.zeros(hidden) if masked[tile, slot] else torch.zeros(()) + terms[tile, slot]
                first_rows[layout.term_row(cta, block_row) * rows + slot] = term
    blocked = []
    for out_row in range(-(-tiles // row_block) * rows):
        first, slot = out_row // rows * layout.kept, out_row % rows
        count = min(layout.kept, first_rows.shape[0] // rows - first)
        acc = first_rows[first * rows + slot].clone()
        for i in range(1, count):
            acc = acc + first_rows[(first + i) * rows + slot]
        blocked.append(acc)
    return torch.stack(blocked)


def test_row_block_sum_lowers_with_its_terms_loaded_first() -> None:
    pytest.importorskip("tilelang")
    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.norm.backward import RowBlockSumSpec

    source = jit.lower_source(RowBlockSumSpec(16, 4))
    body = source[source.index("float terms[16]"):]
    assert body.index("terms[i] = partials[") < body.index("__fadd_rn(acc[0], terms[(i_1 + 1)])")
    assert "blockIdx.y" in body and "atomic" not in source.lower()


def test_backward_prefetch_only_on_aligned_rows_that_fit() -> None:
    """The backward row loops stage rows with cp.async only on 128-bit tiles whose two stages fit
    ``PREFETCH_MAX_BYTES``; the environment variable turns it off (and the name says which)."""
    from tileplug.backend_cuda.norm.spec import PREFETCH_MAX_BYTES, prefetch_bytes
    from tileplug.core import ops

    def spec(hidden: int, width: int | None = None, **env: str):
        x = torch.empty(4, width or hidden, dtype=torch.bfloat16)[:, :hidden]
        with pytest.MonkeyPatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            kernel, call, _ = _kernel_call(ops.rms_norm_backward, x, x, torch.empty(hidden, dtype=torch.bfloat16),
                                           torch.empty(4, dtype=torch.float32))
            return kernel.spec(call)

    assert spec(7168).prefetch and "pf" in spec(7168).name.split("_")
    assert prefetch_bytes(spec(7168).tile) == 57344
    assert not spec(7168, TILEPLUG_CUDA_NORM_BACKWARD_PREFETCH="0").prefetch
    assert not spec(576, 579).prefetch  # misaligned rows load element by element
    assert prefetch_bytes(row_tile(16384, torch.bfloat16)) > PREFETCH_MAX_BYTES and not spec(16384).prefetch


def _norm_spec(op_name: str, hidden: int, dtype: torch.dtype = torch.bfloat16, **env: str):
    """(the row kernel's spec, the split path's) of ``op_name`` on 4 rows of ``hidden`` under ``env``."""
    from tileplug.core import ops

    x = torch.empty(4, hidden, dtype=dtype)
    weight = torch.empty(hidden, dtype=dtype)
    rstd = torch.empty(4, dtype=torch.float32)
    arguments = {"rms_norm_backward": (x, x, weight, rstd), "layer_norm_backward": (x, x, weight, rstd, rstd),
                 "rms_norm": (x, weight)}[op_name]
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        kernel, call, _ = _kernel_call(getattr(ops, op_name), *arguments)
        spec = kernel.spec(call)
        return spec, kernel.split_spec(call) if op_name.endswith("_backward") else None


def test_backward_subtrees_variable_names_its_kernels() -> None:
    """The backward row kernels (and the split path's) take the warp-subtree tree by default where the tile allows
    it (``_st``; ``TILEPLUG_CUDA_NORM_BACKWARD_SUBTREES=0``: the levels), never a forward kernel, nor a row of one
    thread or one shuffle tree; anything but 0 / 1 names the variable."""
    variable = "TILEPLUG_CUDA_NORM_BACKWARD_SUBTREES"
    for op_name in ("rms_norm_backward", "layer_norm_backward"):
        levels, _ = _norm_spec(op_name, 7168, **{variable: "0"})
        subtrees, split = _norm_spec(op_name, 7168)
        assert not levels.subtrees and "st" not in levels.name.split("_")
        assert subtrees.subtrees and "st" in subtrees.name.split("_") and "_rb1_st" in split.name
        assert subtrees == _norm_spec(op_name, 7168, **{variable: "1"})[0]
        for hidden in (7, 128):  # one thread a row; one vector a lane of one warp (the shuffle tree)
            assert not _norm_spec(op_name, hidden)[0].subtrees
    assert not _norm_spec("rms_norm", 7168, **{variable: "1"})[0].subtrees
    with pytest.raises(ValueError, match=variable):
        _norm_spec("rms_norm_backward", 7168, **{variable: "yes"})


@pytest.mark.parametrize("op_name,barriers", [("rms_norm_backward", (17, 7)), ("layer_norm_backward", (30, 10))])
def test_backward_subtrees_take_fewer_barriers(op_name: str, barriers: tuple) -> None:
    """At D = 7168 bf16 the subtree form's CUDA adds each row with the warps' shuffles and far fewer CTA
    barriers than the level-per-barrier tree (the forward kernels' form: the same additions, in the same order)."""
    from tileplug.backend_cuda import jit

    apart = {"TILEPLUG_CUDA_NORM_BACKWARD_PAIRED_SUMS": "0"}  # layer_norm_backward's two sums one after the other
    levels = jit.lower_source(_norm_spec(op_name, 7168, TILEPLUG_CUDA_NORM_BACKWARD_SUBTREES="0", **apart)[0])
    subtrees = jit.lower_source(_norm_spec(op_name, 7168, TILEPLUG_CUDA_NORM_BACKWARD_SUBTREES="1", **apart)[0])
    assert (levels.count("__syncthreads()"), subtrees.count("__syncthreads()")) == barriers
    assert "__shfl_down_sync" not in levels and "__shfl_down_sync" in subtrees


PAIRED_SUMS = "TILEPLUG_CUDA_NORM_BACKWARD_PAIRED_SUMS"


def test_paired_sums_variable_names_layer_norm_backward_kernels() -> None:
    """``layer_norm_backward`` pairs its two row sums by default (``_ps``, the split path's kernel too;
    ``TILEPLUG_CUDA_NORM_BACKWARD_PAIRED_SUMS=0``: one after the other), with either tree form;
    ``rms_norm_backward`` (one sum) and the forwards are untouched; anything but 0 / 1 names the variable."""
    apart, _ = _norm_spec("layer_norm_backward", 7168, **{PAIRED_SUMS: "0"})
    paired, split = _norm_spec("layer_norm_backward", 7168)
    assert not apart.paired_sums and paired.paired_sums and paired.name == apart.name + "_ps"
    assert split.name.endswith("_rb1_st_ps") and paired == _norm_spec("layer_norm_backward", 7168, **{PAIRED_SUMS: "1"})[0]
    levels, _ = _norm_spec("layer_norm_backward", 7168, TILEPLUG_CUDA_NORM_BACKWARD_SUBTREES="0")
    assert levels.paired_sums and levels.name.endswith("_pf_ps")
    assert _norm_spec("layer_norm_backward", 64, **{PAIRED_SUMS: "1"})[0].paired_sums  # one shuffle tree a row
    for op_name in ("rms_norm_backward", "rms_norm"):
        assert not _norm_spec(op_name, 7168)[0].paired_sums
    with pytest.raises(ValueError, match=PAIRED_SUMS):
        _norm_spec("layer_norm_backward", 7168, **{PAIRED_SUMS: "on"})


def test_paired_sums_fit_the_shared_budget() -> None:
    """The paired tree takes two sums' shared memory: a row whose one tree would take more than half the budget
    keeps its sums apart (D = 7000 fp32 has no exact tile: its tree is all of D, 28000 bytes)."""
    from tileplug.backend_cuda.norm.spec import MAX_SHARED_BYTES, reduction_plan, row_tile

    plan = reduction_plan(7000, row_tile(7000, torch.float32), 4)
    assert 2 * 4 * plan.width > MAX_SHARED_BYTES >= 4 * plan.width
    assert not _norm_spec("layer_norm_backward", 7000, torch.float32)[0].paired_sums


@pytest.mark.parametrize("forms,barriers", [({"TILEPLUG_CUDA_NORM_BACKWARD_SUBTREES": "0"}, (30, 18)),
                                            ({"TILEPLUG_CUDA_NORM_BACKWARD_SUBTREES": "1"}, (10, 7))])
def test_paired_sums_share_their_barriers(forms: dict, barriers: tuple) -> None:
    """At D = 7168 bf16 the paired sums' CUDA has fewer CTA barriers than the sums one after the other (the prefetch
    and the column sums keep theirs), in the level-per-barrier tree and in the subtree form."""
    from tileplug.backend_cuda import jit

    apart = jit.lower_source(_norm_spec("layer_norm_backward", 7168, **forms, **{PAIRED_SUMS: "0"})[0])
    paired = jit.lower_source(_norm_spec("layer_norm_backward", 7168, **forms, **{PAIRED_SUMS: "1"})[0])
    assert (apart.count("__syncthreads()"), paired.count("__syncthreads()")) == barriers
    assert apart.count("__shfl_down_sync") == paired.count("__shfl_down_sync")


@pytest.mark.nvcc
def test_paired_sums_compile_without_spills() -> None:
    """``layer_norm_backward`` D = 7168 bf16 with the paired sums, in either tree form, compiles for sm_90 without
    spills (nvcc 13.0: 177 / 191 registers against 202 / 195 apart)."""
    pytest.importorskip("tilelang")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_compile import nvcc, spill_bytes

    from tileplug.backend_cuda import jit

    for forms in ({"TILEPLUG_CUDA_NORM_BACKWARD_SUBTREES": "0"}, {"TILEPLUG_CUDA_NORM_BACKWARD_SUBTREES": "1"}):
        spec, _ = _norm_spec("layer_norm_backward", 7168, **forms, **{PAIRED_SUMS: "1"})
        error, _, report = nvcc(jit.lower_source(spec))
        assert error is None, error
        spills = spill_bytes(report)
        assert spills.get(spec.name + "_kernel") == 0 and not any(spills.values()), report[-2000:]


def test_chunks_variable_picks_the_long_rows_tile() -> None:
    """``TILEPLUG_CUDA_NORM_CHUNKS`` is the vectors a lane of a long row aims for: at D = 7168 bf16 the default 4
    gives 7 warps × 4 vectors, 7 gives 4 warps × 7 (TileKernels' shape), named in the kernel (``l128r1c7``); the
    wider tile's forward, fused cast and backward lower (its tree fits the shared budget); anything but an
    integer names the variable."""
    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.norm.spec import RowTile
    from tileplug.core import ops

    assert _norm_spec("rms_norm", 7168)[0].tile == RowTile(224, 1, 4)
    x = torch.empty(4, 7168, dtype=torch.bfloat16)
    weight = torch.empty(7168, dtype=torch.bfloat16)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TILEPLUG_CUDA_NORM_CHUNKS", "7")
        kernel, call, _ = _kernel_call(ops.rms_norm_per_token_cast, x, weight, fmt="e4m3", num_per_channels=32)
        specs = [kernel.spec(call), _norm_spec("rms_norm", 7168)[0], _norm_spec("rms_norm_backward", 7168)[0]]
    for spec in specs:
        assert spec.tile == RowTile(128, 1, 7) and "_l128r1c7" in spec.name
        assert "__shfl_down_sync" in jit.lower_source(spec)  # the warp-subtree sums: 28 subtrees of 256
    with pytest.raises(ValueError, match="TILEPLUG_CUDA_NORM_CHUNKS"):
        _norm_spec("rms_norm", 7168, TILEPLUG_CUDA_NORM_CHUNKS="wide")


# ---------------------------------------------------------------------- launchers


class Recorder:
    def __init__(self) -> None:
        self.args: tuple = ()

    def __call__(self, *args) -> None:
        self.args = args


def _launch(op, *args, **kwargs):
    from tileplug.backend_cuda.norm.kernels import make_launcher
    from tileplug.core import CUDA_LAYOUT

    kernel, call, inputs = _kernel_call(op, *args, **kwargs)
    outputs = call.allocation_plan(CUDA_LAYOUT).allocate(call.tokens, None)
    recorder = Recorder()
    make_launcher(kernel.spec(call), recorder, kernel.arguments(call))(inputs, outputs)
    return kernel.spec(call), inputs, outputs, recorder.args


def test_launcher_passes_x_for_absent_buffers() -> None:
    from tileplug.core import ops

    x = torch.randn(3, 576, dtype=torch.bfloat16)
    _, inputs, outputs, args = _launch(ops.rms_norm, x)
    assert args[0] is x and args[1] is x and args[2] is x and args[3] is outputs.y and args[4] is x and args[5] is x
    weight, residual = torch.randn(576, dtype=torch.bfloat16), torch.randn(3, 576, dtype=torch.bfloat16)
    _, inputs, outputs, args = _launch(ops.rms_norm, x, weight, residual=residual, return_rstd=True)
    assert args[1] is weight and args[2] is residual and args[4] is outputs.residual_out and args[5] is outputs.rstd
    bias = torch.randn(576)
    _, inputs, outputs, args = _launch(ops.layer_norm, x, None, bias, return_stats=True)
    assert args[1] is x and args[2] is bias and args[6] is outputs.mean and args[7] is outputs.rstd


def test_launcher_gives_a_single_row_an_aligned_stride() -> None:
    """T = 1 from a buffer whose row stride (7171) is no multiple of 8: the contract ignores
    the unused stride, the kernel's check reads it, so the launcher passes a view with one."""
    from tileplug.core import ops

    x = torch.randn(2, 7171, dtype=torch.bfloat16)[:1, :7168]
    spec, inputs, outputs, args = _launch(ops.rms_norm, x, torch.randn(7168, dtype=torch.bfloat16))
    assert spec.vectorize
    assert args[0].stride(0) % 8 == 0 and args[0].data_ptr() == x.data_ptr() and torch.equal(args[0], x)


def test_launcher_copies_a_misaligned_weight() -> None:
    from tileplug.core import ops

    x = torch.randn(3, 576, dtype=torch.bfloat16)
    weight = torch.randn(577, dtype=torch.bfloat16)[1:]
    _, inputs, outputs, args = _launch(ops.rms_norm, x, weight)
    assert args[1].data_ptr() % 16 == 0 and torch.equal(args[1], weight)
    aligned = torch.randn(576, dtype=torch.bfloat16)
    _, inputs, outputs, args = _launch(ops.rms_norm, x, aligned)
    assert args[1] is aligned


def test_fused_launcher_hands_packed_scales_as_allocated() -> None:
    """Packed UE8M0 goes to the kernel as core allocated it (int32, column-major here): the kernel
    writes its bytes through an alias (``quant.sf_math.packed_sf_bytes``), no view on the host."""
    from tileplug.core import ops

    x = torch.randn(5, 512, dtype=torch.bfloat16)
    _, _, outputs, args = _launch(ops.rms_norm_per_token_cast, x, round_sf=True, use_packed_ue8m0=True,
                                  use_tma_aligned_col_major_sf=True, num_per_channels=32)
    assert args[-1] is outputs.sf and outputs.sf.dtype == torch.int32 and outputs.sf.stride(0) == 1
    _, _, outputs, args = _launch(ops.rms_norm_per_token_cast, x)
    assert args[-1] is outputs.sf


def test_core_lower_of_a_norm_op_on_meta_tensors() -> None:
    pytest.importorskip("tilelang")
    from tileplug import core

    x = torch.empty(1, 7168, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(7168, dtype=torch.bfloat16, device="meta")
    source = core.lower(core.ops.rms_norm, x, weight, backend="cuda")
    assert "__global__" in source and "*(uint4*)(x +" in source and "__fdiv_rn" in source


@pytest.mark.parametrize("weight_dtype,offset,packed", [
    (torch.bfloat16, 0.0, "tileplug_plus_zero_bf16x2"), (torch.float16, 0.0, "tileplug_plus_zero_f16x2"),
    (torch.bfloat16, 1.0, None), (torch.float32, 0.0, None)])
def test_weight_plus_zero_on_packed_words_only_at_offset_zero(weight_dtype: torch.dtype, offset: float,
                                                              packed: str | None) -> None:
    """A 16-bit weight at offset 0 takes its ``+ 0`` on the packed words (``rows.plus_zero``: one
    helper call a word, no fp32 addition of the offset); another offset, or an fp32 weight, keeps the
    fp32 ``w + offset`` of every value. A power-of-two D's statistic is a product by ``1/D``, another
    D's an IEEE division (``rows.over_width``)."""
    import re

    pytest.importorskip("tilelang")
    from tileplug import core

    offset_literal = "0x0p+0f" if offset == 0.0 else "0x1p+0f"
    weight_add = re.compile(r"__fadd_rn\([^;]*, " + re.escape(offset_literal) + r"/\*")
    for hidden, heads in ((7168, None), (128, 8)):
        shape = (4, hidden) if heads is None else (4, heads, hidden)
        x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
        weight = torch.empty(hidden, dtype=weight_dtype, device="meta")
        source = core.lower(core.ops.rms_norm, x, weight, weight_offset=offset, backend="cuda")
        body = source[source.index("__global__"):]
        if packed:
            assert re.search(r"words\w*\[i\w*\] = " + packed + r"\(words", body), (hidden, packed)
            assert not weight_add.search(body), "no fp32 addition of the offset"
        else:
            assert "tileplug_plus_zero" not in source
            assert weight_add.search(body), "the fp32 w + offset of every value"
        if hidden == 128:
            assert "__fmul_rn(acc[0], 0x1p-7f" in body and "__fdiv_rn(acc[0]" not in body
        else:
            assert "__fdiv_rn(acc[0], 0x1.cp+12f" in body


def test_rows_without_an_exact_long_tile_are_declined() -> None:
    from tileplug.core import ops

    kernel, call, _ = _kernel_call(ops.rms_norm, torch.empty(2, 16000, dtype=torch.bfloat16))
    assert "shared memory" in kernel.supports(call)
    for hidden in (12288, 14336, 16384, 18432, 32768):
        kernel, call, _ = _kernel_call(ops.rms_norm, torch.empty(2, hidden, dtype=torch.bfloat16))
        assert kernel.supports(call) is None, hidden


def test_launcher_gives_a_one_column_view_unit_last_stride() -> None:
    from tileplug.core import ops

    x = torch.randn(5, 3).t()[:, :1]  # [3, 1] with strides (1, 3): D = 1, a last stride of 3
    assert x.stride(-1) != 1
    _, _, outputs, args = _launch(ops.rms_norm, x)
    assert args[0].stride(-1) == 1 and torch.equal(args[0], x) and args[0].data_ptr() == x.data_ptr()


def test_backward_runs_the_row_kernel_then_the_column_sum() -> None:
    from tileplug.backend_cuda.norm.backward import ColumnSumSpec, RowBlockSumSpec
    from tileplug.core import ops

    grad, x = torch.randn(4, 7168, dtype=torch.bfloat16), torch.randn(4, 7168, dtype=torch.bfloat16)
    rstd = torch.ones(4)
    kernel, call, _ = _kernel_call(ops.rms_norm_backward, grad, x, torch.ones(7168, dtype=torch.bfloat16), rstd)
    assert kernel.supports(call) is None
    specs = kernel.specs(call)
    assert specs[0].op == "rms_norm_backward" and specs[1] == kernel.half_spec(call) and specs[3] == kernel.split_spec(call)
    assert specs[2] == RowBlockSumSpec(9, 1)  # the half path's: a block's first sum and 8 rows' terms
    assert specs[4:] == [RowBlockSumSpec(16, 1), ColumnSumSpec(segment=True), ColumnSumSpec()]
    kernel, call, _ = _kernel_call(ops.rms_norm_backward, grad, x, None, rstd)
    assert kernel.specs(call) == [kernel.spec(call), kernel.half_spec(call), kernel.split_spec(call)]  # no weight: no sums


def test_column_sum_lowers_with_an_ordered_loop() -> None:
    pytest.importorskip("tilelang")
    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.norm.backward import ColumnSumSpec

    for spec in (ColumnSumSpec(), ColumnSumSpec(segment=True)):
        source = jit.lower_source(spec)
        assert "__fadd_rn" in source and "atomic" not in source.lower(), spec.name
    assert "blockIdx.y" in jit.lower_source(ColumnSumSpec(segment=True))  # segments along the grid's y


def test_column_sum_stages_add_in_a_fixed_order() -> None:
    """The two-stage column sum on the CPU, with the stages played by PyTorch loops in the
    kernels' order: one segment is the plain row-order sum; more add each run of
    SEGMENT_ROWS rows, then the runs in order."""
    from tileplug.backend_cuda.norm.backward import SEGMENT_ROWS, ColumnSumSpec, column_sum_launcher

    def serial(partials: torch.Tensor, out: torch.Tensor) -> None:
        acc = partials[0].clone()
        for row in partials[1:]:
            acc += row
        out.copy_(acc)

    def segments(partials: torch.Tensor, sums: torch.Tensor) -> None:
        for index in range(sums.shape[0]):
            serial(partials[index * SEGMENT_ROWS:(index + 1) * SEGMENT_ROWS], sums[index])

    entries = {ColumnSumSpec(): serial, ColumnSumSpec(segment=True): segments}
    add = column_sum_launcher(entries.__getitem__)
    for rows in (1, SEGMENT_ROWS, SEGMENT_ROWS + 1, 5 * SEGMENT_ROWS - 3):
        partials = torch.randn(rows, 7, generator=torch.Generator().manual_seed(rows))
        total = torch.empty(7)
        add(partials, total)
        expected = torch.empty(7)
        if rows <= SEGMENT_ROWS:
            serial(partials, expected)
        else:
            stage = torch.empty(-(-rows // SEGMENT_ROWS), 7)
            segments(partials, stage)
            serial(stage, expected)
        assert torch.equal(total, expected), rows
        assert torch.allclose(total, partials.double().sum(0).float(), rtol=1e-5, atol=1e-5)


def test_layer_norm_backward_reduces_bias_and_weight() -> None:
    from tileplug.core import ops

    grad, x = torch.randn(4, 576, dtype=torch.bfloat16), torch.randn(4, 576, dtype=torch.bfloat16)
    mean, rstd = torch.zeros(4), torch.ones(4)
    kernel, call, _ = _kernel_call(ops.layer_norm_backward, grad, x, torch.ones(576, dtype=torch.bfloat16), mean,
                                   rstd)
    assert kernel.supports(call) is None and kernel.reduced(call) == ("grad_bias", "grad_weight")
    kernel, call, _ = _kernel_call(ops.layer_norm_backward, grad, x, None, mean, rstd)
    # the row kernel, the half and split paths' row kernels and block sums, two column stages
    assert kernel.reduced(call) == ("grad_bias",) and len(kernel.specs(call)) == 7


@pytest.mark.parametrize(("op", "hidden", "dtype", "in_shared"), [
    ("rms_norm_backward", 7168, torch.bfloat16, [True]),  # 28 KB of sums + 7 KB of tree
    ("layer_norm_backward", 7168, torch.bfloat16, [True, False]),  # a second 28 KB would pass 48 KB
    ("rms_norm_backward", 16384, torch.bfloat16, [False]),  # 64 KB alone
    ("layer_norm_backward", 1024, torch.float32, [True, True]),
])
def test_backward_column_sums_live_in_shared_memory_while_they_fit(op: str, hidden: int, dtype: torch.dtype,
                                                                   in_shared: list[bool]) -> None:
    """The backward's running column sums: shared memory for the first sums within 48 KB (with the
    reduction's tree), registers for the rest; the row kernel asks for 2 CTAs per SM where every sum
    is in shared memory, else 1 (ptxas would spill)."""
    pytest.importorskip("tilelang")
    from tileplug import core
    from tileplug.backend_cuda.norm.backward import ColumnAccumulators
    from tileplug.backend_cuda.norm.rows import RowMacros
    from tileplug.backend_cuda.norm.spec import BACKWARD_CTAS_PER_SM, MAX_SHARED_BYTES, NormKernelSpec

    tile = row_tile(hidden, dtype)
    spec = NormKernelSpec(op=op, hidden=hidden, heads=None, in_dtype={torch.bfloat16: "bfloat16",
                                                                      torch.float32: "float32"}[dtype],
                          weight_dtype="bfloat16", bias_dtype=None, residual=False, stats=True, eps=0.0,
                          weight_offset=0.0, out_scale=1.0, vectorize=True, tile=tile)
    rows = RowMacros(spec, 1)
    sums = ColumnAccumulators(rows, len(in_shared))
    assert sums.shared == in_shared
    shared = rows.tree_bytes() + sum(in_shared) * rows.VALUES * rows.THREADS * 4
    assert shared <= MAX_SHARED_BYTES
    x = torch.empty(4, hidden, dtype=dtype, device="meta")
    weight = torch.empty(hidden, dtype=torch.bfloat16, device="meta")
    statistic = torch.empty(4, dtype=torch.float32, device="meta")
    if op == "rms_norm_backward":
        source = core.lower(core.ops.rms_norm_backward, x, x, weight, statistic, backend="cuda")
    else:
        source = core.lower(core.ops.layer_norm_backward, x, x, weight, statistic, statistic, backend="cuda")
    assert sums.ctas_per_sm == (BACKWARD_CTAS_PER_SM if all(in_shared) else 1)
    bounds = f"{tile.threads}, {BACKWARD_CTAS_PER_SM}" if all(in_shared) else f"{tile.threads}, 1"
    assert f"__launch_bounds__({bounds})" in source


def test_strides_fixed_keeps_tensors_without_size_one_dims_and_fixes_the_others() -> None:
    """``_strides_fixed`` (every launch of a one-row or one-head call): a tensor without a size-1
    dim comes back itself; otherwise each size-1 dim's stride becomes a multiple of ``vec`` (a
    size-1 last dim's 1), sizes-above-1 strides untouched, a view of the same storage, the cached
    layout lookup giving the same result on a second call."""
    from tileplug.backend_cuda.norm.kernels import _strides_fixed

    storage = torch.empty(4096)
    cases = [((3, 64), (64, 1)), ((1, 64), (64, 1)), ((1, 64), (67, 1)), ((1, 1, 64), (3, 5, 1)),
             ((5, 1, 64), (192, 7, 1)), ((2, 8, 1), (16, 2, 3)), ((1, 1), (9, 9)), ((4, 2, 32), (80, 33, 1))]
    for vec in (1, 4, 8):
        for shape, strides in cases:
            tensor = storage.as_strided(shape, strides)
            for _ in range(2):
                result = _strides_fixed(tensor, vec)
                if 1 not in shape:
                    assert result is tensor
                    continue
                assert result.shape == tensor.shape and result.data_ptr() == tensor.data_ptr()
                for d, (size, old, new) in enumerate(zip(shape, strides, result.stride())):
                    if size > 1:
                        assert new == old, (shape, strides, vec)
                    elif d == len(shape) - 1:
                        assert new == (old if old == 1 else 1), (shape, strides, vec)
                    else:
                        assert new % vec == 0 and (new == old or old % vec), (shape, strides, vec)


@pytest.mark.parametrize(("hidden", "dtype", "residual", "bounds"), [
    (7168, torch.bfloat16, False, "224, 5"),  # 1120 threads an SM: 5 rows of 7 warps (56 registers)
    (4096, torch.bfloat16, False, "128, 8"),
    (7168, torch.float32, False, "448, 2"),
    (7168, torch.bfloat16, True, "224, 1"),  # with a residual: ptxas' choice (the cap spilled 208 bytes)
    (576, torch.bfloat16, False, "128, 1"),  # four rows a CTA: not a long row
])
def test_fused_norm_cast_caps_a_long_rows_registers(hidden: int, dtype: torch.dtype, residual: bool, bounds: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``rms_norm_per_token_cast`` of one row a CTA without a residual asks ptxas for
    ``CAST_THREADS_PER_SM // threads`` CTAs an SM (``__launch_bounds__``' second argument); with a
    residual or several rows a CTA it leaves ptxas its choice; ``TILEPLUG_CUDA_NORM_CAST_THREADS_PER_SM=0``
    turns the cap off and anything but an integer is refused, naming the variable."""
    from tileplug import core
    from tileplug.backend_cuda.norm.spec import CAST_THREADS_PER_SM

    x = torch.empty(4, hidden, dtype=dtype, device="meta")
    weight = torch.empty(hidden, dtype=dtype, device="meta")
    extra = {"residual": torch.empty(4, hidden, dtype=dtype, device="meta")} if residual else {}

    def lowered() -> str:
        return core.lower(core.ops.rms_norm_per_token_cast, x, weight, fmt="e4m3", num_per_channels=32, backend="cuda",
                          **extra)

    assert CAST_THREADS_PER_SM == 1120
    assert f"__launch_bounds__({bounds})" in lowered()
    monkeypatch.setenv("TILEPLUG_CUDA_NORM_CAST_THREADS_PER_SM", "0")
    assert f"__launch_bounds__({bounds.split(',')[0]}, 1)" in lowered()
    monkeypatch.setenv("TILEPLUG_CUDA_NORM_CAST_THREADS_PER_SM", "many")
    with pytest.raises(ValueError, match="TILEPLUG_CUDA_NORM_CAST_THREADS_PER_SM='many': expected an integer"):
        lowered()


def test_rms_norm_threads_per_sm_is_a_tuning_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    """``rms_norm`` leaves ptxas its choice by default; ``TILEPLUG_CUDA_RMS_NORM_THREADS_PER_SM`` asks for
    that many threads an SM on a long row (residual or not) and never on tiles of several rows."""
    from tileplug import core

    def bounds(hidden: int, residual: bool = False) -> str:
        x = torch.empty(4, hidden, dtype=torch.bfloat16, device="meta")
        extra = {"residual": torch.empty_like(x)} if residual else {}
        source = core.lower(core.ops.rms_norm, x, torch.empty(hidden, dtype=torch.bfloat16, device="meta"),
                            backend="cuda", **extra)
        return source[source.index("__launch_bounds__("):].split(")")[0] + ")"

    assert bounds(7168) == "__launch_bounds__(224, 1)" and bounds(7168, True) == "__launch_bounds__(224, 1)"
    monkeypatch.setenv("TILEPLUG_CUDA_RMS_NORM_THREADS_PER_SM", "1120")
    assert bounds(7168) == "__launch_bounds__(224, 5)" and bounds(576) == "__launch_bounds__(128, 1)"
    monkeypatch.setenv("TILEPLUG_CUDA_RMS_NORM_THREADS_PER_SM", "896")
    assert bounds(7168, True) == "__launch_bounds__(224, 4)"
