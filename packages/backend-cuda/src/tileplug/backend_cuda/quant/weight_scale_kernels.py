"""The TileLang kernel of the CUDA ``transpose_weight_sf`` (``transpose_weight_sf``: the kernel
object and its specialisation).

One launch lays out one scale tensor ``S [G, R, C]`` (fp32, contiguous) of ``bs × bs`` weight
blocks into both outputs, taken as the op returns them (no view made on the host) and written in
their memory order: ``sf0 [G, P0, N]`` and ``sf1 [G, P1, K]`` of int32 (N = R·bs, K = C·bs,
P0 = ceil(C/4), P1 = ceil(R/4)); docs/spec.md §11 has the layouts.
``sf0[g, p, n]`` packs the UE8M0 bytes of
``S[g, n / bs, 4p … 4p + 3]`` (byte ``i`` of the integer: column ``4p + i``, 0 past ``C``),
``sf1[g, p, k]`` those of ``S[g, 4p … 4p + 3, k / bs]`` (0 past ``R``).

A CTA writes ``THREADS · 4`` consecutive integers of one output row, each thread four (one
128-bit store): rows of sf0 first, then those of sf1. ``bs`` is a multiple of 16, so the four
share one weight block row (sf0) or column (sf1) and one packed value, read from four scales (a
gather the L1 serves: the scales are ``bs²`` times smaller than the weights). The outputs
dominate the bytes: ``N·P0 + K·P1`` integers against ``R·C`` scales.

The byte of a scale is ``sf_math.ue8m0_byte``, from the scale's fp32 bit pattern.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.quant.sf_math import ue8m0_byte

THREADS = 256
INTS_PER_STORE = 4
"""int32 of one 128-bit store."""
INTS_PER_THREAD = 4
"""Integers a thread writes (one packed value; a weight block's N or K extent, bs ≥ 16, holds
them). H200, bs 128, scales [512, 56] (a 65536 × 7168 weight), CUDA graph: 4 per thread wrote
the 7.3 MB in 8.25 µs, 16 per thread (four 128-bit stores) in 8.12 µs, but 1.94 µs against
1.46 at T = 128: 4 kept."""
PACK = 4
"""UE8M0 bytes per int32 (the CUDA layout's pack factor)."""
def build(spec):
    """The ``T.prim_func`` of a ``transpose_weight_sf.WeightScaleSpec``: buffers ``(scales, sf0,
    sf1)`` exactly as the op hands them out, so the host makes no view: ``scales [G, R, C]``
    (``[R, C]`` without ``spec.groups``) fp32 contiguous, ``sf0 [G, N, P0]`` strides
    ``(N·P0, 1, N)`` and ``sf1 [G, K, P1]`` strides ``(K·P1, 1, K)`` (``[G, P1, K]``, strides
    ``(K·P1, K, 1)``, with ``spec.transpose_sf1``), int32; without groups the leading dimension
    is absent. ``G``, ``R``, ``C`` dynamic. ``blockIdx.x`` is a row of the outputs' memory order
    (``G·P0`` of sf0, then ``G·P1`` of sf1), ``blockIdx.y`` a chunk of ``THREADS · 4`` integers
    along it."""
    BS = spec.block_size
    GROUPS = spec.groups
    SPAN = THREADS * INTS_PER_THREAD  # integers of one CTA along a row
    G = T.dynamic("G") if GROUPS else 1
    R, C = T.dynamic("R"), T.dynamic("C")
    P0, P1 = T.ceildiv(C, PACK), T.ceildiv(R, PACK)
    N, K = R * BS, C * BS
    lead = (G,) if GROUPS else ()
    scales_t = T.Tensor((*lead, R, C), "float32")
    sf0_t = T.StridedTensor((*lead, N, P0), ((N * P0,) if GROUPS else ()) + (1, N), "int32")
    if spec.transpose_sf1:
        sf1_t = T.StridedTensor((*lead, P1, K), ((K * P1,) if GROUPS else ()) + (K, 1), "int32")
    else:
        sf1_t = T.StridedTensor((*lead, K, P1), ((K * P1,) if GROUPS else ()) + (1, K), "int32")

    def scale_at(scales, group, row, col):
        return scales[group, row, col] if GROUPS else scales[row, col]

    def sf0_at(sf0, group, plane, n):
        """Element (plane, n) of group ``group`` of sf0's memory order [G, P0, N]."""
        return (group, n, plane) if GROUPS else (n, plane)

    def sf1_at(sf1, group, plane, k):
        """Element (plane, k) of group ``group`` of sf1's memory order [G, P1, K]."""
        index = (plane, k) if spec.transpose_sf1 else (k, plane)
        return (group, *index) if GROUPS else index

    @T.macro
    def store(out, at, group, plane, first, value):
        packed = T.alloc_local((INTS_PER_STORE,), "int32")
        for j in T.unroll(INTS_PER_STORE):
            packed[j] = T.reinterpret(value, "int32")
        for store_index in T.unroll(INTS_PER_THREAD // INTS_PER_STORE):
            for j in T.vectorized(INTS_PER_STORE):
                out[at(out, group, plane, first + store_index * INTS_PER_STORE + j)] = packed[j]

    @T.prim_func
    def kernel(scales: scales_t, sf0: sf0_t, sf1: sf1_t):
        with T.Kernel(G * (P0 + P1), T.ceildiv(T.max(R, C) * BS, SPAN), threads=THREADS) as (bx, by):
            tx = T.get_thread_binding()
            value = T.alloc_var("uint32")
            group = T.alloc_var("int32")
            plane = T.alloc_var("int32")
            first = by * SPAN + tx * INTS_PER_THREAD  # the thread's first integer of the row
            value = T.uint32(0)
            if bx < G * P0:
                # sf0 row (group, plane): weight rows n = first ..., block row n / bs, block columns 4·plane + i
                group = T.truncdiv(bx, P0)
                plane = bx - group * P0
                if first < N:
                    for i in T.unroll(PACK):
                        if plane * PACK + i < C:
                            value = value | T.shift_left(
                                ue8m0_byte(scale_at(scales, group, T.truncdiv(first, BS), plane * PACK + i)),
                                T.uint32(8 * i))
                    store(sf0, sf0_at, group, plane, first, value)
            else:
                # sf1 row (group, plane): weight columns k = first ..., block column k / bs, block rows 4·plane + i
                group = T.truncdiv(bx - G * P0, P1)
                plane = bx - G * P0 - group * P1
                if first < K:
                    for i in T.unroll(PACK):
                        if plane * PACK + i < R:
                            value = value | T.shift_left(
                                ue8m0_byte(scale_at(scales, group, plane * PACK + i, T.truncdiv(first, BS))),
                                T.uint32(8 * i))
                    store(sf1, sf1_at, group, plane, first, value)

    return kernel.with_attr("global_symbol", spec.name)
