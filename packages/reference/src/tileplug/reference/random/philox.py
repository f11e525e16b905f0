"""Philox4x32-10 (Salmon, Moraes, Dror, Shaw, SC'11; the Random123 definition) in PyTorch.

Every 32-bit word is held in an int64 tensor, masked to its low 32 bits, so no operation
overflows int64: the 32×32 → 64-bit products of a round are built from the multiplier times
the word's two 16-bit halves (each product < 2^48). All blocks of a draw are computed at once
(one tensor element per block); nothing is read back to the host.

A draw of ``n`` words under ``(seed, offset)`` uses key ``(seed mod 2^32, seed >> 32)`` and,
for block ``b``, counter ``(b mod 2^32, b >> 32, offset mod 2^32, offset >> 32)``; word ``i``
of block ``b`` is element ``4b + i``, the tail of the last block is dropped (SPEC §9).
"""

from __future__ import annotations

import torch

WORD_MASK = 0xFFFFFFFF
MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
"""The round multipliers of counter words 0 and 2."""
WEYL_CONSTANTS = (0x9E3779B9, 0xBB67AE85)
"""What each key word gains between two rounds (mod 2^32)."""
ROUNDS = 10
WORDS_PER_BLOCK = 4


def _multiply_high_low(multiplier: int, word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``multiplier · word`` (both < 2^32) as its high and low 32-bit halves, int64 tensors.

    ``word = h·2^16 + l``: ``multiplier·l`` and ``multiplier·h`` are below 2^48; the low half
    is ``(multiplier·l + ((multiplier·h) mod 2^16)·2^16) mod 2^32`` and the carry of that sum
    joins ``(multiplier·h) >> 16`` in the high half."""
    low_product = (word & 0xFFFF) * multiplier
    high_product = (word >> 16) * multiplier
    low_sum = low_product + ((high_product & 0xFFFF) << 16)
    return (high_product >> 16) + (low_sum >> 32), low_sum & WORD_MASK


def philox4x32_10(counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                  key: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The four output words of Philox4x32-10 for each block: ``counter`` four int64 tensors
    and ``key`` two (broadcast against each other), each value in ``[0, 2^32)``; returns four
    int64 tensors of the broadcast shape, values in ``[0, 2^32)``."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for index in range(ROUNDS):
        if index:
            k0 = (k0 + WEYL_CONSTANTS[0]) & WORD_MASK
            k1 = (k1 + WEYL_CONSTANTS[1]) & WORD_MASK
        high0, low0 = _multiply_high_low(MULTIPLIERS[0], c0)
        high1, low1 = _multiply_high_low(MULTIPLIERS[1], c2)
        c0, c1, c2, c3 = high1 ^ c1 ^ k0, low1, high0 ^ c3 ^ k1, low0
    return c0, c1, c2, c3


def block_count(count: int) -> int:
    """Blocks of four words a draw of ``count`` elements uses: ``ceil(count / 4)``."""
    return (count + WORDS_PER_BLOCK - 1) // WORDS_PER_BLOCK


def block_words(seed: torch.Tensor, offset: torch.Tensor, blocks: int) -> torch.Tensor:
    """The words of ``blocks`` whole blocks → int64 ``[blocks, 4]`` (values in ``[0, 2^32)``).

    ``seed`` and ``offset``: int64 ``[1]`` tensors holding the 64-bit values (two's complement:
    a seed of 2^63 or more is negative as int64, its 64 bits are what count), on the device
    the words are made on."""
    block = torch.arange(blocks, dtype=torch.int64, device=seed.device)
    counter = (block & WORD_MASK, block >> 32, offset & WORD_MASK, (offset >> 32) & WORD_MASK)
    key = (seed & WORD_MASK, (seed >> 32) & WORD_MASK)
    return torch.stack(philox4x32_10(counter, key), dim=1)


def words(seed: torch.Tensor, offset: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` words of a draw under ``(seed, offset)`` → int64 ``[count]``:
    element ``4b + i`` is word ``i`` of block ``b``."""
    return block_words(seed, offset, block_count(count)).reshape(-1)[:count]
