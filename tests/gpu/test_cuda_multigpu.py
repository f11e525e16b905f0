"""The CUDA backend on a host with two or more GPUs (``-m multigpu``; skipped with the reason
on a host with one, not collected without a GPU). Every op launches on its tensors' device and
that device's current stream whatever the current device is, and leaves the current device as
it found it (``backend_cuda.devices``; its logic is tested on the CPU in
tests/test_cuda_devices.py):

- every op's cases on ``cuda:1`` with ``cuda:0`` current give the bytes of the same call on
  ``cuda:0``, the outputs on ``cuda:1``, ``cuda:0`` still current;
- under ``torch.cuda.stream(s)`` on each device, a launch waits for the work queued before it
  on ``s`` (a sleep, then the inputs' copy) with no synchronisation in between;
- CUDA-graph capture of every op on ``cuda:1`` replays over fresh inputs;
- calls alternating between devices call by call; tensors of two GPUs in one call are a
  ContractError naming both devices; the bench (``tileplug bench --device cuda:1``) and its
  timing helpers on a device that is not the current one.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tileplug.core.testing import assert_bytes_equal, cpu_copy, moved

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

TOKENS = 257
FIRST, SECOND = torch.device("cuda:0"), torch.device("cuda:1")


def _cases():
    """(opdef, case): the first, middle and last op-table case of every op with a CUDA kernel."""
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core import opdefs

    chosen = []
    for opdef in opdefs.all_ops():
        if opdef.kernel in _KERNELS:
            cases = opdef.cases()
            chosen.extend((opdef, case) for case in dict.fromkeys((cases[0], cases[len(cases) // 2], cases[-1])))
    return chosen


def _calls(device: torch.device, seed: int = 0, tokens: int = TOKENS):
    """Each chosen case's arguments, made by the reference on the CPU, moved to ``device``."""
    from tileplug.core import config
    from tileplug.core.registry import use_backend

    calls = []
    for opdef, case in _cases():
        with use_backend("reference"), config.host_layout("cuda"):
            args, kwargs = case.arguments(tokens, "cpu", seed=seed + case.hidden)
        calls.append((opdef, case, moved(args, device), moved(kwargs, device)))
    return calls


def _run(opdef, args, kwargs, device: torch.device) -> list[torch.Tensor]:
    """The call's produced tensors (an in-place op runs on fresh copies of its inputs)."""
    if opdef.mutates:
        args, kwargs = moved(args, device, fresh=True), moved(kwargs, device, fresh=True)
    produced = opdef.produced(opdef.function(*args, **kwargs), *args, **kwargs)
    return [tensor for tensor in produced if tensor is not None]


def _flat(args, kwargs) -> list[torch.Tensor]:
    found = []
    for value in list(args) + list(kwargs.values()):
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif hasattr(item, "seed_state"):  # a Generator: its state tensors
                found.extend((item.seed_state, item.offset_state))
    return found


def _assert_same(have: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(have) == len(want), what
    for index, (a, b) in enumerate(zip(have, want)):
        assert_bytes_equal(cpu_copy(a), cpu_copy(b), what=f"{what} output {index}", strides=True, nan_equal=True)


@pytest.mark.parametrize("tokens", [1, TOKENS, 4001])
def test_every_op_on_cuda1_with_cuda0_current_gives_the_bytes_of_cuda0(tokens: int) -> None:
    torch.cuda.set_device(FIRST)
    for (opdef, case, args0, kwargs0), (_, _, args1, kwargs1) in zip(_calls(FIRST, tokens=tokens),
                                                                     _calls(SECOND, tokens=tokens)):
        want = _run(opdef, args0, kwargs0, FIRST)
        have = _run(opdef, args1, kwargs1, SECOND)
        assert torch.cuda.current_device() == 0, f"{case.id} left cuda:{torch.cuda.current_device()} current"
        assert all(tensor.device == SECOND for tensor in have), case.id
        torch.cuda.synchronize(SECOND)
        _assert_same(have, want, case.id)


def test_every_op_on_cuda0_with_cuda1_current_gives_the_bytes_of_cuda1() -> None:
    torch.cuda.set_device(SECOND)
    try:
        for (opdef, case, args0, kwargs0), (_, _, args1, kwargs1) in zip(_calls(FIRST), _calls(SECOND)):
            want = _run(opdef, args1, kwargs1, SECOND)
            have = _run(opdef, args0, kwargs0, FIRST)
            assert torch.cuda.current_device() == 1, case.id
            assert all(tensor.device == FIRST for tensor in have), case.id
            _assert_same(have, want, case.id)
    finally:
        torch.cuda.set_device(FIRST)


@pytest.mark.parametrize("device", [FIRST, SECOND], ids=str)
def test_a_side_stream_on_each_device_orders_the_launches_without_syncs(device: torch.device) -> None:
    """Each call's inputs are written on a side stream of ``device`` after a 20 ms sleep there,
    then the op is called under that stream: had it launched on another stream (or another
    device's), it would read the stale inputs (zeros) and its bytes would differ."""
    torch.cuda.set_device(FIRST)
    fresh = _calls(device, seed=5)
    expected = [_run(opdef, args, kwargs, device) for opdef, _, args, kwargs in fresh]
    torch.cuda.synchronize(device)
    staged = _calls(device, seed=5)
    side = torch.cuda.Stream(device)
    for (opdef, case, args, kwargs), (_, _, sources, source_kwargs), want in zip(_calls(device, seed=5), staged,
                                                                                  expected):
        for tensor in _flat(args, kwargs):
            tensor.zero_()
        torch.cuda.synchronize(device)
        with torch.cuda.stream(side):
            torch.cuda._sleep(40_000_000)  # ~20 ms at 2 GHz: the copy below lands long after any other stream ran
            for target, source in zip(_flat(args, kwargs), _flat(sources, source_kwargs)):
                target.copy_(source)
            produced = opdef.produced(opdef.function(*args, **kwargs), *args, **kwargs)
            have = [tensor for tensor in produced if tensor is not None]
        assert torch.cuda.current_device() == 0, case.id
        side.synchronize()
        _assert_same(have, want, f"{case.id} on {device}")


def test_cuda_graph_capture_on_cuda1_replays_over_fresh_inputs() -> None:
    torch.cuda.set_device(FIRST)
    captured = _calls(SECOND, seed=1)
    for opdef, _, args, kwargs in captured:  # compile and warm up outside the capture
        _run(opdef, args, kwargs, SECOND)
    torch.cuda.synchronize(SECOND)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(SECOND), torch.cuda.graph(graph):
        outputs = [_run(opdef, args, kwargs, SECOND) for opdef, _, args, kwargs in captured]
    assert torch.cuda.current_device() == 0
    for seed in (2, 3):
        fresh = _calls(SECOND, seed=seed)
        for (_, _, args, kwargs), (_, _, new_args, new_kwargs) in zip(captured, fresh):
            for old, new in zip(_flat(args, kwargs), _flat(new_args, new_kwargs)):
                old.copy_(new)
        graph.replay()
        torch.cuda.synchronize(SECOND)
        for (opdef, case, args, kwargs), have in zip(fresh, outputs):
            _assert_same(have, _run(opdef, args, kwargs, SECOND), f"seed {seed} {case.id}")


def test_calls_alternating_between_devices_call_by_call() -> None:
    from tileplug.core import ops

    torch.cuda.set_device(FIRST)
    generator = torch.Generator().manual_seed(11)
    rows = [torch.randn(1031, 7168, generator=generator).to(torch.bfloat16) for _ in range(6)]
    weight = torch.randn(7168, generator=generator).to(torch.bfloat16)
    expected = [(ops.per_token_cast(row.to(FIRST)), ops.rms_norm(row.to(FIRST), weight.to(FIRST))) for row in rows]
    for round_index in range(3):
        for index, row in enumerate(rows):
            device = (FIRST, SECOND)[(index + round_index) % 2]
            (q, sf), y = ops.per_token_cast(row.to(device)), ops.rms_norm(row.to(device), weight.to(device))
            assert torch.cuda.current_device() == 0
            assert q.device == sf.device == y.device == device
            (want_q, want_sf), want_y = expected[index]
            _assert_same([q, sf, y], [want_q, want_sf, want_y], f"row {index} on {device}")


def test_tensors_of_two_gpus_in_one_call_are_a_contract_error_naming_both() -> None:
    from tileplug.core import ops
    from tileplug.core.errors import ContractError

    x = torch.randn(8, 256, device=SECOND, dtype=torch.bfloat16)
    weight = torch.ones(256, device=FIRST, dtype=torch.bfloat16)
    with pytest.raises(ContractError, match=r"argument 'weight': expected a tensor on cuda:1, the device of x, "
                                            r"got .*device=cuda:0"):
        ops.rms_norm(x, weight)


def test_the_timing_helpers_time_a_device_that_is_not_current() -> None:
    from tileplug.core import benchmark, ops

    torch.cuda.set_device(FIRST)
    x = torch.randn(4096, 7168, device=SECOND, dtype=torch.bfloat16)
    eager = benchmark.median_seconds(lambda: ops.per_token_cast(x), SECOND)
    graph, calls = benchmark.graph_seconds_per_call(ops.per_token_cast, (x,), {}, SECOND, x.numel() * 3)
    assert torch.cuda.current_device() == 0
    # per_token_cast of 4096 x 7168 moves ~90 MB: tens of microseconds on an H200, never below 1
    assert 1e-6 < graph <= eager < 1e-2 and calls >= 2


@pytest.mark.parametrize("index", range(2))
def test_the_bench_runs_on_each_device(index: int) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "tileplug.core.cli", "bench", "--device", f"cuda:{index}", "--backends", "cuda",
         "--ops", "per_token_cast,rms_norm,apply_rotary/neox,moe_topk_gate/deepseek-v3", "--tokens", "1,4096",
         "--no-compile", "--no-dispatch"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"device: cuda:{index} (" in run.stdout
    assert run.stdout.count(" cuda ") >= 8, run.stdout  # 4 cases x 2 token counts, each a cuda row
