"""The kernel-protocol side shared by the CUDA norm ops: supports, specs, cached launchers.

A launcher is built once per call signature by ``prepare`` (the dispatcher's route keeps
it): it holds the compiled entry and the argument order, so a call costs a few attribute
reads and the tvm_ffi launch. Two things the contract does not fix are handled here, per
call and only where they can matter:

- a size-1 dim's stride takes no part in the contract's ``alignment`` (it is never used),
  but the kernel's runtime check of ``T.assume(stride % VEC == 0)`` reads it: such a dim
  gets a stride the check accepts (a view, no copy); likewise a size-1 last dim (D = 1,
  which the contract lets have any stride) gets stride 1;
- the weight and bias are read with vector loads as wide as the input's vectors
  (``VEC`` values of their dtype): one whose data pointer is not aligned to that is copied
  (a fresh allocation is), which only odd views of a weight ever need.
"""

from __future__ import annotations

import functools

from collections.abc import Callable
from typing import Any

import torch

from tileplug.backend_cuda import jit
from tileplug.backend_cuda.norm.spec import NormKernelSpec, common_reason, make_spec
from tileplug.core.contracts.norm import NormCall

Launcher = Callable[[Any, Any], None]


class NormKernel:
    """Base of the CUDA norm kernels: ``supports``, ``spec``, ``source``, ``prepare``, ``__call__``."""

    op = ""  # NormCall.op served

    # ------------------------------------------------------------------ protocol
    def supports(self, call: NormCall) -> str | None:
        if call.op != self.op:
            return f"this kernel serves {self.op}, not {call.op}"
        return common_reason(call) or self.reason(call)

    def __call__(self, call: NormCall, inputs: Any, outputs: Any) -> None:
        """Run ``call`` directly (the dispatcher keeps the launcher :meth:`prepare` returns)."""
        self.prepare(call)(inputs, outputs)

    def prepare(self, call: NormCall) -> Launcher:
        """``launch(inputs, outputs)`` bound to ``call``'s signature (the compiled entry from the
        kernel index or TileLang, once per specialisation and process)."""
        spec = self.spec(call)
        return make_launcher(spec, jit.entry(spec), self.arguments(call))

    # ------------------------------------------------------------------ per op
    def reason(self, call: NormCall) -> str | None:
        """Op-specific declines (None: accepted)."""
        return None

    def spec(self, call: NormCall) -> NormKernelSpec:
        """The specialisation serving ``call``."""
        return make_spec(call)

    def specs(self, call: NormCall) -> list:
        """Every specialisation a call runs (what ``tileplug precompile`` compiles)."""
        return [self.spec(call)]

    def arguments(self, call: NormCall) -> Callable[[Any, Any], tuple]:
        """``order(inputs, outputs)`` → the kernel's tensors in its signature's order."""
        raise NotImplementedError

    def source(self, call: NormCall, arch: str = jit.DEFAULT_ARCH) -> str:
        """Generated CUDA source of the kernel serving ``call`` (no GPU needed)."""
        return jit.lower_source(self.spec(call), arch)


def _vector_aligned(tensor: torch.Tensor, vec: int) -> torch.Tensor:
    """``tensor`` (a [D] weight or bias), copied if its data pointer is not aligned to ``vec`` values."""
    return tensor if tensor.data_ptr() % (vec * tensor.element_size()) == 0 else tensor.clone()


def _strides_fixed(tensor: torch.Tensor, vec: int) -> torch.Tensor:
    """``tensor`` with every size-1 dim's stride (unused) a multiple of ``vec``, a size-1 last
    dim's stride 1 (the kernel's buffers have unit last stride): a view. A tensor without a size-1
    dim is itself (the common case, decided without looking at its strides); the others' strides
    are looked up by their layout (:func:`_fixed_strides`)."""
    shape = tensor.shape
    if len(shape) < 2 or 1 not in shape:
        return tensor
    strides = tensor.stride()
    fixed = _fixed_strides(shape, strides, vec)
    return tensor if fixed is None else tensor.as_strided(shape, fixed)


@functools.lru_cache(maxsize=4096)
def _fixed_strides(shape: tuple[int, ...], strides: tuple[int, ...], vec: int) -> tuple[int, ...] | None:
    """The strides :func:`_strides_fixed` gives a tensor of this ``shape`` and ``strides`` (None: its own)."""
    last = len(shape) - 1
    fixed = tuple(s if size > 1 or (s % vec == 0 and (d < last or s == 1)) else (1 if d == last else vec)
                  for d, (size, s) in enumerate(zip(shape, strides)))
    return None if fixed == strides else fixed


def make_launcher(spec: NormKernelSpec, kernel: Any, order: Callable[[Any, Any], tuple]) -> Launcher:
    """A closure running ``kernel`` (compiled ``spec``) on a call's inputs and outputs
    (``order`` puts them in the kernel's argument order; vectors are at positions 1 and 2
    of ``inputs``: weight, bias)."""
    vec = spec.vec
    if not spec.vectorize:
        if spec.hidden == 1:  # D = 1: the contract allows any last stride, the kernel's buffers have 1

            def launch(inputs: Any, outputs: Any) -> None:
                kernel(*(_strides_fixed(a, 1) for a in order(inputs, outputs)))

            return launch

        def launch(inputs: Any, outputs: Any) -> None:
            kernel(*order(inputs, outputs))

        return launch

    single_head = spec.heads == 1
    weighted = spec.weight_dtype is not None
    biased = spec.bias_dtype is not None

    def launch(inputs: Any, outputs: Any) -> None:
        if weighted:
            inputs = inputs._replace(weight=_vector_aligned(inputs.weight, vec))
        if biased:
            inputs = inputs._replace(bias=_vector_aligned(inputs.bias, vec))
        arguments = order(inputs, outputs)
        if single_head or inputs.x.shape[0] == 1:
            arguments = tuple(_strides_fixed(a, vec) for a in arguments)
        kernel(*arguments)

    return launch
