"""Ascend kernel of ``transpose_weight_sf`` (docs/spec.md §11): fp32 weight-block scales ``S``
``[G, R, C]`` → per weight the packed UE8M0 ``sf0`` and ``sf1`` of the Ascend layout (two bytes per
``int16``: ``tileplug.core.quant.layouts.ASCEND_LAYOUT``). LOWERED only, never run on an NPU.

In memory order ``sf0`` is ``[G, P0, N]`` (``N = R·bs``, ``P0 = ceil(C/2)``): ``sf0[g, p, n]`` holds
the bytes of ``S[g, n // bs, 2p]`` (low) and ``S[g, n // bs, 2p + 1]`` (high, 0 past ``C``); ``sf1``
is ``[G, P1, K]`` (``K = C·bs``, ``P1 = ceil(R/2)``): ``sf1[g, p, k]`` holds the bytes of
``S[g, 2p, k // bs]`` and ``S[g, 2p + 1, k // bs]`` (0 past ``R``). ``transpose_sf1`` changes only
the view returned, never the memory.

Two prim_funcs per weight shape, each ``T.Kernel(C)`` with one pipelined loop over items (item
``i`` on vector core ``i % C``), every cross-stage UB buffer with 2 versions:

* **sf0 kernel**, one item per scale row ``(g, r)``: the row's ``C`` scales DMA'd in; one
  ``T.SimdVF`` region computes each scale's byte (:func:`ue8m0_bytes`), splits the row's even and
  odd columns (``vdintlv``), packs the pairs (:func:`pack_pairs`) into ``P0`` words in UB, then
  expands them (:func:`expand_words`: word ``p`` repeated ``bs`` times, a ``vselr`` lane gather per
  register) into a ``[P0, bs]`` int16 tile; one strided DMA writes it to ``sf0[g, 0:P0, r·bs:(r+1)·bs]``.
* **sf1 kernel**, one item per pair of scale rows ``(g, p)``: rows ``2p`` and ``2p + 1`` (the second
  only when it exists; else its bytes are masked to 0) DMA'd in; the same region packs column by
  column (row ``2p`` low, row ``2p + 1`` high) into ``C`` words and expands them into the
  contiguous output row ``sf1[g, p, 0:K]``, one DMA.

The byte rule (:func:`ue8m0_bytes`) is integer work on the fp32 bit pattern ``b``: with the
negative zero taken as ``+0``, ``0xFF`` for every pattern above the largest finite one (NaN, ±inf,
every negative nonzero, unsigned), else ``(b + 0x7FFFFF) >> 23`` (``E + (m != 0)``: the ceiling of
``log2`` for a normal scale; ``2^127·(1 + 2^-23)`` and up give 255 = ``0xFF``) where ``b > 0x400000``
(above ``2^-127``), else 0 (zero and the subnormals up to ``2^-127``; a subnormal above it gives 1).
Plain Python over an ``ops`` object (:mod:`~tileplug.backend_ascend.random.vector_ops`):
tests/test_ascend_weight_scales_lowering.py runs the same functions on numpy against the reference.

Instruction behaviours assumed (unknown without an NPU), besides vector_ops' list: ``vdintlv(x, y)``
returns the even then the odd lanes of the 128 lanes ``x ++ y``; ``vselr(src, index)`` gives lane
``j`` the lane ``index[j]`` of ``src``; ``mem_bar("VST_VLD")`` orders the word stores before the
expansion's loads inside one VF; the narrowing ``vcvt`` u32 → u16 of words below 2^16 is exact.

Specialised on ``(R, C, bs)`` (compile-time: the UB rows and the expansion's gather indices depend
on them); the group count ``G`` is dynamic. Declined (the reference serves the call): a block size
outside 16, 32, 64, 128 (what the contract allows), a call laid out for another pack factor than
the Ascend layout's 2 per int16, and a shape whose plan does not fit UB (an sf1
output row of ``C·bs`` int16 double-buffered: ``C·bs`` up to about 48 000 at ``bs = 16``, 61 000
at ``bs = 128``).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.
"""

from dataclasses import dataclass
from typing import Any

import tilelang.ascend.language as T
from tvm import tirx

from tileplug.backend_ascend import gm, rows
from tileplug.backend_ascend.device import DeviceTarget, lowering_target
from tileplug.backend_ascend.kernel import SpecKernel, checked_lowering
from tileplug.backend_ascend.lowering import CompileCache
from tileplug.backend_ascend.random.vector_ops import VECTOR
from tileplug.backend_ascend.ub import LANES, Plan, PlannedInSimdUb, VERSIONS
from tileplug.core.quant.sf_math import align

PACK_FACTOR = 2
"""UE8M0 bytes per packed integer on the Ascend layout (``ASCEND_LAYOUT.ue8m0_pack_factor``; the
test checks they agree)."""
PACK_DTYPE = "int16"
"""The packed integer (``ASCEND_LAYOUT.ue8m0_pack_dtype``)."""
BLOCK_SIZES = (16, 32, 64, 128)
"""Weight block sides served (the contract's; each a power of two, 64-lane registers cover whole
blocks or whole registers cover one block)."""
NEGATIVE_ZERO = 0x80000000
"""``-0.0``'s pattern: its byte is 0, as ``+0.0``'s."""
MAGNITUDE_MASK = 0x7FFFFFFF
LARGEST_FINITE = 0x7F7FFFFF
"""Patterns above it, unsigned, are NaN, ±inf or negative nonzero: byte ``0xFF``."""
NONFINITE_BYTE = 0xFF
CEILING_ADDEND = 0x7FFFFF
"""``(b + 0x7FFFFF) >> 23`` is the exponent field plus one when the mantissa is not zero."""
EXPONENT_SHIFT = 23
SMALLEST_SCALE_PATTERN = 0x400000
"""``2^-127`` (UE8M0 byte 0) as an fp32 pattern: a pattern at or below it has byte 0."""
BYTE_BITS = 8
"""The high byte of a packed word sits ``8`` bits up."""
Ops = Any
"""The instruction interface (:class:`~tileplug.backend_ascend.random.vector_ops.VectorOps`; numpy
in the tests)."""
Register = Any
"""One 64-lane register (``uint32x64`` words or a lane mask; a ``[..., 64]`` numpy array in the tests)."""
REGISTERS_PER_PAIR_CHUNK = 2
"""The sf0 row is read two registers (128 columns) at a time: their de-interleave gives 64 pairs."""


# ---------------------------------------------------------------------- arithmetic over ``ops``


def ue8m0_bytes(ops: Ops, patterns: Register) -> Register:
    """fp32 scale patterns (a ``uint32`` register) → their UE8M0 bytes (``uint32`` lanes below 256):
    ``e + 127`` with ``e = ceil(log2 s)`` clamped below at -127, ``0xFF`` for a scale that is NaN,
    infinite, negative nonzero or above ``2^127``, 0 for either zero."""
    unsigned_zero = ops.select(ops.above(patterns, NEGATIVE_ZERO, "is_negative_nonzero"), patterns,
                               ops.and_word(patterns, MAGNITUDE_MASK, "magnitude"), "zero_unsigned")
    ceiling = ops.shift_right(ops.add_word(unsigned_zero, CEILING_ADDEND, "rounded_up"), EXPONENT_SHIFT,
                              "ceiling_byte")
    finite = ops.select(ops.above(unsigned_zero, SMALLEST_SCALE_PATTERN, "above_smallest"), ceiling,
                        ops.splat(0, "zero_byte"), "finite_byte")
    return ops.select(ops.above(unsigned_zero, LARGEST_FINITE, "is_nonfinite"), ops.splat(NONFINITE_BYTE, "ff"),
                      finite, "ue8m0_byte")


def pack_pairs(ops: Ops, low_bytes: Register, high_bytes: Register) -> Register:
    """Two registers of UE8M0 bytes → the packed words ``low | high << 8`` (one per lane)."""
    return ops.or_words(low_bytes, ops.shift_left(high_bytes, BYTE_BITS, "high_byte"), "packed_word")


def mask_lanes_from(ops: Ops, bytes_: Register, lane_index: Register, first_masked: int) -> Register:
    """``bytes_`` with every lane whose ``lane_index`` (a ``uint32`` register) is at least
    ``first_masked`` (a Python int ≥ 0) set to 0."""
    if first_masked == 0:
        return ops.splat(0, "masked_bytes")
    return ops.select(ops.above(lane_index, first_masked - 1, "past_end"), ops.splat(0, "pad_byte"), bytes_,
                      "masked_bytes")


def expansion_index(ops: Ops, register: Any, block: int) -> tuple[Any, Register]:
    """Gather indices of output register ``register`` (flat int16 positions ``64·register + j``):
    lane ``j`` takes word ``(64·register + j) // block``, as a lane of the 64-word chunk that holds
    it; ``(chunk, indices)``. ``block`` a power of two in 16 .. 128: an output register never
    straddles two chunks."""
    first_word = (register * LANES) // block
    chunk = first_word // LANES
    within = ops.shift_right(ops.ramp(0, "lane"), block.bit_length() - 1, "lane_word")
    return chunk, ops.add_word(within, first_word - chunk * LANES, "word_in_chunk")


def row_pair_words(ops: Ops, first_patterns: Register, second_patterns: Register, pair_index: Register,
                   cols: int) -> Register:
    """sf0: 128 consecutive scales of a row (two registers of fp32 patterns, columns ``2·pair_index``
    and ``2·pair_index + 1`` de-interleaved from them) → the 64 packed words of those pairs: the
    even column's byte low, the odd column's high, 0 where the odd column is ``>= cols``."""
    even, odd = ops.deinterleave(ue8m0_bytes(ops, first_patterns), ue8m0_bytes(ops, second_patterns), "column")
    return pack_pairs(ops, even, mask_lanes_from(ops, odd, pair_index, cols // PACK_FACTOR))


def column_pair_words(ops: Ops, first_patterns: Register, second_patterns: Register,
                      keep_second: Register) -> Register:
    """sf1: the same 64 columns of rows ``2p`` and ``2p + 1`` (fp32 patterns) → their packed words,
    row ``2p``'s byte low, row ``2p + 1``'s high and-ed with ``keep_second`` (all ones when that
    row exists, else 0)."""
    high = ops.and_words(ue8m0_bytes(ops, second_patterns), keep_second, "second_kept")
    return pack_pairs(ops, ue8m0_bytes(ops, first_patterns), high)


def expanded_register(ops: Ops, chunk_words: Register, index: Register) -> Register:
    """Output register from the 64-word chunk that holds its words: lane ``j`` is word
    ``index[j]`` (:func:`expansion_index`)."""
    return ops.gather(chunk_words, index, "expanded_words")


# ---------------------------------------------------------------------- specialisation


@dataclass(frozen=True)
class WeightScaleSpec(PlannedInSimdUb):
    """One of the two kernels of a weight shape: ``side`` "sf0" or "sf1", the scale shape
    ``rows × cols`` (``R × C``), the block side, the vector cores and buffer versions. ``G`` is
    dynamic."""

    side: str
    rows: int
    cols: int
    block: int
    vector_cores: int = 64
    num_buffers: int = VERSIONS

    @property
    def packed(self) -> int:
        """Packed integers per output row's pair axis: ``P0 = ceil(C/2)`` or ``P1 = ceil(R/2)``."""
        return -(-(self.cols if self.side == "sf0" else self.rows) // PACK_FACTOR)

    @property
    def words(self) -> int:
        """Words one item packs: ``P0`` (sf0) or ``C`` (sf1)."""
        return self.packed if self.side == "sf0" else self.cols

    @property
    def expanded(self) -> int:
        """int16 elements one item writes: ``P0·bs`` or ``C·bs``."""
        return self.words * self.block

    @property
    def input_width(self) -> int:
        """fp32 scales in UB per scale row (whole registers; sf0 whole 128-column chunks)."""
        unit = LANES * (REGISTERS_PER_PAIR_CHUNK if self.side == "sf0" else 1)
        return align(self.cols, unit)

    def plan(self) -> Plan:
        """``scales_ub`` the item's scale row(s), ``words_ub`` its packed words, ``out_ub`` the
        expanded int16 tile (whole registers)."""
        input_rows = 1 if self.side == "sf0" else PACK_FACTOR
        out_elements = align(self.expanded, LANES)
        out_shape = (out_elements // self.block, self.block) if self.side == "sf0" else (out_elements,)
        return {
            "scales_ub": ((input_rows * self.input_width,), "float32", self.num_buffers),
            "words_ub": ((align(self.words, LANES),), "uint32", 1),
            "out_ub": (out_shape, PACK_DTYPE, self.num_buffers),
        }

    @property
    def layout(self) -> str:
        if self.side == "sf0":
            return (f"one item per scale row (g, r): {self.cols} scales in, {self.packed} words of 2 UE8M0 bytes, "
                    f"a [{self.packed}, {self.block}] int16 tile to sf0[g, :, r*bs:(r+1)*bs]; item i on core i % C")
        return (f"one item per pair of scale rows (g, p): 2 x {self.cols} scales in, {self.cols} words, "
                f"{self.expanded} int16 to sf1[g, p, :]; item i on core i % C")

    def describe(self) -> str:
        return f"transpose_weight_sf {self.side} [G, {self.rows}, {self.cols}] bs={self.block}"


def _scale_shape(shape) -> tuple[int, int]:
    return int(shape[-2]), int(shape[-1])


def specs_of(call: Any, target: DeviceTarget | None = None) -> list[WeightScaleSpec]:
    """The sf0 and sf1 specialisation of each distinct weight shape of ``call``, in launch order."""
    cores = (target or lowering_target()).vector_cores
    specs = []
    for shape in dict.fromkeys(_scale_shape(shape) for shape in call.shapes):
        if shape[0] * shape[1] == 0:  # an empty weight: nothing to launch
            continue
        for side in ("sf0", "sf1"):
            specs.append(WeightScaleSpec(side, shape[0], shape[1], call.block_size, cores))
    return specs


def spec_of(call: Any, target: DeviceTarget | None = None) -> WeightScaleSpec:
    """The first specialisation of ``call`` (:func:`specs_of` has them all)."""
    return specs_of(call, target)[0]


def decline_reason(call: Any) -> str | None:
    """Why the kernel cannot serve ``call`` (None: it can)."""
    if call.block_size not in BLOCK_SIZES:
        return f"block_size {call.block_size} is not one of {BLOCK_SIZES}: falls to the reference"
    factor = call.host_layout.ue8m0_pack_factor
    if factor != PACK_FACTOR:
        return (f"outputs laid out with {factor} UE8M0 bytes per integer, not the Ascend layout's {PACK_FACTOR} per "
                f"{PACK_DTYPE}: falls to the reference")
    for spec in specs_of(call):
        if spec.footprint > spec.budget:
            return (f"{spec.describe()}: UB plan {spec.footprint} bytes > {spec.budget} (an sf1 row of C*bs int16 "
                    "double-buffered does not fit; no split-row form): falls to the reference")
    return None


# ---------------------------------------------------------------------- the kernels


@T.macro
def store_words(words_ub, at, words):
    """Store a ``uint32`` register of packed words at ``words_ub[at ..]``."""
    T.simd.vsts(words_ub[at], words)


@T.macro
def store_row_halves(out_ub, at, narrow):
    """Store the low 16 bits of each lane (a narrowed register) at ``out_ub[at ..]`` (64 int16)."""
    T.simd.vsts(out_ub[at], tirx.reinterpret("int16x128", narrow), dist="PK_B32")


@T.macro
def store_tile_halves(out_ub, row, column, narrow):
    """:func:`store_row_halves` into the 2-D sf0 tile at ``out_ub[row, column]``."""
    T.simd.vsts(out_ub[row, column], tirx.reinterpret("int16x128", narrow), dist="PK_B32")


def expand_at(spec: WeightScaleSpec, buffers: dict, register: Any) -> None:
    """(Inside a ``T.SimdVF`` region.) Output register ``register`` of ``out_ub`` (flat int16
    positions ``64·register ..``): its words gathered from ``words_ub``, narrowed to 16 bits and
    stored packed."""
    chunk, index = expansion_index(VECTOR, register, spec.block)
    source = VECTOR.bind(T.simd.vld(buffers["words_ub"][chunk * LANES]), "chunk_words")
    narrow = T.simd.vcvt(expanded_register(VECTOR, source, index), "uint16", sat=True, part=0)
    position = register * LANES
    if spec.side == "sf0":
        store_tile_halves(buffers["out_ub"], position // spec.block, position % spec.block, narrow)
    else:
        store_row_halves(buffers["out_ub"], position, narrow)


def row_words_at(spec: WeightScaleSpec, buffers: dict, chunk: Any) -> None:
    """(sf0, inside a region.) Columns ``128·chunk ..`` of the row → ``words_ub[64·chunk ..]``."""
    scales_ub = buffers["scales_ub"]
    first = VECTOR.float_bits(T.simd.vld(scales_ub[chunk * 2 * LANES]), "first_scales")
    second = VECTOR.float_bits(T.simd.vld(scales_ub[chunk * 2 * LANES + LANES]), "second_scales")
    words = row_pair_words(VECTOR, first, second, VECTOR.ramp(chunk * LANES, "pair_index"), spec.cols)
    store_words(buffers["words_ub"], chunk * LANES, words)


def column_words_at(spec: WeightScaleSpec, buffers: dict, register: Any, keep_second: Register) -> None:
    """(sf1, inside a region.) Columns ``64·register ..`` of both rows → ``words_ub[64·register ..]``."""
    scales_ub = buffers["scales_ub"]
    first = VECTOR.float_bits(T.simd.vld(scales_ub[register * LANES]), "first_row")
    second = VECTOR.float_bits(T.simd.vld(scales_ub[spec.input_width + register * LANES]), "second_row")
    store_words(buffers["words_ub"], register * LANES, column_pair_words(VECTOR, first, second, keep_second))


def pack_compute(spec: WeightScaleSpec) -> Any:
    """The vector work of one item (a macro): one ``T.SimdVF`` region, the words then (after a
    ``VST_VLD`` barrier) their expansion. Looked up by :func:`build` at trace time;
    tests/test_ascend_weight_scales_lowering.py replaces it with scalar code."""
    sf0 = spec.side == "sf0"
    word_steps = spec.input_width // (LANES * (REGISTERS_PER_PAIR_CHUNK if sf0 else 1))
    out_registers = align(spec.expanded, LANES) // LANES

    def words_at(buffers, step, keep_second):
        if sf0:
            row_words_at(spec, buffers, step)
        else:
            column_words_at(spec, buffers, step, VECTOR.bind(T.simd.vdup(keep_second, "uint32"), "keep_second"))

    def expand(buffers, register):
        expand_at(spec, buffers, register)

    @T.macro
    def compute(buffers, keep_second):
        with T.SimdVF():
            for step in T.serial(word_steps):
                words_at(buffers, step, keep_second)
            T.simd.mem_bar("VST_VLD")
            for register in T.serial(out_registers):
                expand(buffers, register)

    return compute


def parameters(spec: WeightScaleSpec) -> tuple[list, Any]:
    """``(name, tensor type)`` of the GM tensors, in launch order: ``S`` the scales ``[G, R, C]``,
    ``SF0`` ``[G, P0, N]`` or ``SF1`` ``[G, P1, K]`` (memory order, contiguous); and ``G``."""
    G = T.dynamic("G")
    R, C, bs = spec.rows, spec.cols, spec.block
    output = ("SF0", T.Tensor((G, spec.packed, R * bs), PACK_DTYPE)) if spec.side == "sf0" else (
        "SF1", T.Tensor((G, spec.packed, C * bs), PACK_DTYPE))
    return [("S", T.Tensor((G, R, C), "float32")), output], G


def build(spec: WeightScaleSpec) -> Any:
    """The prim_func of ``spec`` (UB budget checked)."""
    rows.check_budget(spec.footprint, spec.budget, spec.describe())
    params, G = parameters(spec)
    plan = spec.plan()
    R, C, bs, P, cores = spec.rows, spec.cols, spec.block, spec.packed, spec.vector_cores
    per_group = R if spec.side == "sf0" else P
    width = spec.input_width
    compute = pack_compute(spec)

    def weight_scale_kernel(tensors):
        GM = gm.declare(tensors)
        with T.Kernel(cores) as cid:
            buffers, versions = rows.plan_buffers(plan)
            for it in rows.row_loop(T.ceildiv(G * per_group - cid, cores), versions, spec.num_buffers):
                item = cid + it * cores
                g = item // per_group
                j = item % per_group
                if spec.side == "sf0":
                    T.copy(GM["S"][g, j, 0:C], buffers["scales_ub"][0:C])
                    compute(buffers, T.uint32(0))
                    T.copy(buffers["out_ub"][0:P, 0:bs], GM["SF0"][g, 0:P, j * bs:(j + 1) * bs])
                else:
                    T.copy(GM["S"][g, 2 * j, 0:C], buffers["scales_ub"][0:C])
                    if 2 * j + 1 < R:
                        T.copy(GM["S"][g, 2 * j + 1, 0:C], buffers["scales_ub"][width:width + C])
                    compute(buffers, T.if_then_else(2 * j + 1 < R, T.uint32(0xFFFFFFFF), T.uint32(0)))
                    T.copy(buffers["out_ub"][0:C * bs], GM["SF1"][g, j, 0:C * bs])

    return gm.prim_func(weight_scale_kernel, params)


# ---------------------------------------------------------------------- the kernel object


def _memory_order(tensor: Any, transposed: bool) -> Any:
    """The ``[G, P, L]`` contiguous view of an output in memory order (``[*g, L, P]`` with strides
    ``(L·P, 1, L)``, or its ``[*g, P, L]`` view when ``transposed``)."""
    view = tensor if transposed else tensor.transpose(-1, -2)
    return view.reshape(-1, view.shape[-2], view.shape[-1])


def arguments(spec: WeightScaleSpec, scales: Any, output: Any, transposed: bool) -> list:
    """Launch arguments of one kernel: the scales as ``[G, R, C]`` and the output in memory order."""
    return [scales.reshape(-1, spec.rows, spec.cols), _memory_order(output, transposed)]


class WeightScaleKernel(SpecKernel):
    """``transpose_weight_sf``: per weight, the sf0 kernel then the sf1 kernel of its shape."""

    def __init__(self) -> None:
        super().__init__("transpose_weight_sf", spec_of, decline_reason, build, arguments)
        self.compiled = CompileCache(build)

    def describe(self, call: Any) -> str:
        """Every specialisation ``call`` lowers to, in launch order, as one line."""
        return "; ".join(spec.describe() for spec in specs_of(call))

    def lowerings(self, call: Any) -> list:
        """Each distinct weight shape's sf0 and sf1 kernels, lowered (disk-cached)."""
        target = lowering_target()
        return [checked_lowering(spec, build, target) for spec in specs_of(call, target)]

    def lowering(self, call: Any) -> Any:
        """The first kernel of ``call`` lowered (:meth:`lowerings` has them all)."""
        return self.lowerings(call)[0]

    def __call__(self, call: Any, inputs: tuple, outputs: list) -> None:
        """Per weight (scales ``[*g, R, C]``), the sf0 then the sf1 kernel on its outputs' storage."""
        from tileplug.backend_ascend.device import dispatch_target

        target = dispatch_target(call.device)
        for index, scales in enumerate(inputs):
            if scales.numel() == 0:
                continue
            rows_, cols = _scale_shape(scales.shape)
            for side, output in zip(("sf0", "sf1"), outputs[2 * index:2 * index + 2]):
                spec = WeightScaleSpec(side, rows_, cols, call.block_size, target.vector_cores)
                transposed = side == "sf1" and call.transpose_sf1
                self.compiled.get(spec)(*arguments(spec, scales, output, transposed))


KERNEL = WeightScaleKernel()
