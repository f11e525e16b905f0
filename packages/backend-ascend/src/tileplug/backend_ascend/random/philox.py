"""Philox4x32-10 (SPEC §9, the Random123 definition) on 64-lane vector registers: lane ``j``
of a *group* computes block ``first + j``, so one group is 64 blocks, 256 words, 256 elements.

Plain Python over an ``ops`` object (:class:`~.vector_ops.VectorOps` in the kernels, a numpy
emulation in the tests): the same code makes the Ascend C and the CPU check.

* Counter of block ``b``: ``(b mod 2^32, b >> 32, offset mod 2^32, offset >> 32)``. The
  kernels serve fewer than 2^31 elements, so ``b < 2^29``: ``b >> 32`` is 0 and ``b mod 2^32``
  is the int32 ramp ``first + j``.
* A round: ``(c0, c1, c2, c3) → (hi(M1·c2) ^ c1 ^ k0, lo(M1·c2), hi(M0·c0) ^ c3 ^ k1,
  lo(M0·c0))``, the key growing by the Weyl constants between rounds (mod 2^32).
* The 32×32 → 64-bit products are one ``vmull`` each: the dialect has a widening unsigned
  multiply giving both halves, so no 16-bit decomposition is needed (the reference, on int64
  tensors, builds them from 16-bit halves because an int64 product of two 32-bit words could
  overflow; ``vmull`` cannot: its result is the full 64 bits). Everything else is ``vxor`` and
  ``vadds`` on ``uint32`` lanes, exact mod 2^32.
* Element order (word ``i`` of block ``b`` is element ``4b + i``): four ``vintlv`` turn the
  word registers ``r0..r3`` (lane = block) into four registers of 64 consecutive elements.
"""

MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
"""The round multipliers of counter words 0 and 2."""
WEYL_CONSTANTS = (0x9E3779B9, 0xBB67AE85)
"""What each key word gains between two rounds (mod 2^32)."""
ROUNDS = 10
BLOCKS_PER_GROUP = 64
"""One block per lane of a 64-lane ``uint32`` register."""
WORDS_PER_BLOCK = 4
ELEMENTS_PER_GROUP = BLOCKS_PER_GROUP * WORDS_PER_BLOCK


def multiplier_registers(ops):
    """The two round multipliers, each in every lane (made once per SIMD region)."""
    return ops.splat(MULTIPLIERS[0], "multiplier0"), ops.splat(MULTIPLIERS[1], "multiplier1")


def block_words(ops, multipliers, first_block, key, offset, counter_high=None):
    """The words ``(r0, r1, r2, r3)`` of blocks ``first_block + j`` (lane ``j``, ``first_block``
    an int32 scalar, ``first_block + 63 < 2^31``) under ``key = (k0, k1)`` and ``offset =
    (offset mod 2^32, offset >> 32)``, each a register of that word in every lane; returns
    four ``uint32`` registers. ``counter_high``: counter word 1 (``b >> 32``) as a register;
    None, what the kernels pass, is 0 (the first round's ``hi(M1·c2) ^ c1`` is then
    ``hi(M1·c2)``)."""
    c0 = ops.ramp(first_block, "c0")
    c1 = counter_high
    c2, c3 = offset
    k0, k1 = key
    for index in range(ROUNDS):
        if index:
            k0 = ops.add_word(k0, WEYL_CONSTANTS[0], "k0")
            k1 = ops.add_word(k1, WEYL_CONSTANTS[1], "k1")
        low0, high0 = ops.multiply_wide(c0, multipliers[0], "product0")
        low1, high1 = ops.multiply_wide(c2, multipliers[1], "product1")
        mixed1 = high1 if c1 is None else ops.xor(high1, c1, "mixed1")
        c0, c1, c2, c3 = (ops.xor(mixed1, k0, "c0"), low1, ops.xor(ops.xor(high0, c3, "mixed0"), k1, "c2"), low0)
    return c0, c1, c2, c3


def element_order(ops, words):
    """Registers ``(f0, f1, f2, f3)`` holding word ``i``'s values of the group's 64 blocks
    (lane = block) → four registers of elements ``0..63``, ``64..127``, ``128..191``,
    ``192..255`` of the group (element ``4b + i`` is word ``i`` of block ``b``)."""
    f0, f1, f2, f3 = words
    even_low, even_high = ops.interleave(f0, f2, "words02")  # f0[j], f2[j] for blocks 0..31 / 32..63
    odd_low, odd_high = ops.interleave(f1, f3, "words13")
    e0, e1 = ops.interleave(even_low, odd_low, "elements_low")  # f0[j], f1[j], f2[j], f3[j]
    e2, e3 = ops.interleave(even_high, odd_high, "elements_high")
    return e0, e1, e2, e3
