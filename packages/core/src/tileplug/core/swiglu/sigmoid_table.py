"""The fp32 sigmoid of every bf16 gate, as a table: what a backend's SwiGLU kernels of a bf16 x with
an fp32 ``y`` (or gradients) may read instead of evaluating the sigmoid (CUDA: every kernel whose
sigmoid bits reach an fp32 result or a gradient; Ascend: ``swiglu`` with an fp32 ``y`` and the fused
cast).

SPEC §8 asks for the correctly rounded fp32 ``sigmoid(g)`` (one ulp of ``s`` grows to five of
``y``), which in registers costs an fp64 evaluation and a rounding test per value. A bf16 gate has
only 65536 values, and all but 8192 of them share a handful of results, so a kernel looks ``s`` up
instead: the bf16 bits of ``g`` (the sign, then the magnitude's 15 bits) pick an entry;
magnitudes below :data:`LOW` (below ``2^-25``: ``s`` rounds to ``1/2``) read the first entry of
their sign, those above :data:`HIGH` (from ``128``: ``s`` rounds to 1, or to 0 for a negative gate,
``e^-128`` being below half of fp32's smallest subnormal; inf and NaN too) its last one. The table
holds the reference's own values (``correctly_rounded(torch.sigmoid, g)``: fp64, rounded once;
``tests/test_cuda_swiglu_sigmoid_table.py`` checks every bf16 gate through :func:`table_index`
against the reference, and every entry against a 50-digit sigmoid: the nearest fp32 but for 63
gates below ``2^-16``, where the fp64 value is exactly an fp32 midpoint and rounds to even).

Entry ``i`` of the table is gate ``sign · 2^15 + LOW + (i mod SPAN)`` (bf16 bits) with ``sign =
i // SPAN``: :data:`ENTRIES` fp32 values, 32 KiB, which a kernel copies into shared memory once
per CTA (CUDA) or DMAs into UB once per vector core (Ascend). A NaN gate reads a finite entry;
``y`` is NaN all the same (``g`` is a factor of it).

Nothing here imports TileLang.
"""

from __future__ import annotations

import threading

import torch

from tileplug.core.moe.formulas import correctly_rounded

LOW = 0x3300
"""bf16 magnitude bits of ``2^-25``: every smaller magnitude has ``sigmoid(±g)`` round to 1/2
(``1/2 + g/4`` is within half an ulp of 1/2 below ``|g| = 2^-24``)."""
SPAN = 4096
"""Entries per sign: magnitudes ``LOW … HIGH``."""
HIGH = LOW + SPAN - 1
"""bf16 magnitude bits of ``127.5`` (``0x42FF``): every larger magnitude (128 up, inf, NaN) has
``sigmoid`` round to 1 for a positive gate and to 0 for a negative one, as this one does."""
ENTRIES = 2 * SPAN
"""Table length: positive gates, then negative ones."""

_TABLES: dict[torch.device, torch.Tensor] = {}
_LOCK = threading.Lock()


def table_gates() -> torch.Tensor:
    """fp32 ``[ENTRIES]``: the gate of each entry (exact: bf16 values)."""
    magnitudes = torch.arange(LOW, HIGH + 1, dtype=torch.int32)
    bits = torch.cat((magnitudes, magnitudes | 0x8000)).to(torch.int16)
    return bits.view(torch.bfloat16).to(torch.float32)


def table_index(bits: torch.Tensor) -> torch.Tensor:
    """int32 entry of each gate given by its bf16 bits ``bits`` (int32, 0 … 65535): the kernel's
    arithmetic (``activation.table_sigmoid``), for the tests."""
    magnitude = torch.clamp(bits & 0x7FFF, LOW, HIGH)
    return magnitude - LOW + ((bits >> 3) & SPAN)


def sigmoid_table(device: torch.device, computed_on: str | None = None) -> torch.Tensor:
    """The table on ``device`` (fp32 ``[ENTRIES]``), computed by the reference's formula on
    ``device`` (``computed_on`` None: it holds the bits the reference backend gives there) or on
    ``computed_on`` (``"cpu"``: for a device whose fp64 arithmetic is not the reference's) and
    copied over; once per device, when a kernel reading it is first prepared: a normal tensor even
    under ``torch.inference_mode``; refused (RuntimeError) while a CUDA device's stream captures a
    graph, whose replay alone would fill it (a call before the capture prepares the kernel, as it
    compiles it)."""
    table = _TABLES.get(device)
    if table is None:
        with _LOCK:
            table = _TABLES.get(device)
            if table is None:
                if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError("the SwiGLU sigmoid table of this device is built at the first call of a kernel "
                                       "reading it: make one such call before capturing a CUDA graph")
                with torch.inference_mode(False):
                    gates = table_gates().to(computed_on or device)
                    table = correctly_rounded(torch.sigmoid, gates).to(device)
                _TABLES[device] = table
    return table


def clamp_sigmoid(clamp: float) -> float:
    """``sigmoid`` of the fp32 clamp value ``clamp`` as the reference rounds it (a gate the clamp
    cut has ``g = c``, not a bf16 value: the kernel selects this constant for it)."""
    return float(correctly_rounded(torch.sigmoid, torch.tensor([clamp], dtype=torch.float32))[0])
