"""The CUDA gates' rounds over the lanes' two heads (``TILEPLUG_CUDA_MOE_LANE_HEADS=1``, the default since an
H100 compared their bytes and timed them on 2026-12-06) and their register bound, without a GPU: the kernel's steps (``warp_topk.WarpRow``'s
``fill_heads`` / ``heads_round``) emulated lane by lane in Python — each lane's two first entries in
the order (key descending, column ascending), the rounds' max / min reductions over the heads, the
lane that gives up its head, the refill from the entries after the last one given up — against the
default rounds (each lane's own first maximum over all its entries, the chosen one taken), on keys
with ties, excluded columns (``NONE``: past ``E`` or outside the chosen groups) and rows whose chosen
experts crowd into a few lanes (the refill path); which specs the variable picks; and the compiled
kernels."""

from __future__ import annotations

import random

import pytest
import torch

from tileplug.backend_cuda.moe.spec import GATE_CTAS_PER_SM_VARIABLE, LANE_HEADS_VARIABLE, GateSpec

WARP = 32
NONE = -(2**31)
NO_COLUMN = 1 << 30


def _columns(experts: int, vec: int) -> list[list[int]]:
    """Lane ``l``'s columns in entry order (``WarpRow.column``), past ``E`` included."""
    chunks = -(-experts // (WARP * vec))
    return [[(j * WARP + lane) * vec + c for j in range(chunks) for c in range(vec)] for lane in range(WARP)]


def default_rounds(keys: dict[int, int], columns: list[list[int]], count: int) -> list[tuple[int, int]]:
    """``argmax`` + ``take``: each round every lane's own first maximum (strict ``>`` in entry order),
    the warp's largest key, the smallest column holding it; that column becomes ``NONE``."""
    keys = dict(keys)
    chosen = []
    for _ in range(count):
        heads = []
        for lane_columns in columns:
            best, where = NONE, NO_COLUMN
            for column in lane_columns:
                if keys[column] > best:
                    best, where = keys[column], column
            heads.append((best, where))
        found = max(best for best, _ in heads)
        index = min(where if best == found else NO_COLUMN for best, where in heads)
        chosen.append((found, index))
        for lane_columns in columns:
            if index in lane_columns:
                keys[index] = NONE
    return chosen


def heads_rounds(keys: dict[int, int], columns: list[list[int]], count: int,
                 fixed: bool = False) -> tuple[list[tuple[int, int]], int]:
    """``fill_heads`` / ``heads_round`` as the kernel runs them, lane by lane; also how many rounds refilled.
    ``fixed``: the heads stay in place (``TILEPLUG_CUDA_MOE_GATE_FIXED_HEADS``) — ``dropped`` picks the current
    one, a lane giving it up only counts, and a refill takes the second head as its threshold."""

    def fill(lane_columns, after):
        head_key, head_column = [NONE, NONE], [NO_COLUMN, NO_COLUMN]
        for column in lane_columns:
            key = keys[column]
            later = after is None or key < after[0] or (key == after[0] and column > after[1])
            above_first, above_second = later and key > head_key[0], later and key > head_key[1]
            head_key[1] = head_key[0] if above_first else key if above_second else head_key[1]
            head_column[1] = head_column[0] if above_first else column if above_second else head_column[1]
            head_key[0] = key if above_first else head_key[0]
            head_column[0] = column if above_first else head_column[0]
        return head_key, head_column

    lanes = [dict(zip(("key", "column"), fill(lane_columns, None)), after=None, dropped=0) for lane_columns in columns]
    chosen, refills = [], 0
    for round_index in range(count):
        if round_index >= 2 and any(lane["dropped"] == 2 for lane in lanes):
            refills += 1
            for lane, lane_columns in zip(lanes, columns):
                if lane["dropped"] == 2:
                    if fixed:
                        lane["after"] = (lane["key"][1], lane["column"][1])
                    lane["key"], lane["column"] = fill(lane_columns, lane["after"])
                    lane["dropped"] = 0
        if fixed:  # the current head of each lane: dropped is 0 or 1 here
            current = [(lane["key"][lane["dropped"]], lane["column"][lane["dropped"]]) for lane in lanes]
            found = max(key for key, _ in current)
            index = min(column if key == found else NO_COLUMN for key, column in current)
            chosen.append((found, index))
            for lane, (_, column) in zip(lanes, current):
                lane["dropped"] += column == index
            continue
        found = max(lane["key"][0] for lane in lanes)
        index = min(lane["column"][0] if lane["key"][0] == found else NO_COLUMN for lane in lanes)
        chosen.append((found, index))
        for lane in lanes:
            if lane["column"][0] == index:
                lane["after"] = (lane["key"][0], lane["column"][0])
                lane["key"] = [lane["key"][1], NONE]
                lane["column"] = [lane["column"][1], NO_COLUMN]
                lane["dropped"] += 1
    return chosen, refills


def _row(experts: int, vec: int, kind: str, rng: random.Random, groups: tuple[int, int] | None) -> dict[int, int]:
    columns = [column for lane in _columns(experts, vec) for column in lane]
    if kind == "ties":
        keys = {column: rng.choice([5, 5, 7, -3, 0]) for column in columns}
    elif kind == "crowded":  # the largest keys in a few lanes: the refill path
        favourite = {rng.randrange(WARP) for _ in range(2)}
        keys = {column: rng.randrange(-1000, 1000) + (5000 if (column // vec) % WARP in favourite else 0)
                for column in columns}
    else:
        keys = {column: rng.randrange(-(2**31) + 1, 2**31) for column in columns}
    for column in columns:
        if column >= experts:
            keys[column] = NONE
    if groups is not None:  # experts outside the chosen groups are NONE (pick_groups)
        count, chosen = groups
        size = experts // count
        for column in columns:
            if column < experts and column // size not in chosen:
                keys[column] = NONE
    return keys


@pytest.mark.parametrize("fixed", [False, True], ids=["moving", "fixed"])
@pytest.mark.parametrize("kind", ["random", "ties", "crowded"])
@pytest.mark.parametrize(("experts", "vec", "topk", "grouped"), [
    (256, 4, 8, False), (256, 8, 9, False), (256, 4, 8, True), (72, 1, 6, False), (1024, 4, 32, False),
    (100, 4, 10, True), (64, 1, 1, False), (33, 1, 33, False),
])
def test_the_heads_choose_what_the_rounds_choose(experts: int, vec: int, topk: int, grouped: bool, kind: str,
                                                 fixed: bool) -> None:
    rng = random.Random(f"{experts}-{vec}-{topk}-{kind}")
    columns = _columns(experts, vec)
    refilled = 0
    for _ in range(40):
        groups = None
        if grouped:
            count = 4
            groups = (count, set(rng.sample(range(count), 2)))
            topk_here = min(topk, 2 * (experts // count))
        else:
            topk_here = topk
        keys = _row(experts, vec, kind, rng, groups)
        want = default_rounds(keys, columns, topk_here)
        have, refills = heads_rounds(keys, columns, topk_here, fixed)
        assert have == want, (kind, keys)
        assert all(index < experts for _, index in have)  # never a column past E or outside the groups
        refilled += refills
    if kind == "crowded" and topk >= 8:
        assert refilled > 0  # the refill path ran


def test_a_refill_without_the_threshold_fails() -> None:
    """The check can fail: refilling from every entry (ignoring the ones already given up) chooses a
    column twice on a row whose chosen experts crowd into one lane."""
    columns = _columns(256, 4)
    keys = {column: (10_000 - column if (column // 4) % WARP == 3 else -column) for lane in columns for column in lane}
    want = default_rounds(keys, columns, 8)

    def careless(keys, columns, count):
        chosen, taken = [], set()
        lanes = [sorted(lane, key=lambda c: (-keys[c], c))[:2] for lane in columns]
        dropped = [0] * WARP
        for round_index in range(count):
            for lane in range(WARP):
                if round_index >= 2 and dropped[lane] == 2:
                    lanes[lane] = sorted(columns[lane], key=lambda c: (-keys[c], c))[:2]
                    dropped[lane] = 0
            found = max(keys[lane[0]] if lane else NONE for lane in lanes)
            index = min(lane[0] for lane in lanes if lane and keys[lane[0]] == found)
            chosen.append((found, index))
            taken.add(index)
            for lane in range(WARP):
                if lanes[lane] and lanes[lane][0] == index:
                    lanes[lane] = lanes[lane][1:]
                    dropped[lane] += 1
        return chosen

    assert careless(keys, columns, 8) != want
    assert heads_rounds(keys, columns, 8)[0] == want


def test_the_variable_picks_the_heads(monkeypatch) -> None:
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core import ops
    from tileplug.core.lowering import describe_call

    scores, logits = torch.randn(4, 256), torch.randn(4, 256, dtype=torch.bfloat16)
    plain = describe_call(ops.topk_gate, scores, 8)[0]
    full = describe_call(ops.moe_topk_gate, logits, 8, "sqrtsoftplus", bias=torch.randn(256))[0]
    backward_spec = GateSpec("moe_topk_gate_backward", 256, 8)
    monkeypatch.setenv(LANE_HEADS_VARIABLE, "0")
    assert not _KERNELS["topk_gate"].spec(plain).lane_heads and not _KERNELS["moe_topk_gate"].spec(full).lane_heads
    monkeypatch.delenv(LANE_HEADS_VARIABLE)  # the default: the heads
    for kernel, call in (("topk_gate", plain), ("moe_topk_gate", full)):
        spec = _KERNELS[kernel].spec(call)
        assert spec.lane_heads and "_heads" in spec.name, spec.name
    assert not backward_spec.lane_heads
    monkeypatch.setenv(LANE_HEADS_VARIABLE, "2")
    with pytest.raises(ValueError, match=f"{LANE_HEADS_VARIABLE}='2': expected one of 0, 1"):
        _KERNELS["topk_gate"].spec(plain)


@pytest.mark.nvcc
@pytest.mark.parametrize("op", ["topk_gate", "moe_topk_gate"])
def test_the_heads_kernels_compile_without_spills(op: str) -> None:
    """The gates with the heads compile without spills; the rounds reduce the heads (two ``redux``
    a round) and the refill sits behind ``__any_sync``."""
    pytest.importorskip("tilelang")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_compile import nvcc, spill_bytes

    from tileplug.backend_cuda import jit

    if op == "topk_gate":
        specs = [GateSpec(op, 256, 8, "float32", 4, lane_heads=True), GateSpec(op, 72, 6, "float32", 1, lane_heads=True)]
    else:
        specs = [GateSpec(op, 256, 8, "float32", 4, scoring="sqrtsoftplus", biased=True, renormalize=True, shared=1,
                          table_math=True, lane_heads=True),
                 GateSpec(op, 256, 8, "bfloat16", 8, scoring="sigmoid", biased=True, groups=8, topk_groups=4,
                          renormalize=True, scaling=2.5, lane_groups=True, lane_heads=True)]
    for spec in specs:
        source = jit.lower_source(spec)
        assert "__any_sync" in source and "warp_reduce_max" in source, spec.name
        error, _, report = nvcc(source)
        assert error is None, error
        spills = spill_bytes(report)
        assert spills.get(spec.name + "_kernel") == 0 and not any(spills.values()), report[-2000:]


def test_the_variable_bounds_the_gates_registers(monkeypatch) -> None:
    """``TILEPLUG_CUDA_MOE_GATE_CTAS_PER_SM`` reaches the gates' specs (and their names) and the kernel's
    ``__launch_bounds__`` for rows of at most 8 values a lane; other values are refused, naming the variable."""
    pytest.importorskip("tilelang")
    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core import ops
    from tileplug.core.lowering import describe_call

    scores, logits = torch.randn(4, 256), torch.randn(4, 256)
    plain = describe_call(ops.topk_gate, scores, 8)[0]
    full = describe_call(ops.moe_topk_gate, logits, 8, "sqrtsoftplus", bias=torch.randn(256))[0]
    monkeypatch.setenv(GATE_CTAS_PER_SM_VARIABLE, "0")
    unbound = _KERNELS["moe_topk_gate"].spec(full)
    assert unbound.ctas_per_sm == 0 and "_c" not in unbound.name.rsplit("_w4", 1)[1], unbound.name
    monkeypatch.delenv(GATE_CTAS_PER_SM_VARIABLE)  # the default: 10
    for kernel, call in (("topk_gate", plain), ("moe_topk_gate", full)):
        spec = _KERNELS[kernel].spec(call)
        assert spec.ctas_per_sm == 10 and "_c10" in spec.name, spec.name
        assert "__launch_bounds__(128, 10)" in jit.lower_source(spec), spec.name
    long_row = describe_call(ops.topk_gate, torch.randn(4, 1024), 8)[0]  # 32 values a lane: spills under a bound
    assert _KERNELS["topk_gate"].spec(long_row).ctas_per_sm == 0
    monkeypatch.setenv(GATE_CTAS_PER_SM_VARIABLE, "16")
    with pytest.raises(ValueError, match=f"{GATE_CTAS_PER_SM_VARIABLE}='16': expected one of 0, 6, 8, 10"):
        _KERNELS["topk_gate"].spec(plain)


@pytest.mark.nvcc
@pytest.mark.parametrize("ctas", [8, 10])
def test_the_bounded_gate_compiles_without_spills(ctas: int) -> None:
    """The sqrtsoftplus gate with the heads under each offered bound: no spills, registers within it."""
    pytest.importorskip("tilelang")
    import re
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_compile import nvcc, spill_bytes

    from tileplug.backend_cuda import jit

    spec = GateSpec("moe_topk_gate", 256, 8, "float32", 4, scoring="sqrtsoftplus", biased=True, renormalize=True,
                    shared=1, table_math=True, lane_heads=True, ctas_per_sm=ctas)
    error, _, report = nvcc(jit.lower_source(spec))
    assert error is None, error
    assert not any(spill_bytes(report).values()), report[-2000:]
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", report)]
    assert registers and max(registers) <= 65536 // (ctas * 128), registers
