"""The per-token cast of a normalized row held in registers: the last stage of the fused
``rms_norm_per_token_cast`` and ``rms_norm_rope_per_token_cast`` kernels.

It reads ``y`` (rounded to x.dtype) from the thread's row chunks with the quant family's
scale macros (``quant.sf_math``) in the quant kernel's order of operations: amax on the
bits of ``|y|`` (NaN-propagating integer max), reduced over the ``group / VEC`` lanes of a
group with xor shuffles (a max: any order gives the same bits), ``group_inverse`` /
``group_scale``, ``q = saturate(float(y) · inv)`` (e4m3 by the hardware's saturating
conversion, e2m1 by ``sf_math.e2m1_pair``). A group never leaves a row's lanes: a vector of
a row is ``VEC`` consecutive columns, ``VEC`` divides the group, and a group's vectors sit in
adjacent lanes of one chunk (``rows``' layout) — or, where a chunk's lanes span fewer columns
than a group (the fused QK kernel's tile of few lanes), in consecutive whole chunks of every
lane, whose amax is merged in registers before the shuffles (:func:`group_layout`). A partial
last group's amax covers its valid columns only. Row ``n`` of token ``t`` is columns ``n·D …``
of the quantized ``[T, N·D]`` row (``heads`` None: a 2-D input, the row itself).

No ``from __future__ import annotations``: TileLang evaluates the macro annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.norm.rows import packed_words
from tileplug.backend_cuda.quant import sf_math
from tileplug.core.quant.formats import QUANT_FORMATS

SF_DTYPES = {"fp32": "float32", "e4m3": "float8_e4m3fn", "ue8m0": "uint8"}


def group_layout(group: int, lanes: int, vec: int, chunks: int) -> tuple[list[list[int]], list[int]]:
    """(the chunk lists of a thread's groups, the xor distances of the lanes' shuffles) for groups
    of ``group`` columns on a row tile of ``lanes`` lanes of ``chunks`` vectors of ``vec``: a group
    of at most ``lanes · vec`` columns is ``group / vec`` adjacent lanes of one chunk (each chunk
    its own group list, shuffled over those lanes); a wider one is ``group / (lanes · vec)``
    consecutive chunks of every lane (shuffled over all ``lanes``)."""
    group_lanes = min(group // vec, lanes)  # lanes holding one group's values (fewer: the row is shorter)
    steps = [d for d in (16, 8, 4, 2, 1) if d < group_lanes]
    per_group = max(1, min(group // (lanes * vec), chunks))
    groups = [list(range(first, min(first + per_group, chunks))) for first in range(0, chunks, per_group)]
    return groups, steps


class RowCast:
    """Constants, buffer types and the ``cast`` macro of one cast configuration ``quant`` (a
    norm spec's quant part) over ``rows`` (``norm.rows.RowMacros``) of ``width`` values of
    ``in_dtype`` in vectors of ``vec``; ``vectorize``: 128-bit stores of ``q``."""

    def __init__(self, quant, rows, in_dtype: str, vec: int, width: int, heads, vectorize: bool) -> None:
        self.e2m1 = quant.fmt == "e2m1"
        self.values_per_byte = 2 if self.e2m1 else 1
        self.q_dtype = "int8" if self.e2m1 else "float8_e4m3fn"
        self.sf_dtype = SF_STORED = SF_DTYPES[quant.sf_kind]
        self.packed, self.sf_col_major = quant.sf_kind == "ue8m0", quant.sf_col_major
        self.chunks = rows.CHUNKS
        VEC, D, HEADS, VPB, E2M1 = vec, width, heads, self.values_per_byte, self.e2m1
        IN = in_dtype
        FMAX = QUANT_FORMATS[quant.fmt].max_value
        FRCP = sf_math.f32(1.0 / FMAX)
        CMIN_BITS = sf_math.f32_bits(quant.clamp_min)
        ROUND = quant.round_sf
        E4M3_SF = quant.sf_kind == "e4m3"
        PACKED = quant.sf_kind == "ue8m0"
        SF_COL = quant.sf_col_major
        GROUP = quant.group
        LANES_PER_GROUP = GROUP // VEC
        GROUPS, GROUP_STEPS = group_layout(GROUP, rows.LANES, VEC, rows.CHUNKS)  # (unrolled while tracing)
        VALUE_INDICES = list(range(VEC))

        def amax_key(yv, i, inside):
            """int32 amax key of output value ``i`` (the bits of |y|; 0 past D)."""
            key = sf_math.bf16_abs_bits(yv[i]) if IN == "bfloat16" else sf_math.abs_bits(yv[i])
            return key if inside is True else T.if_then_else(inside, key, 0)

        def flat_column(n, col):
            """Column of the quantized row ``[N·D]`` of a head's column."""
            return col if HEADS is None else n * D + col

        @T.macro
        def store_scale(sf, t, gc, value):
            if not PACKED:
                sf[t, gc] = value
            else:
                sf_bytes = sf_math.packed_sf_bytes(sf, SF_COL)
                if SF_COL:
                    sf_bytes[gc // 4, t * 4 + gc % 4] = value
                else:
                    sf_bytes[t, gc] = value

        @T.macro
        def quantize(yv, q, t, n, lane, valid, inv, g, qv, k):
            """``q`` of the thread's vector ``k`` in group ``g``: ``saturate(float(y) · inv[g])``."""
            col = rows.column(k, lane)
            flat = flat_column(n, col)
            if E2M1:
                for j in T.unroll(VEC // 2):
                    qv[j] = sf_math.e2m1_pair(T.cast(yv[k * VEC + 2 * j], "float32") * inv[g],
                                              T.cast(yv[k * VEC + 2 * j + 1], "float32") * inv[g])
            else:
                for j in T.vectorized(VEC):
                    qv[j] = T.cast(T.cast(yv[k * VEC + j], "float32") * inv[g], "float8_e4m3fn")
            if vectorize:
                if valid and col < D:
                    for j in T.vectorized(VEC // VPB):
                        q[t, flat // VPB + j] = qv[j]
            else:
                for j in T.unroll(VEC // VPB):
                    if valid and col + j * VPB < D:
                        q[t, flat // VPB + j] = qv[j]

        PAIRED = IN == "bfloat16" and VEC % 2 == 0  # bf16 pairs: one packed 16-bit max for two values

        def pair_mask(k, j, lane):
            """The ``|y|`` bits of values ``j``, ``j + 1`` of vector ``k`` a packed max takes (0 past D)."""
            low, high = rows.in_row(k, j, lane), rows.in_row(k, j + 1, lane)
            if low is True and high is True:
                return T.uint32(0x7FFF7FFF)
            return T.if_then_else(low, T.uint32(0x7FFF), T.uint32(0)) | T.if_then_else(high, T.uint32(0x7FFF0000),
                                                                                     T.uint32(0))

        @T.macro
        def group_amax(yv, lane, amax, chunks):
            """``amax[chunks[0]]`` = the amax key of the group made of the thread's ``chunks`` (and
            the same chunks of the group's other lanes)."""
            g = chunks[0]
            if PAIRED:
                # bf16 words of two values: |y| bits of each half, maxed as unsigned 16-bit pairs
                # (``__vmaxu2``), then the larger half as the key: the same key as value by value
                words = packed_words(yv)
                halves = T.alloc_var("uint32")
                for k in chunks:
                    halves = T.uint32(0)
                    for j in VALUE_INDICES[::2]:
                        halves = T.call_extern("uint32", "__vmaxu2", halves,
                                               words[(k * VEC + j) // 2] & pair_mask(k, j, lane))
                    amax[k] = T.shift_left(T.cast(T.max(T.shift_right(halves, 16), halves & T.uint32(0xFFFF)),
                                                  "int32"), 16)
            else:
                for k in chunks:
                    amax[k] = 0
                    for j in VALUE_INDICES:
                        amax[k] = T.max(amax[k], amax_key(yv, k * VEC + j, rows.in_row(k, j, lane)))
            for k in chunks[1:]:
                amax[g] = T.max(amax[g], amax[k])
            for d in GROUP_STEPS:
                amax[g] = T.max(amax[g], T.shfl_xor(amax[g], d))

        def inverse(amax_bits):
            """The fp32 factor of a group of amax key ``amax_bits`` (``sf_math.group_inverse``)."""
            return sf_math.group_inverse(amax_bits, CMIN_BITS, FMAX, FRCP, ROUND, E4M3_SF)

        @T.macro
        def cast(yv, q, sf, t, n, lane, valid, amax, inv, qv, kept=True):
            """Scales and quantized bytes of the thread's values ``yv`` of row ``n`` of token ``t``
            (``amax`` / ``inv``: ``chunks`` registers each, ``qv``: one vector of ``q``); where
            ``kept`` is false (a padding row of the SwiGLU cast) the row's scales are stored as 0."""
            for chunks in GROUPS:
                g = chunks[0]  # the group's first chunk holds its amax, inverse and scale
                group_amax(yv, lane, amax, chunks)
                inv[g] = inverse(amax[g])
                col = rows.column(g, lane)
                flat = flat_column(n, col)
                if valid and col < D and lane % LANES_PER_GROUP == 0:
                    scale = sf_math.group_scale(amax[g], CMIN_BITS, FMAX, FRCP, ROUND, E4M3_SF, PACKED)
                    if kept is True:
                        store_scale(sf, t, flat // GROUP, scale)
                    else:
                        store_scale(sf, t, flat // GROUP, T.if_then_else(kept, scale, T.cast(0, SF_STORED)))
                for k in chunks:
                    quantize(yv, q, t, n, lane, valid, inv, g, qv, k)

        self.cast = cast
        self.groups = GROUPS
        self.group_amax = group_amax
        self.inverse = inverse

    def sf_type(self):
        """The ``sf`` buffer: any strides, or packed UE8M0 integers as core allocated them
        (``sf_math.packed_sf_type``: written byte by byte, the unit stride a constant)."""
        if self.packed:
            return sf_math.packed_sf_type(self.sf_col_major)
        return T.StridedTensor((T.dynamic("OR"), T.dynamic("OC")), (T.dynamic("OS0"), T.dynamic("OS1")),
                               self.sf_dtype)
