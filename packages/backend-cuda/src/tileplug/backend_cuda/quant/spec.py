"""What a CUDA quant kernel is specialised on, derived from a ``QuantCall``.

A :class:`KernelSpec` holds only compile-time constants: formats, group shapes, flags,
sf encodings and the tile geometry. Token count, hidden size, row stride and every sf
stride are runtime values (``T.dynamic``), so one compiled kernel serves every shape of a
configuration. ``supports_reason`` says why a call cannot be served.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tileplug.core.call import QuantMode
from tileplug.core.contracts.quant import QuantCall
from tileplug.core.contracts.quant_reblock import LOSSLESS
from tileplug.core.quant.layouts import CUDA_LAYOUT

HIDDEN_MULTIPLE = 16
"""Hidden sizes the kernels serve: multiples of 16 (one 128-bit load never straddles a row end)."""

TL_DTYPES = {
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.int8: "int8",
}
SF_TL_DTYPES = {("fp32", 1): "float32", ("e4m3", 1): "float8_e4m3fn", ("ue8m0", 4): "int32", ("ue8m0", 2): "int16"}


@dataclass(frozen=True)
class SfRead:
    """An sf tensor a kernel reads (a quantized input's own sf, or a caller's given sf):
    encoding ``kind`` (fp32 / e4m3 / ue8m0), UE8M0 ``pack`` factor, and the group ``block``
    it describes. Row- or column-major storage is read off the strides at run time."""

    kind: str
    pack: int
    block: tuple[int, int]

    @property
    def pack_axis(self) -> int:
        return 0 if self.block[1] == 1 else 1

    @property
    def tl_dtype(self) -> str:
        return SF_TL_DTYPES[(self.kind, self.pack)]


@dataclass(frozen=True)
class KernelSpec:
    """Compile-time constants of one CUDA quant kernel.

    ``op``: per_token / per_block / per_channel / cast_back. ``mode``: cast, sf_only,
    precomputed_sf, cast_back. ``in_dtype``: TileLang dtype of the data read
    (bfloat16, float32, float8_e4m3fn, int8 = e2m1 pairs). ``in_sf``: the quantized input's
    sf. ``block``: output groups ``(bm, bn)``. ``fmt``: e4m3 / e2m1 (casts) or the
    cast_back output dtype. ``sf_kind``: how output sf is stored (fp32 / e4m3 / ue8m0),
    ``sf_col_major`` only matters for packed UE8M0 (fp32/e4m3 sf are written by strides).
    ``given``: the caller's sf in precomputed_sf mode. ``vectorize``: 128-bit loads of
    ``x`` (needs 16-byte aligned data pointer and row stride). ``warps`` × ``rows_per_thread``
    is the tile height.

    Tuning knobs (same bytes, different schedule): ``spread`` hands a tile's scale
    divisions to different threads instead of repeating them in every thread (per token:
    the lanes of a group split the rows' inverse/scale divisions and shuffle the inverses;
    per channel: one thread per column and kind reduces the warps' amax from shared memory,
    divides once and stores the sf coalesced). ``grid_cols``: one-dimensional grid with the
    column tiles of a row tile adjacent in launch order (a row tile's bytes and its sf row
    are written together) instead of row tiles adjacent. ``column_chunks`` (per-token
    tiles only): each thread owns that many 128-bit chunks of each of its rows, ``32 × VEC``
    columns apart, so one CTA covers that many times more columns of a row (its rows' sf
    values then fill whole 32-byte sectors instead of 8 bytes per CTA). ``inline_coords``
    (with ``grid_cols``): the tile coordinates are re-derived from the block index in every
    offset (64-bit floor divisions) instead of divided once into 32-bit registers.
    ``lanes_per_row`` (block and channel tiles): 16 puts two rows in each warp's slot, so a
    tile is half as wide (128 bf16 columns) and twice as many CTAs cover a small T; a channel tile
    also takes 8 or 4 (four or eight rows a slot, 64 or 32 bf16 columns: CTAs of a few warps).

    ``stochastic`` (cast mode): the narrowing of ``x · inv`` rounds stochastically with the
    Philox words of the generator's ``seed`` / ``offset`` buffers (element ``i = r·H + c`` with
    8-bit field ``i mod 4`` of word ``i // 4``: a Philox block serves 16 elements, a slot's ``VEC``
    columns are one whole block for a quantized input, half of one for bf16, a quarter for fp32,
    H being a multiple of 16; the lanes sharing a block draw one each and exchange their parts).

    ``philox_wide`` (with ``stochastic``): the Philox rounds take each 32 × 32 → 64-bit product as one
    ``mul.wide.u32`` instead of ``__umulhi`` and a 32-bit product (the same words; nvcc 13.0, sm_90: per-token
    bf16 1 × 128 e4m3 1336 → 1272 SASS instructions, per-block 128 × 128 2608 → 2448, e2m1 1 × 16 1200 →
    1128; the default: ``quant.kernels.PHILOX_WIDE``, ``TILEPLUG_CUDA_PHILOX_WIDE_<OP>=0`` the split form).

    ``lossless`` (``per_block_cast_lossless``, cast mode of an e2m1 input): a group's scale is
    read off its input scales' exponents (the largest, less the e4m3 headroom) instead of the
    amax of its values; ``round_sf`` and ``clamp_min`` are then unused (False, 0).
    """

    op: str
    mode: QuantMode
    in_dtype: str
    in_sf: SfRead | None
    block: tuple[int, int] | None
    fmt: str
    sf_kind: str | None
    sf_col_major: bool
    given: SfRead | None
    round_sf: bool
    clamp_min: float
    vectorize: bool
    warps: int
    rows_per_thread: int
    min_blocks_per_sm: int = 1
    bf16_pairs: bool = False
    spread: bool = False
    grid_cols: bool = False
    column_chunks: int = 1
    inline_coords: bool = False
    lanes_per_row: int = 32
    stochastic: bool = False
    lossless: bool = False
    philox_wide: bool = False

    def build(self):
        """The TileLang ``PrimFunc`` of this specialisation (``tileplug.backend_cuda.jit``)."""
        from tileplug.backend_cuda.quant.grouped import build_kernel

        return build_kernel(self)

    # --------------------------------------------------------------- derived constants
    @property
    def quantized_input(self) -> bool:
        return self.in_dtype in ("float8_e4m3fn", "int8")

    @property
    def in_values_per_byte(self) -> int:
        """Logical values per storage element of ``x`` (2: e2m1 pairs, or bf16 pairs read as int32)."""
        return 2 if self.in_dtype == "int8" or self.bf16_pairs else 1

    @property
    def x_storage_dtype(self) -> str:
        """TileLang dtype of the ``x`` buffer (bf16 pairs are read as int32 words)."""
        return "int32" if self.bf16_pairs else self.in_dtype

    @property
    def vec(self) -> int:
        """Logical values one thread owns per row: one 128-bit load of a float input, or 16
        quantized values (16 bytes of e4m3, 8 bytes of e2m1)."""
        if self.in_dtype == "bfloat16":
            return 8
        if self.in_dtype == "float32":
            return 4
        return 16

    @property
    def x_vec(self) -> int:
        """Storage elements of ``x`` one thread loads per row."""
        return self.vec // self.in_values_per_byte

    @property
    def tile_rows(self) -> int:
        return self.warps * self.rows_per_thread * (32 // self.lanes_per_row)

    @property
    def tile_cols(self) -> int:
        return self.lanes_per_row * self.vec * self.column_chunks

    @property
    def name(self) -> str:
        """A short, unique, identifier-safe name (kernel symbol and cache key text)."""
        parts = [self.op, self.mode.value, self.in_dtype.replace("float8_e4m3fn", "e4m3").replace("int8", "e2m1")]
        if self.in_sf is not None:
            parts.append(f"in{self.in_sf.block[0]}x{self.in_sf.block[1]}{self.in_sf.kind}{self.in_sf.pack}")
        if self.block is not None:
            parts.append(f"g{self.block[0]}x{self.block[1]}")
        parts.append(self.fmt)
        if self.sf_kind is not None:
            parts.append(f"sf{self.sf_kind}{'col' if self.sf_col_major else ''}")
        if self.given is not None:
            parts.append(f"given{self.given.kind}{self.given.pack}")
        if self.round_sf:
            parts.append("round")
        parts.append(f"c{self.clamp_min.hex().replace('.', '_').replace('+', 'p').replace('-', 'm')}")
        parts.append("v128" if self.vectorize else "scalar")
        if self.bf16_pairs:
            parts.append("pairs")
        parts.append(f"w{self.warps}r{self.rows_per_thread}b{self.min_blocks_per_sm}")
        if self.spread:
            parts.append("spread")
        if self.grid_cols:
            parts.append("gcols")
        if self.column_chunks > 1:
            parts.append(f"k{self.column_chunks}")
        if self.inline_coords:
            parts.append("inl")
        if self.lanes_per_row != 32:
            parts.append(f"h{self.lanes_per_row}")
        if self.stochastic:
            parts.append("sr")
        if self.lossless:
            parts.append("lossless")
        if self.philox_wide:
            parts.append("wide")
        return "_".join(parts)


def vector_bytes(in_dtype: torch.dtype) -> int:
    """Bytes of ``x`` one thread loads per row (16 for float and e4m3 inputs, 8 for e2m1)."""
    return 8 if in_dtype == torch.int8 else 16


def common_reason(call: QuantCall) -> str | None:
    """Declines shared by every CUDA quant kernel (None: nothing to decline)."""
    if call.hidden % HIDDEN_MULTIPLE:
        return f"hidden size must be a multiple of {HIDDEN_MULTIPLE} (got {call.hidden})"
    for what, encoding in (
        ("input sf", None if call.quantized_input is None else call.quantized_input.sf_encoding),
        ("given sf", None if call.given_sf is None else call.given_sf.encoding),
    ):
        if encoding is not None and (encoding.kind, encoding.pack_factor) not in SF_TL_DTYPES:
            return f"{what} encoding {encoding.kind}x{encoding.pack_factor} is not read by the CUDA kernels"
    return None


def make_spec(
    call: QuantCall, op: str, warps: int, rows_per_thread: int, min_blocks_per_sm: int = 1, bf16_pairs: bool = False,
    spread: bool = False, grid_cols: bool = False, column_chunks: int = 1, inline_coords: bool = False,
    lanes_per_row: int = 32, philox_wide: bool = False,
) -> KernelSpec:
    """The kernel specialisation serving ``call`` (assumes ``common_reason(call)`` is None)."""
    in_sf = None
    qin = call.quantized_input
    if qin is not None:
        in_sf = SfRead(qin.sf_encoding.kind, qin.sf_encoding.pack_factor, tuple(qin.block))
    vectorize = call.input_alignment >= vector_bytes(call.input_dtype)
    if call.mode is QuantMode.CAST_BACK:
        return KernelSpec(
            op, call.mode, TL_DTYPES[call.input_dtype], in_sf, None, TL_DTYPES[call.output_dtype], None, False,
            None, False, 0.0, vectorize, warps, rows_per_thread, min_blocks_per_sm, grid_cols=grid_cols,
            column_chunks=column_chunks, inline_coords=inline_coords and grid_cols,
        )
    cast = call.cast
    lossless = call.op == LOSSLESS
    given = None
    sf_kind = None
    if call.given_sf is not None:
        given = SfRead(call.given_sf.encoding.kind, call.given_sf.encoding.pack_factor, tuple(cast.block))
    else:
        sf_kind = cast.sf_encoding(CUDA_LAYOUT).kind
    return KernelSpec(
        op,
        call.mode,
        TL_DTYPES[call.input_dtype],
        in_sf,
        tuple(cast.block),
        cast.fmt.name,
        sf_kind,
        bool(cast.col_major_sf) and sf_kind == "ue8m0",
        given,
        bool(cast.round_sf) and given is None and not lossless,
        float(cast.clamp_min) if given is None and not lossless else 0.0,
        vectorize,
        warps,
        rows_per_thread,
        min_blocks_per_sm,
        bf16_pairs and vectorize and call.input_dtype == torch.bfloat16,
        spread and not lossless and _spreads(call, op, sf_kind),
        grid_cols,
        column_chunks if cast.block[0] == 1 else 1,
        inline_coords and grid_cols,
        lanes_per_row if cast.block[0] > 1 else 32,
        bool(cast.stochastic) and call.mode is QuantMode.CAST,
        lossless,
        philox_wide and bool(cast.stochastic) and call.mode is QuantMode.CAST,
    )


def _spreads(call: QuantCall, op: str, sf_kind: str | None) -> bool:
    """Whether ``op``'s kernel has a spread schedule for ``call`` (the flag stays off where it
    would not change the code, so specialisation names stay one per kernel)."""
    cast = call.cast
    if call.mode not in (QuantMode.CAST, QuantMode.SF_ONLY):
        return False
    if op == "per_channel":
        return True
    if op == "per_token":
        if call.quantized_input is not None:
            return False  # re-quantized inputs keep the per-lane schedule (the one the GPU tests pass)
        lanes = cast.block[1] // (16 if call.quantized_input is not None else 16 // _itemsize_of(call.input_dtype))
        return sf_kind == "fp32" and not cast.round_sf and lanes >= 2
    return False


def _itemsize_of(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
