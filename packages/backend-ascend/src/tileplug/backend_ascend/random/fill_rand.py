"""Ascend kernel of ``fill_rand`` (SPEC §9): ``u = (r >> 8) · 2^-24`` of each Philox word.

The draw kernel (:mod:`.draw`) with :func:`uniform_words` as its transform: per word a
logical shift, an exact s32 → f32 conversion (a 24-bit integer) and an exact scale by a power
of two, so the fp32 value is the reference's bit for bit; a 16-bit dtype rounds it once (to
nearest even, on the store). Plain Python over ``ops`` (see :mod:`.vector_ops`).
"""

from __future__ import annotations

from tileplug.backend_ascend.random.draw import make_kernel

MANTISSA_SHIFT = 8
"""``r >> 8`` keeps the top 24 bits of a word: fp32's significand."""
UNIT = 2.0**-24


def uniform(ops, word, name: str):
    """``(word >> 8) · 2^-24`` lane-wise: a ``uint32`` register → an fp32 register in ``[0, 1)``."""
    return ops.scale(ops.to_float(ops.shift_right(word, MANTISSA_SHIFT, name + "_code"), name + "_count"), UNIT,
                     name)


def uniform_words(ops, words):
    """The transform of the draw kernel: Philox words ``(r0, r1, r2, r3)`` → their uniform values."""
    return tuple(uniform(ops, word, f"u{index}") for index, word in enumerate(words))


KERNEL = make_kernel("fill_rand", uniform_words)
