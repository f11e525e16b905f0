"""CUDA ``per_token_cast`` (groups ``1 × g``, g in 16/32/64/128) and its sf-only /
precomputed-sf variants, for bf16/fp32 and re-quantized ``(xq, sf)`` inputs.

Tile: 4 warps × 1 row per thread = 4 rows; a thread owns 4 chunks (one 128-bit load each,
``32 × VEC`` columns apart) of its row, so a CTA covers 4 × 32 lanes × one load = 1024 bf16
columns of each row and writes its rows' sf values as whole 32-byte sectors (with one chunk
a CTA wrote 8 bytes of a fp32 sf row and the sector was finished by another CTA launched
long after: 77% of copy at T = 65536 against 93% with 4 chunks). Re-quantized inputs keep
4 rows × 1 chunk (per-lane input scales per chunk would not fit the registers). A group is
``g / VEC`` adjacent lanes reduced with xor-shuffles (see ``grouped.py``). With fp32 scales
(not ``round_sf``) the group's lanes share out the divisions (``spread``): each lane runs
``ceil(2 · slots / lanes)`` exact divisions instead of two per slot, and the inverses are
shuffled back.
"""

from __future__ import annotations

import dataclasses

import torch

from tileplug.backend_cuda.quant.kernels import QuantKernel, tile_override
from tileplug.backend_cuda.quant.spec import KernelSpec
from tileplug.core.call import QuantMode
from tileplug.core.contracts.quant import QuantCall
from tileplug.core.quant.layouts import CUDA_LAYOUT

WARPS = 4
# GPU sweep (tests/gpu/sweep_tiles.py, H200, H = 7168, bf16, T = 4096 / 16384 / 65536, % of
# copy, triton do_bench): fp32 sf, 4 warps x 1 row x 4 chunks 75.7 / 89.5 / 93.3 (the old tile,
# 4 warps x 4 rows x 1 chunk: 72.9 / 87.0 / 77.6); UE8M0 column-major 72.8 / 89.7 / 95.4
# (old 68.9 / 86.8 / 91.5).
# e2m1 g16 (bit-arithmetic encoder): 4 x 1 x 4 chunks 50.2 / 57.5 / 60.1, 2 chunks 49.1 / 56.5 / 58.9.
CHUNKS = 4
SMALL_T_CHUNKS = 2  # packed UE8M0 column-major sf at T <= kernels.SMALL_TOKENS (sweep below)
QUANTIZED_INPUT_ROWS = 4
STOCHASTIC_MIN_CTAS_PER_SM = 6
"""At least this many CTAs an SM for the stochastic tiles of a bf16 input (ptxas caps the 1 × 128 e4m3 tile at 78
registers, was 90, no spills): H100, 2026-12-07, tests/gpu/probe_stochastic_quant.py, H = 7168, after the 8-bit
fields: 1 × 128 e4m3 530.3 -> 507.7 us at T = 65536 (86.3 -> 90.2 % of the deterministic cast eager), 37.87 ->
36.67 us at T = 4096 (docs/benchmarks/h100-stochastic-byte-fields-2026-12-07-s42.txt); e2m1 1 × 16 (fp32 scales)
583.9 -> 572.0 us. e2m1 took the cap once its carry lost the select on ``a < 1`` (43rd session: 1 × 16 at 77 / 78
registers under it with fp32 / e4m3 scales, no spills; the e4m3-scale form had spilled 12 bytes before)."""


# GPU sweep 2026-12-01 (H200, H = 7168, bf16, T = 128 / 1024 / 16384 / 65536, us and % of copy,
# read-flush timing), after grid_cols kept its tile coordinates in registers: fp32 sf, 4 x 1 x 4 chunks
# with grid_cols 4.90 / 9.74 / 100.4% / 101.9% against 5.09 / 9.28 / 93.7% / 93.7% on the 2-D grid;
# column-major UE8M0 sf is better on the 2-D grid (96.0% against 94.6% at 65536: consecutive CTAs
# then write consecutive rows of an sf column: no longer so, see grid_columns), e2m1 g16 is even
# (59.2% / 59.4%). A second run with the add-2^23 e2m1 encoder: e2m1 g16 60.0% on the 2-D grid
# against 55.1% with grid_cols, so e2m1 keeps the 2-D grid.


def _packed_ue8m0(call: QuantCall) -> bool:
    """Whether ``call``'s scales are stored as packed UE8M0 bytes on the CUDA layout."""
    return call.cast.sf_encoding(CUDA_LAYOUT).kind == "ue8m0"


class PerTokenCast(QuantKernel):
    op = "per_token_cast"
    tile_op = "per_token"
    spread = True

    def grid_columns(self, call: QuantCall) -> bool:
        # GPU run 2026-12-02 (ninth session, H200, H = 7168, after the packed sf bytes got a unit
        # stride): column-major UE8M0 sf with grid_cols 99.5% of copy at T = 65536 against 96.9% on
        # the 2-D grid (16384: 95.7 / 94.3%); e2m1 g16 (min-of-three encoder) 73.9% against 78.8%.
        # An fp32 / e4m3 column-major sf (runtime strides) was not re-timed: it keeps the 2-D grid.
        return call.quantized_input is None and call.cast.fmt.name == "e4m3" and (
            _packed_ue8m0(call) or not call.cast.col_major_sf)

    def geometry(self, call: QuantCall) -> tuple[int, int, int]:
        rows = QUANTIZED_INPUT_ROWS if call.quantized_input is not None else 1
        stochastic = (call.mode is QuantMode.CAST and bool(call.cast.stochastic) and call.quantized_input is None
                      and call.input_dtype == torch.bfloat16)
        return tile_override("per_token", (WARPS, rows, STOCHASTIC_MIN_CTAS_PER_SM if stochastic else 1))

    def column_chunks(self, call: QuantCall) -> int:
        return 1 if call.quantized_input is not None else CHUNKS

    def small_tokens_spec(self, call: QuantCall) -> KernelSpec | None:
        # GPU sweep 2026-12-02 (H200, packed UE8M0 column-major sf, H = 7168, CUDA-graph us at
        # T = 128 / 1024 / 4096 / 65536): 4 warps x 1 row x 2 chunks 2.45 / 7.02 / 23.82 / 347.1
        # against 2.67 / 7.38 / 24.03 / 343.3 with 4 chunks (TileKernels 2.65 / 6.86 / 23.66 / 325.2).
        if call.quantized_input is not None or not (call.cast.col_major_sf and _packed_ue8m0(call)):
            return None
        # (the 2-D grid: CUDA-graph us at T = 1024, 6.98 against 7.38 with grid_cols, same run as above)
        return dataclasses.replace(self.spec(call), column_chunks=SMALL_T_CHUNKS, grid_cols=False)


FAKE_QUANT_VERIFIED = True
"""Whether the CUDA ``per_token_cast_and_cast_back`` serves calls. True since the GPU run of
2026-12-02 (eighth session, H200, main at 63d7cde: ``tests/gpu/probe_fake_quant.py``, all 19
op-table cases at T = 1 / 3 / 1031 / 4001, 76 checks bytewise equal to the reference, none
failed). Set to False, every call is declined with :data:`FAKE_QUANT_UNVERIFIED` and the
reference serves it, while the compile grid still lowers, compiles and checks its kernels
(it asks ``capability``, which ignores the switch)."""
FAKE_QUANT_UNVERIFIED = ("the CUDA per_token_cast_and_cast_back kernel is built and compiled but not yet verified on a "
                         "GPU (quant.per_token_cast.FAKE_QUANT_VERIFIED is False): the next backend serves the call")


class PerTokenCastAndCastBack(PerTokenCast):
    """CUDA ``per_token_cast_and_cast_back``: the per-token tile in its fake-quant mode (the
    row's values quantized and dequantized in registers, written back over ``x``; no scale
    leaves the chip)."""

    op = "per_token_cast_and_cast_back"
    tile_op = "fake_quant"
    spread = False  # every lane needs its group's scale: no division is handed to another lane

    def capability(self, call: QuantCall) -> str | None:
        """Why the kernel cannot run ``call`` (None: it can), verified or not."""
        return super().supports(call)

    def supports(self, call: QuantCall) -> str | None:
        reason = self.capability(call)
        return FAKE_QUANT_UNVERIFIED if reason is None and not FAKE_QUANT_VERIFIED else reason

    def small_tokens_spec(self, call: QuantCall) -> KernelSpec | None:
        return None
