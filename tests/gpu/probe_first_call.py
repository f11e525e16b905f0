#!/usr/bin/env python3
"""First call in a fresh process (a script, not a pytest test): tileplug against TileKernels.

For each case a fresh Python process (``subprocess``, so nothing is inherited) imports torch,
makes its input on the GPU, then times, with a device sync after each call:

- ``import``: importing the library (``tileplug.core`` / ``tile_kernels``),
- ``first``: the first call (dispatch, backend load, kernel load or compile, launch),
- ``second``: the second call.

Each library runs twice per case with ``TILELANG_CACHE_DIR`` pointing at a fresh empty
directory: ``cold`` (empty cache: the kernel is compiled), then ``warm`` (the same
directory, now holding what the cold run wrote). tileplug's kernel index lives inside that
directory, so cold really is cold for both libraries.

Python bytecode: where the packages' directories are not writable (the GPU host's unpacked
bundle), every process would compile every imported module from source, which a pip-installed
package never does; set ``PYTHONPYCACHEPREFIX`` to a writable directory so the warm runs find
bytecode, as an installed package would.

    . .gpu-bundle/prelude.sh && python3 tests/gpu/probe_first_call.py   # writes $OUT/first_call.json
    python3 tests/gpu/probe_first_call.py --profile   # cProfile of a warm first call: $OUT/first_call_profile.txt
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
import torch
library, case = sys.argv[1], sys.argv[2]
T, H = 128, 7168
device = torch.device("cuda")
x = torch.randn(T, H, device=device).to(torch.bfloat16)
q = (torch.randn(T, H, device=device) * 50).to(torch.float8_e4m3fn)
sf = torch.rand(T, H // 128, device=device) + 0.5
torch.cuda.synchronize()
ARGS = {
    "per_token": ("per_token_cast", (x, "e4m3", 128), {}),
    "per_token_ue8m0": ("per_token_cast", (x, "e4m3", 128),
                        {"use_tma_aligned_col_major_sf": True, "round_sf": True, "use_packed_ue8m0": True}),
    "per_token_e2m1": ("per_token_cast", (x, "e2m1", 16), {}),
    "per_block": ("per_block_cast", (x, "e4m3", (128, 128)), {}),
    "per_channel": ("per_channel_cast", (x, "e4m3", 128), {}),
    "cast_back": ("cast_back", ((q, sf), "bf16", (1, 128)), {}),
}
op, args, kwargs = ARGS[case]
begin = time.perf_counter()
if library == "tileplug":
    from tileplug.core import ops as module
else:
    import tile_kernels.quant as module
imported = time.perf_counter()
function = getattr(module, op)
if len(sys.argv) > 3:  # profile the first call
    import cProfile, io, pstats
    profiler = cProfile.Profile()
    profiler.enable()
    function(*args, **kwargs)
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
    open(sys.argv[3], "w").write(text.getvalue())
else:
    function(*args, **kwargs)
    torch.cuda.synchronize()
first = time.perf_counter()
function(*args, **kwargs)
torch.cuda.synchronize()
second = time.perf_counter()
extra = {}
if library == "tileplug":
    from tileplug.backend_cuda import jit
    extra = {"compiles": jit.compile_count, "index_hits": jit.index_hits, "tilelang_imported": "tilelang" in sys.modules}
print(json.dumps({"import_s": imported - begin, "first_s": first - imported, "second_s": second - first, **extra}))
"""

CASES = tuple(os.environ.get("FIRST_CALL_CASES",
                             "per_token,per_token_ue8m0,per_token_e2m1,per_block,per_channel,cast_back").split(","))
PEER_CASES = tuple(os.environ.get("FIRST_CALL_PEER_CASES", "per_token,per_block,cast_back").split(","))


def run(library: str, case: str, cache: str, profile: str | None = None) -> dict:
    env = dict(os.environ, TILELANG_CACHE_DIR=cache)
    env.pop("TILEPLUG_CUDA_KERNEL_INDEX", None)
    done = subprocess.run([sys.executable, "-c", CHILD, library, case] + ([profile] if profile else []), env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"error": (done.stderr or done.stdout)[-600:]}
    return json.loads(lines[-1])


def main() -> int:
    out = os.environ.get("OUT", ".")
    if "--profile" in sys.argv:  # cProfile of a warm first call of per_token_cast
        with tempfile.TemporaryDirectory(prefix="first-call-") as cache:
            run("tileplug", "per_token", cache)
            print(run("tileplug", "per_token", cache, os.path.join(out, "first_call_profile.txt")))
        return 0
    try:
        import tile_kernels  # noqa: F401

        peers = True
    except Exception as error:  # noqa: BLE001
        print(f"tile_kernels not importable ({type(error).__name__}: {error}); tileplug only")
        peers = False
    results = []
    for case in CASES:
        for library in ("tileplug", "tile_kernels"):
            if library == "tile_kernels" and (not peers or case not in PEER_CASES):
                continue
            with tempfile.TemporaryDirectory(prefix="first-call-") as cache:
                for mode in ("cold", "warm"):
                    result = {"case": case, "library": library, "mode": mode, **run(library, case, cache)}
                    results.append(result)
                    shown = {k: (round(v * 1e3, 1) if isinstance(v, float) else v) for k, v in result.items()}
                    print(json.dumps(shown), flush=True)
    with open(os.path.join(out, "first_call.json"), "w") as handle:
        json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
