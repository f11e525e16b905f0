"""Rows of the expanded MoE layout (SPEC §7) the SwiGLU ops read: expert ``e`` owns rows
``[start[e], expert_ends[e])`` with ``start[0] = 0`` and ``start[e] = align(expert_ends[e − 1],
alignment)``; every other row is padding."""

from __future__ import annotations

import torch


def expert_ends_for(rows: int, experts: int, alignment: int, seed: int) -> torch.Tensor:
    """An ``expert_ends`` int32 ``[experts]`` (SPEC §7) whose layout fits in ``rows`` rows: each
    expert gets a random count, every expert but the last leaving room for its alignment
    padding; rows past the last end are padding too."""
    generator = torch.Generator().manual_seed(seed)
    ends, start = [], 0
    for expert in range(experts):
        room = rows - start - (alignment - 1 if expert < experts - 1 else 0)
        count = int(torch.randint(0, room + 1, (1,), generator=generator)) if room > 0 else 0
        end = start + count
        ends.append(end)
        start = (end + alignment - 1) // alignment * alignment
    return torch.tensor(ends, dtype=torch.int32)


def valid_rows_of(rows: int, expert_ends: torch.Tensor, alignment: int) -> torch.Tensor:
    """bool ``[rows]``: which rows lie inside some expert's ``[start[e], expert_ends[e])``."""
    ends = expert_ends.to(torch.int64)
    starts = torch.zeros_like(ends)
    starts[1:] = (ends[:-1] + alignment - 1) // alignment * alignment
    row = torch.arange(rows, device=ends.device)
    expert = torch.searchsorted(ends, row, right=True)
    inside = expert < ends.shape[0]
    return inside & (row >= starts[torch.clamp_max(expert, ends.shape[0] - 1)])
