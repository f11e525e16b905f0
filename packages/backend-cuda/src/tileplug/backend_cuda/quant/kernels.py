"""The kernel-protocol side shared by the four ops: supports, specs, cached launchers.

A launcher is built once per call signature (a ``QuantCall`` compares on everything but
the token count and the device) by ``prepare`` and kept by the dispatcher's route: it holds
the compiled kernel and the argument order, so a call costs a few attribute reads and the
tvm_ffi launch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tileplug.backend_cuda import jit
from tileplug.backend_cuda.quant.spec import KernelSpec, common_reason, make_spec
from tileplug.backend_cuda.random.arrivals import arrival_counter
from tileplug.backend_cuda.tuning import tuning_flag, tuning_override, tuning_tuple
from tileplug.core.call import QuantMode
from tileplug.core.contracts.quant import QuantCall, QuantInputs, QuantOutputs

Launcher = Callable[[QuantInputs, QuantOutputs], None]

SMALL_TOKENS = 2048
"""Calls of at most this many rows run an op's small-T specialisation where it has one
(GPU sweep 2026-12-01, H200: the half-width block / channel tiles win at T = 128 and 1024
and lose at T = 16384)."""


PHILOX_WIDE = True
"""Default of ``KernelSpec.philox_wide`` for the stochastic per-token / per-block tiles (H100, 2026-12-07,
docs/benchmarks/h100-in-kernel-advance-2026-12-07-s39.txt, the same run: 2-6 % faster at T = 4096 and 65536 in
each case, e.g. e2m1 1 x 16 per-token 859.9 -> 823.5 us, per-block 128 x 128 600.3 -> 575.4 us at T = 65536; the
``mul.wide.u32`` helper is the one the draws and the element casts already run on the GPU)."""


def tile_override(op: str, default: tuple[int, int, int]) -> tuple[int, int, int]:
    """``(warps, rows_per_thread, min_blocks_per_sm)`` of an op's tile; the variable
    ``TILEPLUG_CUDA_TILE_<OP>=warps,rows,min_blocks`` (its leading entries) overrides it (tuning
    on a GPU host without editing code; read when a call signature is first seen)."""
    return tuning_tuple(f"TILEPLUG_CUDA_TILE_{op.upper()}", default)


def knob_override(op: str, knob: str, default: bool) -> bool:
    """A schedule knob of ``KernelSpec`` (``spread``, ``grid_cols``) for an op's kernels;
    ``TILEPLUG_CUDA_<KNOB>_<OP>=0|1`` overrides it."""
    return tuning_flag(f"TILEPLUG_CUDA_{knob.upper()}_{op.upper()}", default)


def count_override(op: str, knob: str, default: int, allowed: tuple[int, ...] = ()) -> int:
    """A counted schedule knob of ``KernelSpec`` (``column_chunks``, ``lanes_per_row``) for an
    op's kernels; ``TILEPLUG_CUDA_<KNOB>_<OP>=n`` (one of ``allowed`` where given) overrides it."""
    return tuning_override(f"TILEPLUG_CUDA_{knob.upper()}_{op.upper()}", default, allowed)


class QuantKernel:
    """Base of the CUDA quant kernels: ``supports``, ``spec``, ``source`` and ``__call__``."""

    op = ""  # public family name (QuantCall.op)
    tile_op = ""  # KernelSpec.op
    spread = False  # KernelSpec.spread default (where the op's kernel has a spread schedule)
    grid_cols = False  # KernelSpec.grid_cols default
    inline_coords = False  # KernelSpec.inline_coords default
    small_tokens = SMALL_TOKENS  # the most rows the small-T specialisation serves, where the op has one

    # ------------------------------------------------------------------ protocol
    def supports(self, call: QuantCall) -> str | None:
        if call.op != self.op:
            return f"this kernel serves {self.op}, not {call.op}"
        return common_reason(call) or self.reason(call)

    def __call__(self, call: QuantCall, inputs: QuantInputs, outputs: QuantOutputs) -> None:
        """Run ``call`` directly (the dispatcher does not come here: it keeps the launcher
        :meth:`prepare` returns in its route, the one launcher cache)."""
        self.prepare(call)(inputs, outputs)

    def prepare(self, call: QuantCall) -> Launcher:
        """``launch(inputs, outputs)`` bound to ``call``'s signature: the kernel's entry (from
        the kernel index or compiled, once per specialisation and process: ``jit.entry``)
        and its argument order fixed. Where the op has specialisations by token count
        (:meth:`token_tiers`), a call runs the first tier whose bound holds its rows, each
        tier's kernel loaded at its first call (a first call compiles only what it runs);
        every specialisation writes the same bytes, so which one ran never shows."""
        tiers = self.token_tiers(call)
        if len(tiers) == 1:
            spec = tiers[0][1]
            return make_launcher(spec, jit.entry(spec))
        bounds = tuple(bound for bound, _ in tiers[:-1])
        launchers: list[Launcher | None] = [None] * len(tiers)

        def by_tokens(inputs: QuantInputs, outputs: QuantOutputs) -> None:
            rows = inputs.x.shape[0]
            tier = 0
            while tier < len(bounds) and rows > bounds[tier]:
                tier += 1
            launch = launchers[tier]
            if launch is None:
                spec = tiers[tier][1]
                launch = launchers[tier] = make_launcher(spec, jit.entry(spec))
            launch(inputs, outputs)

        return by_tokens

    def token_tiers(self, call: QuantCall) -> list[tuple[int | None, KernelSpec]]:
        """``[(most rows, spec), ..., (None, spec)]``, bounds ascending: the specialisation
        serving each range of token counts (default: the op's small-T specialisation up to
        :attr:`small_tokens` rows where it has one, then :meth:`spec`)."""
        small = self.small_tokens_spec(call)
        return ([(self.small_tokens, small)] if small is not None else []) + [(None, self.spec(call))]

    # ------------------------------------------------------------------ per op
    def reason(self, call: QuantCall) -> str | None:
        """Op-specific declines (None: accepted)."""
        return None

    def geometry(self, call: QuantCall) -> tuple[int, ...]:
        """(warps per CTA, rows per thread[, min CTAs per SM]) of the tile."""
        raise NotImplementedError

    def column_chunks(self, call: QuantCall) -> int:
        """128-bit chunks of each of its rows a thread owns (``KernelSpec.column_chunks``)."""
        return 1

    def lanes_per_row(self, call: QuantCall) -> int:
        """Lanes of a warp along one row of a block / channel tile (``KernelSpec.lanes_per_row``;
        default 32: a warp's slot is one row)."""
        return 32

    def philox_wide(self) -> bool:
        """``KernelSpec.philox_wide`` of the op's stochastic tiles: :data:`PHILOX_WIDE`, or
        ``TILEPLUG_CUDA_PHILOX_WIDE_<OP>=0|1``."""
        return knob_override(self.tile_op, "philox_wide", PHILOX_WIDE)

    def grid_columns(self, call: QuantCall) -> bool:
        """``KernelSpec.grid_cols`` of the kernel serving ``call`` (default: the class's)."""
        return self.grid_cols

    def small_tokens_spec(self, call: QuantCall) -> KernelSpec | None:
        """The specialisation serving calls of at most ``SMALL_TOKENS`` rows, where the op has
        one (default: none, :meth:`spec` serves every T)."""
        return None

    # ------------------------------------------------------------------ helpers
    def spec(self, call: QuantCall) -> KernelSpec:
        """The specialisation serving ``call``."""
        return make_spec(
            call, self.tile_op, *self.geometry(call),
            spread=knob_override(self.tile_op, "spread", self.spread),
            grid_cols=knob_override(self.tile_op, "grid_cols", self.grid_columns(call)),
            column_chunks=count_override(self.tile_op, "column_chunks", self.column_chunks(call)),
            inline_coords=knob_override(self.tile_op, "inline_coords", self.inline_coords),
            lanes_per_row=self.lanes_per_row(call),
            philox_wide=self.philox_wide(),
        )

    def specs(self, call: QuantCall) -> list[KernelSpec]:
        """Every specialisation a call of this signature may run (precompile, compile grids),
        the largest tier's (:meth:`spec`) first."""
        return [spec for _, spec in reversed(self.token_tiers(call))]

    def source(self, call: QuantCall, arch: str = jit.DEFAULT_ARCH) -> str:
        """Generated CUDA source of the kernel serving ``call`` (no GPU needed)."""
        return jit.lower_source(self.spec(call), arch)


def make_launcher(spec: KernelSpec, kernel: Any) -> Launcher:
    """A closure running ``kernel`` (compiled ``spec``) on a call's inputs and outputs.

    Outputs are stored 64/128 bits at a time: they must be 16-byte aligned, which core
    guarantees (fresh allocations, and ``out=`` is checked by the contract)."""
    vec = (spec.x_vec * spec.in_values_per_byte if spec.bf16_pairs else spec.x_vec) if spec.vectorize else 1
    pairs = spec.bf16_pairs
    quantized = spec.in_sf is not None
    mode = spec.mode

    def row_stride_fixed(x: torch.Tensor) -> torch.Tensor:
        # A single row's stride is never used, but the kernel's runtime check reads it:
        # give the row a stride the check accepts (the contract ignores it for one row).
        if vec > 1 and x.stride(0) % vec and x.shape[0] == 1:
            x = x.as_strided(x.shape, (-(-x.shape[1] // vec) * vec, 1))
        return x.view(torch.int32) if pairs else x

    if mode is QuantMode.CAST and spec.stochastic:  # the generator's state; the kernel's last CTA advances it

        def launch(inputs: QuantInputs, outputs: QuantOutputs) -> None:
            offset = inputs.offset
            if quantized:
                kernel(row_stride_fixed(inputs.x), inputs.input_sf, outputs.q, outputs.sf, inputs.seed, offset,
                       arrival_counter(offset))
            else:
                kernel(row_stride_fixed(inputs.x), outputs.q, outputs.sf, inputs.seed, offset, arrival_counter(offset))

    elif mode is QuantMode.CAST:

        def launch(inputs: QuantInputs, outputs: QuantOutputs) -> None:
            if quantized:
                kernel(row_stride_fixed(inputs.x), inputs.input_sf, outputs.q, outputs.sf)
            else:
                kernel(row_stride_fixed(inputs.x), outputs.q, outputs.sf)

    elif mode is QuantMode.SF_ONLY:

        def launch(inputs: QuantInputs, outputs: QuantOutputs) -> None:
            x = row_stride_fixed(inputs.x)
            if quantized:
                kernel(x, inputs.input_sf, outputs.sf)
            else:
                kernel(x, outputs.sf)

    elif mode is QuantMode.PRECOMPUTED_SF:

        def launch(inputs: QuantInputs, outputs: QuantOutputs) -> None:
            if quantized:
                kernel(row_stride_fixed(inputs.x), inputs.input_sf, inputs.given_sf, outputs.q)
            else:
                kernel(row_stride_fixed(inputs.x), inputs.given_sf, outputs.q)

    elif mode is QuantMode.CAST_AND_CAST_BACK:

        def launch(inputs: QuantInputs, outputs: QuantOutputs) -> None:
            kernel(row_stride_fixed(inputs.x))  # in place (a re-strided single row is a view of x)

    else:

        def launch(inputs: QuantInputs, outputs: QuantOutputs) -> None:
            kernel(row_stride_fixed(inputs.x), inputs.input_sf, outputs.q)

    return launch
