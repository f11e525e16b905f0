"""The tile kernel every CUDA quant op is an instance of (TileLang, SIMT style).

Geometry. A CTA of ``warps`` warps owns a tile of ``warps × rows_per_thread`` rows and
``column_chunks × 32 × VEC`` columns. A thread owns ``rows_per_thread × column_chunks``
*slots*: slot ``s`` is row ``tile_row·TM + (s // chunks)·warps + w`` and the ``VEC``
consecutive columns from ``((tile_col·chunks + s % chunks)·32 + l)·VEC`` (one 128-bit load
of a bf16/fp32 row, 16 values of a quantized row) for lane ``l``; block and channel tiles
have one chunk, so a slot is a row. With ``lanes_per_row = 16`` (block and channel tiles) a
slot is two rows, lanes 0–15 on the first and 16–31 on the second, each 16 × ``VEC`` columns
wide: the tile is half as wide and twice as tall per warp, and the group reductions add a
shuffle across the half warps (channel tiles also take 8 or 4 lanes a row: 4 or 8 rows a slot,
reduced by 2 or 3 such shuffles). All loads of a thread are issued before any math (bytes
in flight), data stays in registers between the amax pass and the quantize pass (one read
of ``x`` from DRAM). Rows run along ``blockIdx.x`` (no 65535 limit).

Groups ``bm × bn``:
- per token (``bm == 1``): a group is ``bn / VEC`` adjacent lanes of one slot, reduced with
  xor-shuffles; the tile's slots are independent.
- per block (``bm > 1``, ``bn >= VEC``): the tile is one group row (``TM == bm``): each
  thread reduces its rows, lanes of a group shuffle, warps meet in shared memory.
- per channel (``bn == 1``): each of a thread's ``VEC`` columns is its own group, reduced
  over the thread's rows and then across warps in shared memory.

Tails: a lane past ``H`` or a row past ``T`` loads nothing, contributes 0 to the amax and
stores nothing, so a partial group covers only its valid elements and no neighbour row or
clamped stand-in is ever read (SPEC §0). Offsets are 64-bit (TileLang's index math), so
tensors past 2^31 elements are fine.

Buffers (all shapes/strides dynamic except where a layout fixes them):
``x [T, XW] (row stride S)`` · ``sf_in`` (quantized input's sf, any strides) · ``given``
(caller's sf, any strides) · ``q [T, H/vpb]`` (or the cast_back result ``[T, H]``) ·
``sf`` (fp32/e4m3 ``[R, C]`` any strides, or the bytes of packed UE8M0 int32 storage).

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.quant import sf_math
from tileplug.backend_cuda.quant.spec import HIDDEN_MULTIPLE, KernelSpec
from tileplug.backend_cuda.quant.element_kernels import (
    E2M1_DROPPED_BITS,
    carry_code_e2m1,
    carry_round_normal_to_e4m3,
    carry_round_to_e4m3,
    e4m3_field_position,
    on_normal_e4m3_steps,
    random_field,
)
from tileplug.backend_cuda.random.philox import (
    DEVICE_HELPERS,
    advance_if_the_last_cta,
    arrivals_buffer,
    philox_block,
    read_the_offset_and_count_the_cta,
    state_buffers,
)
from tileplug.core.contracts.cast import QUANT_RANDOM_FIELD_BITS
from tileplug.core.call import QuantMode
from tileplug.core.quant.formats import QUANT_FORMATS



def build_kernel(spec: KernelSpec):
    """The ``T.prim_func`` of ``spec`` (see the module docstring for its buffers)."""
    VEC = spec.vec
    XVEC = spec.x_vec
    VPB_IN = spec.in_values_per_byte
    NW = spec.warps
    RPT = spec.rows_per_thread
    TM = spec.tile_rows
    TC = spec.tile_cols
    NT = 32 * NW
    MODE = spec.mode
    CAST_BACK = MODE is QuantMode.CAST_BACK
    FAKE_QUANT = MODE is QuantMode.CAST_AND_CAST_BACK  # quantize, dequantize into x itself
    COMPUTE_SF = MODE in (QuantMode.CAST, QuantMode.SF_ONLY, QuantMode.CAST_AND_CAST_BACK)
    WRITE_Q = MODE is not QuantMode.SF_ONLY
    QUANTIZED = spec.quantized_input
    IN_DT = spec.in_dtype
    X_DT = spec.x_storage_dtype
    PAIRS = spec.bf16_pairs

    if CAST_BACK:
        BM, BN = 1, 16  # cast_back has no output groups; tile like a per-token op
        QDT = spec.fmt
        VPB_OUT = 1
    else:
        BM, BN = spec.block
        QDT = "float8_e4m3fn" if spec.fmt == "e4m3" else "int8"
        VPB_OUT = 1 if spec.fmt == "e4m3" else 2
        FMAX = QUANT_FORMATS[spec.fmt].max_value
        FRCP = sf_math.f32(1.0 / FMAX)
    PER_TOKEN = BM == 1
    PER_CHANNEL = BN == 1
    CPT = spec.column_chunks
    LR = spec.lanes_per_row  # lanes along a row: 32, or 16 / 8 / 4 (a warp holds 2 / 4 / 8 rows per slot)
    RG = 32 // LR  # rows a warp holds per slot
    assert LR * RG == 32, "a warp's slot is whole rows"
    NSLOT = RPT * CPT  # (row, column chunk) pairs of a thread: slot s = row s // CPT, chunk s % CPT
    if not PER_TOKEN:
        assert TM == BM, "a block/channel tile is exactly one group row"
        assert CPT == 1, "column chunks are a per-token tile knob"
    else:
        assert LR == 32, "half-warp rows are a block/channel tile knob"
    if not PER_CHANNEL:
        assert BN % VEC == 0
    LPG = 1 if PER_CHANNEL else BN // VEC  # lanes per group
    assert LPG <= LR, "a group's lanes lie in one row"
    SHUFFLES = [1 << k for k in range(LPG.bit_length() - 1)]
    ROW_SHUFFLES = [LR << k for k in range(RG.bit_length() - 1)]  # the rows of one warp's slot
    NSF = VEC if PER_CHANNEL else 1  # scales per thread-row
    ROUND = spec.round_sf
    E4M3_SF = spec.sf_kind == "e4m3"
    PACKED = spec.sf_kind == "ue8m0"
    SF_COL = spec.sf_col_major
    CMIN_BITS = sf_math.f32_bits(spec.clamp_min) if COMPUTE_SF else 0
    SFO_DT = {"fp32": "float32", "e4m3": "float8_e4m3fn", "ue8m0": "uint8", None: "float32"}[spec.sf_kind]
    # spread (see KernelSpec): per token, the 2·NSLOT divisions of a thread's slots (inverse and
    # stored scale of each) are split over the group's LPG lanes, ROUNDS each, and the
    # inverses are shuffled back; per channel, job j < 2·TC is (column j % TC, kind j // TC).
    SPREAD_PT = spec.spread and PER_TOKEN and COMPUTE_SF and not ROUND and not E4M3_SF and LPG >= 2
    SPREAD_PC = spec.spread and PER_CHANNEL and not PER_TOKEN and COMPUTE_SF
    ROUNDS = -(-2 * NSLOT // LPG)
    NCOL = LR * NSF  # columns of a per-channel tile (== TC)
    WARP_STRIDE = 32 * NSF  # entries of one warp in ``red``
    NJOB = 2 * NCOL
    JR = -(-NJOB // NT)

    LOSSLESS = spec.lossless  # the group scale from the input scales' exponents (SPEC §11)
    assert not LOSSLESS or (QUANTIZED and MODE is QuantMode.CAST and not spec.stochastic)
    STOCHASTIC = spec.stochastic
    if STOCHASTIC:
        # element i = r·H + c + j takes field i mod FIELDS of word i // FIELDS: a Philox block serves
        # BLOCK_VALUES elements. A slot's VEC columns are whole blocks (a quantized input), or one part
        # of PART_WORDS words of a block the SHARERS adjacent lanes of its row cover together (H and
        # every slot's first column are multiples of BLOCK_VALUES, so the lanes' parts line up).
        # Where a thread's slots come in whole SHARERS-tuples (SHARED), each lane of a tuple's lanes
        # draws the block of one slot and they hand each other their parts with SHARERS - 1 shuffles:
        # a block per BLOCK_VALUES elements, not per slot.
        FIELDS = 32 // QUANT_RANDOM_FIELD_BITS
        BLOCK_VALUES = 4 * FIELDS
        assert MODE is QuantMode.CAST and (VEC % BLOCK_VALUES == 0 or BLOCK_VALUES % VEC == 0)
        assert VEC % FIELDS == 0, "a slot's values take whole words"
        assert HIDDEN_MULTIPLE % BLOCK_VALUES == 0, "every row starts on a Philox block"
        BLOCKS_PER_SLOT = max(VEC // BLOCK_VALUES, 1)
        SHARERS = max(BLOCK_VALUES // VEC, 1)
        PART_WORDS = 4 // SHARERS
        assert LR % SHARERS == 0, "a block's lanes lie in one row"
        SHARED = SHARERS > 1 and NSLOT % SHARERS == 0
        # the carry rounding: e4m3's of the element casts (its field at bits 20 − w … 19), e2m1's codes read
        # off the same carry (its field at bits 22 − w … 21)
        if spec.fmt == "e4m3":
            round_value, FIELD_POSITION = carry_round_to_e4m3, e4m3_field_position(QUANT_RANDOM_FIELD_BITS)
        else:
            round_value, FIELD_POSITION = carry_code_e2m1, E2M1_DROPPED_BITS - QUANT_RANDOM_FIELD_BITS

    IN_SF = spec.in_sf
    if IN_SF is not None:
        IBM, IBN = IN_SF.block
        assert IBN == 1 or IBN % VEC == 0
    GIVEN = spec.given

    M = T.dynamic("M")  # tokens
    XW = T.dynamic("XW")  # storage width of x (H, or H/2 for e2m1 pairs)
    S = T.dynamic("S")  # row stride of x in storage elements
    H = XW * VPB_IN
    QW = XW * VPB_IN // VPB_OUT
    IR, IC, IS0, IS1 = T.dynamic("IR"), T.dynamic("IC"), T.dynamic("IS0"), T.dynamic("IS1")
    GR, GC, GS0, GS1 = T.dynamic("GR"), T.dynamic("GC"), T.dynamic("GS0"), T.dynamic("GS1")
    OR, OC, OS0, OS1 = T.dynamic("OR"), T.dynamic("OC"), T.dynamic("OS0"), T.dynamic("OS1")
    CTAS = T.cast(T.ceildiv(M, TM) * T.ceildiv(H, TC), "int32")  # the grid's size: a draw's arrival count

    # ------------------------------------------------------------ trace-time helpers
    def slot_row(bx, w, lane, s):
        """Row of a thread's slot ``s`` (lane ``lane`` of warp ``w`` of row tile ``bx``)."""
        if RG == 1:
            return bx * TM + (s // CPT) * NW + w
        return bx * TM + ((s // CPT) * NW + w) * RG + lane // LR

    def slot_col(by, lane, s):
        """First column of a thread's slot ``s`` (lane ``lane`` of column tile ``by``)."""
        if RG == 1:
            return ((by * CPT + s % CPT) * 32 + lane) * VEC
        return ((by * CPT + s % CPT) * LR + lane % LR) * VEC

    def read_sf(buf, read, gr, gc):
        """fp32 scale of group (gr, gc) of an sf tensor described by ``read``."""
        if read.kind == "fp32":
            return buf[gr, gc]
        if read.kind == "e4m3":
            return T.cast(buf[gr, gc], "float32")
        if read.pack_axis == 1:
            word = T.cast(buf[gr, gc // read.pack], "int32")
            byte = T.shift_right(word, (gc % read.pack) * 8) & 255
        else:
            word = T.cast(buf[gr // read.pack, gc], "int32")
            byte = T.shift_right(word, (gr % read.pack) * 8) & 255
        return sf_math.ue8m0_value(byte)

    def decoded(xv, i, j):
        """fp32 value of element j of the thread's row i (before any input scale)."""
        if PAIRS:  # bf16 2k in the low half of word k, 2k+1 in the high half
            word = xv[i * XVEC + j // 2]
            return T.reinterpret(T.if_then_else(j % 2 == 0, T.shift_left(word, 16), word & -65536), "float32")
        if IN_DT == "int8":
            byte = T.cast(xv[i * XVEC + j // 2], "int32")
            return sf_math.e2m1_value(T.shift_right(byte, (j % 2) * 4) & 15)
        return T.cast(xv[i * XVEC + j], "float32")

    def input_scale(sin, i, j):
        return sin[i * VEC + j] if IBN == 1 else sin[i]

    def scaled(xv, sin, i, j):
        """The value an element represents: float(x), or float(xq) * sf_in."""
        if QUANTIZED:
            return decoded(xv, i, j) * input_scale(sin, i, j)
        return decoded(xv, i, j)

    def amax_key(xv, sin, i, j):
        """int32 amax key of an element: the bits of |value| (see sf_math.abs_bits). For a
        bf16 input it is taken from the raw bf16 bits (the fp32 bits are those shifted left
        by 16), so the amax pass holds no fp32 copy of the tile in registers. A lossless
        re-blocking keys an element by its input scale's exponent (sf_math.lossless_key)."""
        if LOSSLESS:
            return sf_math.lossless_key(input_scale(sin, i, j))
        if PAIRS:
            word = xv[i * XVEC + j // 2]
            return T.if_then_else(j % 2 == 0, T.shift_left(word & 0x7FFF, 16), word & 0x7FFF0000)
        if IN_DT == "bfloat16":
            return sf_math.bf16_abs_bits(xv[i * XVEC + j])
        return sf_math.abs_bits(scaled(xv, sin, i, j))

    def inverse_of(key):
        """The factor a group's values are multiplied by, from its reduced key."""
        if LOSSLESS:
            return sf_math.lossless_inverse(key)
        return sf_math.group_inverse(key, CMIN_BITS, FMAX, FRCP, ROUND, E4M3_SF)

    def stored_scale(key, packed):
        """The scale a group stores (``packed``: its UE8M0 byte), from its reduced key."""
        if LOSSLESS:
            return sf_math.lossless_scale(key, packed)
        return sf_math.group_scale(key, CMIN_BITS, FMAX, FRCP, ROUND, E4M3_SF, packed)

    if STOCHASTIC:
        def pick(words, index, choices):
            """``words[index]`` for a runtime ``index`` among ``choices`` (constants): a chain of selects,
            where indexing would move the thread's words to local memory."""
            picked = words[choices[-1]]
            for choice in reversed(choices[:-1]):
                picked = T.if_then_else(index == choice, words[choice], picked)
            return picked

        def part_word(words, part, u):
            """Word ``u`` of part ``part`` (a runtime lane position) of a Philox block's ``words``: the part of
            ``PART_WORDS`` words that serves the lane at that position among the block's ``SHARERS``."""
            return pick(words, part * PART_WORDS + u, [choice * PART_WORDS + u for choice in range(SHARERS)])

        @T.macro
        def round_values(slot_words, base, values, first, yv, rounding):
            """``yv[first … first + values)``: each value rounded by ``rounding`` with its field of the words
            ``slot_words[base …]`` (those of its Philox block that serve the slot's values, in order)."""
            for j in T.unroll(values):
                rounding(yv[first + j], random_field(slot_words[base + j // FIELDS], j % FIELDS,
                                                     QUANT_RANDOM_FIELD_BITS, FIELD_POSITION), yv, first + j)

        def tuple_part(words, received, position, q, u):
            """Word ``u`` of this lane's part of slot ``first_slot + q``'s block: round ``t = p ^ q``
            brought it (round 0: the lane's own block)."""
            chosen = part_word(words, position, u)
            for t in range(1, SHARERS):
                chosen = T.if_then_else((position ^ q) == t, received[(t - 1) * PART_WORDS + u], chosen)
            return chosen

        @T.macro
        def draw_shared(words, received, tuple_words, first_slot, lane, bx, by, w, seed, drawn_offset):
            """``tuple_words[q·PART_WORDS + u]`` = word ``u`` of the part of slot ``first_slot + q``'s block
            that serves this lane (``q < SHARERS``): the lane at position ``p = lane % SHARERS`` draws the
            block of slot ``first_slot + p`` (its lanes' block in that slot), then in round ``t`` it sends
            part ``p ^ t`` of it to lane ``lane ^ t`` and receives its own part of slot
            ``first_slot + (p ^ t)``'s block."""
            position = lane % SHARERS
            drawn_slot = first_slot + position
            row, column = slot_row(bx, w, lane, drawn_slot), slot_col(by, lane, drawn_slot)
            philox_block(seed[0], drawn_offset[0], (T.cast(row, "int64") * H + column) // BLOCK_VALUES, words,
                         spec.philox_wide)
            for t in T.unroll(1, SHARERS):
                for u in T.unroll(PART_WORDS):
                    received[(t - 1) * PART_WORDS + u] = T.shfl_xor(part_word(words, position ^ t, u), t)
            for q in T.unroll(SHARERS):
                for u in T.unroll(PART_WORDS):
                    tuple_words[q * PART_WORDS + u] = tuple_part(words, received, position, q, u)

    @T.macro
    def tile(x, sf_in, given, q, sf, seed, offset, arrivals, bx, by):
        if True:
            if spec.vectorize:
                T.assume(S % XVEC == 0)
            T.assume(XW % (16 // VPB_IN) == 0)
            if spec.min_blocks_per_sm > 1:
                T.annotate_min_blocks_per_sm(spec.min_blocks_per_sm)
            tx = T.get_thread_binding()
            lane = tx % 32
            w = tx // 32
            c0 = slot_col(by, lane, 0)  # block / channel tiles (one chunk per row)
            xv = T.alloc_local((NSLOT * XVEC,), X_DT)
            amax = T.alloc_local((NSLOT if PER_TOKEN else NSF,), "int32")
            inv = T.alloc_local((NSLOT if PER_TOKEN else NSF,), "float32")
            yv = T.alloc_local((VEC,), "float32")
            sin = None
            if QUANTIZED:
                sin = T.alloc_local((NSLOT * (VEC if IBN == 1 else 1),), "float32")
            if WRITE_Q:
                qv = T.alloc_local((VEC // VPB_OUT,), QDT)
            if STOCHASTIC:
                words = T.alloc_local((4,), "uint32")
                if SHARED:
                    received = T.alloc_local(((SHARERS - 1) * PART_WORDS,), "uint32")
                if SHARERS > 1:  # the words serving this lane's slots (SHARED: a tuple of slots; else its slot)
                    tuple_words = T.alloc_local((4 if SHARED else PART_WORDS,), "uint32")
            if FAKE_QUANT:
                scale = T.alloc_local((NSLOT,), "float32")  # each slot's group scale, as cast_back reads it
            if not PER_TOKEN and COMPUTE_SF:
                red = T.alloc_shared((NW * 32 * NSF,), "int32")
            if SPREAD_PT or SPREAD_PC:
                sel = T.alloc_local((1,), "int32")
            if SPREAD_PT:
                dv = T.alloc_local((ROUNDS,), "float32")
            if SPREAD_PC:
                res = T.alloc_shared((NCOL,), "float32")

            # ---- loads: every row of the thread first (bytes in flight) ----
            for i in T.unroll(NSLOT):
                r = slot_row(bx, w, lane, i)
                c = slot_col(by, lane, i)
                if r < M and c < H:
                    if spec.vectorize:
                        for j in T.vectorized(XVEC):
                            xv[i * XVEC + j] = x[r, c // VPB_IN + j]
                    else:
                        for j in T.serial(XVEC):
                            xv[i * XVEC + j] = x[r, c // VPB_IN + j]
                    if QUANTIZED:
                        if IBN == 1:
                            for j in T.unroll(VEC):
                                sin[i * VEC + j] = read_sf(sf_in, IN_SF, r // IBM, c + j)
                        else:
                            sin[i] = read_sf(sf_in, IN_SF, r // IBM, c // IBN)
                else:
                    for j in T.unroll(XVEC):
                        xv[i * XVEC + j] = T.cast(0, X_DT)
                    if QUANTIZED:
                        if IBN == 1:
                            for j in T.unroll(VEC):
                                sin[i * VEC + j] = T.float32(0.0)
                        else:
                            sin[i] = T.float32(0.0)

            if STOCHASTIC:  # the offset's read and the CTA's count behind the loads
                drawn_offset, arrived = read_the_offset_and_count_the_cta(offset, arrivals, tx)

            if CAST_BACK:
                for i in T.unroll(NSLOT):
                    r = slot_row(bx, w, lane, i)
                    c = slot_col(by, lane, i)
                    # e4m3 pairs convert in one instruction each (vectorized casts), as
                    # do the bf16 pairs of the store (ncu, T = 128: 447,616 -> 390,528 warp instructions)
                    if IN_DT == "int8":
                        for j in T.unroll(VEC):
                            yv[j] = decoded(xv, i, j)
                    else:
                        for j in T.vectorized(VEC):
                            yv[j] = T.cast(xv[i * XVEC + j], "float32")
                    for j in T.unroll(VEC):
                        yv[j] = yv[j] * input_scale(sin, i, j)
                    for j in T.vectorized(VEC):
                        qv[j] = T.cast(yv[j], QDT)
                    if r < M and c < H:
                        for j in T.vectorized(VEC):
                            q[r, c + j] = qv[j]

            if COMPUTE_SF:
                # ---- amax of |value| on bits (NaN-propagating) ----
                if PER_TOKEN:  # one accumulator per slot
                    for i in T.unroll(NSLOT):
                        amax[i] = 0
                        for j in T.unroll(VEC):
                            amax[i] = T.max(amax[i], amax_key(xv, sin, i, j))
                    for i in T.unroll(NSLOT):
                        for d in SHUFFLES:
                            amax[i] = T.max(amax[i], T.shfl_xor(amax[i], d))
                else:  # one accumulator per group column, folded over the thread's rows
                    for e in T.unroll(NSF):
                        amax[e] = 0
                    for i in T.unroll(RPT):
                        for j in T.unroll(VEC):
                            if PER_CHANNEL:
                                amax[j] = T.max(amax[j], amax_key(xv, sin, i, j))
                            else:
                                amax[0] = T.max(amax[0], amax_key(xv, sin, i, j))
                    for d in SHUFFLES:
                        amax[0] = T.max(amax[0], T.shfl_xor(amax[0], d))
                    for d in ROW_SHUFFLES:
                        for e in T.unroll(NSF):
                            amax[e] = T.max(amax[e], T.shfl_xor(amax[e], d))
                    for e in T.unroll(NSF):
                        red[(w * 32 + lane) * NSF + e] = amax[e]
                    T.sync_threads()
                    if not SPREAD_PC:
                        for e in T.unroll(NSF):
                            amax[e] = red[lane * NSF + e]
                            for v in T.unroll(NW - 1):
                                amax[e] = T.max(amax[e], red[(v + 1) * WARP_STRIDE + lane * NSF + e])
                if SPREAD_PT:
                    # ---- lane k of a group divides jobs k, k + LPG, ...: job < NSLOT is the
                    # inverse FMAX / c of slot job, job - NSLOT < NSLOT the scale c / FMAX of that slot ----
                    for t in T.unroll(ROUNDS):
                        job = lane % LPG + t * LPG
                        sel[0] = amax[0]
                        for i in T.unroll(NSLOT - 1):
                            sel[0] = T.if_then_else(job % NSLOT == i + 1, amax[i + 1], sel[0])
                        clamped = sf_math.clamped_amax(sel[0], CMIN_BITS)
                        dv[t] = T.ieee_fdiv(
                            T.if_then_else(job < NSLOT, T.float32(FMAX), clamped),
                            T.if_then_else(job < NSLOT, clamped, T.float32(FMAX)),
                        )
                    for i in T.unroll(NSLOT):
                        inv[i] = T.shfl_sync(dv[i // LPG], i % LPG, LPG)
                    for t in T.unroll(ROUNDS):
                        job = lane % LPG + t * LPG
                        gr = slot_row(bx, w, lane, job - NSLOT)
                        gcol = slot_col(by, lane, job - NSLOT)
                        # The storing lane may lie past H in a partial last group: the group
                        # exists when its first column does (the lane's own column is not the test).
                        if job >= NSLOT and job < 2 * NSLOT and gr < M and (gcol // BN) * BN < H:
                            sf[gr, gcol // BN] = dv[t]
                elif SPREAD_PC:
                    # ---- thread tx takes jobs tx, tx + NT, ...: job j reduces column j % NCOL
                    # over the warps; j < NCOL keeps its inverse, the others store the scale ----
                    for t in T.unroll(JR):
                        job = tx + t * NT
                        col = job % NCOL
                        gc = by * TC + col
                        if job < NJOB:
                            sel[0] = red[col]
                            for v in T.unroll(NW - 1):
                                sel[0] = T.max(sel[0], red[(v + 1) * WARP_STRIDE + col])
                            if job < NCOL:
                                res[col] = inverse_of(sel[0])
                            elif gc < H:
                                value = stored_scale(sel[0], PACKED)
                                if PACKED:  # packed along tokens: column-major [H, 4·P] bytes, group (r, c) is byte (c, r)
                                    sf_bytes = sf_math.packed_sf_bytes(sf, SF_COL)
                                    if SF_COL:
                                        sf_bytes[gc, bx] = value
                                    else:
                                        sf_bytes[bx // 4, gc * 4 + bx % 4] = value
                                else:
                                    sf[bx, gc] = value
                    T.sync_threads()
                    for e in T.unroll(NSF):
                        inv[e] = res[(lane % LR) * NSF + e]
                # ---- scales: store (first lane of a group / first warp of a block) and invert ----
                if not (SPREAD_PT or SPREAD_PC):
                    NROWS = NSLOT if PER_TOKEN else 1
                    for i in T.unroll(NROWS):
                        for e in T.unroll(NSF):
                            inv[i * NSF + e] = inverse_of(amax[i * NSF + e])
                        if FAKE_QUANT:  # nothing stored: the scale multiplies the values back
                            scale[i] = T.cast(stored_scale(amax[i], False), "float32")
                        else:
                            if PER_TOKEN:
                                gr = slot_row(bx, w, lane, i)
                                gcol = slot_col(by, lane, i)
                                ok = (gr < M) and (gcol < H) and (lane % LPG == 0)
                            else:
                                gr = bx
                                gcol = c0
                                ok = (w == 0) and (lane < LR) and (c0 < H) and (lane % LPG == 0)
                            if ok:
                                for e in T.unroll(NSF):
                                    gc = (gcol + e) if PER_CHANNEL else (gcol // BN)
                                    value = stored_scale(amax[i * NSF + e], PACKED)
                                    if not PACKED:
                                        sf[gr, gc] = value
                                    else:
                                        sf_bytes = sf_math.packed_sf_bytes(sf, SF_COL)
                                        if PER_CHANNEL and SF_COL:  # packed along tokens, column-major: byte (c, r)
                                            sf_bytes[gc, gr] = value
                                        elif PER_CHANNEL:
                                            sf_bytes[gr // 4, gc * 4 + gr % 4] = value
                                        elif SF_COL:
                                            sf_bytes[gc // 4, gr * 4 + gc % 4] = value
                                        else:
                                            sf_bytes[gr, gc] = value

            if MODE is QuantMode.PRECOMPUTED_SF:
                NROWS = NSLOT if PER_TOKEN else 1
                for i in T.unroll(NROWS):
                    gr = slot_row(bx, w, lane, i) if PER_TOKEN else bx
                    gcol = slot_col(by, lane, i) if PER_TOKEN else c0
                    if (gr < M or not PER_TOKEN) and gcol < H:
                        for e in T.unroll(NSF):
                            gc = (gcol + e) if PER_CHANNEL else (gcol // BN)
                            inv[i * NSF + e] = T.ieee_fdiv(T.float32(1.0), read_sf(given, GIVEN, gr, gc))
                    else:
                        for e in T.unroll(NSF):
                            inv[i * NSF + e] = T.float32(0.0)

            if WRITE_Q and not CAST_BACK:
                if STOCHASTIC:  # before the draws (see philox.advance_if_the_last_cta)
                    advance_if_the_last_cta(offset, arrivals, tx, arrived, CTAS)
                # ---- quantize from registers and store ----
                for i in T.unroll(NSLOT):
                    r = slot_row(bx, w, lane, i)
                    c = slot_col(by, lane, i)
                    si = i if PER_TOKEN else 0
                    for j in T.unroll(VEC):
                        factor = inv[si * NSF + (j if PER_CHANNEL else 0)]
                        if QUANTIZED:
                            yv[j] = decoded(xv, i, j) * (input_scale(sin, i, j) * factor)
                        else:
                            yv[j] = decoded(xv, i, j) * factor
                    if STOCHASTIC:  # element i = r·H + c + j: field i mod FIELDS of word i // FIELDS
                        for k in T.unroll(BLOCKS_PER_SLOT):
                            if SHARERS == 1:  # one mul.wide.u32 a product by default (see KernelSpec.philox_wide)
                                block = (T.cast(r, "int64") * H + c) // BLOCK_VALUES + k
                                philox_block(seed[0], drawn_offset[0], block, words, spec.philox_wide)
                                slot_words, base = words, 0
                            elif SHARED:
                                if i % SHARERS == 0:
                                    draw_shared(words, received, tuple_words, i, lane, bx, by, w, seed, drawn_offset)
                                slot_words, base = tuple_words, (i % SHARERS) * PART_WORDS
                            else:  # the lane's own part of its slot's block
                                block = (T.cast(r, "int64") * H + c) // BLOCK_VALUES
                                philox_block(seed[0], drawn_offset[0], block, words, spec.philox_wide)
                                for u in T.unroll(PART_WORDS):
                                    tuple_words[u] = part_word(words, lane % SHARERS, u)
                                slot_words, base = tuple_words, 0
                            first = k * BLOCK_VALUES
                            values = min(VEC, BLOCK_VALUES)
                            if spec.fmt == "e4m3":  # the slot's values all on normal steps: the short carry
                                if on_normal_e4m3_steps(yv, [first + j for j in range(values)]):
                                    round_values(slot_words, base, values, first, yv, carry_round_normal_to_e4m3)
                                else:
                                    round_values(slot_words, base, values, first, yv, round_value)
                            else:  # e2m1: the carry's codes, no fp32 value and no encoder between
                                round_values(slot_words, base, values, first, yv, round_value)
                    if spec.fmt == "e4m3":
                        for j in T.vectorized(VEC):
                            qv[j] = T.cast(yv[j], "float8_e4m3fn")
                    elif STOCHASTIC:  # yv holds the codes' bits
                        for j in T.unroll(VEC // 2):
                            qv[j] = sf_math.e2m1_code_pair(T.reinterpret(yv[2 * j], "uint32"),
                                                           T.reinterpret(yv[2 * j + 1], "uint32"))
                    else:
                        for j in T.unroll(VEC // 2):
                            qv[j] = sf_math.e2m1_pair(yv[2 * j], yv[2 * j + 1])
                    if FAKE_QUANT:
                        # ---- dequantize as cast_back does (fp32 product, one rounding to x's dtype), into x ----
                        for j in T.unroll(VEC):
                            if spec.fmt == "e4m3":
                                yv[j] = T.cast(qv[j], "float32") * scale[i]
                            else:
                                code = T.shift_right(T.cast(qv[j // 2], "int32"), (j % 2) * 4) & 15
                                yv[j] = sf_math.e2m1_value(code) * scale[i]
                        if r < M and c < H:
                            if spec.vectorize:
                                for j in T.vectorized(VEC):
                                    x[r, c + j] = T.cast(yv[j], X_DT)
                            else:
                                for j in T.serial(VEC):
                                    x[r, c + j] = T.cast(yv[j], X_DT)
                    elif r < M and c < H:
                        for j in T.vectorized(VEC // VPB_OUT):
                            q[r, c // VPB_OUT + j] = qv[j]

    PRELUDE = DEVICE_HELPERS if spec.philox_wide else ""  # (tileplug_mul_wide_u32)

    @T.macro
    def build(x, sf_in, given, q, sf, seed=None, offset=None, arrivals=None):
        if spec.grid_cols:  # column tiles of a row tile adjacent in launch order
            with T.Kernel(T.ceildiv(M, TM) * T.ceildiv(H, TC), threads=NT, prelude=PRELUDE) as bid:
                if spec.inline_coords:
                    # the coordinates inlined: every offset re-derives them with a 64-bit
                    # floor division (see KernelSpec.inline_coords)
                    tile(x, sf_in, given, q, sf, seed, offset, arrivals, bid // T.ceildiv(H, TC),
                         bid % T.ceildiv(H, TC))
                else:
                    # The tile coordinates, divided once in 32-bit registers: inlined, every
                    # offset re-derived them with a 64-bit floor division by the runtime
                    # column count (per token, 1 x 128: 93.7% -> 101.9% of copy at T = 65536).
                    row_tile = T.alloc_var("int32")
                    col_tile = T.alloc_var("int32")
                    row_tile = T.truncdiv(bid, T.ceildiv(H, TC))
                    col_tile = T.truncmod(bid, T.ceildiv(H, TC))
                    tile(x, sf_in, given, q, sf, seed, offset, arrivals, row_tile, col_tile)
        else:
            with T.Kernel(T.ceildiv(M, TM), T.ceildiv(H, TC), threads=NT, prelude=PRELUDE) as (bx, by):
                tile(x, sf_in, given, q, sf, seed, offset, arrivals, bx, by)

    # ------------------------------------------------------------ signatures per mode
    x_t = T.StridedTensor((M, XW), (S, 1), X_DT)
    sf_in_t = T.StridedTensor((IR, IC), (IS0, IS1), IN_SF.tl_dtype) if IN_SF is not None else None
    given_t = T.StridedTensor((GR, GC), (GS0, GS1), GIVEN.tl_dtype) if GIVEN is not None else None
    q_t = T.Tensor((M, H), QDT) if CAST_BACK else T.Tensor((M, QW), QDT)
    # Packed UE8M0 scales arrive as core allocated them and are written as their bytes
    # (``sf_math.packed_sf_bytes``) with a constant unit stride: each store's address a constant
    # offset from the row's (per token, column-major: ncu 2026-12-02 counted 210.6 M warp
    # instructions against 166.1 M for the fp32-sf tile, the runtime-stride byte addresses among them).
    sf_t = sf_math.packed_sf_type(SF_COL) if PACKED else T.StridedTensor((OR, OC), (OS0, OS1), SFO_DT)

    # One prim_func per buffer set (TileLang reads the signature off the annotations).
    if FAKE_QUANT:  # x is read and written; nothing else

        @T.prim_func
        def kernel(x: x_t):
            build(x, None, None, None, None)

    elif STOCHASTIC:  # cast mode with the generator's state; the draw's last CTA advances the offset
        seed_t, offset_t = state_buffers()
        if IN_SF is None:

            @T.prim_func
            def kernel(x: x_t, q: q_t, sf: sf_t, seed: seed_t, offset: offset_t, arrivals: arrivals_buffer()):
                build(x, None, None, q, sf, seed, offset, arrivals)

        else:

            @T.prim_func
            def kernel(x: x_t, sf_in: sf_in_t, q: q_t, sf: sf_t, seed: seed_t, offset: offset_t,
                       arrivals: arrivals_buffer()):
                build(x, sf_in, None, q, sf, seed, offset, arrivals)

    elif IN_SF is None:
        if MODE is QuantMode.CAST:

            @T.prim_func
            def kernel(x: x_t, q: q_t, sf: sf_t):
                build(x, None, None, q, sf)

        elif MODE is QuantMode.SF_ONLY:

            @T.prim_func
            def kernel(x: x_t, sf: sf_t):
                build(x, None, None, None, sf)

        else:

            @T.prim_func
            def kernel(x: x_t, given: given_t, q: q_t):
                build(x, None, given, q, None)

    else:
        if MODE is QuantMode.CAST:

            @T.prim_func
            def kernel(x: x_t, sf_in: sf_in_t, q: q_t, sf: sf_t):
                build(x, sf_in, None, q, sf)

        elif MODE is QuantMode.SF_ONLY:

            @T.prim_func
            def kernel(x: x_t, sf_in: sf_in_t, sf: sf_t):
                build(x, sf_in, None, None, sf)

        elif MODE is QuantMode.PRECOMPUTED_SF:

            @T.prim_func
            def kernel(x: x_t, sf_in: sf_in_t, given: given_t, q: q_t):
                build(x, sf_in, given, q, None)

        else:

            @T.prim_func
            def kernel(x: x_t, sf_in: sf_in_t, q: q_t):
                build(x, sf_in, None, q, None)

    # The device symbol names the specialisation (profiles and merged sources stay readable).
    return kernel.with_attr("global_symbol", spec.name)
