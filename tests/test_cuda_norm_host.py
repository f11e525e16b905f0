"""CUDA norm kernels, host side and without a GPU: the row tile, the reduction plan
(emulated here in fp32, it must add a row in the reference's order: bit-identical sums),
declines, specialisation keys and the launchers' argument marshalling."""

from __future__ import annotations


import pytest
import torch

from tileplug.backend_cuda.norm.spec import MAX_VECTORS, RowTile, reduction_plan, row_tile, vector_width
from tileplug.core.norm.formulas import row_sum

HIDDEN_SIZES = (1, 2, 3, 7, 8, 16, 63, 64, 100, 128, 576, 1000, 1024, 1536, 2048, 2880, 3072, 4096, 5120, 7168,
                8192, 12288, 16384)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def emulate_row_sum(terms: torch.Tensor, hidden: int, tile: RowTile, vec: int) -> torch.Tensor:
    """The kernel's ``rows.row_sum`` on one row of fp32 ``terms`` [D], step by step in fp32:
    the thread layout, the in-register folds, the shared-memory levels (each an IEEE fp32 add)."""
    plan = reduction_plan(hidden, tile, vec)
    lanes, chunks = tile.lanes, tile.chunks
    local = torch.zeros(lanes, chunks * vec, dtype=torch.float32)
    for lane in range(lanes):
        for k in range(chunks):
            for j in range(vec):
                col = (k * lanes + lane) * vec + j
                if col < hidden:
                    local[lane, k * vec + j] = terms[col]
    if plan.local_steps is not None:
        values = local[0].clone()
        for i, partner in plan.local_steps:
            values[i] = values[i] + values[partner]
        return values[0]
    for i, partner in plan.fold_steps:
        local[:, i] = local[:, i] + local[:, partner]
    tree = torch.full((plan.width,), float("nan"), dtype=torch.float32)
    for lane in range(lanes):
        for c in range(plan.written_chunks):
            for j in range(vec):
                col = (c * lanes + lane) * vec + j
                if plan.exact or col < hidden:
                    tree[col] = local[lane, c * vec + j]
    for h, last, rounds in plan.levels:
        before = tree.clone()  # every lane reads before any writes (one barrier per level)
        for offset, _ in rounds:
            for lane in range(lanes):
                i = lane + offset
                if i < h:
                    partner = last if (last is not None and i == h - 1) else i + h
                    tree[i] = before[i] + before[partner]
    return tree[0]


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


def test_the_emulation_would_see_another_order() -> None:
    """Sanity of the test above: a sequential sum of the same values differs in its bits."""
    generator = torch.Generator().manual_seed(0)
    terms = torch.randn(7168, generator=generator) * torch.exp(4 * torch.randn(7168, generator=generator))
    sequential = torch.zeros((), dtype=torch.float32)
    for value in terms:
        sequential = sequential + value
    assert sequential.view(torch.int32) != row_sum(terms.unsqueeze(0))[0].view(torch.int32)


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
