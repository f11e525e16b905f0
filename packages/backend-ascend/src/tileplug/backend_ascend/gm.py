"""GM (global memory) parameters of an Ascend prim_func whose tensor list depends on the call.

No ``from __future__ import annotations`` here: TileLang parses the kernels that use it.

A kernel with optional tensors (weight, bias, residual, statistics, key, positions) would
need one ``@T.prim_func`` per combination; instead its body receives one hashable tuple of
``(name, tensor type)`` pairs as its only annotation and :func:`declare` registers each as a
parameter, in order. The launcher passes tensors in the same order (:func:`argument_names`).
"""

import inspect

import tilelang.ascend.language as T
from tvm.script.ir_builder import tirx


def declare(parameters):
    """Register each ``(name, tensor type)`` of ``parameters`` as a prim_func parameter, in
    order; returns ``{name: buffer}``. Call it first in the prim_func body."""
    return {name: tirx.arg(name, tensor) for name, tensor in parameters}


def prim_func(body, parameters):
    """The prim_func of ``body(parameters)`` (``body`` a plain function whose one argument
    receives the tuple and calls :func:`declare` on it)."""
    (name,) = inspect.signature(body).parameters
    body.__annotations__ = {name: tuple(parameters)}
    return T.prim_func(body)


def argument_names(parameters) -> list:
    """Names of ``parameters`` in launch order."""
    return [name for name, _ in parameters]


def rows_tensor(name: str, hidden: int, heads, dtype: str, tokens):
    """A strided row tensor ``[T, D]`` / ``[T, N, D]`` with unit last stride and dynamic other
    strides (named after ``name``): ``x``, ``residual``, ``out`` may be any such view."""
    if heads is None:
        return T.StridedTensor((tokens, hidden), (T.dynamic(f"{name}_s0"), 1), dtype)
    return T.StridedTensor((tokens, heads, hidden), (T.dynamic(f"{name}_s0"), T.dynamic(f"{name}_s1"), 1), dtype)


def row_of(tensor, heads, row, lo, hi):
    """Columns ``lo:hi`` of row ``row`` of a :func:`rows_tensor` (row ``i`` of a 3-D tensor is
    ``[i // N, i % N]``)."""
    if heads is None:
        return tensor[row, lo:hi]
    return tensor[row // heads, row % heads, lo:hi]


def statistic_of(tensor, heads, row):
    """Element ``row`` (as a one-element region) of a contiguous ``[T]`` / ``[T, N]`` tensor."""
    if heads is None:
        return tensor[row:row + 1]
    return tensor[row // heads, row % heads:row % heads + 1]
