"""The Ascend draw kernel both random-number ops are built on (``fill_rand.py`` and
``fill_randn.py`` supply the transform of the Philox words).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

``values`` is written as a flat ``[N]`` tensor (``N`` dynamic, contiguous: the contract), in
tiles of :data:`TILE_ELEMENTS` elements = 16 groups of 64 Philox blocks; tile ``t`` covers
elements ``[t·W, t·W + W)``, blocks ``t·W/4 ..``. Per vector core ``cid`` of ``T.Kernel(C)``:

1. once, DMA the seed's and the offset's two int32 words (the little-endian halves of the
   int64 ``[1]`` state tensors) into UB: the key and the counter's high half come from the
   device tensors, never from the host;
2. one :func:`~tileplug.backend_ascend.rows.row_loop` (``T.Pipelined``, the output tile
   double-buffered) over tiles ``cid, cid + C, ...``: one ``T.SimdVF`` region broadcasts the
   state words into registers and, per group, runs the Philox rounds, the op's transform, the
   element interleave and the (rounded) stores into the UB tile; then the tile is DMA'd out —
   all ``W`` elements, or for the last tile only the ``N − t·W`` that exist (a dynamic burst
   length: the words of a last block past ``N`` are computed and dropped, nothing is written
   past the tensor). Groups wholly past ``N`` are not computed.

**The offset's advance.** The kernel only reads the state. After the launch, the kernel
object queues ``offset.add_(1)`` (a torch_npu op) on the same stream: it starts only after
every block of the draw kernel has finished, so every read of the offset precedes its write,
and a captured NPU graph keeps both nodes in that order (a replay draws new numbers). One
kernel in which block 0 writes the offset would need a cross-core barrier
(``CrossCoreSetFlag`` mode 0) before the write, whose semantics cannot be checked here; the
second launch costs one small op.

Served: fp32 / bf16 / fp16 values, any element count below :data:`MAX_ELEMENTS` (int32 index
arithmetic in the kernel); larger draws fall to the reference.
"""

from dataclasses import dataclass

import tilelang.ascend.language as T
from tvm import tirx

from tileplug.backend_ascend import gm, rows
from tileplug.backend_ascend.device import DeviceTarget, lowering_target
from tileplug.backend_ascend.random import philox
from tileplug.backend_ascend.random.vector_ops import VECTOR
from tileplug.backend_ascend.ub import LANES, Plan, PlannedInSimdUb, VERSIONS

GROUPS_PER_TILE = 16
TILE_ELEMENTS = GROUPS_PER_TILE * philox.ELEMENTS_PER_GROUP
"""Elements of one pipelined tile (16 KiB of fp32)."""
MAX_ELEMENTS = 2**31 - TILE_ELEMENTS
"""Largest draw served: every element index, and a tile's end, fits an int32."""
STATE_WORDS = 8
"""A UB slot of one int64 state word (2 int32 used; 32 bytes, the DMA alignment)."""


@dataclass(frozen=True)
class DrawSpec(PlannedInSimdUb):
    """What a draw kernel is specialised on: the op (uniform or normal), the values' dtype,
    the vector-core count and the output tile's buffer versions. The element count is dynamic."""

    op: str
    dtype: str
    vector_cores: int = 64
    num_buffers: int = VERSIONS
    tile: int = TILE_ELEMENTS

    def plan(self) -> Plan:
        """``seed_ub`` / ``offset_ub`` the state words (read once), ``out_ub`` one tile of values."""
        return {
            "seed_ub": ((STATE_WORDS,), "int32", 1),
            "offset_ub": ((STATE_WORDS,), "int32", 1),
            "out_ub": ((self.tile,), self.dtype, self.num_buffers),
        }

    @property
    def layout(self) -> str:
        return (f"tiles of {self.tile} elements ({self.tile // philox.ELEMENTS_PER_GROUP} groups of 64 Philox "
                "blocks), tile t on vector core t % C, one per pipeline step")

    def describe(self) -> str:
        return f"{self.op} [N] {self.dtype} tile={self.tile}"


def spec_of(call, target: DeviceTarget | None = None) -> DrawSpec:
    cores = (target or lowering_target()).vector_cores
    return DrawSpec(op=call.op, dtype=str(call.dtype).removeprefix("torch."), vector_cores=cores)


def decline_reason(call) -> str | None:
    """Why the Ascend draw kernel cannot serve ``call`` (None: it can)."""
    if call.tokens > MAX_ELEMENTS:
        return (f"{call.tokens} elements > {MAX_ELEMENTS}: the Ascend draw kernel indexes elements in int32; "
                "falls to the reference")
    return None


def state_word(buf, index):
    """Word ``index`` of a UB state slot in every lane of a ``uint32`` register."""
    return tirx.reinterpret("uint32x64", T.simd.vld(buf[index], dist="BRC_B32"))


def group_compute(emit, elements_per_group: int = philox.ELEMENTS_PER_GROUP):
    """The vector work of one tile (a macro): one ``T.SimdVF`` region that broadcasts the state
    words into registers, then for each of ``groups`` groups of 64 blocks from block
    ``first_block`` computes the Philox words (four ``uint32`` registers, lane = block) and
    hands them to ``emit(buffers, at, words)`` (plain Python, run at trace time inside the
    region; ``at`` is the UB index of the group's first element, ``elements_per_group · g``:
    ``256·g`` when each word serves one element, ``256·k·g`` when it serves ``k``)."""

    @T.macro
    def compute(buffers, first_block, groups):
        with T.SimdVF():
            key_low = state_word(buffers["seed_ub"], 0)
            key_high = state_word(buffers["seed_ub"], 1)
            offset_low = state_word(buffers["offset_ub"], 0)
            offset_high = state_word(buffers["offset_ub"], 1)
            multipliers = philox.multiplier_registers(VECTOR)
            for g in T.serial(groups):
                words = philox.block_words(VECTOR, multipliers, first_block + g * philox.BLOCKS_PER_GROUP,
                                           (key_low, key_high), (offset_low, offset_high))
                emit(buffers, g * elements_per_group, words)

    return compute


def draw_compute(spec: DrawSpec, transform):
    """The vector work of one draw tile (a macro, :func:`group_compute`): each group's words
    through ``transform(ops, words)`` (four registers, word ``i`` of each block → its fp32
    value), interleaved into element order and stored rounded to the values' dtype at
    ``out_ub[256·g ..]``. Looked up by :func:`build` at trace time;
    tests/test_ascend_rng_lowering.py replaces it with scalar code to show the vector check failing."""
    dt = spec.dtype

    def store_values(buffers, at, words):
        elements = philox.element_order(VECTOR, transform(VECTOR, words))
        for index, element in enumerate(elements):
            rows.store_rounded(buffers["out_ub"], at + index * LANES, element, dt)

    return group_compute(store_values)


def parameters(spec: DrawSpec):
    """``(name, tensor type)`` of the GM tensors, in launch order: ``SEED`` and ``OFFSET`` the
    int32 word views of the int64 ``[1]`` state, ``V`` the values ``[N]``."""
    N = T.dynamic("N")
    return [
        ("SEED", T.Tensor((2,), "int32")),
        ("OFFSET", T.Tensor((2,), "int32")),
        ("V", T.Tensor((N,), spec.dtype)),
    ], N


def tile_kernel(spec, params, count, compute, source=None, result: str = "V", state: bool = True,
                elements_per_word: int = 1):
    """The prim_func of a draw-shaped kernel (UB budget checked): ``T.Kernel(C)``; once (when
    ``state``), the state words into ``seed_ub`` / ``offset_ub``; then one pipelined step per
    tile of ``spec.tile`` elements (tile ``t`` on core ``t % C``): ``source`` (None, or ``(GM
    name, UB name)`` of an input read element for element) DMA'd in, the tile's elements that
    exist; ``compute(buffers, first_block, groups)`` (``first_block`` the tile's first Philox
    block, which a kernel without state ignores; groups of ``256·k`` elements wholly past
    ``count`` skipped); ``out_ub`` DMA'd to GM ``result``, the elements that exist.
    ``elements_per_word``: ``k``, the elements one Philox word serves (1, the draw's, by default),
    so a group of 64 blocks covers ``256·k`` elements and tile ``t`` starts at block ``t·W / (4k)``
    (``W`` a multiple of ``256·k``). ``params``: the GM parameters (``SEED`` and ``OFFSET`` among
    them when ``state``), ``count``: the dynamic element count; ``spec`` has ``tile``,
    ``vector_cores``, ``num_buffers``, ``plan()`` (``out_ub``, the source's buffer, and
    ``seed_ub`` / ``offset_ub`` when ``state``), ``footprint``, ``budget`` and ``describe()``."""
    rows.check_budget(spec.footprint, spec.budget, spec.describe())
    plan = spec.plan()
    N, W, C = count, spec.tile, spec.vector_cores
    elements_per_block = philox.WORDS_PER_BLOCK * elements_per_word
    elements_per_group = philox.BLOCKS_PER_GROUP * elements_per_block
    assert W % elements_per_group == 0, (W, elements_per_group)
    blocks_per_tile = W // elements_per_block
    reads_source = source is not None
    source_gm, source_ub = source if reads_source else (None, None)

    def draw_kernel(tensors):
        G = gm.declare(tensors)
        with T.Kernel(C) as cid:
            buffers, versions = rows.plan_buffers(plan)
            if state:
                T.copy(G["SEED"][0:2], buffers["seed_ub"][0:2])
                T.copy(G["OFFSET"][0:2], buffers["offset_ub"][0:2])
            for it in rows.row_loop(T.ceildiv(T.ceildiv(N, W) - cid, C), versions, spec.num_buffers):
                tile = cid + it * C
                start = tile * W
                if reads_source:
                    if start + W <= N:
                        T.copy(G[source_gm][start:start + W], buffers[source_ub][0:W])
                    else:
                        available = T.alloc_var("int32")  # a variable, as for the write-back below
                        available = N - start
                        T.copy(G[source_gm][start:start + available], buffers[source_ub][0:available])
                compute(buffers, tile * blocks_per_tile,
                        T.min(W // elements_per_group, T.ceildiv(N - start, elements_per_group)))
                if start + W <= N:
                    T.copy(buffers["out_ub"][0:W], G[result][start:start + W])
                else:
                    remaining = T.alloc_var("int32")  # a variable: the byte count is then min(W, remaining) * size,
                    remaining = N - start  # never N * size (which could overflow int32)
                    T.copy(buffers["out_ub"][0:remaining], G[result][start:start + remaining])

    return gm.prim_func(draw_kernel, params)


def build(spec: DrawSpec, transform):
    """The prim_func of ``spec`` with the op's ``transform`` (UB budget checked)."""
    params, N = parameters(spec)
    return tile_kernel(spec, params, N, draw_compute(spec, transform))


def arguments(spec: DrawSpec, inputs, outputs) -> list:
    """Launch arguments: the int32 word views of seed and offset, the flat values."""
    import torch

    return [inputs.seed.view(torch.int32), inputs.offset.view(torch.int32), inputs.values.view(-1)]


def advancing_kernel(op: str, spec_of, decline_reason, build, arguments):
    """The tileplug kernel of ``op`` over a draw-shaped kernel (:class:`~..kernel.SpecKernel`'s
    arguments), then ``offset += 1`` queued on the same stream."""
    from tileplug.backend_ascend.kernel import SpecKernel

    class AdvancingKernel(SpecKernel):
        def __call__(self, call, inputs, outputs) -> None:
            super().__call__(call, inputs, outputs)
            inputs.offset.add_(1)  # same stream, after every block of the draw read the offset

    return AdvancingKernel(op, spec_of, decline_reason, build, arguments)


def make_kernel(op: str, transform):
    """The tileplug kernel of ``op``: the draw kernel with ``transform``, then ``offset += 1``."""
    return advancing_kernel(op, spec_of, decline_reason, lambda spec: build(spec, transform), arguments)
