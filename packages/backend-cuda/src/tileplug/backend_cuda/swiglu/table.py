"""The kernel objects of the CUDA SwiGLU ops (the protocol side: ``supports`` / ``spec`` /
``prepare`` and each kernel's argument order); each op's TileLang kernel is built by its
module, ``tileplug.backend_cuda.swiglu.<op>`` (``SwigluKernelSpec.build``).

Nothing here imports TileLang (a process whose kernels are indexed loads them without it).
A launcher is built once per call signature: a call costs two views (x as ``[N, 2, H]``, the
``[N, H]`` tensors as ``[N, 1, H]``) and the tvm_ffi launch; no host sync, no formatting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tileplug.backend_cuda import jit
from tileplug.backend_cuda.norm.kernels import _strides_fixed
from tileplug.core.swiglu.sigmoid_table import sigmoid_table
from tileplug.backend_cuda.swiglu.spec import HALVES, SwigluKernelSpec, make_spec, reason, row_steps
from tileplug.core.contracts.swiglu import SwigluCall

Launcher = Callable[[Any, Any], None]


def halves(x: torch.Tensor) -> torch.Tensor:
    """x ``[N, 2H]`` as ``[N, 2, H]`` (a view: gate half, up half; splitting the unit-stride last dim
    is a view at any row stride, and ``view`` costs less host time than ``unflatten``)."""
    rows, width = x.shape
    return x.view(rows, HALVES, width // HALVES)


def single(tensor: torch.Tensor) -> torch.Tensor:
    """A ``[N, H]`` tensor as ``[N, 1, H]`` (a view)."""
    return tensor.unsqueeze(1)


def fixed(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with the unused strides of its size-1 dims acceptable to the kernel's
    alignment assumptions (a one-row call: the row stride is never used)."""
    return _strides_fixed(tensor, 16 // tensor.element_size())


class SwigluKernel:
    """Base of the CUDA SwiGLU kernels: ``supports``, ``spec``, ``specs``, ``source``, ``prepare``."""

    op = ""

    def supports(self, call: SwigluCall) -> str | None:
        if call.op != self.op:
            return f"this kernel serves {self.op}, not {call.op}"
        return reason(call)

    def spec(self, call: SwigluCall) -> SwigluKernelSpec:
        return make_spec(call)

    def specs(self, call: SwigluCall) -> list:
        return [self.spec(call)]

    def source(self, call: SwigluCall, arch: str = jit.DEFAULT_ARCH) -> str:
        return jit.lower_source(self.spec(call), arch)

    def __call__(self, call: SwigluCall, inputs: Any, outputs: Any) -> None:
        self.prepare(call)(inputs, outputs)

    def prepare(self, call: SwigluCall) -> Launcher:
        """``launch(inputs, outputs)`` bound to ``call``'s signature."""
        spec = self.spec(call)
        kernel = jit.entry(spec)
        order = self.arguments(call, spec)

        def launch(inputs: Any, outputs: Any) -> None:
            arguments = order(inputs, outputs)
            if inputs.x.shape[0] == 1:
                arguments = tuple(fixed(a) if isinstance(a, torch.Tensor) and a.dim() > 1 else a for a in arguments)
            kernel(*arguments)

        return launch

    def arguments(self, call: SwigluCall, spec: SwigluKernelSpec) -> Callable[[Any, Any], tuple]:
        raise NotImplementedError


def _optional(call: SwigluCall):
    """``(inputs) → (topk_weights, expert_ends)``, x standing in for an absent one."""
    weighted, experts = call.weighted, call.num_experts is not None

    def pick(inputs: Any) -> tuple:
        x = inputs.x
        return inputs.topk_weights if weighted else x, inputs.expert_ends if experts else x

    return pick


def _table(call: SwigluCall, spec: SwigluKernelSpec):
    """``(inputs) → ()``, or for a kernel reading the sigmoid table ``(table, row_steps)``: the
    table of the device being prepared (a CUDA kernel is prepared with its device current, once
    per device: ``devices.launcher_for``) and the row tiles a CTA runs (``swiglu.spec.row_steps``)."""
    if spec.sigmoid != "table":
        return lambda inputs: ()
    device = call.device
    if device is not None and device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    table, rows = sigmoid_table(device), spec.tile.rows

    def pick(inputs: Any) -> tuple:
        return table, row_steps(-(-inputs.x.shape[0] // rows))

    return pick


class Swiglu(SwigluKernel):
    op = "swiglu"

    def arguments(self, call: SwigluCall, spec: SwigluKernelSpec):
        optional, table = _optional(call), _table(call, spec)

        def order(inputs: Any, outputs: Any) -> tuple:
            return (halves(inputs.x), *optional(inputs), *table(inputs), single(outputs.y))

        return order


class SwigluPerTokenCast(SwigluKernel):
    op = "swiglu_per_token_cast"

    def arguments(self, call: SwigluCall, spec: SwigluKernelSpec):
        optional, table = _optional(call), _table(call, spec)

        def order(inputs: Any, outputs: Any) -> tuple:
            return (halves(inputs.x), *optional(inputs), *table(inputs), outputs.q, outputs.sf)

        return order


class SwigluBackward(SwigluKernel):
    op = "swiglu_backward"

    def arguments(self, call: SwigluCall, spec: SwigluKernelSpec):
        optional, table = _optional(call), _table(call, spec)
        weighted = call.weighted

        def order(inputs: Any, outputs: Any) -> tuple:
            x = inputs.x
            return (halves(x), single(inputs.grad_y), *optional(inputs), *table(inputs), halves(outputs.grad_x),
                    outputs.grad_topk_weights if weighted else x)

        return order
