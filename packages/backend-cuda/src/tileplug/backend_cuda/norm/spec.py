"""What a CUDA norm kernel is specialised on, derived from a ``NormCall``.

A :class:`NormKernelSpec` holds compile-time constants only: the op, the hidden size ``D``,
the head count of a 3-D input, dtypes, flags, the scalar parameters (``eps``,
``weight_offset``, ``out_scale``: fixed per model, so folded into the code), the per-token
cast of the fused op, and the row tile. The row count is a runtime value (``T.dynamic``),
and so are every row stride, so one compiled kernel serves every batch size and every
view of a configuration.

Row tile (:func:`row_tile`, a function of ``D`` and the dtype only, never of ``T``): a row
is ``NV = ceil(D / VEC)`` vectors of ``VEC`` values (16 bytes: 8 bf16/fp16, 4 fp32).
``lanes`` threads share a row; lane ``l`` holds the vectors ``k · lanes + l`` for
``k < chunks`` (consecutive lanes read consecutive 16-byte pieces: coalesced), so one
CTA of ``lanes × rows`` threads covers ``rows`` rows of capacity ``lanes · chunks · VEC``.

- small rows (``NV <= 32``): ``lanes`` = the next power of two >= NV, one vector each,
  ``128 / lanes`` rows per CTA (D = 64 bf16: 8 lanes, 16 rows);
- medium rows (``NV <= 128``): one warp per row, up to 4 vectors per lane, 4 rows per CTA;
- long rows: one row per CTA of 4..16 warps, each lane 1..8 vectors: the (warps, chunks)
  pair wasting the fewest vector slots, then chunks closest to 4 (bytes in flight per
  thread), then fewer warps (D = 7168 bf16: 7 warps × 4 vectors, no waste; 16384: 16 × 4).

Rows longer than 16 warps × 8 vectors (bf16 D > 32768, fp32 D > 16384) are declined, and so
are rows above 12288 values that no tile covers exactly (their reduction buffer would pass
48 KB of shared memory; see ``reduction_plan``).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from tileplug.backend_cuda.tuning import tuning_choice, tuning_flag, tuning_override
from tileplug.core.contracts.norm import NormCall

TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
VECTOR_BYTES = 16
SMALL_ROW_THREADS = 128
MEDIUM_ROW_VECTORS = 128
MEDIUM_ROWS_PER_CTA = 4
LONG_ROW_WARPS = range(4, 17)
LONG_ROW_CHUNKS = range(1, 9)
MAX_VECTORS = LONG_ROW_WARPS[-1] * 32 * LONG_ROW_CHUNKS[-1]
MAX_SHARED_BYTES = 48 * 1024  # a kernel's shared buffers stay within the default dynamic shared memory
BACKWARD_CTAS_PER_SM = 2
"""CTAs per SM the backward row kernels ask ptxas to fit (``__launch_bounds__``' second
argument): left alone, ptxas gave a D = 7168 bf16 row 164-192 registers a thread, so one CTA
of 7 warps per SM. Measured on the H200 (rms_norm_backward, T = 65536): 1 → 1406 us, 2 → 1035 us,
3 → 1889 us (ptxas spills). ``TILEPLUG_CUDA_NORM_BACKWARD_CTAS`` overrides it, for tuning with
the kernel index off (the index key does not see the variable)."""


LAYER_NORM_THREADS_PER_SM = 672
"""Threads of a long-row ``layer_norm`` an SM should hold at once: the kernel asks ptxas for
``LAYER_NORM_THREADS_PER_SM // threads`` CTAs per SM (at D = 7168 bf16, 3 CTAs of 224
threads: 80 registers, 24 bytes spilled, where 103 registers left room for 2: 733 → 569 µs at
T = 65536 on the H200). Rows with a residual keep ptxas' choice (the cap spilled 284 bytes).
``TILEPLUG_CUDA_LAYER_NORM_THREADS_PER_SM`` overrides, for tuning, with the kernel index off or
one of its own (the index key does not see the variable)."""


def layer_norm_threads_per_sm() -> int:
    return tuning_override("TILEPLUG_CUDA_LAYER_NORM_THREADS_PER_SM", LAYER_NORM_THREADS_PER_SM)


def long_row_ctas(rows_per_cta: int, threads: int, threads_per_sm: int) -> int:
    """CTAs per SM a forward norm kernel asks ptxas to fit (``__launch_bounds__``' second argument) so that
    an SM holds about ``threads_per_sm`` threads of CTAs of ``threads``; 0 (ptxas' choice) for tiles of
    several rows a CTA (short rows: their registers are few) or ``threads_per_sm`` 0."""
    if rows_per_cta != 1 or not threads_per_sm:
        return 0
    return max(1, threads_per_sm // threads)


RMS_NORM_THREADS_PER_SM = 0
"""Threads of a long-row ``rms_norm`` an SM should hold (:func:`long_row_ctas`; 0, the default: ptxas' choice, at
D = 7168 bf16 72 registers, 4 CTAs of 224 threads; with a residual 88, 3 CTAs). A tuning knob under trial,
``TILEPLUG_CUDA_RMS_NORM_THREADS_PER_SM`` (kernel index off: the index key does not see it): 1120 gives 56
registers without a residual (no spill, nvcc 13.0, since the bf16 word reads of ``rows.as_float``; 16 bytes
before), 896 gives a residual's rows 72 (12 bytes; 24 before)."""


def rms_norm_threads_per_sm() -> int:
    return tuning_override("TILEPLUG_CUDA_RMS_NORM_THREADS_PER_SM", RMS_NORM_THREADS_PER_SM)


CAST_THREADS_PER_SM = 1120
"""Threads of a long-row fused norm cast (``rms_norm_per_token_cast``, one row a CTA, no residual) an SM should
hold at once: the kernel asks ptxas for ``CAST_THREADS_PER_SM // threads`` CTAs per SM. At D = 7168 bf16, 5 CTAs
of 224 threads: 56 registers (40 bytes spilled when timed below; none since the bf16 word reads, with
``RmsNormMacros(capped=True)``: 478.1 µs at T = 65536 on an H100) where ptxas' own 71 left room for 4 —
TileKernels' fused kernel holds 5 rows an SM too. Measured on an H100 (1×32 e4m3, eager µs at T = 1024 / 4096 / 16384 / 65536, one process
each, 2026-12-06): ptxas' choice 14.5 / 37.3 / 133.4 / 518.3 and again 14.4 / 37.2 / 133.2 / 518.0; 5 CTAs
14.8 / 36.3 / 126.1 / 486.5 (99.1 % of copy at 65536); TileKernels 13.1 / 32.2 / 120.1 / 474.1 (TileKernels' own
tile, 4 warps × 7 vectors, at 5 CTAs: 19.8 / 51.1 / 175.0 / 669.2). Other widths follow the same rule untimed
(D = 4096 bf16: 8 CTAs of 128 at 64 registers, no spill; 5120: 7 of 160 at 56, 40 bytes). Rows with a residual
keep ptxas' choice (the cap spilled 88–208 bytes). ``TILEPLUG_CUDA_NORM_CAST_THREADS_PER_SM`` overrides (0: no
cap), for tuning, with the kernel index off (the index key does not see the variable)."""


def cast_threads_per_sm() -> int:
    return tuning_override("TILEPLUG_CUDA_NORM_CAST_THREADS_PER_SM", CAST_THREADS_PER_SM)


def backward_ctas_per_sm() -> int:
    return tuning_override("TILEPLUG_CUDA_NORM_BACKWARD_CTAS", BACKWARD_CTAS_PER_SM)


BACKWARD_OPS = ("rms_norm_backward", "layer_norm_backward")
"""The ops whose row loop runs ``row_block`` iterations a CTA and copies its next row ahead
(``NormKernelSpec.prefetch``) on 128-bit tiles."""
BACKWARD_ROW_BLOCK = 16
"""Row-tile iterations of a backward's block of rows: ``rows · 16`` rows per partial row of the weight
gradient. A constant, never chosen by ``T`` (the gradient's blocking fixes the order of its additions: SPEC §5);
which path runs a batch (fused, half, split: ``backward.BackwardKernel.prepare``) is chosen by ``T``, and gives
the same bytes. Measured on an H100 (D = 7168 bf16, with the prefetch, eager median µs, one process per block,
2026-12-05), rms_norm_backward / layer_norm_backward:

    block   T = 1024        4096            16384           65536
    8       33.3 / 54.1     89.8 / 152.3    308.7 / 492.2   1148.3 / 1813.2
    16      38.4 / 57.1     78.0 / 121.1    280.6 / 398.0   1070.1 / 1403.7
    32      61.1 / 87.4     76.7 / 102.2    268.8 / 349.3   1035.6 / 1264.6

and again at the twenty-ninth session's defaults (the subtrees, the paired sums; H100, 2026-12-06, two processes
each, TileKernels 61.6–61.8 / 236.1–236.3 / 940.6–943.0 at 4096 / 16384 / 65536, Liger's layer_norm_backward
96.1 / 310.9 / 1172.2):

    block   T = 1024        2048            4096            16384           65536
    16      36.2 / 50.9     46.8 / 66.7     82.4 / 118.6    282.3 / 382.8   1051.7 / 1348.4
    32      83.9 / 171.9    57.2 / 75.5     76.0 / 95.3     266.6 / 325.7   1010.7 / 1160.1

32 halves the partial rows (written and read again: 117 MB each way at T = 65536 with 16; the column segment sums
47.9 → 28.1 µs) and one CTA of 32 rows an SM ran the row loop faster than two of 16 (T = 4096: 77.5 → 68.4 µs,
profiler), but its short batches fall to the split path (one row tile a CTA: 83.9 µs at T = 1024). The half path
(``TILEPLUG_CUDA_NORM_BACKWARD_HALF_PATH``) is to serve them. With its 128-bit stores, on an H100 (2026-12-06, one
process a block, the half path on, TileKernels and Liger beside 32):

    block   T = 256         1024            2048            4096            16384           65536
    16      30.6 / 55.3     35.9 / 56.3     46.7 / 66.1     81.3 / 117.8    281.1 / 382.1   1050.0 / 1348.9
    32      46.5 / 64.2     50.4 / 78.8     57.4 / 74.9     75.9 / 95.5     266.7 / 326.2   1009.2 / 1156.0
    peers   12.1 / 113.0    21.4 / 96.7     33.3 / 99.4     61.2 / 98.2     236.6 / 306.5   940.4 / 1146.5

(peers: TileKernels' rms, Liger's layer). 32 is 4-19 % faster from T = 4096 and 13-99 % slower at T ≤ 2048 (the half
path's second CTAs write half the block's rows as one-row partials: at T = 1024 its grid is 64 CTAs, each writing 16
rows of 28 KB), so 16 stays the default; the GPU byte test of the half path's 128-bit stores ran 5 of its 6 cases
(all passed) before its time ran out. ``TILEPLUG_CUDA_NORM_BACKWARD_ROW_BLOCK`` overrides it, for tuning (the spec
name carries it)."""
PREFETCH_MAX_BYTES = 64 * 1024
"""The most shared memory the staging of ``grad_y`` and ``x`` (two stages) may take: with the
column sums' 48 KB two CTAs still fit an SM's 228 KB (D ≤ 8192 at 16-bit, 4096 at fp32);
longer rows load directly."""


PREFETCH_STAGES = 2
"""Row iterations the backward's staging holds: the one being read and the next one, in flight. Two iterations
in flight (iteration ``i + 2``'s copies into the stage ``i`` was read from, once its values were used) were no
faster on an H100 (2026-12-06, D = 7168 bf16, eager µs at T = 1024 / 4096 / 65536: rms_norm_backward 39.9 / 80.1 /
1055.5 → 41.4 / 82.2 / 1059.5, layer_norm_backward 59.6 / 127.4 / 1463.6 → 61.0 / 131.0 / 1501.5): the row loop
at T = 4096 is bound by each row's reductions and barriers at two CTAs an SM (ncu: DRAM 70 % busy, no eligible
warp 66 % of cycles), not by its loads."""
PREFETCH_SOURCES = 2
"""The rows a backward iteration stages: ``grad_y`` and ``x``."""


def prefetch_shape(tile: RowTile, vec: int, sources: int = PREFETCH_SOURCES) -> tuple[int, int, int, int]:
    """The backward row loop's staging buffer (``rows.RowPrefetch``): ``[stages, sources, rows,
    lanes · chunks · vec]`` values of the input dtype (``vec`` of them a 16-byte vector)."""
    return (PREFETCH_STAGES, sources, tile.rows, tile.lanes * tile.chunks * vec)


def prefetch_bytes(tile: RowTile) -> int:
    """Shared bytes of the backward row loop's staging: :func:`prefetch_shape` of one-byte values,
    16 to a vector."""
    return math.prod(prefetch_shape(tile, VECTOR_BYTES))


def backward_row_block() -> int:
    """Row-tile iterations a backward CTA runs (``TILEPLUG_CUDA_NORM_BACKWARD_ROW_BLOCK``, else
    :data:`BACKWARD_ROW_BLOCK`)."""
    return tuning_override("TILEPLUG_CUDA_NORM_BACKWARD_ROW_BLOCK", BACKWARD_ROW_BLOCK)


BACKWARD_SPLIT_BELOW = 64
"""The backwards (``backward.BackwardKernel``) leave the fused row kernel while its grid would have
fewer CTAs than this (and more than one row tile): below it the fused kernel leaves most SMs idle,
each CTA running its ``row_block`` iterations one after the other. The half path (each block over
two CTAs, the second writing its rows' terms as one-row partials) runs while its grid reaches this,
the split path (one row tile a CTA, every row's terms a one-row partial) below; both add the same
terms in the same order afterwards: the same bytes, for 8 bytes more traffic a value written as a
one-row partial (written and read again), so they pay only while the fused grid is short of the
SMs (64 at D = 7168: at a block of 16 fused from T = 1024; at a block of 32 with the half path fused from
T = 2048, half from 1024, split below; without it, split below 2048).

On an H100 (2026-12-06, D = 7168 bf16, eager µs, split off → 64): rms_norm_backward 34.9 → 15.2 at
T = 32, 36.0 → 20.2 at T = 128 (TileKernels 10.7 / 11.4), layer_norm_backward 50.0 → 26.9 / 50.7 →
37.1; T = 1 (one row tile) and T ≥ 1024 unchanged. ``tests/gpu/probe_norm_backward_split.py``: its
bytes equal the fused path's and the reference comparisons pass (21 checks).
``TILEPLUG_CUDA_NORM_BACKWARD_SPLIT_BELOW`` overrides it (0: never split)."""


def backward_split_below() -> int:
    """The fused grid size (CTAs) below which a backward runs split
    (``TILEPLUG_CUDA_NORM_BACKWARD_SPLIT_BELOW``, else :data:`BACKWARD_SPLIT_BELOW`)."""
    return tuning_override("TILEPLUG_CUDA_NORM_BACKWARD_SPLIT_BELOW", BACKWARD_SPLIT_BELOW)


HALF_PATH_VARIABLE = "TILEPLUG_CUDA_NORM_BACKWARD_HALF_PATH"
"""``1``: a backward whose fused grid is short of ``backward_split_below()`` CTAs runs the half path where that
path's grid (two CTAs a block) reaches it (``backward.BlockLayout``: the block's second CTA writes each row's
terms as one-row partials, 8 bytes a value more traffic for half the rows, against all of them on the split path);
``0`` (the default): the split path. The same bytes either way (the fp32 order played on the CPU in
``tests/test_cuda_norm_host.py``; on an H100 the split / half / fused byte test passed 5 of its 6 cases before its
time ran out, with the one-value stores and again with the 128-bit ones). Timed with the block of 32 (H100,
2026-12-06): 50.4 / 78.8 µs at T = 1024 (rms / layer; the one-value stores 96.4 / 180.9, the split path 83.9 / 171.9,
the block of 16 35.9 / 56.3): still behind the block of 16, so it stays off (:data:`BACKWARD_ROW_BLOCK`)."""
HALF_PATH_CHOICES = ("0", "1")


def backward_half_path() -> bool:
    """Whether a short backward may take the half path (:data:`HALF_PATH_VARIABLE`)."""
    return tuning_choice(HALF_PATH_VARIABLE, "0", HALF_PATH_CHOICES) == "1"


def backward_prefetch() -> bool:
    """Whether the backward row loops prefetch (``TILEPLUG_CUDA_NORM_BACKWARD_PREFETCH``: 1 by
    default, 0 for the direct loads; a tuning knob, seen by the spec name)."""
    return tuning_flag("TILEPLUG_CUDA_NORM_BACKWARD_PREFETCH", True)


BACKWARD_SUBTREES_VARIABLE = "TILEPLUG_CUDA_NORM_BACKWARD_SUBTREES"
"""How the backward row kernels add a row's terms (``rows.RowMacros.row_sum``, the reference's pairwise tree either
way: the same additions in the same order, so the same bytes). ``1`` (the default since the twenty-ninth session):
the warp-subtree form the forward kernels take (each warp adds its subtrees in registers and shuffles, then every
thread the subtree sums: 7 CTA barriers in ``rms_norm_backward``'s CUDA at D = 7168 bf16, 10 in
``layer_norm_backward``'s two sums), where the tile allows it (:func:`takes_subtrees`). ``0``: one level of the tree
per CTA barrier in shared memory (17 and 30). No spills with nvcc 13.0 at D = 2048 / 4096 / 5120 / 7168 bf16
(``rms_norm_backward`` 95 / 130 / 130 / 125 registers, 95 / 163 / 163 / 128 before its weight term lost its
``· 1``; ``layer_norm_backward`` 5120: 8 bytes; fp32 7168: 32 bytes where the levels spill 8; 16384: 216 where
they spill 156). On an H100 (2026-12-06, D = 7168 bf16, eager µs, 0 → 1,
two processes of the levels): ``rms_norm_backward`` 40.0–40.1 → 36.0 at T = 1024, 81.2–81.8 → 81.9 at 4096,
286.4–286.6 → 284.8 at 16384, 1077 → 1074.5 at 65536; ``layer_norm_backward`` 59.4 → 54.0, 127.6–127.7 → 120.1,
417.9–418.1 → 386.9, 1465.6–1466.2 → 1365.5; the same bytes as the levels (the GPU test of the tree forms, 36
cases, split and fused paths). Alternating two trees so that the barrier before the next row's sums goes (one CTA
barrier a row fewer) was no faster there (rms 1074.5 → 1080.0 at 65536, 81.9 → 81.2–81.9 at 4096; layer within
±1 %) and was dropped; so was a column sum of 128 threads a CTA instead of 256 (81.9 → 81.2 at 4096, equal
elsewhere). The kernel's name says which (``_st``)."""
BACKWARD_SUBTREES_CHOICES = ("0", "1")


def backward_subtrees() -> bool:
    """Whether the backward row kernels take the warp-subtree tree (:data:`BACKWARD_SUBTREES_VARIABLE`)."""
    return tuning_choice(BACKWARD_SUBTREES_VARIABLE, "1", BACKWARD_SUBTREES_CHOICES) == "1"


PAIRED_SUMS_VARIABLE = "TILEPLUG_CUDA_NORM_BACKWARD_PAIRED_SUMS"
"""Whether ``layer_norm_backward`` adds its row's two sums (``Σ g`` and ``Σ g · x̂``, both known before either is
added) through one pass of the tree (``rows.RowMacros.row_sums``: each level, or each subtree stage, does both sums'
additions before its barrier) instead of one after the other: the same additions in the same order for each sum, so
the same bytes, with fewer barriers (the kernel's CUDA at D = 7168 bf16: 10 → 7 CTA barriers with the subtrees,
30 → 18 with the levels; 195 → 191 and 202 → 177 registers, no spills) and the two sums' shuffle chains side by
side; the tree takes twice the shared memory (only where that stays within :data:`MAX_SHARED_BYTES`). ``1`` (the
default since the twenty-ninth session): paired. ``0``: one sum after the other. On an H100 (2026-12-06, D = 7168
bf16, with the subtrees, eager µs, 0 → 1): 54.0 → 51.5 at T = 1024, 120.1 → 118.5 at 4096, 386.9 → 383.6 at
16384, 1365.5 → 1353.1 at 65536; the same bytes (the tree forms' GPU test). The kernel's name says which
(``_ps``)."""
PAIRED_SUMS_CHOICES = ("0", "1")


def backward_paired_sums() -> bool:
    """Whether ``layer_norm_backward`` pairs its two row sums (:data:`PAIRED_SUMS_VARIABLE`)."""
    return tuning_choice(PAIRED_SUMS_VARIABLE, "1", PAIRED_SUMS_CHOICES) == "1"


def pairs_sums(call_op: str, plan: ReductionPlan, tile: RowTile, vec: int) -> bool:
    """Whether a backward of ``call_op`` on this tile adds its row sums paired: ``layer_norm_backward`` (two sums)
    when :data:`PAIRED_SUMS_VARIABLE` asks and two sums' tree (:func:`tree_bytes`, its subtree sums counted
    whichever form the row takes: the choice does not follow the subtree variable) fits :data:`MAX_SHARED_BYTES` (a
    row of one thread or one shuffle tree has no shared tree, and pairs in registers)."""
    if call_op != "layer_norm_backward" or not backward_paired_sums():
        return False
    return tree_bytes(plan, tile, vec, plan.subtrees is not None, 2) <= MAX_SHARED_BYTES


@dataclass(frozen=True)
class RowTile:
    """``lanes`` threads per row, ``rows`` rows per CTA, ``chunks`` vectors per lane."""

    lanes: int
    rows: int
    chunks: int

    @property
    def threads(self) -> int:
        return self.lanes * self.rows

    @property
    def name(self) -> str:
        """The tile's part of a kernel name."""
        return f"l{self.lanes}r{self.rows}c{self.chunks}"


def vector_width(dtype: torch.dtype) -> int:
    """Values of ``dtype`` in one 128-bit vector (8 bf16/fp16, 4 fp32)."""
    return VECTOR_BYTES // torch.empty((), dtype=dtype).element_size()


def row_tile(hidden: int, dtype: torch.dtype, target_chunks: int = 4) -> RowTile | None:
    """The row tile of ``D = hidden`` values of ``dtype`` (None: too long for one CTA); a long row
    takes the vectors a lane closest to ``target_chunks`` among the tiles that waste fewest slots."""
    vectors = -(-hidden // vector_width(dtype))
    if vectors <= 32:
        lanes = 1 << max(0, (vectors - 1).bit_length())
        return RowTile(lanes, SMALL_ROW_THREADS // lanes, 1)
    if vectors <= MEDIUM_ROW_VECTORS:
        return RowTile(32, MEDIUM_ROWS_PER_CTA, -(-vectors // 32))
    if vectors > MAX_VECTORS:
        return None
    best = min(
        ((warps, chunks) for warps in LONG_ROW_WARPS for chunks in LONG_ROW_CHUNKS if warps * 32 * chunks >= vectors),
        key=lambda pair: (pair[0] * 32 * pair[1] - vectors, abs(pair[1] - target_chunks), pair[0]),
    )
    return RowTile(32 * best[0], 1, best[1])


def tree_levels(width: int) -> list[tuple[int, int, int]]:
    """The reference's pairwise tree (``tileplug.core.norm.formulas.row_sum``) on ``width``
    values kept in place: per level ``(w, h, last)`` — value ``i < h`` becomes ``v[i] + v[i + h]``,
    where ``v[w − 1]`` is found at index ``last`` (an odd level carries its last value to the
    next level without moving it, so the new last value stays where it was)."""
    levels = []
    last = width - 1
    while width > 1:
        half = width // 2
        levels.append((width, half, last))
        if width % 2 == 0:
            last = half - 1
        width = half + width % 2
    return levels


@dataclass(frozen=True)
class ReductionPlan:
    """How a row tile adds a row's ``D`` terms in the reference's order (``rows.row_sum``).

    A thread's terms are ``terms[k · VEC + j]`` (column ``(k · lanes + lane) · VEC + j``).
    ``local_steps``: with one lane per row, the whole tree as in-place ``(i, partner)``
    additions on the thread's terms (None otherwise). Else ``exact`` (``D = chunks · lanes ·
    VEC``): ``fold_steps`` are the tree's first levels on the thread's chunks, in place, after
    which its first ``written_chunks`` chunks hold the ``width`` values the shared-memory
    levels start from (not exact: every term within ``D``, ``width = D``). ``levels``: per
    shared-memory level ``(h, last, rounds)`` — value ``i < h`` becomes ``v[i] + v[last if i ==
    h − 1 else i + h]`` (``last`` None: ``i + h``), lane ``l`` taking ``i = l + offset`` for each
    round ``(offset, whole)`` (``whole``: every lane of the round has a value).

    ``subtrees`` ``(S, N)`` (None where it does not apply): rows of whole warps whose ``width =
    S · N`` with ``N`` a power of two ≥ 32 and ``S`` a multiple of the row's warps (at most
    :data:`MAX_SUBTREES`). The tree's first levels then halve ``width`` down to ``S`` values, the
    value ``r < S`` being the pairwise-halving tree over ``v[r + S·j]``, ``j < N``: each warp adds
    ``S / warps`` of those subtrees in registers and shuffles (lane ``l`` holding ``j = l + 32·m``)
    and the remaining levels run on the ``S`` subtree sums — the same additions in the same order,
    with 2 barriers per row instead of one per level."""

    local_steps: list[tuple[int, int]] | None
    exact: bool
    fold_steps: list[tuple[int, int]]
    written_chunks: int
    width: int
    levels: list[tuple[int, int | None, list[tuple[int, bool]]]]
    subtrees: tuple[int, int] | None = None


MAX_SUBTREES = 64
"""Most subtree sums a row's last levels add (every thread of the row adds them in registers)."""


def warp_subtrees(width: int, lanes: int) -> tuple[int, int] | None:
    """``(S, N)`` of :class:`ReductionPlan.subtrees` for a tree of ``width`` values on rows of
    ``lanes`` threads (None: the rows are not whole warps, or no split fits)."""
    if lanes % 32:
        return None
    warps = lanes // 32
    odd, power = width, 1
    while odd % 2 == 0:
        odd //= 2
        power *= 2
    subtrees = odd
    while subtrees % warps and power > 1:
        subtrees *= 2
        power //= 2
    if subtrees % warps or power < 32 or subtrees > MAX_SUBTREES:
        return None
    return subtrees, power


def reduction_plan(hidden: int, tile: RowTile, vec: int) -> ReductionPlan:
    """The :class:`ReductionPlan` of ``D = hidden`` on ``tile`` with ``vec`` values per vector."""
    lanes, chunks = tile.lanes, tile.chunks
    if lanes == 1:
        steps = [(i, last if (w % 2 == 0 and i == h - 1) else i + h) for w, h, last in tree_levels(hidden)
                 for i in range(h)]
        return ReductionPlan(steps, False, [], chunks, hidden, [])
    exact = hidden == chunks * lanes * vec
    folds = ((chunks & -chunks).bit_length() - 1) if exact else 0
    fold_steps = [(c * vec + j, (c + (chunks >> (level + 1))) * vec + j)
                  for level in range(folds) for c in range(chunks >> (level + 1)) for j in range(vec)]
    written = chunks >> folds
    width = written * lanes * vec if exact else hidden
    levels = [(h, None if (w % 2 or last == w - 1) else last,
               [(r * lanes, (r + 1) * lanes <= h) for r in range(-(-h // lanes))])
              for w, h, last in tree_levels(width)]
    return ReductionPlan(None, exact, fold_steps, written, width, levels, warp_subtrees(width, lanes))


def shuffle_tree(plan: ReductionPlan, tile: RowTile, vec: int) -> bool:
    """Whether a row's tree runs in registers and shuffles alone (``rows.RowMacros.row_sum``): a row within one
    warp whose tree starts from exactly one vector per lane on a power of two of values."""
    return (plan.local_steps is None and plan.exact and plan.written_chunks == 1 and tile.lanes <= 32
            and plan.width == tile.lanes * vec and plan.width & (plan.width - 1) == 0)


def tree_bytes(plan: ReductionPlan, tile: RowTile, vec: int, subtrees: bool, sums: int = 1) -> int:
    """Shared bytes of a row tile's reduction tree over ``sums`` sums (``rows.RowMacros.tree_buffer``): each sum's
    ``rows · width`` values, then (``subtrees``: the warp-subtree form taken) its ``rows · S`` subtree sums; a thread
    holding its whole row, or a row reduced by shuffles, needs none: one element."""
    if tile.lanes == 1 or shuffle_tree(plan, tile, vec):
        return 4
    subtree_sums = plan.subtrees[0] if subtrees else 0
    return 4 * sums * tile.rows * (plan.width + subtree_sums)


def takes_subtrees(plan: ReductionPlan, tile: RowTile, vec: int) -> bool:
    """Whether a row's tree can take the warp-subtree form (:attr:`ReductionPlan.subtrees`; neither one thread's
    nor a shuffle tree)."""
    return plan.local_steps is None and plan.subtrees is not None and not shuffle_tree(plan, tile, vec)


@dataclass(frozen=True)
class QuantSpec:
    """The per-token cast ending ``rms_norm_per_token_cast`` (groups ``1 × group`` along the
    row ``[T, N·D]``): output format, scale encoding (fp32 / e4m3 / ue8m0 bytes), packed
    column-major storage, power-of-two scales, amax clamp, and whether ``y`` is also written."""

    fmt: str
    group: int
    sf_kind: str
    sf_col_major: bool
    round_sf: bool
    clamp_min: float
    unquantized: bool

    def name_parts(self, clamp_tag: str = "c") -> list[str]:
        """This cast's part of a kernel name (``clamp_tag`` before the amax clamp's digits)."""
        parts = [self.fmt, f"g{self.group}", f"sf{self.sf_kind}{'col' if self.sf_col_major else ''}"]
        if self.round_sf:
            parts.append("round")
        parts.append(f"{clamp_tag}{_hex(self.clamp_min)}")
        if self.unquantized:
            parts.append("y")
        return parts


@dataclass(frozen=True)
class NormKernelSpec:
    """Compile-time constants of one CUDA norm kernel (see the module docstring).

    ``op``: rms_norm / layer_norm / rms_norm_per_token_cast / rms_norm_backward. ``hidden``: D. ``heads``: N of a
    3-D ``[T, N, D]`` input (None: 2-D). ``in_dtype`` / ``weight_dtype`` / ``bias_dtype``:
    TileLang dtypes (None: absent). ``residual``: ``s = x + residual`` is formed and
    written to ``residual_out``. ``stats``: rstd (and mean) are written. ``vectorize``:
    128-bit loads and stores (every row pointer 16-byte aligned and ``D`` a multiple of
    ``VEC``), else per-element accesses. ``tile``: the row tile. ``quant``: the fused cast.
    ``grad_residual``: a backward adds ``grad_residual_out`` to ``grad_x``. ``prefetch``: a
    backward row loop copies its next row of ``grad_y`` and ``x`` into shared memory with
    ``cp.async`` while it works on this one (``rows.RowPrefetch``; 128-bit tiles only).
    ``row_block``: row-tile iterations of a backward's block of rows (one partial row of the weight gradient:
    ``backward.py``). ``sub_block`` (0: the whole block a CTA): the half path's row-tile iterations a CTA, the
    block's first CTA adding its rows' terms, the others writing each row's terms (``backward.py``).
    ``subtrees``: a backward adds its rows' terms in the warp-subtree form (:data:`BACKWARD_SUBTREES_VARIABLE`; the forward kernels take it
    wherever it applies). ``paired_sums``: ``layer_norm_backward`` adds its two row sums in one pass of the tree
    (:data:`PAIRED_SUMS_VARIABLE`).
    """

    op: str
    hidden: int
    heads: int | None
    in_dtype: str
    weight_dtype: str | None
    bias_dtype: str | None
    residual: bool
    stats: bool
    eps: float
    weight_offset: float
    out_scale: float
    vectorize: bool
    tile: RowTile
    quant: QuantSpec | None = None
    grad_residual: bool = False
    prefetch: bool = False
    row_block: int = BACKWARD_ROW_BLOCK
    sub_block: int = 0
    subtrees: bool = False
    paired_sums: bool = False

    def build(self):
        """The TileLang ``PrimFunc`` of this specialisation (``tileplug.backend_cuda.jit``): built by
        the op's module, ``tileplug.backend_cuda.norm.<op>``."""
        import importlib

        return importlib.import_module(f"tileplug.backend_cuda.norm.{self.op}").build(self)

    @property
    def vec(self) -> int:
        """Values per vector (16 bytes of the input dtype)."""
        return {"bfloat16": 8, "float16": 8, "float32": 4}[self.in_dtype]

    @property
    def name(self) -> str:
        """A short, unique, identifier-safe name (kernel symbol and cache key text)."""
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", None: "none"}
        parts = [self.op, short[self.in_dtype], f"d{self.hidden}"]
        if self.heads is not None:
            parts.append(f"h{self.heads}")
        parts.append(f"w{short[self.weight_dtype]}")
        if self.bias_dtype is not None:
            parts.append(f"b{short[self.bias_dtype]}")
        if self.residual:
            parts.append("res")
        if self.stats:
            parts.append("stats")
        if self.grad_residual:
            parts.append("gres")
        parts.append(f"e{_hex(self.eps)}")
        if self.weight_offset != 0.0:
            parts.append(f"o{_hex(self.weight_offset)}")
        if self.out_scale != 1.0:
            parts.append(f"s{_hex(self.out_scale)}")
        parts.append("v128" if self.vectorize else "scalar")
        parts.append(self.tile.name)
        if self.quant is not None:
            parts += self.quant.name_parts()
        if self.prefetch:
            parts.append("pf")
        if self.row_block != BACKWARD_ROW_BLOCK:
            parts.append(f"rb{self.row_block}")
        if self.sub_block:
            parts.append(f"sb{self.sub_block}")
        if self.subtrees:
            parts.append("st")
        if self.paired_sums:
            parts.append("ps")
        return "_".join(parts)


def _hex(value: float) -> str:
    """Identifier-safe text of ``value`` rounded to fp32 (the kernel's constant): its hex digits."""
    mantissa, exponent = struct.unpack("<f", struct.pack("<f", value))[0].hex().split("p")
    mantissa = mantissa.rstrip("0").rstrip(".") if "." in mantissa else mantissa
    return f"{mantissa}p{exponent}".replace(".", "_").replace("+", "").replace("-", "m")


CHUNKS_VARIABLE = "TILEPLUG_CUDA_NORM_CHUNKS"
"""Vectors a lane of a long row aims for in the norm kernels (:func:`row_tile`'s ``target_chunks``; default
:data:`CHUNKS`); tuning on a GPU host (the tile is part of the kernel's name; the row's additions keep the
reference's order on any tile). ncu of ``rms_norm_per_token_cast`` 1×32 at T = 4096 on an H100 (2026-12-06): the
default tile of D = 7168 (7 warps × 4 vectors a lane) at 71 registers, 4 CTAs an SM, 36.0 µs, against TileKernels'
one row a CTA of 4 warps × 7 vectors, 30.6 µs; ``7`` gives that shape. Timed on an H100 (2026-12-06, eager µs at
T = 1024 / 4096 / 16384 / 65536; the same bytes as 4, ``tests/gpu/test_cuda_norm.py -k wider_lanes``): 4 is the
fastest. The fused cast 1×32 14.4–14.5 / 37.2–37.4 / 133.2–133.3 / 517.4–518.0 at 4, 20.0 / 55.4 / 194.6 / 751.8 at
7, 16.0 / 46.7 / 173.7 / 681.7 at 2 (14 warps × 2); ``rms_norm_backward`` 37.4 / 81.2 / 280.5 / 1050.1 at 4, 54.2 /
87.4 / 297.7 / 1087.5 at 7, 39.7 / 82.7 / 287.4 / 1066.1 at 2; ``layer_norm_backward`` 52.4 / 119.4 / 384.9 / 1349.2
at 4, 99.8 / 157.3 / 549.1 / 1997.0 at 7 (816 bytes of spills), 56.1 / 122.7 / 401.5 / 1397.0 at 2."""
CHUNKS = 4


def norm_tile(call: NormCall) -> RowTile | None:
    """The row tile of ``call`` (:func:`row_tile` at :data:`CHUNKS_VARIABLE`'s target)."""
    return row_tile(call.hidden, call.input_dtype, tuning_override(CHUNKS_VARIABLE, CHUNKS))


def common_reason(call: NormCall) -> str | None:
    """Declines shared by the CUDA norm kernels (None: served)."""
    if call.input_dtype not in TL_DTYPES:
        return f"input dtype {call.input_dtype} is not served by the CUDA kernels (bf16, fp16, fp32)"
    for what, dtype in (("weight", call.weight_dtype), ("bias", call.bias_dtype)):
        if dtype is not None and dtype not in TL_DTYPES:
            return f"{what} dtype {dtype} is not served by the CUDA kernels (bf16, fp16, fp32)"
    tile = norm_tile(call)
    if tile is None:
        return (f"a row of D = {call.hidden} {call.input_dtype} values does not fit one CTA's registers "
                f"(at most {MAX_VECTORS * vector_width(call.input_dtype)})")
    shared = tile.rows * reduction_plan(call.hidden, tile, vector_width(call.input_dtype)).width * 4
    if shared > MAX_SHARED_BYTES:
        return (f"D = {call.hidden} has no exact row tile: its reduction would need {shared} bytes of shared memory "
                f"(more than {MAX_SHARED_BYTES})")
    return None


def vectorizes(call: NormCall) -> bool:
    """128-bit accesses: every row of every tensor 16-byte aligned and D a multiple of VEC."""
    return call.alignment >= VECTOR_BYTES and call.hidden % vector_width(call.input_dtype) == 0


def make_spec(call: NormCall, quant: QuantSpec | None = None) -> NormKernelSpec:
    """The specialisation serving ``call`` (assumes ``common_reason(call)`` is None)."""
    tile = norm_tile(call)
    vectorize = vectorizes(call)
    backward = call.op in BACKWARD_OPS
    vec = vector_width(call.input_dtype)
    plan = reduction_plan(call.hidden, tile, vec)
    subtrees = backward and backward_subtrees() and takes_subtrees(plan, tile, vec)
    return NormKernelSpec(
        op=call.op,
        hidden=call.hidden,
        heads=call.heads,
        in_dtype=TL_DTYPES[call.input_dtype],
        weight_dtype=None if call.weight_dtype is None else TL_DTYPES[call.weight_dtype],
        bias_dtype=None if call.bias_dtype is None else TL_DTYPES[call.bias_dtype],
        residual=call.residual,
        stats=call.stats,
        eps=float(call.eps),
        weight_offset=float(call.weight_offset),
        out_scale=float(call.out_scale),
        vectorize=vectorize,
        tile=tile,
        quant=quant,
        grad_residual=call.grad_residual,
        prefetch=backward and vectorize and backward_prefetch() and prefetch_bytes(tile) <= PREFETCH_MAX_BYTES,
        row_block=backward_row_block() if backward else BACKWARD_ROW_BLOCK,
        subtrees=subtrees,
        paired_sums=pairs_sums(call.op, plan, tile, vec),
    )
