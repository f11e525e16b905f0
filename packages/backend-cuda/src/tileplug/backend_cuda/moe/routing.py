"""The expert layout kernels shared by ``moe_expert_counts``, ``moe_permute`` (and read by
``moe_unpermute``): counting and a stable, deterministic placement without atomics.

The ``T·K`` (token, slot) pairs are cut into fixed *chunks* of ``CHUNK_TOKENS`` tokens (a
constant of ``K``, never of ``T`` or the device). Every position is computed by exactly one
thread, never raced:

1. ``chunk_counts`` (one CTA per chunk): the chunk's expert ids go to shared memory (an id
   outside ``[0, E)`` becomes −1: not routed); thread ``e`` counts the pairs routed to expert
   ``e`` in pair order → ``partial[chunk, e]``.
2. ``expert_scan`` (one CTA of 1024 threads, ``E ≤ 1024``): thread ``e`` adds its column of
   ``partial`` in chunk order → ``counts[e]``; an inclusive scan over experts (Hillis–Steele
   in shared memory) of ``align(counts[e], alignment)`` gives ``start[e]`` and
   ``expert_ends[e] = start[e] + counts[e]``; with ``bases``, ``partial[chunk, e]`` becomes
   the first row of expert ``e`` that chunk fills (``start[e]`` + the counts of earlier chunks).
3. ``permute_index`` (one CTA per chunk): thread ``e`` walks the chunk's pairs in order and
   gives the ``j``-th pair routed to ``e`` the row ``partial[chunk, e] + j``:
   ``permutation[t, s]`` (−1: not routed). Rows of an expert follow token order (then slot order).

With ``spec.batched`` (``spec.BATCHED_LAYOUT_VARIABLE``) step 2 loads ``SCAN_BATCH`` chunk counts at a
time, and steps 1 and 3 rank the chunk's pairs in
batches of ``COUNT_THREADS`` instead (:func:`_match_ranks`): thread ``i`` of a batch takes pair
``batch · COUNT_THREADS + i``; ``__match_any_sync`` gives each lane the lanes of its warp routed to the
same expert, so its place among them (the lanes below it) and, for the lowest such lane, the warp's
count of that expert (``warp_counts[w, e]``); a pair's row is its expert's running base plus the
counts of the batch's earlier warps plus its place; the bases then gain the batch's counts. The same
numbers: every count is an exact integer, and a pair's row is the number of the chunk's earlier pairs
routed to its expert (plus the chunk's first row), whichever way they are counted.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.moe.spec import SCAN_BATCH, SCAN_THREADS, WARP, LayoutSpec, chunk_tokens

COUNT_THREADS = 256
COUNT_WARPS = COUNT_THREADS // WARP
FULL_WARP = 0xFFFFFFFF


def _load_chunk(topk_idx, chunk, tx, experts, K, CT, rows, NT):
    """Macro body: the chunk's expert ids into shared memory (−1: not routed or past T)."""

    @T.macro
    def load(ids):
        for step in T.serial(T.ceildiv(CT * K, NT)):
            i = step * NT + tx
            if i < CT * K:
                t = chunk * CT + i // K
                ids[i] = -1
                if t < rows:
                    expert = topk_idx[t, i % K]
                    if T.And(expert >= 0, expert < experts):
                        ids[i] = T.cast(expert, "int32")
        T.sync_threads()

    return load


def _match_ranks(topk_idx, chunk, tx, experts, K, CT, rows, with_rows: bool):
    """Macro body (``spec.batched``): the chunk's pairs, a batch of ``COUNT_THREADS`` at a time, in
    pair order, with each expert's running ``base`` in shared memory. Without ``with_rows`` the bases
    start at 0 and end as the chunk's counts, written to ``partial[chunk, e]``; with ``with_rows`` they
    start at ``partial[chunk, e]`` (the scan's first rows) and each pair's row (its expert's base before
    it, plus the earlier pairs of its batch routed there) goes to ``permutation[t, slot]`` (−1: not
    routed), for every pair of a row below ``T``."""
    BATCHES = -(-(CT * K) // COUNT_THREADS)
    E = experts
    EXPERT_STEPS = -(-E // COUNT_THREADS)

    @T.macro
    def ranks(partial, permutation):
        lane = tx % WARP
        warp = tx // WARP
        base = T.alloc_shared((E,), "int32")
        warp_counts = T.alloc_shared((COUNT_WARPS, E), "int32")
        ids = T.alloc_local((BATCHES,), "int32")
        same = T.alloc_local((1,), "uint32")
        place = T.alloc_local((1,), "int32")
        row = T.alloc_local((1,), "int32")
        for step in T.serial(EXPERT_STEPS):
            if step * COUNT_THREADS + tx < E:
                base[step * COUNT_THREADS + tx] = partial[chunk, step * COUNT_THREADS + tx] if with_rows else 0
        for b in T.unroll(BATCHES):  # every batch's expert id first: the loads overlap
            i = b * COUNT_THREADS + tx
            t = chunk * CT + i // K
            ids[b] = -1
            if T.And(i < CT * K, t < rows):
                expert = topk_idx[t, i % K]
                if T.And(expert >= 0, expert < E):
                    ids[b] = T.cast(expert, "int32")
        for b in T.unroll(BATCHES):
            for step in T.serial(-(-(COUNT_WARPS * E) // COUNT_THREADS)):
                j = step * COUNT_THREADS + tx
                if j < COUNT_WARPS * E:
                    warp_counts[j // E, j % E] = 0
            T.sync_threads()
            # the lanes of this warp routed to the same expert; this lane's place among them
            same[0] = T.call_extern("uint32", "__match_any_sync", T.uint32(FULL_WARP), ids[b])
            place[0] = T.call_extern("int32", "__popc",
                                     same[0] & (T.shift_left(T.uint32(1), T.cast(lane, "uint32")) - T.uint32(1)))
            if T.And(ids[b] >= 0, place[0] == 0):
                warp_counts[warp, ids[b]] = T.call_extern("int32", "__popc", same[0])
            T.sync_threads()
            if with_rows:
                i = b * COUNT_THREADS + tx
                t = chunk * CT + i // K
                if ids[b] >= 0:
                    row[0] = base[ids[b]] + place[0]
                    for w in T.serial(COUNT_WARPS):
                        if w < warp:
                            row[0] = row[0] + warp_counts[w, ids[b]]
                else:
                    row[0] = -1
                if T.And(i < CT * K, t < rows):
                    permutation[t, i % K] = row[0]
                T.sync_threads()
            for step in T.serial(EXPERT_STEPS):
                e = step * COUNT_THREADS + tx
                if e < E:
                    for w in T.serial(COUNT_WARPS):
                        base[e] = base[e] + warp_counts[w, e]
            T.sync_threads()
        if not with_rows:
            for step in T.serial(EXPERT_STEPS):
                if step * COUNT_THREADS + tx < E:
                    partial[chunk, step * COUNT_THREADS + tx] = base[step * COUNT_THREADS + tx]

    return ranks


def build_chunk_counts(spec: LayoutSpec):
    """``(topk_idx [T, K], partial [C, E])``: the pairs of each chunk routed to each expert."""
    E, K = spec.experts, spec.slots
    CT = chunk_tokens(K)
    rows, chunks = T.dynamic("T"), T.dynamic("C")
    idx_t = T.StridedTensor((rows, K), (T.dynamic("I0"), 1), spec.index_dtype)

    if spec.batched:

        @T.prim_func
        def kernel(topk_idx: idx_t, partial: T.Tensor((chunks, E), "int32")):
            with T.Kernel(chunks, threads=COUNT_THREADS) as bx:
                tx = T.get_thread_binding()
                _match_ranks(topk_idx, bx, tx, E, K, CT, rows, False)(partial, partial)

        return kernel.with_attr("global_symbol", spec.name)

    @T.prim_func
    def kernel(topk_idx: idx_t, partial: T.Tensor((chunks, E), "int32")):
        with T.Kernel(chunks, threads=COUNT_THREADS) as bx:
            tx = T.get_thread_binding()
            ids = T.alloc_shared((CT * K,), "int32")
            count = T.alloc_local((1,), "int32")
            _load_chunk(topk_idx, bx, tx, E, K, CT, rows, COUNT_THREADS)(ids)
            for step in T.serial(T.ceildiv(E, COUNT_THREADS)):
                expert = step * COUNT_THREADS + tx
                if expert < E:
                    count[0] = 0
                    for i in T.serial(CT * K):
                        count[0] = count[0] + T.if_then_else(ids[i] == expert, 1, 0)
                    partial[bx, expert] = count[0]

    return kernel.with_attr("global_symbol", spec.name)


def build_expert_scan(spec: LayoutSpec):
    """``(partial [C, E], counts [E], expert_ends [E])``; with ``spec.bases`` ``partial`` is
    overwritten with each chunk's first row per expert."""
    E, ALIGN = spec.experts, spec.alignment
    chunks = T.dynamic("C")
    LEVELS = []
    step = 1
    while step < SCAN_THREADS:
        LEVELS.append(step)
        step *= 2

    @T.macro
    def load_batch(partial, batch, e, counts_in):
        """``counts_in[i]`` = expert ``e``'s count in chunk ``batch · SCAN_BATCH + i`` (0 past the last chunk):
        ``SCAN_BATCH`` independent loads in flight (``spec.batched``)."""
        for i in T.unroll(SCAN_BATCH):
            counts_in[i] = T.if_then_else(batch * SCAN_BATCH + i < chunks, partial[batch * SCAN_BATCH + i, e], 0)

    @T.prim_func
    def kernel(partial: T.Tensor((chunks, E), "int32"), counts: T.Tensor((E,), "int32"),
               expert_ends: T.Tensor((E,), "int32")):
        with T.Kernel(1, threads=SCAN_THREADS) as bx:
            e = T.get_thread_binding()
            scan = T.alloc_shared((2, SCAN_THREADS), "int32")
            total = T.alloc_local((1,), "int32")
            running = T.alloc_local((1,), "int32")
            value = T.alloc_local((1,), "int32")
            counts_in = T.alloc_local((SCAN_BATCH,), "int32")
            total[0] = 0
            if e < E:
                if spec.batched:  # SCAN_BATCH independent loads in flight, then their sum (integers: any order)
                    for batch in T.serial(T.ceildiv(chunks, SCAN_BATCH)):
                        load_batch(partial, batch, e, counts_in)
                        for i in T.unroll(SCAN_BATCH):
                            total[0] = total[0] + counts_in[i]
                else:
                    for b in T.serial(chunks):
                        total[0] = total[0] + partial[b, e]
            scan[0, e] = T.if_then_else(e < E, (total[0] + (ALIGN - 1)) // ALIGN * ALIGN, 0)
            T.sync_threads()
            for level, distance in enumerate(LEVELS):
                source, target = level % 2, 1 - level % 2
                scan[target, e] = scan[source, e] + T.if_then_else(e >= distance, scan[source, e - distance], 0)
                T.sync_threads()
            inclusive = scan[len(LEVELS) % 2, e]
            if e < E:
                start = inclusive - (total[0] + (ALIGN - 1)) // ALIGN * ALIGN
                counts[e] = total[0]
                expert_ends[e] = start + total[0]
                if spec.bases:
                    running[0] = start
                    if spec.batched:
                        for batch in T.serial(T.ceildiv(chunks, SCAN_BATCH)):
                            load_batch(partial, batch, e, counts_in)
                            for i in T.unroll(SCAN_BATCH):
                                if batch * SCAN_BATCH + i < chunks:
                                    partial[batch * SCAN_BATCH + i, e] = running[0]
                                running[0] = running[0] + counts_in[i]
                    else:
                        for b in T.serial(chunks):
                            value[0] = partial[b, e]
                            partial[b, e] = running[0]
                            running[0] = running[0] + value[0]

    return kernel.with_attr("global_symbol", spec.name)


def build_permute_index(spec: LayoutSpec):
    """``(topk_idx [T, K], partial [C, E] (bases), permutation [T, K])``."""
    E, K = spec.experts, spec.slots
    CT = chunk_tokens(K)
    rows, chunks = T.dynamic("T"), T.dynamic("C")
    idx_t = T.StridedTensor((rows, K), (T.dynamic("I0"), 1), spec.index_dtype)

    if spec.batched:

        @T.prim_func
        def kernel(topk_idx: idx_t, partial: T.Tensor((chunks, E), "int32"), permutation: T.Tensor((rows, K), "int32")):
            with T.Kernel(chunks, threads=COUNT_THREADS) as bx:
                tx = T.get_thread_binding()
                _match_ranks(topk_idx, bx, tx, E, K, CT, rows, True)(partial, permutation)

        return kernel.with_attr("global_symbol", spec.name)

    @T.prim_func
    def kernel(topk_idx: idx_t, partial: T.Tensor((chunks, E), "int32"), permutation: T.Tensor((rows, K), "int32")):
        with T.Kernel(chunks, threads=COUNT_THREADS) as bx:
            tx = T.get_thread_binding()
            ids = T.alloc_shared((CT * K,), "int32")
            rows_of = T.alloc_shared((CT * K,), "int32")
            row = T.alloc_local((1,), "int32")
            _load_chunk(topk_idx, bx, tx, E, K, CT, rows, COUNT_THREADS)(ids)
            for step in T.serial(T.ceildiv(CT * K, COUNT_THREADS)):
                i = step * COUNT_THREADS + tx
                if i < CT * K:
                    rows_of[i] = -1
            T.sync_threads()
            for step in T.serial(T.ceildiv(E, COUNT_THREADS)):
                expert = step * COUNT_THREADS + tx
                if expert < E:
                    row[0] = partial[bx, expert]
                    for i in T.serial(CT * K):
                        if ids[i] == expert:
                            rows_of[i] = row[0]
                            row[0] = row[0] + 1
            T.sync_threads()
            for step in T.serial(T.ceildiv(CT * K, COUNT_THREADS)):
                i = step * COUNT_THREADS + tx
                t = bx * CT + i // K
                if i < CT * K:
                    if t < rows:
                        permutation[t, i % K] = rows_of[i]

    return kernel.with_attr("global_symbol", spec.name)
