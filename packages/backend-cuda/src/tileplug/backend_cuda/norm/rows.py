"""Shared TileLang pieces of the CUDA norm kernels: the row tile, its loads, its two-stage
reduction and its stores (one module per op builds its kernel from these).

Layout (``spec.RowTile``): thread ``tx`` of a CTA works on row ``bx · rows + tx // lanes``
at lane ``l = tx % lanes``; it holds ``chunks`` vectors of ``VEC`` values of that row,
vector ``k`` being columns ``[(k · lanes + l) · VEC, + VEC)``. Every row buffer is read once
from global memory into registers (one 128-bit load per vector where the spec vectorizes,
else per element), kept there for every pass, and each thread writes back exactly the
columns it read: an output may be its input itself (``out=x``, ``residual_out=residual``)
because no thread writes a column another thread reads.

Tails: a column ``>= D`` or a row ``>= R`` loads 0, is never stored, and is masked to 0
wherever it could enter a statistic with a non-zero value (LayerNorm's centered values).

Reduction (:meth:`RowMacros.row_sum`, planned by ``spec.reduction_plan``): the reference's
own order, ``tileplug.core.norm.formulas.row_sum`` (a pairwise halving tree), so a row's
statistics are the reference's bit for bit — and depend on that row alone, never on ``T``,
the row's position or the SM count. Where ``D = chunks · lanes · VEC`` exactly, the tree's
first levels pair a lane's chunk ``c`` with its chunk ``c + chunks/2`` (same lane, same
value: in registers) while the chunk count is even; the remaining ``width`` values (else
all ``D``) go to shared memory, where the row's lanes run one tree level per barrier
(``__syncwarp`` for a row within one warp, ``__syncthreads`` for a row over several). A
thread holding its whole row (``lanes == 1``) adds in registers; so does a row within one
warp whose remaining width is one vector per lane and a power of two (the levels across
lanes through ``shfl_down``: the same additions, no shared memory, no barrier). Several rows per CTA use
disjoint parts of the buffer, so a non-finite value stays in its row.

Buffers: a 2-D row buffer is ``[M, D]`` with row stride ``S0``; a 3-D one ``[M, N, D]``
with strides ``(S0, S1)``; ``row = t · N + n``. Strides are runtime values; every offset
is 64-bit (TileLang's index math), so tensors past 2^31 elements are fine.

No ``from __future__ import annotations``: TileLang evaluates macro annotations.
"""

import struct

import tilelang.language as T

from tileplug.backend_cuda.norm.spec import (PREFETCH_STAGES, NormKernelSpec, prefetch_shape, reduction_plan, shuffle_tree,
                                             takes_subtrees, tree_bytes, tree_levels)


def _halvings(width: int) -> list[int]:
    """The halves of a pairwise-halving tree on ``width`` (a power of two) values: width/2, …, 1."""
    halves = []
    while width > 1:
        width //= 2
        halves.append(width)
    return halves


def f32(value: float) -> float:
    """``value`` rounded to the nearest fp32 (host side: a scalar parameter in the compute dtype)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


class RowMacros:
    """The trace-time constants of a spec's row tile and the macros over them.

    Macros take the per-thread coordinates ``(t, n, lane, valid)`` made by :meth:`coords`:
    token, head, lane within the row, and whether the row exists (``row < R``). ``subtrees``
    False keeps :meth:`row_sum` off the warp-subtree form (``spec.ReductionPlan.subtrees``): the backward
    kernels where their spec says so (``spec.BACKWARD_SUBTREES_VARIABLE=0``)."""

    def __init__(self, spec: NormKernelSpec, rows_total, subtrees: bool = True) -> None:
        tile = spec.tile
        self.spec = spec
        self.D = spec.hidden
        self.VEC = spec.vec
        self.LANES = tile.lanes
        self.ROWS = tile.rows
        self.CHUNKS = tile.chunks
        self.THREADS = tile.threads
        self.VALUES = self.CHUNKS * self.VEC  # values of a row one thread holds
        self.HEADS = spec.heads  # None: 2-D buffers
        self.rows_total = rows_total
        self.vectorize = spec.vectorize
        D, VEC, LANES, CHUNKS, HEADS = self.D, self.VEC, self.LANES, self.CHUNKS, self.HEADS
        vectorize = self.vectorize
        plan = reduction_plan(D, tile, VEC)  # the reference's tree on this tile (Python lists: unrolled while tracing)
        LOCAL_ONLY = plan.local_steps is not None
        LOCAL_STEPS = plan.local_steps
        FOLD_STEPS = plan.fold_steps
        EXACT = plan.exact
        WRITTEN_CHUNKS = list(range(plan.written_chunks))
        WIDTH = plan.width
        LEVELS = plan.levels
        VALUE_INDICES = list(range(VEC))
        self.WIDTH = WIDTH
        # a row within one warp whose tree starts from exactly one vector per lane on a power of
        # two of values: the tree's levels run in registers — a level pairing values VEC or more
        # apart takes the partner from the lane h / VEC above (shfl_down within the row's lanes),
        # a closer level pairs two values of one thread — with the same additions as the shared
        # buffer's levels, bit for bit, and no barrier
        SHUFFLE = shuffle_tree(plan, tile, VEC)
        SHUFFLE_LEVELS = [h for _, h, _ in tree_levels(WIDTH)] if SHUFFLE else []
        self.shuffle_tree = SHUFFLE
        self.plan = plan
        # rows of whole warps whose tree splits into S subtrees of N values (spec.ReductionPlan):
        # each warp adds S / warps subtrees in registers and shuffles (lane l holding j = l + 32·m),
        # then every thread adds the S subtree sums in the tree's last levels
        SUBTREES = plan.subtrees if subtrees and takes_subtrees(plan, tile, VEC) else None
        self.SUBTREES = SUBTREES
        if SUBTREES is not None:
            S, N = SUBTREES
            # Python lists: unrolled while tracing
            PER_WARP = list(range(S // (LANES // 32)))
            SUBTREE_VALUES = list(range(N // 32))  # values of one subtree a lane holds
            SUMS = list(range(S))
            SUBTREE_STEPS = [(m, m + h // 32) for h in _halvings(N) if h >= 32 for m in range(h // 32)]
            SUBTREE_SHUFFLES = [h for h in _halvings(N) if h < 32]
            LAST_STEPS = [(i, last if (w % 2 == 0 and i == h - 1) else i + h) for w, h, last in tree_levels(S)
                          for i in range(h)]
        # chunk k of some lane may lie (partly) past D: only those chunks test their columns
        PARTIAL = [(k + 1) * LANES * VEC > D for k in range(CHUNKS)]
        KS = list(range(CHUNKS))

        def load(buf, t, n, col):
            return buf[t, col] if HEADS is None else buf[t, n, col]

        def chunk_ok(k, col, valid):
            """Whether the thread's whole vector ``k`` (first column ``col``) is stored/loaded."""
            if not PARTIAL[k]:
                return valid
            return col < D if valid is True else T.And(valid, col < D)

        @T.macro
        def store(buf, t, n, col, value):
            if HEADS is None:
                buf[t, col] = value
            else:
                buf[t, n, col] = value

        @T.macro
        def load_row(src, dst, t, n, lane, valid, dtype):
            """``dst[k·VEC + j]`` = column ``(k·lanes + lane)·VEC + j`` of the row (0 past D or R)."""
            for k in KS:
                col = (k * LANES + lane) * VEC
                if vectorize:
                    if chunk_ok(k, col, valid):
                        for j in T.vectorized(VEC):
                            dst[k * VEC + j] = load(src, t, n, col + j)
                    else:
                        for j in T.unroll(VEC):
                            dst[k * VEC + j] = T.cast(0, dtype)
                else:
                    for j in T.unroll(VEC):
                        if valid and col + j < D:
                            dst[k * VEC + j] = load(src, t, n, col + j)
                        else:
                            dst[k * VEC + j] = T.cast(0, dtype)

        @T.macro
        def load_vector(src, dst, lane, dtype):
            """A ``[D]`` vector (weight, bias) at the thread's columns (0 past D)."""
            for k in KS:
                col = (k * LANES + lane) * VEC
                if vectorize:
                    if chunk_ok(k, col, True):
                        for j in T.vectorized(VEC):
                            dst[k * VEC + j] = src[col + j]
                    else:
                        for j in T.unroll(VEC):
                            dst[k * VEC + j] = T.cast(0, dtype)
                else:
                    for j in T.unroll(VEC):
                        if col + j < D:
                            dst[k * VEC + j] = src[col + j]
                        else:
                            dst[k * VEC + j] = T.cast(0, dtype)

        @T.macro
        def store_row(dst, values, t, n, lane, valid):
            """Columns of the thread (``values`` in the buffer's dtype) into the row, within D."""
            for k in KS:
                col = (k * LANES + lane) * VEC
                if vectorize:
                    if chunk_ok(k, col, valid):
                        for j in T.vectorized(VEC):
                            store(dst, t, n, col + j, values[k * VEC + j])
                else:
                    for j in T.unroll(VEC):
                        if valid and col + j < D:
                            store(dst, t, n, col + j, values[k * VEC + j])

        @T.macro
        def load_input(x, residual, s, rv, t, n, lane, valid):
            """``s`` = the thread's values of ``x`` — with a residual ``round_to(x.dtype, x + residual)``
            (added in fp32), the values ``residual_out`` receives."""
            load_row(x, s, t, n, lane, valid, spec.in_dtype)
            if spec.residual:
                load_row(residual, rv, t, n, lane, valid, spec.in_dtype)
                for i in T.unroll(self.VALUES):
                    s[i] = T.cast(T.ieee_add(as_float(s, i), as_float(rv, i)), spec.in_dtype)

        @T.macro
        def barrier():
            if LANES <= 32:
                T.sync_warp()
            else:
                T.sync_threads()

        @T.macro
        def write_values(terms, tree, lane, base):
            """The tree's in-register first levels (``FOLD_STEPS``) on the thread's terms, then its
            ``WIDTH`` remaining values into the row's part of ``tree`` (from ``base``)."""
            for i, partner in FOLD_STEPS:
                terms[i] = T.ieee_add(terms[i], terms[partner])
            for c in WRITTEN_CHUNKS:
                col = (c * LANES + lane) * VEC
                if EXACT:
                    for j in T.vectorized(VEC):
                        tree[base + col + j] = terms[c * VEC + j]
                else:
                    for j in VALUE_INDICES:
                        if col + j < D:
                            tree[base + col + j] = terms[c * VEC + j]

        @T.macro
        def row_sums(term_sets, tree, acc, lane, slot):
            """``acc[c]`` = the row's sum of the fp32 terms ``term_sets[c]`` the threads hold
            (``terms[k·VEC + j]`` at the column of value ``j`` of vector ``k``), each added in the
            reference's order (:func:`tree_levels`); the sums share their barriers (one sum's
            additions never see another's). The terms are consumed; ``tree`` is the shared buffer of
            :meth:`RowMacros.tree_buffer` for ``len(term_sets)`` sums (one per CTA, reusable after
            :meth:`reuse_barrier`)."""
            SETS = list(range(len(term_sets)))
            if LOCAL_ONLY:
                for c in SETS:
                    for i, partner in LOCAL_STEPS:
                        term_sets[c][i] = T.ieee_add(term_sets[c][i], term_sets[c][partner])
                    acc[c] = term_sets[c][0]
            elif SUBTREES is not None:
                for c in SETS:
                    write_values(term_sets[c], tree, lane, (c * self.ROWS + slot) * WIDTH)
                barrier()
                warp = lane // 32
                warp_lane = lane % 32
                # sum c's S subtree sums of the row, after every sum's values
                sums_at = [(len(SETS) * self.ROWS * WIDTH) + (c * self.ROWS + slot) * S for c in SETS]
                for s in PER_WARP:
                    r = warp * len(PER_WARP) + s
                    for c in SETS:
                        for m in SUBTREE_VALUES:
                            term_sets[c][m] = tree[(c * self.ROWS + slot) * WIDTH + r + S * (warp_lane + 32 * m)]
                        for i, partner in SUBTREE_STEPS:
                            term_sets[c][i] = T.ieee_add(term_sets[c][i], term_sets[c][partner])
                    for h in SUBTREE_SHUFFLES:
                        for c in SETS:
                            term_sets[c][0] = T.ieee_add(term_sets[c][0], T.shfl_down(term_sets[c][0], h, 32))
                    if warp_lane == 0:
                        for c in SETS:
                            tree[sums_at[c] + r] = term_sets[c][0]
                barrier()
                # the last levels on the S sums, in the thread's consumed terms (a buffer of their own
                # where S is larger)
                for c in SETS:
                    last = term_sets[c] if S <= self.VALUES else T.alloc_local((S,), "float32")
                    for i in SUMS:
                        last[i] = tree[sums_at[c] + i]
                    for i, partner in LAST_STEPS:
                        last[i] = T.ieee_add(last[i], last[partner])
                    acc[c] = last[0]
            elif SHUFFLE:
                for c in SETS:
                    for i, partner in FOLD_STEPS:
                        term_sets[c][i] = T.ieee_add(term_sets[c][i], term_sets[c][partner])
                for h in SHUFFLE_LEVELS:
                    for c in SETS:
                        if h >= VEC:
                            for j in VALUE_INDICES:
                                term_sets[c][j] = T.ieee_add(term_sets[c][j],
                                                             T.shfl_down(term_sets[c][j], h // VEC, LANES))
                        else:
                            for j in range(h):
                                term_sets[c][j] = T.ieee_add(term_sets[c][j], term_sets[c][j + h])
                for c in SETS:
                    acc[c] = T.shfl_sync(term_sets[c][0], 0, LANES)
            else:
                for c in SETS:
                    write_values(term_sets[c], tree, lane, (c * self.ROWS + slot) * WIDTH)
                barrier()
                for h, last, rounds in LEVELS:
                    for offset, whole in rounds:
                        i = lane + offset
                        partner = i + h if last is None else T.if_then_else(i == h - 1, last, i + h)
                        for c in SETS:
                            base = (c * self.ROWS + slot) * WIDTH
                            if whole:
                                tree[base + i] = T.ieee_add(tree[base + i], tree[base + partner])
                            else:
                                if i < h:
                                    tree[base + i] = T.ieee_add(tree[base + i], tree[base + partner])
                    barrier()
                for c in SETS:
                    acc[c] = tree[(c * self.ROWS + slot) * WIDTH]

        @T.macro
        def row_sum(terms, tree, acc, lane, slot):
            """``acc[0]`` = the row's sum of the fp32 ``terms`` (:meth:`row_sums` of one sum)."""
            row_sums((terms,), tree, acc, lane, slot)

        @T.macro
        def store_statistic(buf, t, n, lane, valid, value):
            """One fp32 value per row (``[M]`` or ``[M, N]``), written by the row's first lane."""
            if valid and lane == 0:
                if HEADS is None:
                    buf[t] = value
                else:
                    buf[t, n] = value

        self.load_row = load_row
        self.load_input = load_input
        self.load_vector = load_vector
        self.store_row = store_row
        self.row_sum = row_sum
        self.row_sums = row_sums
        self.reuse_barrier = barrier
        self.store_statistic = store_statistic
        self.partial = PARTIAL
        self.chunk_ok = chunk_ok

    # ------------------------------------------------------------------ trace-time helpers
    def tree_buffer(self, sums: int = 1):
        """The shared fp32 buffer of :meth:`row_sums` over ``sums`` sums (each ``rows · WIDTH``
        values, then each ``rows · S`` subtree sums where the row splits into subtrees; a thread
        holding its whole row, or a row reduced by shuffles, needs none: one element)."""
        return T.alloc_shared((self.tree_bytes(sums) // 4,), "float32")

    def tree_bytes(self, sums: int = 1) -> int:
        """Shared bytes of :meth:`tree_buffer` over ``sums`` sums (``spec.tree_bytes``)."""
        return tree_bytes(self.plan, self.spec.tile, self.VEC, self.SUBTREES is not None, sums)

    def slot(self, tx):
        """Row of thread ``tx`` within its CTA."""
        return tx // self.LANES

    def coords(self, bx, tx):
        """(t, n, lane, valid) of thread ``tx`` in CTA ``bx``."""
        row = bx * self.ROWS + tx // self.LANES
        lane = tx % self.LANES
        if self.HEADS is None:
            return row, 0, lane, row < self.rows_total
        # 32-bit registers: the division by the head count once, not in 64 bits at every index
        token = T.alloc_var("int32", init=row // self.HEADS)
        head = T.alloc_var("int32", init=row % self.HEADS)
        return token, head, lane, row < self.rows_total

    def column(self, k: int, lane):
        """First column of the thread's vector ``k``."""
        return (k * self.LANES + lane) * self.VEC

    def in_row(self, k: int, j: int, lane):
        """Whether value ``j`` of vector ``k`` lies within D (a Python True where it always does)."""
        if self.vectorize and not self.partial[k]:
            return True
        if (k + 1) * self.LANES * self.VEC <= self.D:
            return True
        return self.column(k, lane) + j < self.D

    def grid(self):
        """CTAs of the launch: ``ceil(R / rows)`` along blockIdx.x (no 65535 limit)."""
        return T.ceildiv(self.rows_total, self.ROWS)


class RowPrefetch:
    """How a backward row loop gets its rows of ``grad_y`` and ``x``: copied one iteration ahead
    into shared memory with ``cp.async`` (``enabled``: the spec's ``prefetch``, 128-bit tiles
    only), else loaded directly (:meth:`RowMacros.load_row`).

    With the copies, a CTA's loop over its ``count`` row iterations takes iteration ``i``'s rows
    of each source from stage ``i % 2`` of the staging buffer while the copies of iteration
    ``i + 1`` into stage ``(i + 1) % 2`` are in flight: the next row's loads overlap this row's
    reductions, barriers and stores instead of waiting for them. Each thread copies and reads back
    only its own vectors (``cp.async.wait_group`` makes a thread's copies visible to itself), so
    no barrier guards a stage; a stage is written again one iteration after it was read, with the
    row's barriers in between. A vector past ``D`` or of a row past ``R`` is zero-filled (its copy
    reads nothing), as :meth:`RowMacros.load_row` loads 0 there.

    Shared memory: ``spec.prefetch_shape`` (``PREFETCH_STAGES`` stages), ``2 · sources · rows · lanes ·
    chunks · 16`` bytes (57344 at D = 7168 bf16, two sources): beyond the 48 KB default, which
    TileLang's launcher raises for the kernel; ``spec.prefetch_bytes`` counts the same for the
    choice of the prefetch.

    Macros: :attr:`start` (``start(staged, sources, first, tx)``: before the loop, the first
    iteration's copies), :attr:`load` (``load(staged, sources, values, first, i, count, tx,
    coords)``: at the top of iteration ``i``, the rows of ``sources`` into the registers
    ``values``; ``coords`` are the iteration's ``(t, n, lane, valid)``) and :attr:`finish`
    (after the loop)."""

    def __init__(self, rows: RowMacros, sources: int, enabled: bool) -> None:
        assert rows.vectorize or not enabled, "cp.async copies whole 128-bit vectors"
        LANES, VEC = rows.LANES, rows.VEC
        KS = list(range(rows.CHUNKS))
        SOURCES = list(range(sources))
        ENABLED = enabled
        IN = rows.spec.in_dtype
        self.enabled = enabled
        self.dtype = IN
        self.shape = prefetch_shape(rows.spec.tile, VEC, sources)
        STAGES = PREFETCH_STAGES
        HEADS = rows.HEADS

        def element(src, t, n, col):
            return src[t, col] if HEADS is None else src[t, n, col]

        @T.macro
        def issue(staged, stage, sources, row, tx):
            """Start the copies of the thread's vectors of CTA row iteration ``row`` (the argument
            :meth:`RowMacros.coords` takes) of every source into ``stage``; then one commit."""
            t, n, lane, valid = rows.coords(row, tx)
            slot = rows.slot(tx)
            for s in SOURCES:
                for k in KS:
                    col = (k * LANES + lane) * VEC
                    T.ptx_cp_async(T.access_ptr(staged[stage, s, slot, col], "w", VEC),
                                   T.access_ptr(element(sources[s], t, n, col), "r", VEC), VEC,
                                   predicate=rows.chunk_ok(k, col, valid))
            T.ptx_commit_group()

        @T.macro
        def start(staged, sources, first, tx):
            if ENABLED:
                issue(staged, 0, sources, first, tx)

        @T.macro
        def load(staged, sources, values, first, i, count, tx, coords):
            t, n, lane, valid = coords
            if ENABLED:
                # iteration i + 1's copies, then the wait for iteration i's (an empty group after
                # the last iteration keeps the wait's count right)
                if i + 1 < count:
                    issue(staged, (i + 1) % STAGES, sources, first + i + 1, tx)
                else:
                    T.ptx_commit_group()
                T.ptx_wait_group(STAGES - 1)
                slot = rows.slot(tx)
                for s in SOURCES:
                    for k in KS:
                        col = (k * LANES + lane) * VEC
                        for j in T.vectorized(VEC):
                            values[s][k * VEC + j] = staged[i % STAGES, s, slot, col + j]
            else:
                for s in SOURCES:
                    rows.load_row(sources[s], values[s], t, n, lane, valid, IN)

        @T.macro
        def finish():
            """After the loop: every copy complete (the last iteration's empty group included), so
            no copy into shared memory outlives the loop."""
            if ENABLED:
                T.ptx_wait_group(0)

        self.start, self.load, self.finish = start, load, finish

    def buffer(self):
        """The staging buffer (one per CTA; None without the copies)."""
        return T.alloc_shared(self.shape, self.dtype) if self.enabled else None


# ---------------------------------------------------------------------- buffer types


def packed_words(values):
    """A thread's local buffer of an even number of 16-bit values seen as its 32-bit words (word ``i``
    holds values ``2i`` in its lower half and ``2i + 1`` in its upper half)."""
    return T.view(values, (values.shape[0] // 2,), "uint32")


PLUS_ZERO_HELPERS = """
#ifndef TILEPLUG_PLUS_ZERO_HELPERS
#define TILEPLUG_PLUS_ZERO_HELPERS
__device__ __forceinline__ unsigned tileplug_plus_zero_bf16x2(unsigned pair) {
  unsigned sum;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(sum) : "r"(pair), "r"(0x3F803F80u), "r"(0u));
  return sum;
}
__device__ __forceinline__ unsigned tileplug_plus_zero_f16x2(unsigned pair) {
  unsigned sum;
  asm("add.rn.f16x2 %0, %1, %2;" : "=r"(sum) : "r"(pair), "r"(0u));
  return sum;
}
#endif
"""
"""The kernel prelude (``T.Kernel(prelude=...)``) of :func:`plus_zero`."""
PLUS_ZERO_FUNCTIONS = {"bfloat16": "tileplug_plus_zero_bf16x2", "float16": "tileplug_plus_zero_f16x2"}


def takes_plus_zero(dtype: str | None, values: int) -> bool:
    """Whether :func:`plus_zero` serves a local buffer of ``values`` elements of ``dtype``."""
    return dtype in PLUS_ZERO_FUNCTIONS and values % 2 == 0


@T.macro
def plus_zero(values):
    """``values[i] + 0`` of every element of a thread's 16-bit local buffer, two values an
    instruction (a packed ``w · 1 + 0`` / ``w + 0``, the kernel's prelude :data:`PLUS_ZERO_HELPERS`):
    exact, but ``−0`` becomes ``+0`` and a NaN the canonical one. ``float(w + 0)`` then equals
    ``float(w) + 0`` in fp32 for every ``w`` but a NaN's payload, which the fp32 product the value
    enters canonicalizes either way: the RMSNorm weight factor ``float(w) + weight_offset`` at offset
    0 without an fp32 addition a value."""
    words = packed_words(values)
    for i in T.unroll(values.shape[0] // 2):
        words[i] = T.call_extern("uint32", PLUS_ZERO_FUNCTIONS[str(values.dtype)], words[i])


def over_width(value, width: int):
    """fp32 ``value / width`` correctly rounded: a product by ``1 / width`` where ``width`` is a power of
    two (the same real number, so the same rounding, subnormals and signs included; ``__fdiv_rn`` by a
    constant is a reciprocal, a Newton step and a range check with a slow path: 9 instructions
    more a row at D = 128), else the IEEE division."""
    if width & (width - 1) == 0:
        return T.ieee_mul(value, T.float32(1.0 / width))
    return T.ieee_fdiv(value, T.float32(width))


def as_float(values, i):
    """The fp32 value of element ``i`` of a thread's local row buffer ``values``. A bf16 buffer
    is read as its 32-bit words: an odd element is the word's upper half (one mask), an even one
    the lower half shifted up (one shift); a cast of the 16-bit element costs ptxas an extract
    (``PRMT``) before the shift. The same fp32 value either way (a bf16 is an fp32's upper half)."""
    if str(values.dtype) != "bfloat16" or values.shape[0] % 2:
        return T.cast(values[i], "float32")
    word = packed_words(values)[i // 2]
    upper, lower = word & T.uint32(0xFFFF0000), T.shift_left(word, 16)
    if isinstance(i, int):
        return T.reinterpret(upper if i % 2 else lower, "float32")
    return T.reinterpret(T.if_then_else(i % 2 == 1, upper, lower), "float32")


def row_buffer(spec: NormKernelSpec, prefix: str, dtype: str, rows, present: bool = True):
    """A row buffer ``[M, D]`` / ``[M, N, D]`` with its own runtime strides; an absent one
    (the launcher passes ``x`` in its place, never read) gets its own runtime shape."""
    if not present:
        if spec.heads is None:
            return T.StridedTensor((T.dynamic(prefix + "A"), T.dynamic(prefix + "B")), (T.dynamic(prefix + "C"), 1),
                                   spec.in_dtype)
        return T.StridedTensor((T.dynamic(prefix + "A"), T.dynamic(prefix + "B"), T.dynamic(prefix + "E")),
                               (T.dynamic(prefix + "C"), T.dynamic(prefix + "F"), 1), spec.in_dtype)
    if spec.heads is None:
        return T.StridedTensor((rows, spec.hidden), (T.dynamic(prefix + "S0"), 1), dtype)
    return T.StridedTensor((rows, spec.heads, spec.hidden), (T.dynamic(prefix + "S0"), T.dynamic(prefix + "S1"), 1),
                           dtype)


def vector_buffer(spec: NormKernelSpec, prefix: str, dtype: str | None):
    """A ``[D]`` vector (weight, bias), or an absent one (``x`` is passed, never read)."""
    if dtype is None:
        return row_buffer(spec, prefix, spec.in_dtype, None, present=False)
    return T.Tensor((spec.hidden,), dtype)


def statistic_buffer(spec: NormKernelSpec, prefix: str, rows, present: bool):
    """fp32 per-row statistics ``[M]`` / ``[M, N]``, or an absent one (``x`` is passed)."""
    if not present:
        return row_buffer(spec, prefix, spec.in_dtype, None, present=False)
    return T.Tensor((rows,) if spec.heads is None else (rows, spec.heads), "float32")


def aligned_strides(spec: NormKernelSpec, *buffers) -> list:
    """The runtime strides the kernel assumes are multiples of VEC (with 128-bit accesses:
    the contract's ``alignment``; the launcher gives size-1 dims such strides); the kernel
    body states ``T.assume(stride % VEC == 0)`` for each."""
    if not spec.vectorize:
        return []
    return [stride for buffer in buffers for stride in buffer.strides[:-1]]
