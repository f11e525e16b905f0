"""Shared by the CUDA norm backward kernels: the weight/bias gradient's deterministic,
batch-invariant reduction over rows.

The row kernel of a backward op (``rms_norm_backward.py``, ``layer_norm_backward.py``)
runs, in CTA ``b``, ``ROW_BLOCK`` consecutive iterations of its row tile (rows
``(b · ROW_BLOCK + i) · rows + slot``); each row slot adds its rows' terms in iteration
order into registers and writes one partial row ``partials[b · rows + slot, :]`` per
reduced vector. :class:`ColumnSumSpec` then adds the partials of each column in partial
order. The blocking is a constant of the tile, so the order of every addition depends on
``T`` alone — never on the SM count or the launch — and no atomics are used: the same
inputs give the same bytes on every run. (The reference adds the rows in a pairwise tree;
the two orders agree within SPEC §5's relative 1e-5.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tileplug.backend_cuda.norm.kernels import NormKernel, make_launcher
from tileplug.core.contracts.norm import NormCall

ROW_BLOCK = 8
"""Iterations of its tile's rows one CTA runs: ``rows · ROW_BLOCK`` rows per partial block."""
COLUMN_THREADS = 256


@dataclass(frozen=True)
class ColumnSumSpec:
    """The column sum of ``partials [P, D]`` (fp32, P and D both runtime) into ``[D]``, each
    column added in row order by one thread."""

    @property
    def name(self) -> str:
        return "norm_column_sum_fp32"

    def build(self):
        import tilelang.language as T

        P = T.dynamic("P")
        D = T.dynamic("D")

        @T.prim_func
        def kernel(partials: T.Tensor((P, D), "float32"), total: T.Tensor((D,), "float32")):
            with T.Kernel(T.ceildiv(D, COLUMN_THREADS), threads=COLUMN_THREADS) as bx:
                tx = T.get_thread_binding()
                acc = T.alloc_local((1,), "float32")
                col = bx * COLUMN_THREADS + tx
                if col < D:
                    acc[0] = partials[0, col]
                    for p in T.serial(P - 1):
                        acc[0] = T.ieee_add(acc[0], partials[p + 1, col])
                    total[col] = acc[0]

        return kernel.with_attr("global_symbol", self.name)


class BackwardKernel(NormKernel):
    """Base of the backward kernel objects: the row kernel with its partial rows, then one
    column sum per reduced vector (:meth:`reduced`: the gradients' field names)."""

    def reduced(self, call: NormCall) -> tuple[str, ...]:
        """Fields of ``NormGradients`` summed over rows (``grad_weight``, ``grad_bias``)."""
        raise NotImplementedError

    def specs(self, call: NormCall) -> list:
        """Every specialisation a call runs."""
        return [self.spec(call)] + ([ColumnSumSpec()] if self.reduced(call) else [])

    def prepare(self, call: NormCall):
        from tileplug.backend_cuda import jit

        spec = self.spec(call)
        order = self.arguments(call)
        reduced = self.reduced(call)
        if not reduced:
            return make_launcher(spec, jit.entry(spec), lambda inputs, outputs: order(inputs, outputs, ()))
        heads = call.heads or 1
        per_block = spec.tile.rows * ROW_BLOCK
        hidden = call.hidden
        slots = spec.tile.rows
        # the row kernel's "outputs" are (gradients, partial rows) for this call only
        rows_launch = make_launcher(spec, jit.entry(spec), lambda inputs, both: order(inputs, both[0], both[1]))
        column_sum = jit.entry(ColumnSumSpec())

        def launch(inputs: Any, outputs: Any) -> None:
            blocks = -(-(inputs.x.shape[0] * heads) // per_block)
            partials = tuple(torch.empty((blocks * slots, hidden), dtype=torch.float32, device=inputs.x.device)
                             for _ in reduced)
            rows_launch(inputs, (outputs, partials))
            for name, rows in zip(reduced, partials):
                column_sum(rows, getattr(outputs, name))

        return launch
