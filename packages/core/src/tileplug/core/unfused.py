"""What an op's bytes would be without fusion: ``tileplug ledger`` prints them beside the op's own.

Two kinds of "unfused", each a list of ``(step, Ledger)``:

- a norm or RoPE as PyTorch eager runs it, one kernel per operator, each reading its inputs
  and writing its result to memory (the decomposition the seed chapter's byte ledger counts:
  full-size tensors in the input's dtype, per-row statistics in fp32). It is a lower bound of
  what eager PyTorch moves — a hypothetical split, not a trace of the kernels it launches;
- a fused op of this library as the chain of this library's own ops it fuses
  (``rms_norm_per_token_cast`` = ``rms_norm`` → ``per_token_cast``, ``rms_norm_rope`` =
  ``rms_norm`` → ``apply_rotary``, …), each of them at its own ledger.

Each op's declaration (``OpDef.unfused``) names its function here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tileplug.core.call import Ledger

Steps = list[tuple[str, Ledger]]

STATISTICS_BYTES = 4
"""Eager per-row statistics (mean, rstd) are fp32, as ``x.float()`` code computes them."""


def _elementwise(name: str, read: int, written: int, elements: int) -> tuple[str, Ledger]:
    return name, Ledger(read, written, elements)


def norm_eager_steps(call: Any) -> Steps:
    """RMSNorm as ``pow → mean → + eps → rsqrt → x · rstd → · weight`` (after ``x + residual``
    when there is one); LayerNorm as ``mean → var → + eps → sqrt → x − mean → / std → · weight
    → + bias`` (``torch.var`` reads x once). Full-size tensors in x.dtype, row statistics fp32.
    On [4096, 4096] 16-bit inputs these give the seed chapter's ratios: 3.50× and 5.00×."""
    rows, width = call.rows, call.hidden
    full = rows * width * call.input_dtype.itemsize
    row = rows * STATISTICS_BYTES
    weight = width * call.weight_dtype.itemsize if call.weight_dtype is not None else 0
    bias = width * call.bias_dtype.itemsize if call.bias_dtype is not None else 0
    elements = rows * width
    steps: Steps = []
    if call.residual:
        steps.append(_elementwise("x + residual", 2 * full, full, elements))
    if call.op == "layer_norm":
        steps += [
            _elementwise("mean(x)", full, row, elements),
            _elementwise("var(x)", full, row, elements),
            _elementwise("+ eps", row, row, rows),
            _elementwise("sqrt", row, row, rows),
            _elementwise("x - mean", full + row, full, elements),
            _elementwise("/ std", full + row, full, elements),
        ]
    else:
        steps += [
            _elementwise("pow(2)", full, full, elements),
            _elementwise("mean", full, row, elements),
            _elementwise("+ eps", row, row, rows),
            _elementwise("rsqrt", row, row, rows),
            _elementwise("x * rstd", full + row, full, elements),
        ]
    if call.weight_dtype is not None:
        steps.append(_elementwise("* weight", full + weight, full, elements))
    if call.bias_dtype is not None:
        steps.append(_elementwise("+ bias", full + bias, full, elements))
    return steps


def rotary_eager_steps(call: Any) -> Steps:
    """RoPE as the ``rotate_half`` form runs eagerly, per rotated tensor (query, then key):
    gather ``cos`` and ``sin`` rows by position, ``−x2``, ``cat(−x2, x1)``, ``x · cos``,
    ``rotate_half(x) · sin``, the sum, and the copy back into the tensor (in place). Tensors
    of the rotated channels only, in x.dtype; cos / sin rows fp32, read once per token."""
    tokens, half = call.tokens, call.rotary_dim // 2
    positions = tokens * call.positions_dtype.itemsize if call.positions_dtype is not None else 0
    table = tokens * half * 4  # one of cos / sin, gathered rows
    steps: Steps = [
        ("cos[positions]", Ledger(table + positions, table, 0)),
        ("sin[positions]", Ledger(table + positions, table, 0)),
    ]
    for name, heads in (("query", call.query_heads), ("key", call.key_heads)):
        if not heads:
            continue
        full = tokens * heads * call.rotary_dim * call.dtype.itemsize
        elements = tokens * heads * call.rotary_dim
        steps += [
            _elementwise(f"{name}: -x2", full // 2, full // 2, elements // 2),
            _elementwise(f"{name}: cat(-x2, x1)", full, full, 0),
            _elementwise(f"{name}: x * cos", full + table, full, elements),
            _elementwise(f"{name}: rotate_half(x) * sin", full + table, full, elements),
            _elementwise(f"{name}: sum", 2 * full, full, elements),
            _elementwise(f"{name}: copy into x", full, full, 0),
        ]
    return steps


def _own_ledger(traits: Any, name: str, *args: Any, **kwargs: Any) -> Ledger:
    """The ledger op ``name`` declares for this call on meta tensors (its own arithmetic)."""
    from tileplug.core import opdefs

    call, _ = opdefs.describe_call(name, *args, **kwargs)
    return opdefs.get(name).ledger(call, traits)


def norm_cast_chain(call: Any, traits: Any) -> Steps:
    """``rms_norm_per_token_cast`` as ``rms_norm`` then ``per_token_cast`` of its output: the
    same call without its cast is the ``rms_norm`` call."""
    norm = dataclasses.replace(call, op="rms_norm", name="rms_norm", quant=None, unquantized=False)
    return [("rms_norm", norm.ledger(traits)), ("per_token_cast", call.quant.ledger(traits))]


def norm_rope_chain(call: Any, traits: Any) -> Steps:
    """``rms_norm_rope`` as ``rms_norm`` per head then ``apply_rotary`` on its output (and,
    with the cast, ``per_token_cast`` of ``y.view(T, N·D)``), each at the ledger it declares."""
    x = torch.empty(call.tokens, call.heads, call.head_dim, dtype=call.dtype, device="meta")
    weight = torch.empty(call.head_dim, dtype=call.weight_dtype, device="meta")
    cache = torch.empty(1, call.rotary_dim, dtype=torch.float32, device="meta")
    positions = (None if call.positions_dtype is None
                 else torch.empty(call.tokens, dtype=call.positions_dtype, device="meta"))
    steps: Steps = [("rms_norm", _own_ledger(traits, "rms_norm", x, weight)),
                    ("apply_rotary", _own_ledger(traits, "apply_rotary", x[..., :call.rotary_dim], cache,
                                                 positions=positions, interleaved=call.interleaved))]
    if call.quant is not None:
        steps.append(("per_token_cast", call.quant.ledger(traits)))
    return steps


def swiglu_cast_chain(call: Any, traits: Any) -> Steps:
    """``swiglu_per_token_cast`` as ``swiglu(x, out_dtype=torch.float32)`` then ``per_token_cast``
    of that fp32 activation: the same call without its cast is the ``swiglu`` call, and the
    chain pays the activation's round trip (written, then read back, in fp32)."""
    forward = dataclasses.replace(call, op="swiglu", name="swiglu", quant=None, output_dtype=torch.float32)
    return [("swiglu", forward.ledger(traits)), ("per_token_cast", call.quant.ledger(traits))]
