"""The warp top-k of the CUDA MoE routing kernels (TileLang macros), shared by ``topk_gate``,
``moe_topk_gate`` and ``moe_topk_gate_backward``.

Layout (:class:`WarpRow`): one warp per row of ``E`` values. Lane ``l`` holds ``CHUNKS``
pieces of ``VEC`` values, piece ``j`` being columns ``[(j·32 + l)·VEC, + VEC)``: consecutive
lanes read consecutive pieces (up to 16 bytes each on the vector path, ``spec.gate_vec``;
coalesced; one value each on the scalar path). A lane's values are held in increasing column order, so its own first
maximum is its smallest column holding it.

Selection ("repeatedly take the max, ties to the smaller index"): each value is turned into
an order-preserving int32 *key* (:meth:`WarpRow.key`: the fp32 bits with the magnitude bits
of negatives flipped, ``-0.0`` first made ``+0.0`` so the two zeros tie as they do in a
stable sort). One round is a lane's own first maximum (strict ``>`` in column order), then
the warp's maximum key (one ``redux.sync.max``), then the smallest column among the lanes
holding that key (one ``redux.sync.min``): the index is exact. The chosen column's key then
becomes ``NONE`` (below every finite value's key), and so is every column past ``E`` or
excluded by a group mask. Only finite values are ever ranked: a row holding a non-finite
value is detected first (``__any_sync``) and never selected from. The gates' default rounds
(:meth:`WarpRow.lane_heads`) keep each lane's two first entries instead, so that a round reduces
the heads only; they choose the same columns in the same order.

No ``from __future__ import annotations``: TileLang evaluates macro annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.moe.spec import lane_chunks
from tileplug.backend_cuda.norm.spec import RowTile, reduction_plan

WARP = 32
NONE = -(2**31)
"""The key of a column that can no longer be chosen (taken, masked, or past ``E``)."""
MAGNITUDE = 0x7FFFFFFF
NO_COLUMN = 1 << 30
"""The column of a lane holding no candidate (larger than every ``E``)."""


def key_of(value):
    """Order-preserving int32 key of a finite fp32 ``value`` (``-0.0`` and ``+0.0`` equal)."""
    bits = T.reinterpret(T.ieee_add(value, T.float32(0.0)), "int32")
    return T.bitwise_xor(bits, T.bitwise_and(T.shift_right(bits, 31), MAGNITUDE))


def value_of(key):
    """The fp32 value of a key (the map is its own inverse)."""
    return T.reinterpret(T.bitwise_xor(key, T.bitwise_and(T.shift_right(key, 31), MAGNITUDE)), "float32")


class WarpRow:
    """Trace-time constants of one warp's row of ``experts`` values and the macros over them.

    ``vec``: values per piece (``spec.gate_vec``: up to 4 fp32 / 8 bf16, 1 on the scalar path).
    Register arrays of a lane have ``VALUES = CHUNKS · VEC`` entries, entry ``i = j·VEC + c``
    being column :meth:`column` ``(i, lane)``."""

    def __init__(self, experts: int, vec: int, fixed_heads: bool = False) -> None:
        self.E = experts
        FIXED = fixed_heads  # the heads stay in place, ``dropped`` says which is current (``heads_round``)
        self.VEC = vec
        self.CHUNKS = lane_chunks(experts, vec)
        self.VALUES = self.CHUNKS * vec
        E, VEC, CHUNKS, VALUES = self.E, self.VEC, self.CHUNKS, self.VALUES
        # piece j of some lane lies (partly) past E: only those pieces test their columns
        PARTIAL = [(j + 1) * WARP * VEC > E for j in range(CHUNKS)]
        self.partial = PARTIAL
        PIECES = list(range(CHUNKS))  # Python lists: unrolled while tracing
        ENTRIES = list(range(VALUES))
        LANE_VALUES = list(range(VEC))
        self.entries = ENTRIES
        # the reference's pairwise tree (tileplug.core.norm.formulas.row_sum) on this layout:
        # the norm rows' plan (a lane's vector k is columns [(k·32 + lane)·VEC, + VEC) there too)
        plan = reduction_plan(experts, RowTile(WARP, 1, CHUNKS), vec)
        FOLD_STEPS, EXACT, LEVELS = plan.fold_steps, plan.exact, plan.levels
        WRITTEN_CHUNKS = list(range(plan.written_chunks))
        self.TREE_WIDTH = plan.width

        def column(i, lane):
            return ((i // VEC) * WARP + lane) * VEC + i % VEC

        self.column = column

        def present(i, lane):
            """Whether entry ``i`` of the lane is a column of the row (Python True where always)."""
            if not PARTIAL[i // VEC]:
                return True
            return column(i, lane) < E

        self.present = present

        def current(pair, second, first_round):
            """Of a head register ``pair`` (fixed heads), the current one: ``pair[1]`` where ``second`` (the lane
            gave up its first), else ``pair[0]``; ``pair[0]`` where the round is known to be the first."""
            return pair[0] if first_round else T.if_then_else(second, pair[1], pair[0])

        @T.macro
        def load_row(src, t, lane, dst):
            """``dst[i]`` = fp32 of column ``column(i, lane)`` of row ``t`` of ``src`` (0 past E)."""
            for j in PIECES:
                col = (j * WARP + lane) * VEC
                if VEC > 1:
                    if PARTIAL[j]:
                        if col < E:
                            for c in T.vectorized(VEC):
                                dst[j * VEC + c] = T.cast(src[t, col + c], "float32")
                        else:
                            for c in LANE_VALUES:
                                dst[j * VEC + c] = T.float32(0.0)
                    else:
                        for c in T.vectorized(VEC):
                            dst[j * VEC + c] = T.cast(src[t, col + c], "float32")
                else:
                    if PARTIAL[j]:
                        dst[j] = T.if_then_else(col < E, T.cast(src[t, T.min(col, E - 1)], "float32"), T.float32(0.0))
                    else:
                        dst[j] = T.cast(src[t, col], "float32")

        @T.macro
        def store_row(dst, t, lane, values):
            """Column ``column(i, lane)`` of row ``t`` of ``dst`` = ``values[i]`` (within E)."""
            for j in PIECES:
                col = (j * WARP + lane) * VEC
                if PARTIAL[j]:
                    if col < E:
                        for c in T.vectorized(VEC):
                            dst[t, col + c] = values[j * VEC + c]
                else:
                    for c in T.vectorized(VEC):
                        dst[t, col + c] = values[j * VEC + c]

        @T.macro
        def all_finite(values, lane, flag):
            """``flag[0]`` = 1 when every value of the row (all lanes) is finite, else 0 (uniform)."""
            flag[0] = 1
            for i in ENTRIES:
                if present(i, lane):
                    if not T.isfinite(values[i]):
                        flag[0] = 0
            flag[0] = T.all_sync(flag[0])

        @T.macro
        def argmax(keys, lane, best, where, found, index):
            """One selection round: ``found[0]`` = the warp's largest key, ``index[0]`` = the smallest
            column holding it (uniform); ``best`` / ``where``: the lane's own first maximum."""
            best[0] = NONE
            where[0] = NO_COLUMN
            for i in ENTRIES:
                if keys[i] > best[0]:
                    best[0] = keys[i]
                    where[0] = column(i, lane)
            found[0] = T.warp_reduce_max(best[0])
            index[0] = T.warp_reduce_min(T.if_then_else(best[0] == found[0], where[0], NO_COLUMN))

        @T.macro
        def fill_heads(keys, values, lane, heads, refill):
            """The lane's two ``heads`` (:meth:`WarpRow.lane_heads`) = its first two entries in the order
            (key descending, column ascending): among those after the last one it gave up when
            ``refill``, else among all (and nothing given up yet); ``(NONE, NO_COLUMN)`` where it holds
            fewer. ``values`` (None: none) travel with their keys. A strict ``>`` in column order keeps
            ties in column order; both new heads are computed before either is written."""
            head_key, head_column, head_value, after_key, after_column, dropped = heads
            head_key[0] = NONE
            head_key[1] = NONE
            head_column[0] = NO_COLUMN
            head_column[1] = NO_COLUMN
            if not refill:
                if not FIXED:  # (fixed heads: the refill takes its threshold from the second head)
                    after_key[0] = NONE
                    after_column[0] = NO_COLUMN
                if values is not None:
                    head_value[0] = T.float32(0.0)
                    head_value[1] = T.float32(0.0)
            dropped[0] = 0
            for i in ENTRIES:
                if refill:
                    later = (keys[i] < after_key[0]) | ((keys[i] == after_key[0]) & (column(i, lane) > after_column[0]))
                    above_first = later & (keys[i] > head_key[0])
                    above_second = later & (keys[i] > head_key[1])
                else:
                    above_first = keys[i] > head_key[0]
                    above_second = keys[i] > head_key[1]
                head_key[1] = T.if_then_else(above_first, head_key[0],
                                             T.if_then_else(above_second, keys[i], head_key[1]))
                head_column[1] = T.if_then_else(above_first, head_column[0],
                                                T.if_then_else(above_second, column(i, lane), head_column[1]))
                if values is not None:
                    head_value[1] = T.if_then_else(above_first, head_value[0],
                                                   T.if_then_else(above_second, values[i], head_value[1]))
                    head_value[0] = T.if_then_else(above_first, values[i], head_value[0])
                head_key[0] = T.if_then_else(above_first, keys[i], head_key[0])
                head_column[0] = T.if_then_else(above_first, column(i, lane), head_column[0])

        @T.macro
        def heads_round(keys, values, lane, heads, round_index, found, index, picked):
            """One selection round over the lanes' ``heads`` (:meth:`WarpRow.lane_heads`): ``found[0]`` /
            ``index[0]`` as :func:`argmax` gives them over the entries not yet chosen, ``picked[0]`` (with
            ``values``) the chosen entry's value in every lane, and the lane whose current head is
            ``index`` gives it up: the second moves up (with ``fixed_heads`` nothing moves: ``dropped``
            says which head is current, and the second head given up is the refill's threshold). From the
            third round on, a lane that gave up both heads first refills them (a warp-uniform branch, taken
            where one lane holds three of the chosen)."""
            head_key, head_column, head_value, after_key, after_column, dropped = heads
            if round_index >= 2:
                if T.any_sync(dropped[0] == 2):
                    if dropped[0] == 2:
                        if FIXED:
                            after_key[0] = head_key[1]
                            after_column[0] = head_column[1]
                        fill_heads(keys, values, lane, heads, True)
            if FIXED:
                # the current head: the first until it is given up, then the second (dropped is 0 or 1 here;
                # the first round of unrolled rounds knows it is 0)
                first_round = isinstance(round_index, int) and round_index == 0
                second = dropped[0] != 0
                current_key = current(head_key, second, first_round)
                current_column = current(head_column, second, first_round)
                found[0] = T.warp_reduce_max(current_key)
                index[0] = T.warp_reduce_min(T.if_then_else(current_key == found[0], current_column, NO_COLUMN))
                if values is not None:
                    current_value = current(head_value, second, first_round)
                    picked[0] = T.shfl_sync(current_value, (index[0] // VEC) % WARP)
                if current_column == index[0]:
                    dropped[0] = dropped[0] + 1
            else:
                found[0] = T.warp_reduce_max(head_key[0])
                index[0] = T.warp_reduce_min(T.if_then_else(head_key[0] == found[0], head_column[0], NO_COLUMN))
                if values is not None:
                    picked[0] = T.shfl_sync(head_value[0], (index[0] // VEC) % WARP)  # (broadcast, defined below)
                if head_column[0] == index[0]:
                    after_key[0] = head_key[0]
                    after_column[0] = head_column[0]
                    head_key[0] = head_key[1]
                    head_column[0] = head_column[1]
                    if values is not None:
                        head_value[0] = head_value[1]
                    head_key[1] = NONE
                    head_column[1] = NO_COLUMN
                    dropped[0] = dropped[0] + 1

        @T.macro
        def take(keys, lane, index):
            """Column ``index`` can no longer be chosen."""
            for i in ENTRIES:
                if column(i, lane) == index:
                    keys[i] = NONE

        @T.macro
        def broadcast(value, index):
            """``value`` of the lane owning column ``index`` (all lanes call it)."""
            return T.shfl_sync(value, (index // VEC) % WARP)

        @T.macro
        def row_sum(terms, tree, base, lane, acc):
            """``acc[0]`` (every lane) = the sum of the row's fp32 ``terms`` (entries within E)
            added in the reference's order: ``row_sum``'s halving tree, value ``i < h`` of a
            level becoming ``v[i] + v[i + h]`` (an odd level's last value carried in place), each
            addition one IEEE fp32 add. The first levels pair a lane's chunk ``c`` with its chunk
            ``c + CHUNKS/2`` in registers where the row fills the lanes exactly; the rest run in
            the warp's part ``tree[base, base + TREE_WIDTH)`` of a shared buffer, one level per
            ``__syncwarp``. ``terms`` is consumed."""
            for i, partner in FOLD_STEPS:
                terms[i] = T.ieee_add(terms[i], terms[partner])
            for c in WRITTEN_CHUNKS:
                col = (c * WARP + lane) * VEC
                if EXACT:
                    for j in LANE_VALUES:
                        tree[base + col + j] = terms[c * VEC + j]
                else:
                    for j in LANE_VALUES:
                        if col + j < E:
                            tree[base + col + j] = terms[c * VEC + j]
            T.sync_warp()
            for h, last, rounds in LEVELS:
                for offset, whole in rounds:
                    i = lane + offset
                    partner = i + h if last is None else T.if_then_else(i == h - 1, last, i + h)
                    if whole:
                        tree[base + i] = T.ieee_add(tree[base + i], tree[base + partner])
                    else:
                        if i < h:
                            tree[base + i] = T.ieee_add(tree[base + i], tree[base + partner])
                T.sync_warp()
            acc[0] = tree[base]
            T.sync_warp()  # every lane has read the sum before the buffer is reused

        self.load_row = load_row
        self.row_sum = row_sum
        self.store_row = store_row
        self.all_finite = all_finite
        self.argmax = argmax
        self.take = take
        self.fill_heads = fill_heads
        self.heads_round = heads_round
        self.broadcast = broadcast

    def keys(self):
        """A lane's key registers."""
        return T.alloc_local((self.VALUES,), "int32")

    @staticmethod
    def rounds(count: int, unrolled: bool):
        """The iterator of ``count`` selection rounds: a Python list when ``unrolled`` (the rounds are
        unrolled while tracing, each round index a constant; a ``range`` would become a loop), else
        ``T.serial``."""
        return list(range(count)) if unrolled else T.serial(count)

    @staticmethod
    def lane_heads():
        """A lane's two *heads* (:data:`spec.LANE_HEADS_VARIABLE`): registers ``(head_key, head_column,
        head_value, after_key, after_column, dropped)``. The heads are the lane's first two entries not
        yet chosen in the selection order (key descending, column ascending) with their columns and
        values, ``(NONE, NO_COLUMN)`` where fewer remain; ``after_*`` is the last entry the lane gave up
        and ``dropped`` how many it gave up since it last filled its heads. Round by round the warp's
        largest head is the warp's largest entry not yet chosen (each lane's first head is its own),
        so the rounds choose what :func:`argmax` and :func:`take` choose, without visiting every entry
        each round."""
        return (T.alloc_local((2,), "int32"), T.alloc_local((2,), "int32"), T.alloc_local((2,), "float32"),
                T.alloc_local((1,), "int32"), T.alloc_local((1,), "int32"), T.alloc_local((1,), "int32"))
