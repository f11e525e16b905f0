"""What a CUDA MoE routing kernel is specialised on (compile-time constants only; the token
count and every row stride are runtime values, so one compiled kernel serves every batch).

Nothing here imports TileLang (``table.py`` builds specs in processes that load compiled
kernels from the index without it).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from tileplug.backend_cuda.tuning import tuning_choice

WARP = 32
VECTOR_BYTES = 16
MAX_EXPERTS = 1024
"""Rows of at most 1024 experts: 32 registers of fp32 per lane of one warp."""
MAX_TOPK = 32
"""Slots per row: one lane keeps each slot."""
GATE_WARPS = 4
"""Rows (warps) per CTA of the gate kernels."""

TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", None: "none"}
LANE_GROUPS_VARIABLE = "TILEPLUG_CUDA_MOE_LANE_GROUPS"
"""``1`` (the default since 2026-12-06): a grouped ``moe_topk_gate`` takes its group scores lane by lane
(each lane's own two largest keys, merged over the group's lanes by shuffles:
``moe_topk_gate.lane_group_scores``) where the layout allows it (:func:`lane_groups_fit`); ``0``: two
masked warp argmax rounds a group. The same scores: on an H100 the grouped gates' bytes equal the masked
rounds' (``tests/gpu/test_cuda_moe.py -k lane_group``, 5 cases at 4001 rows), and the DeepSeek-V3 router
(256 experts, 8 groups, bf16 logits) takes 108.5 µs at T = 65536 against 180.7 (32.1 / 50.7 at 16384, 12.6
/ 18.0 at 4096, 7.4 / 8.0 at 128). The kernel's name says which."""
LANE_GROUPS_CHOICES = ("0", "1")
LANE_HEADS_VARIABLE = "TILEPLUG_CUDA_MOE_LANE_HEADS"
"""``1`` (the default since 2026-12-06): ``topk_gate`` / ``moe_topk_gate`` choose their ``k`` experts from each
lane's two *heads* (``warp_topk.WarpRow.lane_heads``): a lane finds its two first entries once, a round compares
the heads (``redux.sync`` max / min), and the lane that gave up its chosen head moves its second one up; a lane that
gave up both refills them from the entries after the last one it gave up (a warp-uniform branch). ``0``: every
round visits each lane's every entry (its own maximum, then the chosen entry's key and value by column). The same
experts in the same order: on an H100 the same bytes for every gate case of ``tests/gpu/test_cuda_moe.py`` at 1 and
4001 rows; the rounds had been the ALU pipe's main load (73 % busy, ncu). fp32 logits at T = 65536, no register
bound (:data:`GATE_CTAS_PER_SM_VARIABLE` = 0): ``topk_gate`` (E = 256, k = 8) 53.3 → 45.2 µs, the sqrtsoftplus
router 119.9 → 112.5, DeepSeek-V3 111.9 → 105.8 (with the bound's default 10: 45.5, 100.7, 87.3). The kernel's
name says which."""
LANE_HEADS_CHOICES = ("0", "1")
GATE_CTAS_PER_SM_VARIABLE = "TILEPLUG_CUDA_MOE_GATE_CTAS_PER_SM"
"""The least CTAs (of ``GATE_WARPS`` warps) per SM that ``topk_gate`` / ``moe_topk_gate`` ask the compiler for
(``__launch_bounds__``' second argument), which caps their registers: ``10`` (the default since 2026-12-06) at 48
(62.5 % occupancy), ``8`` at 64 (50 %), both without spills (nvcc 13.0, sm_90; ``12`` spills); ``0`` asks nothing
(the sqrtsoftplus gate then takes 82 registers, 31 %, where TileKernels' gate runs at 75 %). On an H100, with the
lanes' heads, fp32 logits at T = 65536: the sqrtsoftplus router 112.5 / 103.0 / 100.7 µs at 0 / 8 / 10, DeepSeek-V3
105.8 / 90.3 / 87.3, ``topk_gate`` 45.2 / 45.8 / 45.5. Only rows of at most :data:`BOUNDED_GATE_VALUES` values a
lane take it. The kernel's name says which (``_c10``)."""
GATE_CTAS_PER_SM_CHOICES = ("0", "6", "8", "10")
GATE_FULL_WARP_VARIABLE = "TILEPLUG_CUDA_MOE_GATE_FULL_WARP"
"""How many values of a row a gate lane (``topk_gate`` / ``moe_topk_gate``) loads at a time. ``1`` (the default
since 2026-12-06): a row shorter than a warp of 16-byte pieces is read at the width that spreads it over the most
lanes (:func:`gate_vec`) — read 16 bytes at a time it leaves lanes idle (E = 64 bf16: 8 lanes of 8 values, each
lane's scores one after the other; read 4 bytes at a time, 32 lanes of 2); longer rows keep 16 bytes. ``0``: 16
bytes wherever ``E`` and the rows allow it. The same experts and weights (the softmax denominator keeps the
reference's order on any layout: ``WarpRow.row_sum``); on an H100 at T = 65536 the softmax router over 64 experts
(k = 6) 103.7 → 34.0 µs with bf16 logits, 59.1 → 34.4 with fp32, ``topk_gate`` over 64 (k = 6) 26.1 → 20.6. The
kernel's name says which (``_v32`` / ``_v64``: 4 / 8 bytes)."""
GATE_FULL_WARP_CHOICES = ("0", "1")
GATE_UNROLLED_VARIABLE = "TILEPLUG_CUDA_MOE_GATE_UNROLLED"
"""``1`` (the default since 2026-12-06): the gates' ``k ≤`` :data:`MAX_UNROLLED_ROUNDS` selection rounds unrolled
while tracing — no round counter, the refill check only where it can be needed (round 3 on), ``topk_gate``'s slot
index held in 32 bits until its store; ``0``: one loop of ``k`` rounds. ncu on an H100 (``topk_gate`` 16384 × 256,
k = 8, the loop) showed the ALU pipe as the limit (issue slots 48 % busy, math-pipe-throttle stalls, 435 warp
instructions a row, 55 % of them in the rounds). The same experts in the same order: on an H100 the loop's bytes for
every gate case at 1 and 4001 rows (``-k gate_forms``). fp32 logits, two processes each, µs eager / graph:
``topk_gate`` 256 × 8 at T = 16384 16.4–16.6 / 13.0 → 15.1–15.2 / 11.6 (14.2–14.4 eager on another machine), at
65536 45.4–45.6 → 40.3–40.4; 384 × 8 at 65536 56.2 → 51.3; the sqrtsoftplus router 101.5 → 96.2–96.6, DeepSeek-V3
88.0–88.1 → 82.1–82.5 (64 × 6: unchanged). The kernel's name says which (``_unrolled``)."""
GATE_UNROLLED_CHOICES = ("0", "1")
GATE_FIXED_HEADS_VARIABLE = "TILEPLUG_CUDA_MOE_GATE_FIXED_HEADS"
"""``1`` (the default since the thirtieth session): the lanes' heads (:data:`LANE_HEADS_VARIABLE`) stay in place
through the rounds — ``dropped`` (0 or 1) says which one is current, a round picks it with one select a register, and
the lane that gives it up only counts (the refill takes its threshold from the second head, the last one given up);
``0``: the lane that gives up its first head moves the second up and records it (six selects a round in every lane,
predicated). The same experts in the same order (a Python model of both forms against the default rounds:
``tests/test_cuda_moe_lane_heads.py``), and the same bytes on an H100: its GPU byte test (``tests/gpu/test_cuda_moe.py
-k "gate_forms and fixed_heads"``) passed 157 of 158 cases in the twenty-ninth session, the 158th a test defect
(mended) that passed with the other row-stride cases in the thirtieth (4 passed). SASS of the unrolled ``topk_gate``
(256 × 8, fp32), whose ALU pipe bounds it (ncu), on the path without refills: 297 → 280 instructions a row,
selects 90 → 66 (64 × 6: 177 → 162). Timed on an H100 (2026-12-06), fp32 logits, two processes each, µs in a CUDA
graph (eager): ``topk_gate`` 64 × 6 at T = 65536 17.7 → 16.6 (21.2–21.3 → 20.2–20.3), 256 × 8 at 16384 11.55–11.58
→ 11.46–11.47 (14.8–15.2 → 14.9–15.1), at 65536 37.9 → 37.4; the DeepSeek-V3 router 78.7–78.8 → 77.1–77.2; the
sqrtsoftplus router 91.4–92.2 either way. The kernel's name says which (``_fixed``)."""
GATE_FIXED_HEADS_CHOICES = ("0", "1")
BATCHED_LAYOUT_VARIABLE = "TILEPLUG_CUDA_MOE_BATCHED_LAYOUT"
"""``1`` (the default since 2026-12-06): the layout kernels work in batches. ``chunk_counts`` /
``permute_index`` rank a chunk's pairs a warp at a time (``__match_any_sync``: the pairs of a warp with the same
expert, their places among them by the lanes below, then the counts of the earlier warps of the batch and of the
earlier batches, in shared memory), about ``CHUNK_PAIRS / 256`` steps a thread; ``expert_scan`` reads its column of
chunk counts ``SCAN_BATCH`` chunks at a time (independent loads in flight, where one chunk at a time waited for
each); the padding job of ``permute_rows`` finds the padding rows from the experts' ends instead of searching
for each row.
``0``: thread ``e`` walks the chunk's ``CHUNK_PAIRS`` pairs for expert ``e``, and the scan reads one chunk at a
time. The same counts and rows (integer sums, and each pair's row is the number of earlier pairs of the chunk
routed to its expert, whichever way it is counted): on an H100 the same bytes (``tests/gpu/test_cuda_moe.py -k
batched_layout``, 42 cases), and E = 256, k = 8: ``moe_expert_counts`` 34.2 → 17.5 µs at T = 65536,
``moe_permute`` of bf16 rows 264.4 → 208.1 µs at 4096 (65.7 → 83.4 % of copy). The kernel's name says which."""
BATCHED_LAYOUT_CHOICES = ("0", "1")
SCORE_MATH_VARIABLE = "TILEPLUG_CUDA_MOE_SCORE_MATH"
"""How ``moe_topk_gate`` takes each score's ``exp`` / ``log1p``: ``library`` (CUDA's fp64 ``exp`` / ``log1p``
for every score, rounded once), ``tables`` (``tileplug.backend_cuda.fp32_math``, which leaves to CUDA's fp64
functions only the inputs whose fp32 rounding its few ulps could change; 21 fp64 instructions a sqrtsoftplus score
against 72) or ``auto`` (the default since 2026-12-06: ``tables`` for the sqrtsoftplus scores, ``library`` for
sigmoid and softmax). The same bits either way by construction, and on an H100 the same bytes (``-k score_math``,
every gate case at 4001 rows); fp32 logits at T = 65536, the sqrtsoftplus router with bias and a shared expert
184.4 → 129.6 µs with the tables, the DeepSeek-V3 (sigmoid) router 112.5 → 116.8 (one exp a score: the tables'
extra loads cost more than the fp64 instructions they save). The kernel's name says which."""
SCORE_MATHS = ("auto", "library", "tables")


def lane_groups_fit(experts: int, groups: int, vec: int) -> bool:
    """Whether each lane's ``vec`` values of a chunk belong to one group and a group's lanes in a chunk
    are an aligned power of two of at most a warp (what :data:`LANE_GROUPS_VARIABLE`'s form needs)."""
    if groups <= 1 or experts % groups:
        return False
    size = experts // groups
    if size < 2 or size % vec:
        return False
    lanes = size // vec
    return lanes & (lanes - 1) == 0 and lanes <= WARP


def lane_groups(experts: int, groups: int, vec: int) -> bool:
    """Whether a ``moe_topk_gate`` kernel takes the lane-by-lane group scores (:data:`LANE_GROUPS_VARIABLE`)."""
    return tuning_choice(LANE_GROUPS_VARIABLE, "1", LANE_GROUPS_CHOICES) == "1" and lane_groups_fit(experts, groups, vec)


def lane_heads() -> bool:
    """Whether the gates choose from the lanes' heads (:data:`LANE_HEADS_VARIABLE`)."""
    return tuning_choice(LANE_HEADS_VARIABLE, "1", LANE_HEADS_CHOICES) == "1"


def lane_chunks(experts: int, vec: int) -> int:
    """Pieces of ``vec`` columns a lane holds of a warp's row of ``experts`` (``warp_topk.WarpRow``)."""
    return -(-experts // (WARP * vec))


BOUNDED_GATE_VALUES = 8
"""Values a lane holds (``WarpRow.VALUES``) up to which the gates take the register bound: the measured rows
(E = 256 at 128-bit loads); longer rows spill under it (E = 384 bf16, 16 values: 468 bytes; E = 1024 fp32, 32:
up to 1380) and keep no bound."""


def gate_ctas_per_sm(experts: int, vec: int) -> int:
    """The least CTAs per SM of a gate over ``experts`` columns read ``vec`` at a time
    (:data:`GATE_CTAS_PER_SM_VARIABLE`; 0: no bound, also for rows past :data:`BOUNDED_GATE_VALUES`)."""
    bound = int(tuning_choice(GATE_CTAS_PER_SM_VARIABLE, "10", GATE_CTAS_PER_SM_CHOICES))
    return bound if lane_chunks(experts, vec) * vec <= BOUNDED_GATE_VALUES else 0


def gate_vec(experts: int, dtype: str, alignment: int) -> int:
    """Values a gate lane loads at a time from rows of ``experts`` ``dtype`` values whose starts are
    ``alignment``-byte aligned: 16 bytes, or 1 where ``E`` or the rows do not allow it; for a row shorter than a
    warp of 16-byte pieces (:data:`GATE_FULL_WARP_VARIABLE`), of the widths ``E`` and the rows allow, the one
    giving a lane the fewest values (the widest among equals)."""
    widest = values_per_vector(dtype)
    size = VECTOR_BYTES // widest
    full_warp = tuning_choice(GATE_FULL_WARP_VARIABLE, "1", GATE_FULL_WARP_CHOICES) == "1"
    if not full_warp or experts >= WARP * widest:
        return widest if experts % widest == 0 and alignment >= VECTOR_BYTES else 1
    widths = [vec for vec in (widest, widest // 2, widest // 4, widest // 8)
              if vec >= 1 and experts % vec == 0 and alignment >= vec * size]
    return min(widths + [1], key=lambda vec: (lane_chunks(experts, vec) * vec, -vec))


MAX_UNROLLED_ROUNDS = 8
"""Rounds up to which :data:`GATE_UNROLLED_VARIABLE` unrolls them (each unrolled round past the second carries its
own copy of the refill: ``k = 32`` over 32 values a lane would be tens of thousands of instructions)."""


def gate_unrolled(topk: int) -> bool:
    """Whether the gates' ``topk`` selection rounds are unrolled (:data:`GATE_UNROLLED_VARIABLE`, up to
    :data:`MAX_UNROLLED_ROUNDS`)."""
    return tuning_choice(GATE_UNROLLED_VARIABLE, "1", GATE_UNROLLED_CHOICES) == "1" and topk <= MAX_UNROLLED_ROUNDS


def gate_fixed_heads() -> bool:
    """Whether the lanes' heads stay in place through the rounds (:data:`GATE_FIXED_HEADS_VARIABLE`)."""
    return tuning_choice(GATE_FIXED_HEADS_VARIABLE, "1", GATE_FIXED_HEADS_CHOICES) == "1"


def batched_layout() -> bool:
    """Whether the layout kernels work in batches (:data:`BATCHED_LAYOUT_VARIABLE`)."""
    return tuning_choice(BATCHED_LAYOUT_VARIABLE, "1", BATCHED_LAYOUT_CHOICES) == "1"


def table_math(scoring: str) -> bool:
    """Whether a ``moe_topk_gate`` kernel scoring by ``scoring`` takes its ``exp`` / ``log1p`` from ``fp32_math``
    (:data:`SCORE_MATH_VARIABLE`)."""
    choice = tuning_choice(SCORE_MATH_VARIABLE, "auto", SCORE_MATHS)
    return choice == "tables" or (choice == "auto" and scoring == "sqrtsoftplus")


def values_per_vector(dtype: str) -> int:
    """Values of ``dtype`` in 16 bytes."""
    return VECTOR_BYTES // (4 if dtype == "float32" else 2)


@dataclass(frozen=True)
class GateSpec:
    """A ``topk_gate`` / ``moe_topk_gate`` / ``moe_topk_gate_backward`` kernel: ``op``,
    ``experts`` E, ``topk`` k, the logits' TileLang ``dtype``, ``vec`` values per piece of the
    warp row (``values_per_vector`` on the 128-bit path, 1 on the scalar one), ``warps`` rows
    per CTA, and (moe_topk_gate) the routing constants: ``scoring``, ``biased``, ``groups`` /
    ``topk_groups``, ``renormalize``, ``scaling`` (routed_scaling_factor), ``shared`` slots,
    ``masked``, ``with_scores``, ``lane_groups`` (the group scores lane by lane:
    :data:`LANE_GROUPS_VARIABLE`), ``table_math`` (the scores' ``exp`` / ``log1p`` from ``fp32_math``:
    :data:`SCORE_MATH_VARIABLE`); (topk_gate, moe_topk_gate) ``lane_heads`` (the rounds over the lanes'
    heads: :data:`LANE_HEADS_VARIABLE`; ``fixed_heads``: :data:`GATE_FIXED_HEADS_VARIABLE`), ``ctas_per_sm``
    (:data:`GATE_CTAS_PER_SM_VARIABLE`) and ``unrolled`` (:data:`GATE_UNROLLED_VARIABLE`); (backward)
    ``index_dtype`` of topk_idx."""

    op: str
    experts: int
    topk: int
    dtype: str = "float32"
    vec: int = 1
    warps: int = GATE_WARPS
    scoring: str = ""
    biased: bool = False
    groups: int = 1
    topk_groups: int = 1
    renormalize: bool = False
    scaling: float = 1.0
    shared: int = 0
    masked: bool = False
    with_scores: bool = False
    index_dtype: str = "int64"
    lane_groups: bool = False
    table_math: bool = False
    lane_heads: bool = False
    ctas_per_sm: int = 0
    unrolled: bool = False
    fixed_heads: bool = False

    @property
    def name(self) -> str:
        """A short, unique, identifier-safe name (kernel symbol and cache key text)."""
        parts = [self.op, SHORT[self.dtype], f"e{self.experts}", f"k{self.topk}",
                 f"v{self.vec * self.value_bytes * 8}" if self.vec > 1 else "scalar"]
        if self.scoring:
            parts.append(self.scoring)
        if self.biased:
            parts.append("bias")
        if self.groups > 1:
            parts.append(f"g{self.groups}t{self.topk_groups}")
        if self.renormalize:
            parts.append("renorm")
        if self.scaling != 1.0:
            parts.append("s" + float(self.scaling).hex().replace(".", "_").replace("+", "").replace("-", "m"))
        if self.shared:
            parts.append(f"sh{self.shared}")
        if self.masked:
            parts.append("mask")
        if self.with_scores:
            parts.append("scores")
        if self.index_dtype != "int64":
            parts.append(self.index_dtype)
        parts.append(f"w{self.warps}")
        if self.lane_groups:
            parts.append("lanegroups")
        if self.table_math:
            parts.append("tablemath")
        if self.lane_heads:
            parts.append("heads")
        if self.ctas_per_sm:
            parts.append(f"c{self.ctas_per_sm}")
        if self.unrolled:
            parts.append("unrolled")
        if self.fixed_heads:
            parts.append("fixed")
        return "_".join(parts)

    @property
    def value_bytes(self) -> int:
        """Bytes of one value of the loaded rows."""
        return VECTOR_BYTES // values_per_vector(self.dtype)

    @property
    def vector_buffers(self) -> tuple[str, ...]:
        """Buffers the vector path loads 128 bits at a time (compile-grid check; none where a narrower width
        spreads a short row over the warp: :func:`gate_vec`)."""
        if self.vec * self.value_bytes < VECTOR_BYTES:
            return ()
        return ("scores",) if self.op == "topk_gate" else ("logits",) if self.op == "moe_topk_gate" else ("scores",)

    @property
    def vectorize(self) -> bool:
        return self.vec > 1

    def build(self):
        """The TileLang ``PrimFunc`` (built by ``tileplug.backend_cuda.moe.<op>``)."""
        return importlib.import_module(f"tileplug.backend_cuda.moe.{self.op}").build(self)


@dataclass(frozen=True)
class RowSpec:
    """A kernel over rows of a fixed ``width`` (``normalize_weight``: K slots)."""

    op: str
    width: int

    @property
    def name(self) -> str:
        return f"{self.op}_w{self.width}"

    def build(self):
        return importlib.import_module(f"tileplug.backend_cuda.moe.{self.op}").build(self)


CHUNK_PAIRS = 2048
"""(token, slot) pairs per chunk of the layout kernels (``routing``): a constant, so the
placement never depends on T's split or the device."""
SCAN_THREADS = 1024
"""Threads of the one-CTA expert scan: one per expert (E ≤ 1024)."""
SCAN_BATCH = 8
"""Chunk counts the batched expert scan loads at once (:data:`BATCHED_LAYOUT_VARIABLE`)."""


def chunk_tokens(slots: int) -> int:
    """Tokens per chunk of the layout kernels: about ``CHUNK_PAIRS`` pairs (a constant of K)."""
    return max(1, CHUNK_PAIRS // slots)


@dataclass(frozen=True)
class LayoutSpec:
    """One of the expert layout kernels (``routing``): ``kernel`` chunk_counts / expert_scan /
    permute_index, ``experts`` E, ``slots`` K, ``index_dtype`` of topk_idx, ``alignment``
    (expert_scan), ``bases`` (expert_scan also writes each chunk's first rows), ``batched``
    (:data:`BATCHED_LAYOUT_VARIABLE`)."""

    kernel: str
    experts: int
    slots: int = 1
    index_dtype: str = "int64"
    alignment: int = 1
    bases: bool = False
    batched: bool = False

    @property
    def name(self) -> str:
        parts = ["moe", self.kernel, f"e{self.experts}"]
        if self.kernel != "expert_scan":
            parts += [f"k{self.slots}", self.index_dtype]
        else:
            parts.append(f"a{self.alignment}")
            if self.bases:
                parts.append("bases")
        if self.batched:
            parts.append("batched")
        return "_".join(parts)

    def build(self):
        from tileplug.backend_cuda.moe import routing

        return getattr(routing, f"build_{self.kernel}")(self)


@dataclass(frozen=True)
class RowCopySpec:
    """A kernel moving whole rows (``rows``): ``kernel`` permute_rows (with the padding rows' zeros) /
    unpermute, the rows' TileLang ``dtype`` and ``width`` (elements), ``vec`` elements per
    piece (16 bytes on the vector path, 1 otherwise), ``slots`` K, ``index_dtype`` (of the
    permutation, unpermute), ``experts`` / ``alignment`` (the padding), the scale rows'
    ``sf_dtype`` / ``sf_width`` (quantized rows of permute_rows), ``batched`` (the padding job:
    :data:`BATCHED_LAYOUT_VARIABLE`)."""

    kernel: str
    dtype: str
    width: int
    vec: int = 1
    slots: int = 1
    index_dtype: str = "int32"
    experts: int = 1
    alignment: int = 1
    sf_dtype: str | None = None
    sf_width: int = 0
    batched: bool = False

    @property
    def name(self) -> str:
        parts = ["moe", self.kernel, self.dtype.replace("float8_e4m3fn", "e4m3").replace("float8_e4m3", "e4m3"),
                 f"h{self.width}", "v128" if self.vec > 1 else "scalar"]
        parts += [f"k{self.slots}", self.index_dtype]
        if self.kernel == "permute_rows":
            parts += [f"e{self.experts}", f"a{self.alignment}"]
        if self.sf_dtype is not None:
            parts += ["sf" + self.sf_dtype.replace("float8_e4m3fn", "e4m3").replace("float8_e4m3", "e4m3"),
                      f"f{self.sf_width}"]
        if self.batched:
            parts.append("batched")
        return "_".join(parts)

    @property
    def vectorize(self) -> bool:
        return self.vec > 1

    @property
    def vector_buffers(self) -> tuple[str, ...]:
        return {"permute_rows": ("x",), "unpermute": ("y_expanded",)}.get(self.kernel, ())

    def build(self):
        from tileplug.backend_cuda.moe import rows

        return getattr(rows, f"build_{self.kernel}")(self)
