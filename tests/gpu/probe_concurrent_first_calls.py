#!/usr/bin/env python3
"""Eight ranks starting at once on one GPU host with one empty JIT cache (issue: multi-GPU
hosts, item 2). A script, not a pytest test: it spawns its own processes.

``torch.multiprocessing`` spawns 8 processes (on ``cuda:rank % device_count``) sharing a fresh
``TILELANG_CACHE_DIR`` (tileplug's kernel index lives inside it). They wait on one barrier,
then make the same first calls — the first op-table cases of quant, norm and RoPE ops at
T = 4001 through the conformance check (each result against the reference backend on the
same inputs: bytewise, or as the op's own compare says). Each rank reports its TileLang compilations,
index hits and waits; a ninth process then makes the same calls on the cache the eight left.
Goal: one compilation per specialisation in all, the ninth compiling nothing.

    . .gpu-bundle/prelude.sh && python3 tests/gpu/probe_concurrent_first_calls.py   # $OUT/concurrent_first_calls.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

RANKS = 8
TOKENS = 4001
OPS = ("per_token_cast", "per_block_cast", "cast_back", "rms_norm", "layer_norm", "rms_norm_per_token_cast",
       "apply_rotary", "rms_norm_rope")
CASES_PER_OP = 1


def calls(rank: int) -> dict:
    """The first ``CASES_PER_OP`` op-table cases of each op in ``OPS`` through the conformance
    check on this rank's GPU (the reference on the same GPU is the oracle); the JIT counters
    after."""
    import torch

    from tileplug.backend_cuda import jit
    from tileplug.core import opdefs
    from tileplug.reference.conformance import CaseDeclined, check_case

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    checked, started = 0, time.perf_counter()
    for op in OPS:
        for case in opdefs.get(op).cases()[:CASES_PER_OP]:
            try:
                check_case(case, TOKENS, "cuda", device, oracle_device=device)
                checked += 1
            except CaseDeclined:
                pass
    torch.cuda.synchronize(device)
    return {"rank": rank, "device": str(device), "cases_checked": checked,
            "seconds": round(time.perf_counter() - started, 2), "compiles": jit.compile_count,
            "index_hits": jit.index_hits, "index_waits": jit.index_waits, "loads": jit.load_count}


def rank_main(rank: int, barrier, results) -> None:
    barrier.wait()
    try:
        results.put(calls(rank))
    except Exception as error:  # noqa: BLE001 - reported by the parent
        results.put({"rank": rank, "error": f"{type(error).__name__}: {error}"})


def main() -> int:
    import torch.multiprocessing as mp

    cache = tempfile.mkdtemp(prefix="tileplug-cold-")
    os.environ["TILELANG_CACHE_DIR"] = cache  # inherited by the spawned ranks
    os.environ.pop("TILEPLUG_CUDA_KERNEL_INDEX", None)
    context = mp.get_context("spawn")
    barrier, results = context.Barrier(RANKS), context.Queue()
    started = time.perf_counter()
    processes = [context.Process(target=rank_main, args=(rank, barrier, results)) for rank in range(RANKS)]
    for process in processes:
        process.start()
    reports = sorted((results.get(timeout=900) for _ in processes), key=lambda report: report["rank"])
    for process in processes:
        process.join()
    eight_seconds = time.perf_counter() - started
    print(json.dumps({"eight_ranks": reports, "wall_seconds": round(eight_seconds, 1)}), flush=True)
    # The ninth's barrier is held here until it has run: a spawned child unpickles its
    # arguments after start() returns, and a barrier collected meanwhile is gone (its
    # semaphore unlinked: FileNotFoundError in the child).
    ninth_barrier = context.Barrier(1)
    ninth = context.Process(target=rank_main, args=(RANKS, ninth_barrier, results))
    ninth.start()
    ninth_report = results.get(timeout=900)
    ninth.join()
    summary = {
        "ranks": reports, "ninth": ninth_report, "wall_seconds_eight": round(eight_seconds, 1),
        "compiles_total": sum(report.get("compiles", 0) for report in reports),
        "specialisations": max(report.get("loads", 0) for report in reports),
        "errors": [report for report in reports + [ninth_report] if "error" in report],
    }
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "concurrent_first_calls.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    print(json.dumps({key: summary[key] for key in ("compiles_total", "specialisations", "wall_seconds_eight",
                                                     "errors")}))
    print(json.dumps(ninth_report))
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
