"""Reference ``apply_rotary``: the rotation of SPEC §6 in fp32, written back in place.

For each token the cache row of its position gives ``c = cos[pos, p]`` and ``n = sin[pos, p]``
(``-sin`` when conjugating); each pair ``(x1, x2)`` of the first ``R`` channels of every head
becomes ``y1 = x1·c − x2·n``, ``y2 = x2·c + x1·n``, evaluated in fp32 exactly as written (two
products, one sum, each rounded to fp32) and rounded once to the tensor's dtype at the store.
A position outside ``[0, L)`` is never read: its ``c`` and ``n`` are NaN, so that token's
rotated channels become NaN and nothing else changes.
"""

from __future__ import annotations

import torch

from tileplug.core.call import NoOutputs
from tileplug.core.contracts.rope import RotaryCall, RotaryInputs


def token_positions(positions: torch.Tensor | None, leading: tuple[int, ...], seqlen_offset: int,
                    device: torch.device) -> torch.Tensor:
    """int64 position of every token, shape ``leading`` (``[T]`` or ``[B, S]``): the given
    positions plus the offset, or ``offset + t`` (3-D) / ``offset + s`` (4-D)."""
    if positions is not None:
        return positions.to(torch.int64) + seqlen_offset
    steps = torch.arange(leading[-1], dtype=torch.int64, device=device) + seqlen_offset
    return steps.expand(leading)


def cos_sin_rows(cos_sin_cache: torch.Tensor, positions: torch.Tensor, conjugate: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(c, n)`` of shape ``[*positions.shape, R/2]``: the cache rows of the positions,
    NaN where a position is outside ``[0, L)`` (never read), ``n`` negated when ``conjugate``."""
    length, rotary = cos_sin_cache.shape
    half = rotary // 2
    valid = (positions >= 0) & (positions < length)
    if length:
        rows = cos_sin_cache[torch.where(valid, positions, 0)]
        rows = torch.where(valid.unsqueeze(-1), rows, float("nan"))
    else:
        rows = torch.full((*positions.shape, rotary), float("nan"), dtype=torch.float32, device=positions.device)
    cos, sin = rows[..., :half], rows[..., half:]
    return cos, (-sin if conjugate else sin)


def rotate(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> None:
    """Rotate the first ``R = 2·cos.shape[-1]`` channels of every head of ``heads``
    ``[..., N, D]`` in place; ``cos`` / ``sin`` fp32 ``[..., R/2]`` per token (broadcast over N).
    NeoX pairs ``(p, p + R/2)``; GPT-J (``interleaved``) pairs ``(2p, 2p + 1)``."""
    half = cos.shape[-1]
    if interleaved:
        first, second = heads[..., 0:2 * half:2], heads[..., 1:2 * half:2]
    else:
        first, second = heads[..., :half], heads[..., half:2 * half]
    c, n = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = first.float(), second.float()
    y1 = x1 * c - x2 * n
    y2 = x2 * c + x1 * n  # both computed before either store (an fp32 x1 is a view of the input)
    first.copy_(y1)
    second.copy_(y2)


def apply_rotary(call: RotaryCall, inputs: RotaryInputs, outputs: NoOutputs) -> None:
    """Rotate ``inputs.query`` and ``inputs.key`` in place (``outputs`` is empty)."""
    query = inputs.query
    leading = tuple(query.shape[:-2])
    positions = token_positions(inputs.positions, leading, inputs.seqlen_offset, query.device)
    cos, sin = cos_sin_rows(inputs.cos_sin_cache, positions, call.conjugate)
    rotate(query, cos, sin, call.interleaved)
    if inputs.key is not None:
        rotate(inputs.key, cos, sin, call.interleaved)
