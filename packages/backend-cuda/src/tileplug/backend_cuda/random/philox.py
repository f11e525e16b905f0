"""Philox4x32-10 in TileLang integer arithmetic, and the advance of a generator's offset at the
end of a draw: what ``fill_rand`` and ``fill_randn`` share (SPEC §9).

Thread ``i`` of the grid owns the Philox blocks ``b = i · B … i · B + B − 1`` (``B``: the
spec's ``blocks_per_thread``) and so the values ``4b … 4b + 3`` of each: its run of
consecutive values, written with 128-bit stores where the whole run lies inside the draw.
A block's counter is ``(b mod 2^32, b >> 32, offset mod 2^32, offset >> 32)`` and the key
``(seed mod 2^32, seed >> 32)``, both read from the device tensors (nothing on the host, so
a captured graph draws with the offset of the moment it replays). A round multiplies two
counter words by the round constants as 32 × 32 → 64-bit products (one ``mul.wide.u32`` each,
or ``__umulhi`` and a 32-bit product: the same words, a kernel's choice by measurement) and
mixes the halves with the key; the key gains the Weyl constants between rounds.

The draw's own kernel advances the offset once every CTA has read it
(:func:`read_the_offset_and_count_the_cta`): each CTA's thread 0 reads the offset into shared
memory and counts the CTA on the generator's arrival counter (``arrivals``, int32 ``[1]``, 0
between draws; ``random.arrivals``); the CTA whose count is the last adds 1 to the offset and sets
the counter back to 0 (:func:`advance_if_the_last_cta`), later in its own work. A CTA scheduled
late thus still reads the offset of the draw, and a draw is one launch (it was two: the draw, then
a one-thread kernel adding 1).

No ``from __future__ import annotations``: TileLang evaluates the macro annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.random.spec import THREADS, RandomKernelSpec

MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
"""The round multipliers of counter words 0 and 2 (Random123's Philox4x32 constants)."""
WEYL_CONSTANTS = (0x9E3779B9, 0xBB67AE85)
"""What each key word gains between two rounds (mod 2^32)."""
ROUNDS = 10
DEVICE_HELPERS = """
#ifndef TILEPLUG_RANDOM_HELPERS
#define TILEPLUG_RANDOM_HELPERS
__device__ __forceinline__ unsigned long long tileplug_mul_wide_u32(unsigned word, unsigned multiplier) {
  unsigned long long product;
  asm("mul.wide.u32 %0, %1, %2;" : "=l"(product) : "r"(word), "r"(multiplier));
  return product;
}
__device__ __forceinline__ float tileplug_rsqrt_approx_ftz(float x) {
  float root;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(root) : "f"(x));
  return root;
}
#endif
"""
"""The prelude (``T.Kernel(prelude=...)``) of the kernels whose Philox rounds take the wide product:
the 32 × 32 → 64-bit product as one ``mul.wide.u32`` (``philox_block(..., wide=True)``; written as
``__umulhi`` and a 32-bit product, ptxas issued two multiplies a word: 544 → 504 SASS instructions
for ``fill_randn``'s 8 fp32 values a thread), and the MUFU reciprocal square root without CUDA's
subnormal fix-up (``fill_randn``: its argument is never subnormal). Which kernels take the wide
product was measured: ``spec.RandomKernelSpec.wide_product``, ``quant.element_kernels.build_stochastic``."""
WORD_BITS = 32


def low_word(value):
    """The low 32 bits of a 64-bit integer expression, as uint32."""
    return T.cast(value, "uint32")


def wide_product(word, multiplier: int):
    """The 64-bit product of uint32 ``word`` and the constant ``multiplier`` (one ``mul.wide.u32``:
    the kernel's prelude is :data:`DEVICE_HELPERS`)."""
    return T.call_extern("uint64", "tileplug_mul_wide_u32", word, T.uint32(multiplier))


def high_word(value):
    """The high 32 bits of a 64-bit integer expression, as uint32."""
    return T.cast(T.shift_right(T.cast(value, "uint64"), WORD_BITS), "uint32")


def multiply_high(word, multiplier: int):
    """The high 32 bits of the 64-bit product of uint32 ``word`` and the constant ``multiplier``
    (``__umulhi``; with the low half's 32-bit product: the split form of a round's product)."""
    return T.call_extern("uint32", "__umulhi", word, T.uint32(multiplier))


@T.macro
def philox_block(seed, offset, block, words, wide: bool = True):
    """``words[0..3]`` (uint32 locals) = Philox4x32-10 of counter ``(block, offset)`` under key
    ``seed`` (``seed`` / ``offset``: the int64 values read from the generator's tensors,
    ``block``: the block's 64-bit index); ``wide``: each product as one ``mul.wide.u32`` (the
    kernel's prelude is :data:`DEVICE_HELPERS`), else ``__umulhi`` and a 32-bit product (the same
    words)."""
    key = T.alloc_local((2,), "uint32")
    high = T.alloc_local((2,), "uint32")
    low = T.alloc_local((2,), "uint32")
    product = T.alloc_local((2,), "uint64") if wide else None
    key[0] = low_word(seed)
    key[1] = high_word(seed)
    words[0] = low_word(block)
    words[1] = high_word(block)
    words[2] = low_word(offset)
    words[3] = high_word(offset)
    for index in T.unroll(ROUNDS):
        if index > 0:
            key[0] = key[0] + T.uint32(WEYL_CONSTANTS[0])
            key[1] = key[1] + T.uint32(WEYL_CONSTANTS[1])
        if wide:
            product[0] = wide_product(words[0], MULTIPLIERS[0])
            product[1] = wide_product(words[2], MULTIPLIERS[1])
            high[0] = high_word(product[0])
            high[1] = high_word(product[1])
            low[0] = low_word(product[0])
            low[1] = low_word(product[1])
        else:
            high[0] = multiply_high(words[0], MULTIPLIERS[0])
            high[1] = multiply_high(words[2], MULTIPLIERS[1])
            low[0] = words[0] * T.uint32(MULTIPLIERS[0])
            low[1] = words[2] * T.uint32(MULTIPLIERS[1])
        words[0] = high[1] ^ words[1] ^ key[0]
        words[2] = high[0] ^ words[3] ^ key[1]
        words[1] = low[1]
        words[3] = low[0]


class RunLayout:
    """The thread's run of values (``blocks_per_thread`` blocks of 4, or ``run`` values), its
    stores and (for an op reading a tensor element by element, as ``stochastic_cast``) its loads.
    ``spec``: a spec with ``blocks_per_thread``, ``dtype`` (what is stored) and ``vectorize``."""

    def __init__(self, spec: RandomKernelSpec, count, run: int | None = None) -> None:
        self.BLOCKS = spec.blocks_per_thread
        self.RUN = run or 4 * self.BLOCKS
        self.THREADS = THREADS
        RUN, DTYPE, VECTORIZE = self.RUN, spec.dtype, spec.vectorize

        @T.macro
        def store_run(values, first, run):
            """``values[first … first + RUN)`` = ``run`` (fp32), rounded once to the values' dtype;
            only the elements inside the draw are written."""
            if VECTORIZE:
                if first + RUN <= count:
                    for j in T.vectorized(RUN):
                        values[first + j] = T.cast(run[j], DTYPE)
                else:
                    for j in T.unroll(RUN):
                        if first + j < count:
                            values[first + j] = T.cast(run[j], DTYPE)
            else:
                for j in T.unroll(RUN):
                    if first + j < count:
                        values[first + j] = T.cast(run[j], DTYPE)

        @T.macro
        def load_run(source, first, run):
            """``run[j] = source[first + j]`` (the run's local dtype) for the elements inside the
            draw, 128-bit loads where the whole run lies inside it; the others are left as they are."""
            if VECTORIZE:
                if first + RUN <= count:
                    for j in T.vectorized(RUN):
                        run[j] = source[first + j]
                else:
                    for j in T.unroll(RUN):
                        if first + j < count:
                            run[j] = source[first + j]
            else:
                for j in T.unroll(RUN):
                    if first + j < count:
                        run[j] = source[first + j]

        self.store_run = store_run
        self.load_run = load_run

    def grid(self, count):
        return T.ceildiv(count, self.RUN * self.THREADS)


def state_buffers():
    """``seed`` and ``offset``: int64 ``[1]``."""
    return T.Tensor((1,), "int64"), T.Tensor((1,), "int64")


def arrivals_buffer():
    """``arrivals``: int32 ``[1]``, how many CTAs of the running draw are done with the offset."""
    return T.Tensor((1,), "int32")


@T.macro
def read_the_offset_and_count_the_cta(offset, arrivals, thread):
    """``(drawn_offset, arrived)``, int64 and int32 locals ``[1]``: thread 0 reads the offset into
    shared memory, the CTA's threads take it from there into ``drawn_offset[0]`` after the barrier,
    and thread 0 then counts the CTA on ``arrivals`` (relaxed, the count before it into
    ``arrived[0]``): from here the CTA is done with the offset's tensor. A kernel calls it after
    issuing its loads (the read and the barrier wait behind them) and reads the count later, in
    :func:`advance_if_the_last_cta`, so the atomic's round trip overlaps the CTA's work. The add is
    relaxed: what has to come before the last CTA's write is every CTA's *load* of the offset, and
    thread 0's has returned before its CTA counts itself (its value fed the shared store before the
    barrier); an acquire-release add made every CTA drain its stores first (MEMBAR.ALL.GPU,
    CCTL.IVALL)."""
    drawn_offset = T.alloc_local((1,), "int64")
    arrived = T.alloc_local((1,), "int32")
    held = T.alloc_shared((1,), "int64")
    if thread == 0:
        held[0] = offset[0]
    T.sync_threads()
    drawn_offset[0] = held[0]
    if thread == 0:
        arrived[0] = T.atomic_add(arrivals[0], 1, return_prev=True, memory_order="relaxed")
    return drawn_offset, arrived


@T.macro
def advance_if_the_last_cta(offset, arrivals, thread, arrived, ctas):
    """After :func:`read_the_offset_and_count_the_cta`: the CTA whose count made ``ctas`` (every CTA
    has read the offset) adds 1 to it and sets the count back to 0. It may come anywhere after the
    count (the CTA's own draws use ``drawn_offset``, not the tensor). The quant tiles call it before
    their draws, not after their last store: code after the last store cost the e2m1 1 × 16
    stochastic tile 25 registers (nvcc 13.0, sm_90, the count at the CTA's start: 150 against 125
    with the split product; 164 with the wide one, 3 CTAs of 128 threads an SM instead of 4; 120
    with the count behind the loads and the advance before the draws)."""
    if thread == 0:
        if arrived[0] == ctas - 1:
            offset[0] = offset[0] + T.int64(1)
            arrivals[0] = 0


def build_draw(spec: RandomKernelSpec, transform):
    """The ``T.prim_func`` of a draw: buffers ``(values [N], seed [1], offset [1], arrivals [1])``.
    Each thread computes its blocks' words and hands each block to ``transform(words, run, k)`` (a
    macro writing fp32 values ``run[4k … 4k + 3]`` from the block's four uint32 ``words``), then
    stores its run; the last CTA advances the offset."""
    N = T.dynamic("N", "int64")
    layout = RunLayout(spec, N)
    BLOCKS, RUN, THREADS = layout.BLOCKS, layout.RUN, layout.THREADS
    WIDE = spec.wide_product
    seed_t, offset_t = state_buffers()

    @T.prim_func
    def kernel(values: T.Tensor((N,), spec.dtype), seed: seed_t, offset: offset_t, arrivals: arrivals_buffer()):
        with T.Kernel(layout.grid(N), threads=THREADS, prelude=DEVICE_HELPERS) as bx:
            tx = T.get_thread_binding()
            words = T.alloc_local((4,), "uint32")
            run = T.alloc_local((RUN,), "float32")
            thread = T.cast(bx, "int64") * THREADS + tx
            drawn_offset, arrived = read_the_offset_and_count_the_cta(offset, arrivals, tx)
            for k in T.unroll(BLOCKS):
                philox_block(seed[0], drawn_offset[0], thread * BLOCKS + k, words, WIDE)
                transform(words, run, k)
            layout.store_run(values, thread * RUN, run)
            advance_if_the_last_cta(offset, arrivals, tx, arrived, T.cast(layout.grid(N), "int32"))

    return kernel.with_attr("global_symbol", spec.name)
