"""The one TileLang Ascend-dialect kernel behind every quant op: a pipelined loop over tiles.

No ``from __future__ import annotations`` here: TileLang resolves prim_func parameter
annotations against module globals, and postponed annotations break closure-local shapes.

Structure (per vector core ``cid`` of ``T.Kernel(C)``; ``T`` rows are a dynamic symbol):

one loop (:func:`row_loop`: ``T.Pipelined``, cross-stage buffers annotated with 2 versions) over
the items ``cid, cid + C, ...`` of the (row tile, column tile) pairs; its body branches on the
tile kind: a full ``W`` columns wide, or the last, narrower column tile of a row tile when ``W``
does not divide H (a second pipelined loop over the same buffers loses the version rotation).

Per tile: DMA GM->UB of the valid rows only (never a neighbour row), an optional SIMT region
that decodes a quantized input / given UE8M0 scales into fp32 UB rows, one SIMD region (group
amax, scale math, quantize or dequantize, whole 64-lane registers), an optional SIMT region that
packs e2m1 nibbles and UE8M0 bytes, and DMA UB->GM.

Fake quant (``spec.fake_quant``, ``per_token_cast_and_cast_back``): the compute region quantizes
each register with its group's inverse scale and dequantizes the code it gets (``float(q) · sf``,
the scale kept in a register, one rounding to x's dtype) into ``o_ub``, which is DMA'd back over
the tile of x; the kernel's one GM tensor is x, no q / sf is stored and there is no SIMT region.

Numerics follow SPEC §1-2 and docs/numerics.md: amax is taken on the integer bits of ``|x|``
(for non-negative floats integer order is float order, and NaN bits exceed +inf), so NaN and
inf propagate into the group scale whatever the float max unit does with NaN; the clamp is
an integer max too. Plain scales are two correctly rounded divisions; power-of-two scales are
built from exponent bits (a non-finite scale gets e = 128: byte 0xFF, sf = +inf, inv = 0).
The e4m3 clamp to +-448 is a compare-and-select (NaN stays NaN), then a saturating RNE
convert; e2m1 codes are built arithmetically (the convert unit has no f32->fp4).

Lossless re-blocking (``spec.lossless``, ``per_block_cast_lossless``, docs/spec.md §11): the
re-quantization of an e2m1 ``(xq, sf)`` input above, with each element keyed by its input scale
in ``s_ub`` (the UE8M0 byte ``E(s) + 127``, 255 = not finite; :func:`~.sf_macros.sf_macros`'
``scale_keys``) instead of by ``|x|``: the same integer max over the group, then the group scale
``2^max(key - 127 - 6, -127)`` from the largest key (``sf_macros``' lossless ``scale_math``), and
``q = e4m3(d · (s · inv))`` as the re-quantization stores it. The keys read no data value.
With ``spec.compact_decode`` (where the plan above is over the UB budget) the SIMT region stores
``d`` as bf16 ``[R, W]`` (every e2m1 value is exact in bf16) and ``s`` once per input group of each
row ``[R, ceil(W / ibn)]``; the SIMD region widens ``d`` on load (``UNPK_B16`` + convert, exact) and
loads ``s`` broadcast (``BRC_B32``, one load per input group of the register, lane-masked selects),
so keys and products are those of the per-element buffers.

Stochastic rounding (``spec.stochastic``, docs/spec.md §10.2; the main casts only): the generator's
seed and offset words are DMA'd into UB once per core (read only: the kernel object queues the
offset's advance after the launch, on the same stream); per tile, one more ``T.SimdVF`` region (:func:`draw_bits`, before the
compute region) runs the Philox rounds of ``fill_rand`` for each valid row of the tile, in groups
of 64 blocks = 1024 elements from the block holding the tile's first element of the row. Element
``i = t·H + h`` takes an 8-bit field (core's ``QUANT_RANDOM_FIELD_BITS``, four a word): field
``i mod 4`` of word ``(i // 4) mod 4`` of block ``i // 16``, the first field at the word's top
(:func:`first_block_of`; a tile starts on a multiple of 64 columns and H is a multiple of 16, so
every row of a tile starts on a block). Each group's words are split into their fields in element
order (:func:`group_random_bits`, ``stochastic_cast``'s ``element_bits``) and stored as
``f << 16`` into ``bits_ub``: the row's whole groups, then of a last partial group only the
registers the row reaches (:func:`row_draw`), so a row of ``bits_ub`` is the tile width rounded
up to whole registers. The compute region then narrows each ``x·inv`` register with the bits of
the same columns (:func:`~.sf_macros.stochastic_store`, the integer rounding of
``stochastic_cast`` in its 24-bit fixed point: up when ``floor(p·2^24) + (f << 16) ≥ 2^24``, i.e.
``floor(p·2^8) + f ≥ 2^8``). The scales are computed exactly as without it. The block index is
uint32 arithmetic and counter word 1 (``b >> 32``) is 0, as in the draw kernels: exact while
``T·H < 2^36`` elements (2^32 blocks, a 128 GiB bf16 input); the GM offsets are int64.
"""

import itertools

import tilelang.ascend.language as T
from tvm import tirx

from tileplug.backend_ascend.device import check_budget
from tileplug.backend_ascend.quant.sf_macros import lane_mask, pack_macro, sf_macros, stochastic_store
from tileplug.backend_ascend.quant.stochastic_cast import WORD_BITS, element_bits
from tileplug.backend_ascend.random import philox
from tileplug.backend_ascend.random.draw import state_word
from tileplug.backend_ascend.random.vector_ops import VECTOR
from tileplug.backend_ascend.quant.spec import LANES, TileSpec, Tiling
from tileplug.core.contracts.cast import QUANT_RANDOM_FIELD_BITS
from tileplug.core.quant.sf_math import ceil_div

RANDOM_FIELDS_PER_WORD = WORD_BITS // QUANT_RANDOM_FIELD_BITS
"""Elements one Philox word serves in the stochastic casts: 4 (docs/spec.md §10.2: a
``QUANT_RANDOM_FIELD_BITS``-bit field each, the first at the word's top)."""
RANDOM_BLOCK_ELEMENTS = philox.WORDS_PER_BLOCK * RANDOM_FIELDS_PER_WORD
"""Elements one Philox block serves: 16 (element ``i = t·H + h`` is in block ``i // 16``)."""
RANDOM_GROUP_ELEMENTS = philox.BLOCKS_PER_GROUP * RANDOM_BLOCK_ELEMENTS
"""Elements one group of 64 Philox blocks (one block per lane) serves: 1024."""
RANDOM_GROUP_REGISTERS = RANDOM_GROUP_ELEMENTS // LANES
"""64-lane registers of one group's fields, in element order: 16."""


def _rest(items):
    """Indices 1.. of a Python list (a list, so that macros unroll it at trace time)."""
    return list(range(1, len(items)))


def _subgroups(lanes: int, bn: int):
    return [(lo, min(lo + bn, lanes)) for lo in range(0, lanes, bn)]


def first_block_of(row, column, hidden: int):
    """The Philox block whose first field is element ``(row, column)`` of the ``[T, hidden]``
    values (``column`` and ``hidden`` multiples of 16, so that every row starts on a block):
    ``(row·hidden + column) / 16``."""
    assert hidden % RANDOM_BLOCK_ELEMENTS == 0, f"H = {hidden}: rows must start on a Philox block"
    return row * (hidden // RANDOM_BLOCK_ELEMENTS) + column // RANDOM_BLOCK_ELEMENTS


def group_random_bits(ops, multipliers, key, offset, first_block, registers: int = RANDOM_GROUP_REGISTERS) -> tuple:
    """The random bits of the first ``64·registers`` of the 1024 elements of Philox blocks
    ``first_block .. + 63`` under ``key`` / ``offset`` (register pairs), in element order:
    ``registers`` ``uint32`` registers of 64 consecutive elements (at most 16). Element ``e`` of the
    group takes field ``e mod 4`` of the group's word ``e // 4`` (word ``j`` is word ``j mod 4`` of
    block ``first_block + j // 4``), its 8 bits ``f`` as ``f << 16``, the rounding's 24-bit fixed
    point (:func:`~.stochastic_cast.element_bits`, which splits only the word registers the taken
    field registers come from: four field registers each). Plain
    Python over ``ops``, as :mod:`~tileplug.backend_ascend.random.philox`."""
    words = philox.block_words(ops, multipliers, first_block, key, offset)
    return tuple(itertools.islice(element_bits(ops, words, QUANT_RANDOM_FIELD_BITS), registers))


def row_draw(width: int) -> tuple[int, int]:
    """How the draw covers one row of a tile ``width`` columns wide: ``(whole_groups,
    last_registers)``, ``whole_groups`` groups of 1024 elements stored whole, then (when 1024 does
    not divide ``width``) one more group of which only the first ``last_registers`` registers are
    stored. A row's bits so end at ``width`` rounded up to whole registers: ``bits_ub``'s row
    (:meth:`~.spec.TileSpec.plan`)."""
    return width // RANDOM_GROUP_ELEMENTS, ceil_div(width % RANDOM_GROUP_ELEMENTS, LANES)


def row_loop(extent, num_stages: int, versions: dict):
    """The kernel's loop over its (row tile, column tile) items, as a ``for`` iterator: every
    cross-stage UB buffer in ``versions`` (buffer -> versions) is annotated, then the loop is
    ``T.Pipelined`` over ``num_stages`` stages (TileLang inserts the MTE2/V/MTE3 syncs and the
    version rotation). Looked up by :func:`build` at trace time; tests/ascend_bad_kernels.py
    swaps it for a serial loop to show the pipelining check failing."""
    T.annotate_buffer_versions(versions)
    return T.Pipelined(extent, num_stages=num_stages)


def tile_compute(spec: TileSpec, width: int, simd_tile):
    """The compute step of one tile ``width`` columns wide: a macro that runs ``simd_tile``
    (group amax, scale math, quantize or dequantize on whole registers) in one ``T.SimdVF``
    region. ``bits_ub`` (stochastic rounding only, else not passed) holds the tile's random bits.
    Looked up by :func:`build` at trace time; tests/ascend_bad_kernels.py swaps it for
    per-element scalar code to show the vector check failing."""

    @T.macro
    def compute(x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, sf_ub, e_ub, gsf_ub, ginv_ub, nv, bits_ub=None):
        with T.SimdVF():
            simd_tile(x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, sf_ub, e_ub, gsf_ub, ginv_ub, nv, bits_ub)

    return compute


def build(spec: TileSpec, tiling: Tiling):
    """The prim_func of ``spec`` tiled by ``tiling``; raises :class:`UBBudgetError` when the
    tiling's UB plan does not fit the budget (TileLang would lower it silently)."""
    check_budget(tiling.footprint, tiling.budget, spec.describe())
    H = spec.hidden
    bm, bn = spec.block
    R = spec.rows
    C = spec.vector_cores
    W = tiling.width
    NCF, WT = tiling.full, tiling.tail
    plan = tiling.plan
    fmt = spec.fmt
    is_cast_back = spec.is_cast_back
    qin, given = spec.qin, spec.given
    in_bf16 = spec.in_dtype == "bfloat16"
    writes_q, writes_sf = spec.writes_q, spec.writes_sf
    precomputed = given is not None
    stochastic = spec.stochastic
    fake_quant = spec.fake_quant
    assert not stochastic or (writes_q and writes_sf and not precomputed and not is_cast_back), \
        "stochastic rounding is a mode of the main casts"
    assert not fake_quant or (R == 1 and qin is None and not precomputed), "fake quant is a mode of the per-token cast"
    lossless = spec.lossless
    assert not lossless or (qin is not None and writes_q and writes_sf and not precomputed and not stochastic), \
        "lossless re-blocking is a mode of the re-quantization of (xq, sf) inputs"
    f32 = T.float32

    Tn = T.dynamic("T")
    S = T.dynamic("S")
    nrb = T.ceildiv(Tn, R)

    # ---------------------------------------------------------------- GM tensors
    x_cols = H // 2 if (qin is not None and qin[0] == "e2m1") else H
    x_dtype = spec.in_dtype
    q_dtype = "float8_e4m3fn" if fmt == "e4m3" else "int8"
    q_cols = H if fmt == "e4m3" else H // 2

    def sf_storage(skind, cm, block, packed_axis_tokens):
        rows, cols = T.ceildiv(Tn, block[0]), ceil_div(H, block[1])
        if skind == "ue8m0":
            if packed_axis_tokens:
                rows = T.ceildiv(rows, 2)
            else:
                cols = ceil_div(cols, 2)
        dtype = "int16" if skind == "ue8m0" else "float32"
        return ((cols, rows) if cm else (rows, cols)), dtype

    XS_shape = XS_dtype = GS_shape = GS_dtype = SF_shape = SF_dtype = None
    if qin is not None:
        XS_shape, XS_dtype = sf_storage(qin[3], qin[4], (qin[1], qin[2]), qin[2] == 1)
    if given is not None:
        GS_shape, GS_dtype = sf_storage(given[0], given[1], (bm, bn), bn == 1)
    if writes_sf:
        SF_shape, SF_dtype = sf_storage("ue8m0" if spec.packed else "fp32", spec.col_major, (bm, bn), bn == 1)
    SXS, SGS, SSF = T.dynamic("SXS"), T.dynamic("SGS"), T.dynamic("SSF")

    # ---------------------------------------------------------------- SIMD helpers
    compact = spec.compact_decode
    assert not compact or (lossless and qin[0] == "e2m1" and qin[2] > 1), \
        "the compact decode is a mode of lossless e2m1 inputs with 1 x ibn (ibn > 1) input groups"
    scale_groups = _subgroups(LANES, qin[2]) if compact else []  # (lo, hi) lanes of each input group

    @T.macro
    def decoded(d_ub, r, off):
        # the decoded input values of a register as fp32 (compact: bf16 in UB, widened exactly)
        if compact:
            return T.simd.vcvt(T.simd.vld(d_ub[r, off], dist="UNPK_B16"), "float32", part=0)
        else:
            return T.simd.vld(d_ub[r, off])

    @T.macro
    def input_scales(s_ub, r, off):
        # the input scale of each lane of a register (compact: one per input group of ibn columns,
        # broadcast onto its lanes; off is a multiple of 64 and of ibn)
        if compact:
            ibn = qin[2]
            s = T.simd.alloc_var("float32")
            s = T.simd.vld(s_ub[r, off // ibn], dist="BRC_B32")
            for k in _rest(scale_groups):
                s = T.simd.vsel(T.simd.vld(s_ub[r, off // ibn + k], dist="BRC_B32"), s, lane_mask(*scale_groups[k]))
            return s
        else:
            return T.simd.vld(s_ub[r, off])

    @T.macro
    def load_x(x_ub, d_ub, s_ub, r, off):
        if qin is not None:
            return T.simd.vmul(decoded(d_ub, r, off), input_scales(s_ub, r, off))
        elif in_bf16:
            return T.simd.vcvt(T.simd.vld(x_ub[r, off], dist="UNPK_B16"), "float32", part=0)
        else:
            return T.simd.vld(x_ub[r, off])

    cast_math = sf_macros(fmt, spec.round_sf, spec.clamp_min, spec.packed, writes_sf, lossless, e4m3_sf=spec.e4m3_sf)
    scale_math, group_inv = cast_math.scale_math, cast_math.group_inv
    store_rounded = stochastic_store(fmt) if stochastic else None

    @T.macro
    def abs_bits(x_ub, d_ub, s_ub, r, off, lanes):
        # what a group reduces with an integer max: the bits of |x|, or (lossless) the input scales' keys
        if lossless:
            return cast_math.scale_keys(input_scales(s_ub, r, off), lanes)
        else:
            return cast_math.abs_bits(load_x(x_ub, d_ub, s_ub, r, off), lanes)

    @T.macro
    def store_out(o_ub, r, off, y):
        # fp32 values rounded once to the output dtype (nearest even, without saturation, as the
        # row kernels' stores: inf stays inf, as in the reference's .to(bfloat16); cast_back of a
        # group with an infinite scale saturated to the bf16 maximum before)
        if spec.out_dtype == "float32":
            T.simd.vsts(o_ub[r, off], y)
        else:
            T.simd.vsts(o_ub[r, off], T.simd.vcvt(y, "bfloat16", round="ROUND_R", sat=False, part=0),
                        dist="PK_B32")

    @T.macro
    def quant_store(x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, r, off, inv, bits_ub, sf=None):
        # (sf: the group scales of the register, fake quant only)
        if is_cast_back:
            store_out(o_ub, r, off, T.simd.vmul(T.simd.vld(d_ub[r, off]), T.simd.vld(s_ub[r, off])))
        elif fake_quant:
            store_out(o_ub, r, off, cast_math.dequantized(T.simd.vmul(load_x(x_ub, d_ub, s_ub, r, off), inv), sf))
        else:
            if qin is not None:
                y = T.simd.vmul(decoded(d_ub, r, off), T.simd.vmul(input_scales(s_ub, r, off), inv))
            else:
                y = T.simd.vmul(load_x(x_ub, d_ub, s_ub, r, off), inv)
            if stochastic:
                store_rounded(q_ub, code_ub, (r, off), y, bits_ub)
            else:
                cast_math.store_quantized(q_ub, code_ub, (r, off), y)

    # ---------------------------------------------------------------- one tile, static width w
    def make_tile(w):
        ng = ceil_div(w, bn) if not is_cast_back else 0
        nfull_groups = w // bn if bn >= LANES else 0
        group_tail = w - nfull_groups * bn if bn >= LANES else 0
        nchunks_full = w // LANES
        chunk_tail = w - nchunks_full * LANES
        wq = w if fmt == "e4m3" or is_cast_back or fake_quant else w // 2
        wx = w // 2 if (qin is not None and qin[0] == "e2m1") else w

        @T.macro
        def simd_one_group(x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, sf_ub, e_ub, ginv_ub, bits_ub, nv, off, gi, gw):
            chunks = [(k * LANES, min(LANES, gw - k * LANES)) for k in range(ceil_div(gw, LANES))]
            inv = T.simd.alloc_var("float32")
            scale = T.simd.alloc_var("float32") if fake_quant else None
            if precomputed:
                inv = T.simd.vld(ginv_ub[gi], dist="BRC_B32")
            else:
                acc = T.simd.alloc_var("int32")
                acc = T.simd.vdup(T.int32(0), "int32")
                if R == 1:
                    for k0, lanes in chunks:
                        acc = T.simd.vmax(acc, abs_bits(x_ub, d_ub, s_ub, 0, off + k0, lanes))
                else:
                    for r in T.serial(nv):
                        for k0, lanes in chunks:
                            acc = T.simd.vmax(acc, abs_bits(x_ub, d_ub, s_ub, r, off + k0, lanes))
                if fake_quant:
                    scale, inv = cast_math.group_scales(acc)
                else:
                    inv = group_inv(acc, sf_ub, e_ub, gi)
            if writes_q:
                if R == 1:
                    for k0, lanes in chunks:
                        quant_store(x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, 0, off + k0, inv, bits_ub, scale)
                else:
                    for r in T.serial(nv):
                        for k0, lanes in chunks:
                            quant_store(x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, r, off + k0, inv, bits_ub)

        @T.macro
        def simd_groups_wide(x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, sf_ub, e_ub, ginv_ub, bits_ub, nv):
            # bn in {64, 128}: a group is bn / 64 whole registers of each row
            for j in T.serial(nfull_groups):
                simd_one_group(x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, sf_ub, e_ub, ginv_ub, bits_ub, nv, j * bn, j,
                               bn)
            if group_tail > 0:
                simd_one_group(
                    x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, sf_ub, e_ub, ginv_ub, bits_ub, nv, nfull_groups * bn,
                    nfull_groups, group_tail,
                )

        @T.macro
        def simd_chunk(x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, sf_ub, e_ub, ginv_ub, bits_ub, nv, off, gbase, lanes):
            # one 64-lane register column: bn in {16, 32} (several groups), bn == 1 (a scale per
            # lane), or cast_back (no scales)
            inv = T.simd.alloc_var("float32")
            scale = T.simd.alloc_var("float32") if fake_quant else None
            if is_cast_back:
                inv = T.simd.vdup(f32(1.0), "float32")
            elif bn == 1:
                halves = [(0, bm), (bm, 2 * bm)] if spec.packed else [(0, bm)]
                for h, (lo, hi) in enumerate(halves):
                    acc = T.simd.alloc_var("int32")
                    acc = T.simd.vdup(T.int32(0), "int32")
                    for r in T.serial(T.min(nv, hi) - lo):
                        acc = T.simd.vmax(acc, abs_bits(x_ub, d_ub, s_ub, r + lo, off, lanes))
                    sf, inv_h, eb = scale_math(acc)
                    if spec.packed:
                        T.simd.vsts(e_ub[h, off], eb)
                    else:
                        T.simd.vsts(sf_ub[off], sf)
                    for r in T.serial(T.min(nv, hi) - lo):
                        quant_store(x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, r + lo, off, inv_h, bits_ub)
            else:
                subs = _subgroups(lanes, bn)
                if precomputed:
                    inv = T.simd.vld(ginv_ub[gbase], dist="BRC_B32")
                    for k in _rest(subs):
                        inv = T.simd.vsel(T.simd.vld(ginv_ub[gbase + k], dist="BRC_B32"), inv, lane_mask(*subs[k]))
                else:
                    acc = T.simd.alloc_var("int32")
                    acc = T.simd.vdup(T.int32(0), "int32")
                    if R == 1:
                        acc = abs_bits(x_ub, d_ub, s_ub, 0, off, lanes)
                    else:
                        for r in T.serial(nv):
                            acc = T.simd.vmax(acc, abs_bits(x_ub, d_ub, s_ub, r, off, lanes))
                    zero = T.simd.vdup(T.int32(0), "int32")
                    if fake_quant:  # each group's (sf, inv) on its lanes
                        scale, inv = cast_math.group_scales(T.simd.vsel(acc, zero, lane_mask(*subs[0])))
                        for k in _rest(subs):
                            scale_k, inv_k = cast_math.group_scales(T.simd.vsel(acc, zero, lane_mask(*subs[k])))
                            scale = T.simd.vsel(scale_k, scale, lane_mask(*subs[k]))
                            inv = T.simd.vsel(inv_k, inv, lane_mask(*subs[k]))
                    else:
                        inv = group_inv(T.simd.vsel(acc, zero, lane_mask(*subs[0])), sf_ub, e_ub, gbase)
                        for k in _rest(subs):
                            inv_k = group_inv(T.simd.vsel(acc, zero, lane_mask(*subs[k])), sf_ub, e_ub, gbase + k)
                            inv = T.simd.vsel(inv_k, inv, lane_mask(*subs[k]))
            if bn != 1 or is_cast_back:
                if writes_q:
                    if R == 1:
                        quant_store(x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, 0, off, inv, bits_ub, scale)
                    else:
                        for r in T.serial(nv):
                            quant_store(x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, r, off, inv, bits_ub)

        @T.macro
        def simd_tile(x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, sf_ub, e_ub, gsf_ub, ginv_ub, nv, bits_ub=None):
            if precomputed:
                for c in T.serial(ceil_div(ng, LANES)):
                    T.simd.vsts(
                        ginv_ub[c * LANES],
                        T.simd.vdiv(T.simd.vdup(f32(1.0), "float32"), T.simd.vld(gsf_ub[c * LANES]),
                                    precision="vdiv_0ulp_ftz_true"),
                    )
            if not is_cast_back and bn >= LANES:
                simd_groups_wide(x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, sf_ub, e_ub, ginv_ub, bits_ub, nv)
            else:
                per = LANES // bn if not is_cast_back and bn > 1 else 1
                for c in T.serial(nchunks_full):
                    simd_chunk(x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, sf_ub, e_ub, ginv_ub, bits_ub, nv, c * LANES,
                               c * per, LANES)
                if chunk_tail > 0:
                    simd_chunk(
                        x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, sf_ub, e_ub, ginv_ub, bits_ub, nv, nchunks_full * LANES,
                        nchunks_full * per, chunk_tail,
                    )

        def decode_sf_byte(b):
            bits = T.if_then_else(b == 255, T.int32(0x7FC00000), T.if_then_else(b == 0, T.int32(0x00400000), b << 23))
            return tirx.reinterpret("float32", bits)

        @T.macro
        def simt_prepare(x_ub, sfin_ub, d_ub, s_ub, graw_ub, gsf_ub, row0):
            with T.SimtVF(threads=128):
                if qin is not None:
                    qfmt, ibm, ibn, skind, _ = qin
                    for i in T.Parallel(R * w, coalesced_width=T.int32(1)):
                        r = i // w
                        k = i % w
                        if qfmt == "e4m3":
                            d_ub[r, k] = T.Cast("float32", x_ub[r, k])
                        else:
                            byte = T.Cast("int32", x_ub[r, k // 2]) & 0xFF
                            code = (byte >> ((k % 2) * 4)) & 0xF
                            mag = code & 7
                            val = T.if_then_else(
                                mag < 4,
                                T.Cast("float32", mag) * f32(0.5),
                                T.if_then_else(mag < 6, T.Cast("float32", mag - 2), T.Cast("float32", (mag - 4) * 2)),
                            )
                            if compact:
                                d_ub[r, k] = T.Cast("bfloat16", T.if_then_else((code & 8) != 0, -val, val))
                            else:
                                d_ub[r, k] = T.if_then_else((code & 8) != 0, -val, val)
                        if compact:
                            pass  # the input scales: one per input group, below
                        elif skind == "fp32":
                            if ibn == 1:
                                s_ub[r, k] = sfin_ub[r, k]
                            else:
                                s_ub[r, k] = sfin_ub[r, k // ibn]
                        else:
                            if ibn == 1:
                                raw = T.Cast("int32", sfin_ub[r, k]) & 0xFFFF
                                shift = (((row0 + r) // ibm) % 2) * 8
                            else:
                                raw = T.Cast("int32", sfin_ub[r, k // ibn // 2]) & 0xFFFF
                                shift = ((k // ibn) % 2) * 8
                            s_ub[r, k] = decode_sf_byte((raw >> shift) & 0xFF)
                    if compact:
                        ngi = ceil_div(w, ibn)  # input groups of a tile row
                        for i in T.Parallel(R * ngi, coalesced_width=T.int32(1)):
                            r = i // ngi
                            g = i % ngi
                            if skind == "fp32":
                                s_ub[r, g] = sfin_ub[r, g]
                            else:
                                raw = T.Cast("int32", sfin_ub[r, g // 2]) & 0xFFFF
                                s_ub[r, g] = decode_sf_byte((raw >> ((g % 2) * 8)) & 0xFF)
                if given is not None and given[0] == "ue8m0":
                    for j in T.Parallel(ng, coalesced_width=T.int32(1)):
                        graw = T.Cast("int32", graw_ub[j // 2]) & 0xFFFF
                        gsf_ub[j] = decode_sf_byte((graw >> ((j % 2) * 8)) & 0xFF)

        simt_pack = pack_macro(R, w, ng, writes_q and fmt == "e2m1", writes_sf and spec.packed, bn == 1)

        whole_groups, last_registers = row_draw(w)  # the Philox groups of a tile row

        @T.macro
        def store_bits(bits_ub, r, at, drawn_bits):
            T.simd.vsts(bits_ub[r, at], tirx.reinterpret("int32x64", drawn_bits))

        def draw_group(bits_ub, key, offset, multipliers, r, row, col0, g, registers):
            # group g of tile row r (plain Python, traced inside the draw region): its first
            # `registers` registers of fields at bits_ub[r, 1024·g ..]; the block index is uint32
            # arithmetic (exact below 2^32 blocks), handed to the int32 ramp as its bit pattern
            block = first_block_of(T.Cast("uint32", row), T.Cast("uint32", col0), H)
            first = T.Cast("int32", block + T.Cast("uint32", g * philox.BLOCKS_PER_GROUP))
            for index, bits in enumerate(group_random_bits(VECTOR, multipliers, key, offset, first, registers)):
                store_bits(bits_ub, r, g * RANDOM_GROUP_ELEMENTS + index * LANES, bits)

        @T.macro
        def draw_row_bits(bits_ub, key, offset, multipliers, r, row, col0):
            if whole_groups > 0:
                for g in T.serial(whole_groups):
                    draw_group(bits_ub, key, offset, multipliers, r, row, col0, g, RANDOM_GROUP_REGISTERS)
            if last_registers > 0:
                draw_group(bits_ub, key, offset, multipliers, r, row, col0, whole_groups, last_registers)

        @T.macro
        def draw_bits(seed_ub, offset_ub, bits_ub, row0, nv, col0):
            # the random bits of the tile's valid rows, columns col0 .. col0 + w (rounded up to whole registers)
            with T.SimdVF():
                key = (state_word(seed_ub, 0), state_word(seed_ub, 1))
                offset = (state_word(offset_ub, 0), state_word(offset_ub, 1))
                multipliers = philox.multiplier_registers(VECTOR)
                if R == 1:
                    draw_row_bits(bits_ub, key, offset, multipliers, 0, row0, col0)
                else:
                    for r in T.serial(nv):
                        draw_row_bits(bits_ub, key, offset, multipliers, r, row0 + r, col0)

        @T.macro
        def load_row(X, XS, x_ub, sfin_ub, row, r, col0):
            if qin is not None and qin[0] == "e2m1":
                T.copy(X[row, col0 // 2: col0 // 2 + wx], x_ub[r, 0:wx])
            else:
                T.copy(X[row, col0: col0 + wx], x_ub[r, 0:wx])
            if qin is not None:
                _, ibm, ibn, skind, cm = qin
                ri = row // ibm
                if ibn == 1:
                    if skind == "ue8m0":
                        ri = ri // 2
                    if cm:
                        T.copy(XS[col0: col0 + w, ri], sfin_ub[r, 0:w])
                    else:
                        T.copy(XS[ri, col0: col0 + w], sfin_ub[r, 0:w])
                else:
                    nci = ceil_div(w, ibn)
                    c0 = col0 // ibn
                    if skind == "ue8m0":
                        nci = ceil_div(nci, 2)
                        c0 = c0 // 2
                    if cm:
                        T.copy(XS[c0: c0 + nci, ri], sfin_ub[r, 0:nci])
                    else:
                        T.copy(XS[ri, c0: c0 + nci], sfin_ub[r, 0:nci])

        @T.macro
        def load_given(GS, graw_ub, gsf_ub, rb, col0):
            gk, gcm = given
            g0 = col0 // bn
            if gk == "ue8m0":
                npair = ceil_div(ng, 2)
                if gcm:
                    T.copy(GS[g0 // 2: g0 // 2 + npair, rb], graw_ub[0:npair])
                else:
                    T.copy(GS[rb, g0 // 2: g0 // 2 + npair], graw_ub[0:npair])
            else:
                if gcm:
                    T.copy(GS[g0: g0 + ng, rb], gsf_ub[0:ng])
                else:
                    T.copy(GS[rb, g0: g0 + ng], gsf_ub[0:ng])

        @T.macro
        def store_sf(SF, sf_ub, sfp_ub, rb, col0):
            if bn == 1:
                if spec.packed:
                    T.copy(sfp_ub[0:w], SF[rb, col0: col0 + w])
                else:
                    T.copy(sf_ub[0:w], SF[rb, col0: col0 + w])
            else:
                g0 = col0 // bn
                if spec.packed:
                    npair = ceil_div(ng, 2)
                    if spec.col_major:
                        T.copy(sfp_ub[0:npair], SF[g0 // 2: g0 // 2 + npair, rb])
                    else:
                        T.copy(sfp_ub[0:npair], SF[rb, g0 // 2: g0 // 2 + npair])
                else:
                    if spec.col_major:
                        T.copy(sf_ub[0:ng], SF[g0: g0 + ng, rb])
                    else:
                        T.copy(sf_ub[0:ng], SF[rb, g0: g0 + ng])

        compute = tile_compute(spec, w, simd_tile)  # module global, looked up at trace time

        @T.macro
        def tile(X, XS, GS, Q, SF, bufs, rb, col0):
            (x_ub, sfin_ub, d_ub, s_ub, graw_ub, gsf_ub, ginv_ub, q_ub, code_ub, o_ub, sf_ub, e_ub, sfp_ub, seed_ub,
             offset_ub, bits_ub) = bufs
            row0 = rb * R
            nv = T.min(R, Tn - row0)
            if R == 1:
                load_row(X, XS, x_ub, sfin_ub, row0, 0, col0)
            else:
                for r in T.serial(nv):
                    load_row(X, XS, x_ub, sfin_ub, row0 + r, r, col0)
            if precomputed:
                load_given(GS, graw_ub, gsf_ub, rb, col0)
            if qin is not None or (precomputed and given[0] == "ue8m0"):
                simt_prepare(x_ub, sfin_ub, d_ub, s_ub, graw_ub, gsf_ub, row0)
            if stochastic:
                draw_bits(seed_ub, offset_ub, bits_ub, row0, nv, col0)
                compute(x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, sf_ub, e_ub, gsf_ub, ginv_ub, nv, bits_ub)
            else:
                compute(x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, sf_ub, e_ub, gsf_ub, ginv_ub, nv)
            if (writes_q and fmt == "e2m1" and not is_cast_back and not fake_quant) or (writes_sf and spec.packed):
                simt_pack(q_ub, code_ub, e_ub, sfp_ub)
            if writes_sf:
                store_sf(SF, sf_ub, sfp_ub, rb, col0)
            if writes_q:
                out_ub = o_ub if is_cast_back or fake_quant else q_ub
                qc0 = col0 if (fmt == "e4m3" or is_cast_back or fake_quant) else col0 // 2
                if R == 1:
                    T.copy(out_ub[0, 0:wq], Q[row0, qc0: qc0 + wq])
                else:
                    for r in T.serial(nv):
                        T.copy(out_ub[r, 0:wq], Q[row0 + r, qc0: qc0 + wq])

        return tile

    tile_full = make_tile(W) if NCF > 0 else None
    tile_tail = make_tile(WT) if WT > 0 else None

    def alloc(name):
        if name not in plan:
            return None
        shape, dtype, _ = plan[name]
        return T.alloc_shared(shape, dtype)

    names = ("x_ub", "sfin_ub", "d_ub", "s_ub", "graw_ub", "gsf_ub", "ginv_ub", "q_ub", "code_ub", "o_ub",
             "sf_ub", "e_ub", "sfp_ub", "seed_ub", "offset_ub", "bits_ub")

    @T.macro
    def item_body(X, XS, GS, Q, SF, bufs, item, per_row):
        if per_row == 1:
            if NCF == 1:
                tile_full(X, XS, GS, Q, SF, bufs, item, 0)
            else:
                tile_tail(X, XS, GS, Q, SF, bufs, item, 0)
        elif WT == 0:
            tile_full(X, XS, GS, Q, SF, bufs, item // per_row, (item % per_row) * W)
        else:
            if item % per_row < NCF:
                tile_full(X, XS, GS, Q, SF, bufs, item // per_row, (item % per_row) * W)
            else:
                tile_tail(X, XS, GS, Q, SF, bufs, item // per_row, NCF * W)

    @T.macro
    def load_state(SEED, OFFSET, bufs):
        # the generator's (seed, offset) words, once per core: the key and the counter's high half
        T.copy(SEED[0:2], bufs[names.index("seed_ub")][0:2])
        T.copy(OFFSET[0:2], bufs[names.index("offset_ub")][0:2])

    @T.macro
    def kernel_body(X, XS, GS, Q, SF, SEED=None, OFFSET=None):
        with T.Kernel(C) as cid:
            bufs = [alloc(n) for n in names]
            if stochastic:
                load_state(SEED, OFFSET, bufs)
            versions = {}
            for n, b in zip(names, bufs):
                if b is not None and plan[n][2] > 1:
                    versions[b] = plan[n][2]
            # one loop over (row tile, column tile) items; the last column tile of a row tile
            # is narrower when W does not divide H (a second pipelined loop over the same
            # buffers would lose the version rotation)
            per_row = NCF + (1 if WT > 0 else 0)
            for it in row_loop(T.ceildiv(nrb * per_row - cid, C), spec.num_buffers, versions):
                item_body(X, XS, GS, Q, SF, bufs, cid + it * C, per_row)

    X_t = T.StridedTensor((Tn, x_cols), (S, 1), x_dtype)

    def strided(shape, dtype, stride):
        return T.StridedTensor(shape, (stride, 1), dtype)

    if is_cast_back:
        O_t = T.Tensor((Tn, H), spec.out_dtype)
        XS_t = strided(XS_shape, XS_dtype, SXS)

        @T.prim_func
        def cast_back_kernel(X: X_t, XS: XS_t, O: O_t):
            kernel_body(X, XS, None, O, None)

        return cast_back_kernel

    if fake_quant:  # x read and written in place, nothing else
        @T.prim_func
        def fake_quant_kernel(X: X_t):
            kernel_body(X, None, None, X, None)

        return fake_quant_kernel

    Q_t = T.Tensor((Tn, q_cols), q_dtype)
    SF_t = strided(SF_shape, SF_dtype, SSF) if writes_sf else None
    XS_t = strided(XS_shape, XS_dtype, SXS) if qin is not None else None
    GS_t = strided(GS_shape, GS_dtype, SGS) if given is not None else None

    # the signature follows what the mode reads and writes: cast (q, sf), sf_only (sf),
    # precomputed_sf (given sf in, q out); XS when the input is quantized; a stochastic cast ends
    # with the generator's state words
    # (one tensor type per parameter: parameters sharing a type object become one buffer)
    SEED_t, OFFSET_t = T.Tensor((2,), "int32"), T.Tensor((2,), "int32")
    if stochastic and qin is None:
        @T.prim_func
        def quant_kernel(X: X_t, Q: Q_t, SF: SF_t, SEED: SEED_t, OFFSET: OFFSET_t):
            kernel_body(X, None, None, Q, SF, SEED, OFFSET)
    elif stochastic:
        @T.prim_func
        def quant_kernel(X: X_t, XS: XS_t, Q: Q_t, SF: SF_t, SEED: SEED_t, OFFSET: OFFSET_t):
            kernel_body(X, XS, None, Q, SF, SEED, OFFSET)
    elif writes_q and writes_sf and qin is None:
        @T.prim_func
        def quant_kernel(X: X_t, Q: Q_t, SF: SF_t):
            kernel_body(X, None, None, Q, SF)
    elif writes_q and writes_sf:
        @T.prim_func
        def quant_kernel(X: X_t, XS: XS_t, Q: Q_t, SF: SF_t):
            kernel_body(X, XS, None, Q, SF)
    elif writes_sf and qin is None:
        @T.prim_func
        def quant_kernel(X: X_t, SF: SF_t):
            kernel_body(X, None, None, None, SF)
    elif writes_sf:
        @T.prim_func
        def quant_kernel(X: X_t, XS: XS_t, SF: SF_t):
            kernel_body(X, XS, None, None, SF)
    elif qin is None:
        @T.prim_func
        def quant_kernel(X: X_t, GS: GS_t, Q: Q_t):
            kernel_body(X, None, GS, Q, None)
    else:
        @T.prim_func
        def quant_kernel(X: X_t, XS: XS_t, GS: GS_t, Q: Q_t):
            kernel_body(X, XS, GS, Q, None)
    return quant_kernel
