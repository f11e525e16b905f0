"""The norm backwards' split path (``TILEPLUG_CUDA_NORM_BACKWARD_SPLIT_BELOW``, 64 by default since 2026-12-06) on a GPU (a script, not a
test): compile its specs and the bench's in parallel, then split vs fused bytes and the reference comparison of
``tests/gpu/test_cuda_norm.py``'s SPLIT cases at their token counts, the split path on there; one line a check.

    . .gpu-bundle/prelude.sh && python3 tests/gpu/probe_norm_backward_split.py
"""
import dataclasses, os, sys, time
os.environ["TILEPLUG_CUDA_NORM_BACKWARD_SPLIT_BELOW"] = "64"  # the reference comparisons below run split
import torch
sys.path.insert(0, "tests/gpu")
import test_cuda_norm as t
from tileplug.backend_cuda import jit
from tileplug.backend_cuda.plugin import _KERNELS
from tileplug.core import config, opdefs


def main() -> None:
    """Compile, then check; the compile pool spawns processes, so the work waits for ``__main__``."""
    started = time.time()
    specs = [s for case, _ in t.SPLIT for s in t._case_specs(case)]
    for op in ("rms_norm_backward", "layer_norm_backward"):
        bench = opdefs.get(op).bench()[0]
        with config.host_layout("cuda"):
            args, kwargs = bench.arguments(128, 7168, torch.bfloat16, torch.device("meta"))
            call, _ = opdefs.describe_call(op, *args, **kwargs)
        specs += _KERNELS[call.op].specs(dataclasses.replace(call, device_type="cuda"))
    specs = list(dict.fromkeys(specs))
    n = jit.precompile(specs, workers=16)
    print(f"precompiled {n} of {len(specs)} in {time.time() - started:.1f} s", flush=True)
    failures = 0
    for case, counts in t.SPLIT:
        for name, run in (("split == fused", lambda: t.test_split_path_gives_the_fused_bytes(case, counts)),
                          *((f"vs reference T={n}", (lambda n=n: t.test_matches_reference(case, n))) for n in counts)):
            try:
                run()
                print(f"ok   {case.id} {name}", flush=True)
            except Exception as error:  # noqa: BLE001
                failures += 1
                print(f"FAIL {case.id} {name}: {type(error).__name__}: {str(error)[:600]}", flush=True)
    print(f"{failures} failures, {time.time() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
