#!/usr/bin/env python3
"""Tile-geometry sweep of the CUDA quant kernels (a script, not a pytest test).

For each of the six issue-3 bench cases (H = 7168, bf16 input) a short list of candidate
specialisations — warps × rows per thread × min CTAs/SM and the schedule knobs of
``KernelSpec`` (``spread``: scale divisions split over threads, coalesced per-channel sf
stores; ``grid_cols``: column tiles adjacent in launch order; ``bf16_pairs``) — is
compiled in parallel (``jit.precompile``), then each candidate is

- checked bytewise against the *oracle* candidate (the first of its list: the geometry the
  bytewise GPU tests passed with, no knobs) at T = 4001 (partial tiles) and at every timed
  T; outputs are pre-filled with 0xFF so a missing store shows;
- timed at T in {4096, 16384, 65536} with ``tileplug.core.benchmark.median_seconds`` (CUDA
  events, L2 flushed clean before each call, as ``tileplug bench``) through the kernel's
  launcher directly (no dispatch / allocation in the timed region).

The device copy (``dst.copy_(src)``, 2 GiB, read + write bytes) is measured in the same
process; effective GB/s = ledger bytes / median time (as ``tileplug bench``).

    . .gpu-bundle/prelude.sh && python3 tests/gpu/sweep_tiles.py      # GPU host; writes $OUT
    hatch run python tests/gpu/sweep_tiles.py --dry-run              # no GPU: build + compile for sm_90

Writes ``$OUT/sweep.json`` and ``$OUT/sweep.txt`` (OUT defaults to the current directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

H = 7168
TOKENS = (4096, 16384, 65536)
VERIFY_ONLY = (4001,)
COMPILE_S = 3.0  # one TileLang specialisation on one core
TIME_S = 0.2  # one timing of one candidate at one size
GRAPH = True  # also time each candidate replayed in a CUDA graph (--no-graph: off)
PEER = False  # also time TileKernels' function on the same inputs (--peer)

# case name -> (op attribute of tileplug.core.ops, kwargs, quantized input?)
CASES = {
    "per_token": ("per_token_cast", {}, False),
    "per_token_ue8m0": ("per_token_cast",
                        {"round_sf": True, "use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True}, False),
    "per_token_e2m1": ("per_token_cast", {"fmt": "e2m1", "num_per_channels": 16}, False),
    "per_block": ("per_block_cast", {"block_size": (128, 128)}, False),
    "per_channel": ("per_channel_cast", {"num_per_tokens": 128}, False),
    "cast_back": ("cast_back", {"fmt": "bf16", "x_block_size": (1, 128)}, True),
}


def _c(warps, rows, blocks=1, **knobs):
    return dict(warps=warps, rows_per_thread=rows, min_blocks_per_sm=blocks, **knobs)


S = {"spread": True}
G = {"grid_cols": True}
SG = {"spread": True, "grid_cols": True}
H16 = {"lanes_per_row": 16}  # two rows of 16 lanes per warp: 128-column block / channel tiles
L8 = {"lanes_per_row": 8}  # four rows of 8 lanes per warp: 64-column channel tiles
L4 = {"lanes_per_row": 4}  # eight rows of 4 lanes per warp: 32-column channel tiles (one warp: no barrier partner)

# The first candidate of each list is the oracle: the geometry the bytewise GPU tests
# passed with (no knobs). Per block / per channel: warps × rows == the group height.
CANDIDATES = {
    "per_token": [
        _c(4, 4), _c(4, 1, column_chunks=4, **S), _c(4, 1, column_chunks=4, **SG), _c(4, 2, column_chunks=4, **SG),
        _c(8, 1, column_chunks=4, **SG), _c(2, 1, column_chunks=4, **SG), _c(4, 1, column_chunks=7, **SG),
    ],
    "per_token_ue8m0": [
        _c(4, 4), _c(4, 1, column_chunks=4), _c(4, 1, column_chunks=4, **G), _c(8, 1, column_chunks=4),
        _c(2, 1, column_chunks=4), _c(1, 2, column_chunks=4), _c(1, 1, column_chunks=8), _c(4, 1, column_chunks=2),
        _c(4, 2, column_chunks=4), _c(4, 1, column_chunks=7), _c(2, 2, column_chunks=4), _c(4, 1, 4, column_chunks=4),
    ],
    "per_token_e2m1": [
        _c(4, 4), _c(4, 1, column_chunks=4, **S), _c(4, 1, column_chunks=4, **SG), _c(4, 2, column_chunks=4, **SG),
    ],
    "per_block": [
        _c(8, 16, 2, bf16_pairs=True), _c(16, 8, 2, bf16_pairs=True, grid_cols=True),
        _c(16, 4, 2, bf16_pairs=True, grid_cols=True, **H16), _c(16, 4, 1, bf16_pairs=True, grid_cols=True, **H16),
        _c(8, 8, 2, bf16_pairs=True, grid_cols=True, **H16), _c(16, 4, 2, bf16_pairs=True, **H16),
        _c(32, 2, 1, bf16_pairs=True, grid_cols=True, **H16),
    ],
    "per_channel": [
        _c(16, 8, 2, bf16_pairs=True), _c(8, 16, 1, bf16_pairs=True, **S), _c(16, 4, 2, bf16_pairs=True, **S, **H16),
        _c(4, 16, 1, bf16_pairs=True, **S, **H16), _c(8, 8, 1, bf16_pairs=True, **S, **H16),
        _c(1, 32, 1, bf16_pairs=True, **S, **L8), _c(2, 16, 1, bf16_pairs=True, **S, **L8),
        _c(4, 8, 1, bf16_pairs=True, **S, **L8), _c(1, 16, 1, bf16_pairs=True, **S, **L4),
        _c(2, 8, 1, bf16_pairs=True, **S, **L4), _c(4, 4, 1, bf16_pairs=True, **S, **L4),
    ],
    "cast_back": [
        _c(4, 4), _c(8, 1, column_chunks=4, inline_coords=True, **G), _c(8, 1, 2, column_chunks=4, inline_coords=True, **G),
        _c(4, 1, column_chunks=4, inline_coords=True, **G), _c(4, 1, column_chunks=2, inline_coords=True, **G),
        _c(4, 1, column_chunks=1, inline_coords=True, **G), _c(8, 1, column_chunks=2, inline_coords=True, **G),
        _c(8, 1, column_chunks=1, inline_coords=True, **G), _c(2, 1, column_chunks=4, inline_coords=True, **G),
        _c(1, 2, column_chunks=4, inline_coords=True, **G), _c(1, 1, column_chunks=8, inline_coords=True, **G),
        _c(4, 2, column_chunks=2, inline_coords=True, **G), _c(4, 1, column_chunks=4, **G),
        _c(1, 1, column_chunks=14, inline_coords=True, **G), _c(1, 1, column_chunks=7, inline_coords=True, **G),
        _c(2, 1, column_chunks=7, inline_coords=True, **G),
    ],
}


# ------------------------------------------------------------------ specs


def _args(case: str, tokens: int, device: torch.device, seed: int = 0) -> tuple[tuple, dict]:
    _, kwargs, quantized = CASES[case]
    if device.type == "meta":
        if quantized:
            q = torch.empty(tokens, H, dtype=torch.float8_e4m3fn, device=device)
            return ((q, torch.empty(tokens, H // 128, device=device)),), dict(kwargs)
        return (torch.empty(tokens, H, dtype=torch.bfloat16, device=device),), dict(kwargs)
    generator = torch.Generator(device=device).manual_seed(seed + tokens)
    x = torch.randn(tokens, H, generator=generator, device=device)
    outliers = torch.randperm(H, generator=generator, device=device)[: H // 256]
    x[:, outliers] *= 50.0
    x = x.to(torch.bfloat16)
    if not quantized:
        return (x,), dict(kwargs)
    from tileplug.core import ops
    from tileplug.core.registry import use_backend

    with use_backend("reference"):
        pair = ops.per_token_cast(x)
    return (pair,), dict(kwargs)


def describe(case: str, tokens: int, device: torch.device):
    """(kernel object, call, inputs) of ``case`` at ``tokens`` rows."""
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core import ops
    from tileplug.core.lowering import describe_call

    args, kwargs = _args(case, tokens, device)
    call, inputs = describe_call(getattr(ops, CASES[case][0]), *args, **kwargs)
    return _KERNELS[call.op], call, inputs


def candidate_specs(case: str) -> list:
    """KernelSpecs of ``case``'s candidates (the default-geometry spec with fields replaced)."""
    kernel, call, _ = describe(case, 4, torch.device("meta"))
    base = kernel.spec(call)
    specs = []
    for knobs in CANDIDATES[case]:
        fields = {"spread": False, "grid_cols": False, "bf16_pairs": False, "column_chunks": 1, "inline_coords": False,
                  "lanes_per_row": 32, **knobs}
        specs.append(dataclasses.replace(base, **fields))
    return specs


def label(spec) -> str:
    knobs = [k for k in ("spread", "grid_cols", "inline_coords") if getattr(spec, k)]
    if spec.bf16_pairs:
        knobs.append("pairs")
    if spec.column_chunks > 1:
        knobs.append(f"k{spec.column_chunks}")
    if spec.lanes_per_row != 32:
        knobs.append(f"h{spec.lanes_per_row}")
    return f"w{spec.warps}r{spec.rows_per_thread}b{spec.min_blocks_per_sm}" + ("+" + "+".join(knobs) if knobs else "")


# ------------------------------------------------------------------ measuring


def raw(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """Bit view of a tensor (same strides) for a NaN-blind bytewise comparison."""
    if tensor is None:
        return None
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.view(ints[tensor.element_size()])


def fill_garbage(outputs) -> None:
    for tensor in outputs:
        if tensor is not None:
            raw(tensor).fill_(-1)


def same(a, b) -> bool:
    return all((x is None and y is None) or torch.equal(raw(x), raw(y)) for x, y in zip(a, b))


def copy_gbps(nbytes: int = 2 << 30) -> float:
    from tileplug.core.benchmark import copy_bandwidth

    gbps = copy_bandwidth(torch.device("cuda"), nbytes)
    torch.cuda.empty_cache()
    return gbps


def run_case(case: str, specs: list, tokens: list[int], copy: float, log) -> list[dict]:
    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.quant.kernels import make_launcher
    from tileplug.core import CUDA_LAYOUT
    from tileplug.core.benchmark import median_seconds

    launchers = []
    for spec in specs:
        try:
            launchers.append(make_launcher(spec, jit.entry(spec)))
        except Exception as error:  # noqa: BLE001 - reported per candidate
            launchers.append(f"{type(error).__name__}: {error}"[:300])
    rows = [{"case": case, "candidate": label(s), "spec": s.name, "results": {}} for s in specs]
    for t in list(VERIFY_ONLY) + list(tokens):
        _, call, inputs = describe(case, t, torch.device("cuda"))
        ledger = call.ledger(CUDA_LAYOUT).bytes_total
        outputs = call.allocate(CUDA_LAYOUT)
        oracle = None
        for row, launch in zip(rows, launchers):
            entry = {"tokens": t, "ledger_bytes": ledger}
            row["results"][str(t)] = entry
            if isinstance(launch, str):
                entry["error"] = launch
                continue
            try:
                fill_garbage(outputs)
                launch(inputs, outputs)
                torch.cuda.synchronize()
                if oracle is None:
                    oracle = tuple(None if o is None else o.clone() for o in outputs)
                    entry["verified"] = "oracle"
                else:
                    entry["verified"] = same(outputs, oracle)
                if t in VERIFY_ONLY:
                    continue
                ms = median_seconds(lambda launch=launch: launch(inputs, outputs), torch.device("cuda"), 0.1, 100) * 1e3
                entry["median_us"] = ms * 1e3
                entry["gbps"] = ledger / (ms * 1e-3) / 1e9
                entry["pct_of_copy"] = 100.0 * entry["gbps"] / copy
                if GRAPH:
                    entry["graph_us"] = graph_us(launch, call, inputs, ledger)
            except Exception as error:  # noqa: BLE001
                entry["error"] = f"{type(error).__name__}: {error}"[:300]
            log(f"  {case:16s} T={t:6d} {row['candidate']:28s} "
                + (f"{entry['gbps']:7.0f} GB/s {entry['pct_of_copy']:5.1f}%" if "gbps" in entry else "")
                + (f" graph {entry['graph_us']:8.2f} us" if "graph_us" in entry else "")
                + f" verified={entry.get('verified')}" + (f" ERROR {entry['error']}" if "error" in entry else ""))
        if PEER and t not in VERIFY_ONLY:
            peer_row = next((r for r in rows if r["candidate"] == "tile_kernels"), None)
            if peer_row is None:
                peer_row = {"case": case, "candidate": "tile_kernels", "spec": "TileKernels 2.1.0", "results": {}}
                rows.append(peer_row)
            peer_row["results"][str(t)] = peer_entry = {"tokens": t, "ledger_bytes": ledger, "verified": "peer"}
            try:
                peer_entry.update(time_peer(case, t, ledger, copy))
            except Exception as error:  # noqa: BLE001
                peer_entry["error"] = f"{type(error).__name__}: {error}"[:300]
            log(f"  {case:16s} T={t:6d} {'tile_kernels':28s} " + (
                f"{peer_entry['gbps']:7.0f} GB/s {peer_entry['pct_of_copy']:5.1f}% graph {peer_entry['graph_us']:8.2f} us"
                if "graph_us" in peer_entry else peer_entry.get("error", "")))
        del outputs, inputs, oracle
        torch.cuda.empty_cache()
    return rows


def graph_us(launch, call, inputs, ledger: int) -> float:
    """Microseconds per launch replayed in a CUDA graph over distinct inputs and outputs (the
    kernel alone; ``tileplug.core.benchmark.graph_seconds_per_call``)."""
    from tileplug.core import CUDA_LAYOUT
    from tileplug.core.benchmark import graph_seconds_per_call

    def one(x, input_sf):
        launch(inputs._replace(x=x, input_sf=input_sf), call.allocate(CUDA_LAYOUT))

    seconds, _ = graph_seconds_per_call(one, (inputs.x, inputs.input_sf), {}, torch.device("cuda"), ledger)
    return seconds * 1e6


def time_peer(case: str, tokens: int, ledger: int, copy: float) -> dict:
    """TileKernels' function of ``case`` on the same inputs: eager median (its host path
    included) and graph replay, with the same timing."""
    from tileplug.core.benchmark import graph_seconds_per_call, median_seconds
    from tileplug.core.peers import tile_kernels

    import inspect

    from tileplug.core import ops

    device = torch.device("cuda")
    args, kwargs = _args(case, tokens, device)
    function = getattr(tile_kernels, CASES[case][0])
    # TileKernels requires some arguments tileplug defaults (fmt, the group size): pass tileplug's defaults
    ours = inspect.signature(getattr(ops, CASES[case][0])).parameters
    for name, parameter in list(inspect.signature(function).parameters.items())[len(args):]:
        if parameter.default is inspect.Parameter.empty and name not in kwargs and name in ours:
            kwargs[name] = ours[name].default
    seconds = median_seconds(lambda: function(*args, **kwargs), device, 0.1, 100)
    graph, _ = graph_seconds_per_call(function, args, kwargs, device, ledger)
    gbps = ledger / seconds / 1e9
    return {"median_us": seconds * 1e6, "gbps": gbps, "pct_of_copy": 100.0 * gbps / copy, "graph_us": graph * 1e6}


def table(rows: list[dict], tokens: list[int], copy: float) -> str:
    lines = [f"device copy: {copy:.0f} GB/s (2 GiB, read + write)   H = {H}, bf16 input; GB/s (% of copy)", ""]
    by_case: dict[str, list[dict]] = {}
    for row in rows:
        by_case.setdefault(row["case"], []).append(row)
    for case, group in by_case.items():
        lines.append(f"== {case}")
        lines.append(f"{'candidate':30s}" + "".join(f"{'T=' + str(t):>27s}" for t in tokens) + "  ok")
        def clean(r):  # every check of the candidate (all sizes) passed
            return all(e.get("verified") in (True, "oracle") for e in r["results"].values())

        best = {}
        for t in tokens:
            good = [r for r in group if clean(r) and "gbps" in r["results"][str(t)]]
            best[t] = max(good, key=lambda r: r["results"][str(t)]["gbps"], default=None)
        for row in group:
            cells = []
            for t in tokens:
                e = row["results"][str(t)]
                if "gbps" in e:
                    mark = "*" if best[t] is row else " "
                    graph = f" g{e['graph_us']:.2f}" if "graph_us" in e else ""
                    cells.append(f"{e['gbps']:7.0f} ({e['pct_of_copy']:4.1f}%){mark}{graph}")
                else:
                    cells.append(f"{'error':>17s} ")
            checks = [row["results"][k].get("verified") for k in row["results"]]
            ok = ("oracle" if "oracle" in checks else "peer" if "peer" in checks
                  else ("yes" if all(c is True for c in checks) else "MISMATCH"))
            lines.append(f"{row['candidate']:30s}" + "".join(f"{c:>27s}" for c in cells) + f"  {ok}")
        big = [t for t in tokens if t >= 8192]
        if big:
            def score(r):
                return min(r["results"][str(t)].get("gbps", 0.0) for t in big) if clean(r) else 0.0
            top = max(group, key=score)
            lines.append(f"best at T >= 8192 (worst-size GB/s): {top['candidate']}  ({top['spec']})")
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="build and compile the specs for sm_90 only (no GPU)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--no-compile", action="store_true", help="with --dry-run: only list the candidates")
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay timing")
    parser.add_argument("--peer", action="store_true", help="time TileKernels' function beside the candidates")
    args = parser.parse_args()
    global GRAPH, PEER
    GRAPH, PEER = not args.no_graph, args.peer
    cases = [c for c in args.cases.split(",") if c]
    tokens = [int(t) for t in args.tokens.split(",") if t]
    out = os.environ.get("OUT", ".")
    started = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {text}", flush=True)

    specs = {case: candidate_specs(case) for case in cases}
    every = [s for case in cases for s in specs[case]]
    unique = list(dict.fromkeys(every))
    workers = max(1, args.workers or 1)
    compile_estimate = -(-len(unique) // workers) * COMPILE_S
    time_estimate = len(every) * len(tokens) * TIME_S
    for case in cases:
        log(f"{case}: {len(specs[case])} candidates")
        for spec in specs[case]:
            log(f"    {label(spec):30s} {spec.name}")
    log(f"{len(unique)} specialisations, {len(every) * len(tokens)} timings; estimate: compile ~{compile_estimate:.0f} s "
        f"on {workers} processes, timing ~{time_estimate:.0f} s (+ inputs, verification, copy)")

    from tileplug.backend_cuda import jit

    if args.dry_run:
        if args.no_compile:
            return 0
        jit.precompile(unique, arch="sm_90", workers=workers)  # the same call as on the GPU host
        log(f"compiled and loaded {len(unique)} specialisations for sm_90 (no GPU used)")
        return 0

    jit.precompile(unique, workers=workers)
    log(f"precompiled {len(unique)} specialisations")
    copy = copy_gbps()
    log(f"device copy: {copy:.0f} GB/s")
    rows = []
    for case in cases:
        rows += run_case(case, specs[case], tokens, copy, log)
        copy_again = copy_gbps(1 << 30) if case == cases[-1] else None
    text = table(rows, tokens, copy)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "sweep.json"), "w") as handle:
        json.dump({"device": torch.cuda.get_device_name(0), "hidden": H, "tokens": tokens, "copy_gbps": copy,
                   "copy_gbps_end_1gib": copy_again, "torch": torch.__version__, "rows": rows}, handle, indent=1)
    with open(os.path.join(out, "sweep.txt"), "w") as handle:
        handle.write(text + "\n")
    print(text)
    log(f"done; wrote {out}/sweep.json and {out}/sweep.txt")
    mismatches = [r["candidate"] for r in rows if any(e.get("verified") is False for e in r["results"].values())]
    if mismatches:
        print(f"BYTEWISE MISMATCH (candidates that differ from the oracle): {mismatches}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
