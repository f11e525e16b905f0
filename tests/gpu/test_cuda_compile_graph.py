"""CUDA backend under torch.compile and CUDA graphs (GPU host, ``-m gpu``).

- ``torch.compile(fullgraph=True)`` over a function calling every op of the op table on
  CUDA tensors: no graph break, the eager bytes.
- CUDA-graph capture of every op, replayed over distinct inputs copied into the captured
  input buffers: the bytes of eager calls on the same inputs.

The stochastic cases carry a ``Generator`` that each call advances: the compiled run starts
from the offsets the eager one started from (``_rewinder``), and a replay from the fresh
call's generator state (copied in with its tensors), so both round with the eager bits.
"""

from __future__ import annotations

import pytest
import torch

from tileplug.core.testing import cpu_copy, moved

pytestmark = pytest.mark.gpu

TOKENS = 257


def _calls(seed: int = 0):
    """Each op with the arguments of a few of its cases, made by the reference on the CPU."""
    from tileplug.core import config, opdefs
    from tileplug.core.registry import use_backend

    from tileplug.backend_cuda.plugin import _KERNELS

    calls = []
    for opdef in opdefs.all_ops():
        if opdef.kernel not in _KERNELS:  # no CUDA kernel yet: the reference runs it
            continue
        cases = opdef.cases()
        for case in dict.fromkeys((cases[0], cases[len(cases) // 2], cases[-1])):
            with use_backend("reference"), config.host_layout("cuda"):
                args, kwargs = case.arguments(TOKENS, "cpu", seed=seed + case.hidden)
            calls.append((opdef, moved(args, "cuda"), moved(kwargs, "cuda")))
    return calls


def _run_all(calls):
    """Every call's produced tensors (returned, or mutated in place: an in-place op runs on
    fresh copies of its inputs, so running the list again starts from the same values)."""
    results = []
    for opdef, args, kwargs in calls:
        if opdef.mutates:
            args, kwargs = moved(args, "cuda", fresh=True), moved(kwargs, "cuda", fresh=True)
        produced = opdef.produced(opdef.function(*args, **kwargs), *args, **kwargs)
        results.extend(tensor for tensor in produced if tensor is not None)
    return results


def _rewinder(calls):
    """A function that puts every ``Generator`` of ``calls`` back at its offset of now (fills of
    its state tensor, which a captured graph reads at replay)."""
    from tileplug.core.generator import Generator

    generators = [value for _, args, kwargs in calls for value in list(args) + list(kwargs.values())
                  if isinstance(value, Generator)]
    starts = [generator.offset_state.clone() for generator in generators]

    def rewind() -> None:
        for generator, start in zip(generators, starts):
            generator.offset_state.copy_(start)

    return rewind


def test_fullgraph_compile_on_cuda_gives_the_eager_bytes() -> None:
    from tileplug.core.testing import assert_bytes_equal

    calls = _calls()
    rewind = _rewinder(calls)
    eager = _run_all(calls)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(lambda: _run_all(calls))()
    assert explanation.graph_break_count == 0, explanation.break_reasons
    rewind()
    compiled = torch.compile(lambda: _run_all(calls), fullgraph=True)()
    torch.cuda.synchronize()
    for index, (have, want) in enumerate(zip(compiled, eager)):
        assert_bytes_equal(cpu_copy(have), cpu_copy(want), what=f"output {index}", strides=True, nan_equal=True)


def test_cuda_graph_capture_replays_every_op_over_distinct_inputs() -> None:
    from tileplug.core.testing import assert_bytes_equal

    captured_calls = _calls(seed=1)
    _run_all(captured_calls)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_outputs = _run_all(captured_calls)
    for seed in (2, 3):
        fresh = _calls(seed=seed)
        for (_, args, kwargs), (_, new_args, new_kwargs) in zip(captured_calls, fresh):
            for old, new in zip(_flat(args, kwargs), _flat(new_args, new_kwargs)):
                old.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        expected = _run_all(fresh)
        for index, (have, want) in enumerate(zip(graph_outputs, expected)):
            assert_bytes_equal(cpu_copy(have), cpu_copy(want), what=f"seed {seed} output {index}", strides=True,
                               nan_equal=True)


def _flat(args, kwargs) -> list[torch.Tensor]:
    """The tensors of a call, a ``Generator``'s state tensors included (copying a fresh call's
    into the captured one's sets its seed and rewinds its offset)."""
    from tileplug.core.generator import Generator

    found = []
    for value in list(args) + list(kwargs.values()):
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif isinstance(item, Generator):
                found.extend((item.seed_state, item.offset_state))
    return found
