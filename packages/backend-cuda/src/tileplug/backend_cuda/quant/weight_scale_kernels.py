"""The TileLang kernel of the CUDA ``transpose_weight_sf`` (``transpose_weight_sf``: the kernel
object and its specialisation).

One launch lays out every weight of a call. Weight ``w``'s scales ``S [G, R, C]`` (fp32,
contiguous; ``G = 1`` for 2-D scales) of ``bs × bs`` weight blocks go into both its outputs,
written in their memory order: ``sf0 [G, P0, N]`` and ``sf1 [G, P1, K]`` of int32 (N = R·bs,
K = C·bs, P0 = ceil(C/4), P1 = ceil(R/4)); docs/spec.md §11 has the layouts. ``sf0[g, p, n]``
packs the UE8M0 bytes of ``S[g, n / bs, 4p … 4p + 3]`` (byte ``i`` of the integer: column
``4p + i``, 0 past ``C``), ``sf1[g, p, k]`` those of ``S[g, 4p … 4p + 3, k / bs]`` (0 past
``R``). Either view of sf1 has that memory order, so the kernel does not depend on it.

The kernel reads each weight's three tensors through its data pointer and sizes, scalar
arguments (no tensor is passed per weight, so its code does not grow with the weight count and
the host makes no view): ``blockIdx.y`` is the weight, ``blockIdx.x`` a *chunk* of
``THREADS · 4`` consecutive integers of one of its output rows — the chunks of sf0's ``G·P0``
rows, then those of sf1's ``G·P1`` rows. The grid's x extent is the largest weight's chunk
count; a smaller weight's extra CTAs exit. Each thread writes four integers (one 128-bit
store). ``bs`` is a multiple of 16, so they share one weight block row (sf0) or column (sf1)
and one packed value, read from four scales (a gather the L1 serves: the scales are ``bs²``
times smaller than the weights). The outputs dominate the bytes: ``N·P0 + K·P1`` integers
against ``R·C`` scales.

The byte of a scale is ``sf_math.ue8m0_byte``, from the scale's fp32 bit pattern.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import linecache

import tilelang.language as T
from tvm import ir

from tileplug.backend_cuda.quant.sf_math import ue8m0_byte

THREADS = 256
INTS_PER_STORE = 4
"""int32 of one 128-bit store."""
INTS_PER_THREAD = 4
"""Integers a thread writes (one packed value; a weight block's N or K extent, bs ≥ 16, holds
them). H200, bs 128, scales [512, 56] (a 65536 × 7168 weight), CUDA graph: 4 per thread wrote
the 7.3 MB in 8.25 µs, 16 per thread (four 128-bit stores) in 8.12 µs, but 1.94 µs against
1.46 at T = 128: 4 kept."""
SPAN = THREADS * INTS_PER_THREAD
"""Integers of one chunk (one CTA) along an output row."""
PACK = 4
"""UE8M0 bytes per int32 (the CUDA layout's pack factor)."""
UNBOUNDED = T.int64(1 << 62)
"""The extent declared for a buffer read through a pointer argument (its real size is the
slot's; nothing indexes past it, and no bounds check is generated)."""
WEIGHT_ARGUMENTS = (("scales", "int64"), ("sf0", "int64"), ("sf1", "int64"),
                    ("groups", "int32"), ("rows", "int32"), ("cols", "int32"))
"""What the kernel takes per weight slot: the data pointers of its scales, sf0 and sf1, and its
``G``, ``R``, ``C`` (:func:`weight_arguments`)."""


def weight_arguments(scales, sf0, sf1) -> list[int]:
    """One weight's :data:`WEIGHT_ARGUMENTS` from its scale tensor and its two outputs."""
    shape = scales.shape
    return [scales.data_ptr(), sf0.data_ptr(), sf1.data_ptr(), shape[0] if len(shape) == 3 else 1,
            shape[-2], shape[-1]]


def chunks(block_size: int, shape) -> int:
    """CTAs along ``blockIdx.x`` that a weight of scale ``shape`` (``(R, C)`` or ``(G, R, C)``)
    needs: one per chunk of ``SPAN`` integers of each output row (``G·ceil(C/4)`` rows of
    ``R·bs`` integers in sf0, ``G·ceil(R/4)`` of ``C·bs`` in sf1)."""
    groups = shape[0] if len(shape) == 3 else 1
    rows, cols = shape[-2:]
    return groups * (-(-cols // PACK) * -(-rows * block_size // SPAN) + -(-rows // PACK) * -(-cols * block_size // SPAN))


def pick(values, index, low: int = 0, high: int | None = None):
    """``values[index]`` for a runtime ``index`` in ``[low, high)``: a balanced tree of selects
    (no local array, depth ``log2(len)``)."""
    high = len(values) if high is None else high
    if high - low == 1:
        return values[low]
    middle = (low + high) // 2
    return T.if_then_else(index < middle, pick(values, index, low, middle), pick(values, index, middle, high))


def pointer_to(address, dtype: str):
    """A ``dtype`` global-memory pointer variable holding the int64 ``address``."""
    return T.bind(T.reinterpret(address, "handle"), ir.PointerType(ir.PrimType(dtype), "global"))


def generated_kernel(spec, body):
    """A ``T.prim_func`` of ``anchor`` (weight 0's scales, the one tensor: it names the device
    and stream of the launch), ``grid_chunks`` and ``weights`` (int32: the grid's extents), then
    :data:`WEIGHT_ARGUMENTS` for each of the spec's ``capacity`` weight slots, whose kernel is the
    macro ``body(grid_chunks, weights, slots)`` (``slots[name]``: the slots' values of argument
    ``name``). TileLang parses a prim_func from its source, so the signature for this capacity
    is written here, and held by ``linecache`` under a name of its own for the parser to read."""
    lead = (T.dynamic("G"),) if spec.anchor_groups else ()
    scope = {"body": body, "T": T, "anchor_t": T.Tensor((*lead, T.dynamic("R"), T.dynamic("C")), "float32")}
    slots = {name: [f"{name}_{slot}" for slot in range(spec.capacity)] for name, _ in WEIGHT_ARGUMENTS}
    signature = ["anchor: anchor_t", "grid_chunks: T.int32", "weights: T.int32"] + [
        f"{name}_{slot}: T.{dtype}" for slot in range(spec.capacity) for name, dtype in WEIGHT_ARGUMENTS]
    by_name = ", ".join(f"'{name}': [{', '.join(names)}]" for name, names in slots.items())
    source = f"def kernel({', '.join(signature)}):\n    body(grid_chunks, weights, {{{by_name}}})\n"
    filename = f"<tileplug transpose_weight_sf, {spec.capacity} weight slots>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), scope)  # noqa: S102 - the signature written above
    return T.prim_func(scope["kernel"])


def build(spec):
    """The ``T.prim_func`` of a ``transpose_weight_sf.WeightScaleSpec`` (see
    :func:`generated_kernel` for its arguments): ``grid_chunks × weights`` CTAs, weight slot
    ``blockIdx.y``, its scales ``[G, R, C]`` fp32 contiguous, sf0 and sf1 int32 in their memory
    order ``[G, P0, N]`` and ``[G, P1, K]``."""
    BS = spec.block_size

    @T.macro
    def body(grid_chunks, weights, slots):
        with T.Kernel(grid_chunks, weights, threads=THREADS) as (bx, by):
            tx = T.get_thread_binding()
            # the slot's arguments, picked once into registers
            groups = T.alloc_var("int32")
            rows = T.alloc_var("int32")
            cols = T.alloc_var("int32")
            address = T.alloc_var("int64")
            groups = pick(slots["groups"], by)
            rows = pick(slots["rows"], by)
            cols = pick(slots["cols"], by)
            scales = T.decl_buffer((UNBOUNDED,), "float32", data=pointer_to(pick(slots["scales"], by), "float32"))
            planes0 = T.alloc_var("int32")
            planes1 = T.alloc_var("int32")
            chunks0 = T.alloc_var("int32")
            chunks1 = T.alloc_var("int32")
            ctas0 = T.alloc_var("int32")
            planes0 = T.ceildiv(cols, PACK)
            planes1 = T.ceildiv(rows, PACK)
            chunks0 = T.ceildiv(rows * BS, SPAN)
            chunks1 = T.ceildiv(cols * BS, SPAN)
            ctas0 = groups * planes0 * chunks0
            # the output row (group, plane) of this CTA, its first integer, the row's extent and pointer
            row = T.alloc_var("int32")
            first = T.alloc_var("int32")
            extent = T.alloc_var("int32")
            group = T.alloc_var("int32")
            plane = T.alloc_var("int32")
            value = T.alloc_var("uint32")
            value = T.uint32(0)
            if bx < ctas0:
                # sf0 row (group, plane): weight rows n = first ..., block row n / bs, block columns 4·plane + i
                row = T.truncdiv(bx, chunks0)
                first = (bx - row * chunks0) * SPAN + tx * INTS_PER_THREAD
                extent = rows * BS
                address = pick(slots["sf0"], by)
                group = T.truncdiv(row, planes0)
                plane = row - group * planes0
                if first < extent:
                    for i in T.unroll(PACK):
                        if plane * PACK + i < cols:
                            at = T.cast(group * rows + T.truncdiv(first, BS), "int64") * cols + plane * PACK + i
                            value = value | T.shift_left(ue8m0_byte(scales[at]), T.uint32(8 * i))
            elif bx < ctas0 + groups * planes1 * chunks1:
                # sf1 row (group, plane): weight columns k = first ..., block column k / bs, block rows 4·plane + i
                row = T.truncdiv(bx - ctas0, chunks1)
                first = (bx - ctas0 - row * chunks1) * SPAN + tx * INTS_PER_THREAD
                extent = cols * BS
                address = pick(slots["sf1"], by)
                group = T.truncdiv(row, planes1)
                plane = row - group * planes1
                if first < extent:
                    for i in T.unroll(PACK):
                        if plane * PACK + i < rows:
                            at = T.cast(group * rows + plane * PACK + i, "int64") * cols + T.truncdiv(first, BS)
                            value = value | T.shift_left(ue8m0_byte(scales[at]), T.uint32(8 * i))
            else:
                first = extent = 0  # a CTA past this weight's chunks
            if first < extent:
                # one 128-bit store of the four integers (extent and first are multiples of 4)
                out = T.decl_buffer((UNBOUNDED,), "int32x4", data=pointer_to(address, "int32x4"))
                out[T.truncdiv(T.cast(row, "int64") * extent + first, INTS_PER_STORE)] = T.Broadcast(
                    T.reinterpret(value, "int32"), INTS_PER_STORE)

    return generated_kernel(spec, body).with_attr("global_symbol", spec.name)
