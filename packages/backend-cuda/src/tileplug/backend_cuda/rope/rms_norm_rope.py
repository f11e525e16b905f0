"""CUDA ``rms_norm_rope`` (SPEC §6): per-head RMSNorm over ``D`` with weight, rounded to
``x.dtype``, then RoPE on the first ``R`` channels, in one pass over ``x`` ``[T, N, D]``.

Bytewise equal to this backend's ``rms_norm`` on the 3-D ``x`` followed by its
``apply_rotary`` on the result (SPEC §4, fusion rule), by construction:

- the norm is the ``rms_norm`` kernel's own code: its row macros (``norm.rows.RowMacros``:
  a head is a row, lane ``l`` of a row holding the vectors ``k·lanes + l``) and its
  ``RmsNormMacros.normalize`` (the reference's reduction tree and fp32 operation order), on
  the ``NormKernelSpec`` the ``rms_norm`` kernel would use for this ``x`` but for its row tile:
  the fused kernel's own ``rope.spec.head_tile`` (about 32 values a lane), on which the sum
  adds in the same order as on every tile;
- the rotation is ``rotation.rotated_first`` / ``rotated_second``, the macros of
  ``apply_rotary``, on the rounded ``y`` values.

The pair exchange stays on chip: a GPT-J pair ``(2p, 2p + 1)`` is two adjacent values of
one thread's vector; a NeoX pair ``(p, p + R/2)`` is, where the head tile allows
(``rope.spec.pair_chunks``: ``R/2`` a multiple of a chunk's columns), two vectors of one
lane, else in two lanes of the row, whose rotated channels then go through shared memory
(written, one barrier — a warp's when a row's lanes fit one warp — then each thread reads
its values' partners). A position outside ``[0, L)`` is never read from the cache: that
token's rotated channels become NaN.

``rms_norm_rope_per_token_cast`` then casts the rotated ``y`` (still in registers) per token
over ``y.view(T, N·D)``, bytewise as this backend's ``per_token_cast`` of that ``y``: groups
of ``g`` columns never straddle two heads (``D`` a multiple of ``g``, else declined), so a
group is ``g / VEC`` adjacent lanes of one chunk of a head's row, or whole consecutive chunks
of its lanes (``norm.row_cast.group_layout``), reduced on chip with xor shuffles of the amax
bits (a max: the same bits in any order), then the quant family's scale macros: the fused
norm cast's own macro (``norm.row_cast.RowCast``).

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

from collections.abc import Callable
from typing import Any

import torch

from tileplug.backend_cuda import jit
from tileplug.backend_cuda.rope.spec import TL_DTYPES, TL_POSITIONS, NormRopeSpec, norm_rope_ctas_per_sm, pair_chunks
from tileplug.core.contracts.rope import NormRopeCall, NormRopeInputs, NormRopeOutputs

Launcher = Callable[[NormRopeInputs, NormRopeOutputs], None]


def build_kernel(spec: NormRopeSpec):
    """The ``T.prim_func`` of ``spec``: buffers ``(x, weight, cache, [positions], y)`` and the
    int64 ``offset``."""
    import tilelang.language as T

    from tileplug.backend_cuda.norm.rms_norm import RmsNormMacros
    from tileplug.backend_cuda.norm.row_cast import RowCast
    from tileplug.backend_cuda.norm.rows import RowMacros, aligned_strides, as_float, row_buffer, vector_buffer
    from tileplug.backend_cuda.rope.rotation import nan_f32, rotated_first, rotated_second

    norm = spec.norm
    M = T.dynamic("M")
    rows = RowMacros(norm, M * norm.heads)
    IN, VEC = norm.in_dtype, norm.vec
    R = spec.rotary_dim
    HALF = R // 2
    GPTJ = spec.interleaved
    ROWS = rows.ROWS
    CTAS_PER_SM = norm_rope_ctas_per_sm()  # (a tuning knob, off)
    rms = RmsNormMacros(norm, rows, capped=bool(CTAS_PER_SM))
    # whole vectors rotate at once where R/2 is a multiple of VEC (the launcher takes the scalar
    # entry when the cache row is not 16-byte aligned)
    ROPE_VECTOR = norm.vectorize and HALF % VEC == 0
    PAIRS_PER_VECTOR = VEC // 2 if GPTJ else VEC
    # NeoX pairs within one thread (``rope.spec.head_tile``): vector k < PAIR_CHUNKS of a lane holds the
    # first halves of VEC pairs, its vector k + PAIR_CHUNKS their second halves (None: the shared exchange)
    PAIR_CHUNKS = pair_chunks(R, rows.LANES, VEC, GPTJ)
    EXCHANGE = not GPTJ and PAIR_CHUNKS is None
    CHUNKS, VALUES = list(range(rows.CHUNKS)), list(range(VEC))  # unrolled while tracing
    L, CS, PS = T.dynamic("L"), T.dynamic("CS"), T.dynamic("PS")

    x_t = row_buffer(norm, "x", IN, M)
    w_t = vector_buffer(norm, "w", norm.weight_dtype)
    y_t = row_buffer(norm, "y", IN, M)
    cache_t = T.StridedTensor((L, R), (CS, 1), "float32")
    positions_t = T.StridedTensor((M,), (PS,), spec.positions or "int32")
    quant = spec.quant
    WRITE_Y = quant is None or quant.unquantized
    STRIDES = aligned_strides(norm, x_t, *((y_t,) if WRITE_Y else ()))
    if quant is not None:
        D, HEADS = norm.hidden, norm.heads
        assert D % quant.group == 0
        # the per-token cast of the rotated row: the fused norm cast's own macro (same bytes as
        # this backend's per_token_cast of y)
        cast = RowCast(quant, rows, IN, VEC, D, HEADS, norm.vectorize)
        VPB, QDT = cast.values_per_byte, cast.q_dtype
        q_t = T.Tensor((M, HEADS * D // VPB), QDT)
        sf_t = cast.sf_type()

    @T.macro
    def cos_sin(cache, position, inside, p, cn):
        """``cn`` = (cos, sin) of pair ``p`` at ``position`` (NaN, never read, when outside)."""
        if inside:
            cn[0] = cache[position, p]
            cn[1] = cache[position, HALF + p]
        else:
            cn[0] = nan_f32()
            cn[1] = nan_f32()

    @T.macro
    def cos_sin_run(cache, position, inside, first, count, vector, c, n):
        """``c[j]`` / ``n[j]`` = cos / sin of pairs ``first + j``, ``j < count`` (``vector``: one vector
        load per half of the cache row; NaN, never read, when the position is outside). The NaN
        registers are not free (32 moves a thread at D = 128 bf16) but they keep every vector's loads
        in flight together: a form that made an outside row's rstd NaN instead, leaving these
        registers unset, cut 32 instructions and let ptxas issue the second vector's loads after the
        first one's math — 1.3-1.8 % slower at T >= 16384 on an H100 (thirty-third session)."""
        if inside:
            if vector:
                for j in T.vectorized(count):
                    c[j] = cache[position, first + j]
                for j in T.vectorized(count):
                    n[j] = cache[position, HALF + first + j]
            else:
                for j in T.unroll(count):
                    c[j] = cache[position, first + j]
                    n[j] = cache[position, HALF + first + j]
        else:
            for j in T.unroll(count):
                c[j] = nan_f32()
                n[j] = nan_f32()

    @T.macro
    def rotate_adjacent(yv, i, c, n, pair):
        """The GPT-J pair ``(yv[i], yv[i + 1])`` rotated by ``(c, n)`` in place, its two results formed in
        ``pair`` before either is written (the two bf16 values share a word)."""
        x1 = as_float(yv, i)
        x2 = as_float(yv, i + 1)
        pair[0] = rotated_first(x1, x2, c, n)
        pair[1] = rotated_second(x1, x2, c, n)
        yv[i] = T.cast(pair[0], IN)
        yv[i + 1] = T.cast(pair[1], IN)

    @T.macro
    def rotate_pairs(cache, position, inside, yv, lane, valid):
        """NeoX on pairs a thread holds both halves of: vector ``k`` (columns ``col … col + VEC``,
        all below ``R/2``) and vector ``k + PAIR_CHUNKS`` (``col + R/2 …``) share one set of cos /
        sin (one vector load per half of the cache row where the spec vectorizes)."""
        # c, n: cos and sin of the vector's VEC pairs; rotated: its pairs' results before they are
        # rounded into ``yv`` (every value read before any is written: a bf16 value shares its word)
        c = T.alloc_local((VEC,), "float32")
        n = T.alloc_local((VEC,), "float32")
        rotated = T.alloc_local((2 * VEC,), "float32")
        for k in range(PAIR_CHUNKS):
            col = rows.column(k, lane)
            if valid:
                cos_sin_run(cache, position, inside, col, VEC, ROPE_VECTOR, c, n)
                for j in VALUES:
                    first = as_float(yv, k * VEC + j)
                    second = as_float(yv, (k + PAIR_CHUNKS) * VEC + j)
                    rotated[j] = rotated_first(first, second, c[j], n[j])
                    rotated[VEC + j] = rotated_second(first, second, c[j], n[j])
                for j in VALUES:
                    yv[k * VEC + j] = T.cast(rotated[j], IN)
                    yv[(k + PAIR_CHUNKS) * VEC + j] = T.cast(rotated[VEC + j], IN)

    @T.macro
    def rotate_vectors(cache, position, inside, pairs, yv, lane, valid, tx):
        """The rotation on whole vectors (``R/2`` a multiple of VEC: a vector lies in one half of
        the rotated channels, or past ``R``): each vector's cos/sin are one vector load per
        half of the cache row, a NeoX vector's partners one vector load from ``pairs``; the
        first / second half of a NeoX pair is a select, not a branch."""
        # c, n: the vector's cos and sin (GPT-J: one per pair); partner: the NeoX partners' values;
        # pair: a GPT-J pair's results (rotate_adjacent)
        c = T.alloc_local((VEC,), "float32")
        n = T.alloc_local((VEC,), "float32")
        partner = T.alloc_local((VEC,), IN)
        pair = T.alloc_local((2,), "float32")
        for k in CHUNKS:
            col = rows.column(k, lane)
            if valid and col < R:
                first = T.truncmod(col, HALF) if not GPTJ else col // 2  # cache column of the vector's first pair
                cos_sin_run(cache, position, inside, first, PAIRS_PER_VECTOR, True, c, n)
                if GPTJ:
                    for j in VALUES[::2]:
                        rotate_adjacent(yv, k * VEC + j, c[j // 2], n[j // 2], pair)
                else:
                    row = rows.slot(tx)
                    for j in T.vectorized(VEC):
                        partner[j] = pairs[row * R + T.truncmod(col + HALF, R) + j]
                    for j in VALUES:
                        own = as_float(yv, k * VEC + j)
                        other = as_float(partner, j)
                        yv[k * VEC + j] = T.cast(T.if_then_else(col < HALF, rotated_first(own, other, c[j], n[j]),
                                                                rotated_second(other, own, c[j], n[j])), IN)

    @T.macro
    def rotate_values(cache, position, inside, pairs, yv, lane, valid, tx):
        """The rotation value by value (any even ``R``; the scalar rows)."""
        cn = T.alloc_local((2,), "float32")
        pair = T.alloc_local((2,), "float32")  # a GPT-J pair's results (rotate_adjacent)
        for k in CHUNKS:
            if GPTJ:
                for j in VALUES[::2]:
                    col = rows.column(k, lane) + j
                    if valid and col < R:
                        cos_sin(cache, position, inside, col // 2, cn)
                        rotate_adjacent(yv, k * VEC + j, cn[0], cn[1], pair)
            else:
                row = rows.slot(tx)
                for j in VALUES:
                    col = rows.column(k, lane) + j
                    if valid and col < R:
                        own = as_float(yv, k * VEC + j)
                        if col < HALF:
                            cos_sin(cache, position, inside, col, cn)
                            other = T.cast(pairs[row * R + col + HALF], "float32")
                            yv[k * VEC + j] = T.cast(rotated_first(own, other, cn[0], cn[1]), IN)
                        else:
                            cos_sin(cache, position, inside, col - HALF, cn)
                            other = T.cast(pairs[row * R + col - HALF], "float32")
                            yv[k * VEC + j] = T.cast(rotated_second(other, own, cn[0], cn[1]), IN)

    @T.macro
    def body(x, weight, cache, positions, y, q, sf, offset):
        with T.Kernel(rows.grid(), threads=rows.THREADS, prelude=rms.prelude) as bx:
            if CTAS_PER_SM:
                T.annotate_min_blocks_per_sm(CTAS_PER_SM)
            for stride in STRIDES:
                T.assume(stride % VEC == 0)
            if ROPE_VECTOR:
                T.assume(CS % 4 == 0)
            tx = T.get_thread_binding()
            t, n, lane, valid = rows.coords(bx, tx)
            s, rv, wv, yv, terms, acc, tree = RmsNormMacros.locals(norm, rows)
            position = T.alloc_var("int64")
            rms.normalize(x, weight, None, None, None, s, rv, wv, yv, terms, acc, tree, t, n, lane, valid, tx)
            if EXCHANGE:  # NeoX partners sit in other lanes of the row: exchange through shared memory
                pairs = T.alloc_shared((ROWS * R,), IN)
                row = rows.slot(tx)
                for k in CHUNKS:
                    col = rows.column(k, lane)
                    if ROPE_VECTOR:
                        if valid and col < R:
                            for j in T.vectorized(VEC):
                                pairs[row * R + col + j] = yv[k * VEC + j]
                    else:
                        for j in VALUES:
                            if valid and col + j < R:
                                pairs[row * R + col + j] = yv[k * VEC + j]
                rows.reuse_barrier()
            position = 0
            if valid:
                if positions is None:
                    position = T.cast(t, "int64") + offset
                else:
                    position = T.cast(positions[t], "int64") + offset
            inside = position >= 0 and position < T.cast(L, "int64")
            if PAIR_CHUNKS is not None:
                rotate_pairs(cache, position, inside, yv, lane, valid)
            elif ROPE_VECTOR:
                rotate_vectors(cache, position, inside, pairs if EXCHANGE else None, yv, lane, valid, tx)
            else:
                rotate_values(cache, position, inside, pairs if EXCHANGE else None, yv, lane, valid, tx)
            if WRITE_Y:
                rows.store_row(y, yv, t, n, lane, valid)
            if quant is not None:
                amax = T.alloc_local((rows.CHUNKS,), "int32")
                inv = T.alloc_local((rows.CHUNKS,), "float32")
                qv = T.alloc_local((VEC // VPB,), QDT)
                cast.cast(yv, q, sf, t, n, lane, valid, amax, inv, qv)

    # One prim_func per buffer set (TileLang reads the signature off the annotations).
    POSITIONS = spec.positions is not None
    if quant is None:
        if POSITIONS:

            @T.prim_func
            def kernel(x: x_t, weight: w_t, cache: cache_t, positions: positions_t, y: y_t, offset: T.int64):
                body(x, weight, cache, positions, y, None, None, offset)

        else:

            @T.prim_func
            def kernel(x: x_t, weight: w_t, cache: cache_t, y: y_t, offset: T.int64):
                body(x, weight, cache, None, y, None, None, offset)

    elif WRITE_Y:
        if POSITIONS:

            @T.prim_func
            def kernel(x: x_t, weight: w_t, cache: cache_t, positions: positions_t, y: y_t, q: q_t, sf: sf_t,
                       offset: T.int64):
                body(x, weight, cache, positions, y, q, sf, offset)

        else:

            @T.prim_func
            def kernel(x: x_t, weight: w_t, cache: cache_t, y: y_t, q: q_t, sf: sf_t, offset: T.int64):
                body(x, weight, cache, None, y, q, sf, offset)

    elif POSITIONS:

        @T.prim_func
        def kernel(x: x_t, weight: w_t, cache: cache_t, positions: positions_t, q: q_t, sf: sf_t, offset: T.int64):
            body(x, weight, cache, positions, None, q, sf, offset)

    else:

        @T.prim_func
        def kernel(x: x_t, weight: w_t, cache: cache_t, q: q_t, sf: sf_t, offset: T.int64):
            body(x, weight, cache, None, None, q, sf, offset)

    return kernel.with_attr("global_symbol", spec.name)


# ---------------------------------------------------------------------- the kernel object


class RmsNormRope:
    """The CUDA ``rms_norm_rope`` / ``rms_norm_rope_per_token_cast`` kernel (one kernel key):
    ``supports`` / ``spec`` / ``source`` / ``prepare``."""

    op = "rms_norm_rope"

    def supports(self, call: NormRopeCall) -> str | None:
        from tileplug.backend_cuda.norm.spec import row_tile

        if call.op != self.op:
            return f"this kernel serves {self.op}, not {call.op}"
        if call.cast is not None and call.head_dim % call.cast.block[1]:
            return (f"D = {call.head_dim} not a multiple of the cast group {call.cast.block[1]}: a group would "
                    "straddle two heads")
        if call.weight_dtype not in TL_DTYPES:
            return f"weight dtype {call.weight_dtype} is not served by the CUDA kernels (bf16, fp16, fp32)"
        if row_tile(call.head_dim, call.dtype) is None:
            return f"a head of D = {call.head_dim} values does not fit one CTA's registers"
        return None

    def spec(self, call: NormRopeCall, vectorize: bool | None = None) -> NormRopeSpec:
        """The specialisation serving ``call``: 128-bit rows where ``D`` allows (``vectorize``
        None or True; the launcher checks the pointers and strides per call), else scalar."""
        from tileplug.backend_cuda.norm.spec import NormKernelSpec, vector_width
        from tileplug.backend_cuda.rope.spec import head_tile

        vector = call.head_dim % vector_width(call.dtype) == 0 and vectorize is not False
        norm = NormKernelSpec(
            op="rms_norm", hidden=call.head_dim, heads=call.heads, in_dtype=TL_DTYPES[call.dtype],
            weight_dtype=TL_DTYPES[call.weight_dtype], bias_dtype=None, residual=False, stats=False,
            eps=float(call.eps), weight_offset=float(call.weight_offset), out_scale=1.0, vectorize=vector,
            tile=head_tile(call.head_dim, call.rotary_dim, call.dtype, call.interleaved),
        )
        quant = None
        cast = call.cast
        if cast is not None:
            from tileplug.backend_cuda.norm.spec import QuantSpec
            from tileplug.core.quant.layouts import CUDA_LAYOUT

            sf_kind = cast.sf_encoding(CUDA_LAYOUT).kind
            quant = QuantSpec(fmt=cast.fmt.name, group=cast.block[1], sf_kind=sf_kind,
                              sf_col_major=bool(cast.col_major_sf) and sf_kind == "ue8m0", round_sf=bool(cast.round_sf),
                              clamp_min=float(cast.clamp_min), unquantized=call.return_unquantized)
        return NormRopeSpec(norm, call.rotary_dim, call.interleaved, TL_POSITIONS[call.positions_dtype], quant)

    def specs(self, call: NormRopeCall) -> list[NormRopeSpec]:
        """Every specialisation a call signature may launch (vector and scalar rows)."""
        return list(dict.fromkeys([self.spec(call), self.spec(call, vectorize=False)]))

    def source(self, call: NormRopeCall, arch: str = jit.DEFAULT_ARCH) -> str:
        return jit.lower_source(self.spec(call), arch)

    def __call__(self, call: NormRopeCall, inputs: NormRopeInputs, outputs: NormRopeOutputs) -> None:
        self.prepare(call)(inputs, outputs)

    def prepare(self, call: NormRopeCall) -> Launcher:
        """``launch(inputs, outputs)``: the 128-bit entry when ``x`` and the weight are 16-byte
        aligned row by row (``y``, ``q``: fresh allocations), else the scalar one (loaded on
        first use)."""
        vector_spec, scalar_spec = self.spec(call), self.spec(call, vectorize=False)
        vector_entry = jit.entry(vector_spec) if vector_spec.norm.vectorize else None
        vec = vector_spec.norm.vec
        scalar: list[Any] = []
        with_positions = call.positions_dtype is not None

        def aligned(tensor: torch.Tensor) -> bool:
            return tensor.data_ptr() % 16 == 0 and all(stride % vec == 0 for stride in tensor.stride()[:-1])

        # the vector entry reads cos/sin as vectors where R/2 is a multiple of VEC
        cache_vectors = (call.rotary_dim // 2) % vec == 0

        def cache_aligned(cache: torch.Tensor) -> bool:
            return cache.data_ptr() % 16 == 0 and cache.stride(0) % 4 == 0

        def entry(inputs: NormRopeInputs, y: torch.Tensor | None) -> Any:
            weight = inputs.weight
            if vector_entry is not None and aligned(inputs.x) and (y is None or aligned(y)) \
                    and weight.data_ptr() % (vec * weight.element_size()) == 0 \
                    and (not cache_vectors or cache_aligned(inputs.cos_sin_cache)):
                return vector_entry
            if not scalar:
                scalar.append(jit.entry(scalar_spec))
            return scalar[0]

        def usable(cache: torch.Tensor) -> torch.Tensor:
            # no row to read: every position is out of range, as with one NaN row
            if cache.shape[0]:
                return cache
            return torch.full((1, call.rotary_dim), float("nan"), dtype=torch.float32, device=cache.device)

        quant = vector_spec.quant

        def outputs_of(outputs: NormRopeOutputs) -> tuple:
            if quant is None:
                return (outputs.y,)
            written = (outputs.q, outputs.sf)
            return (outputs.y, *written) if quant.unquantized else written

        if with_positions:

            def launch(inputs: NormRopeInputs, outputs: NormRopeOutputs) -> None:
                entry(inputs, outputs.y)(inputs.x, inputs.weight, usable(inputs.cos_sin_cache), inputs.positions,
                                         *outputs_of(outputs), inputs.seqlen_offset)

        else:

            def launch(inputs: NormRopeInputs, outputs: NormRopeOutputs) -> None:
                entry(inputs, outputs.y)(inputs.x, inputs.weight, usable(inputs.cos_sin_cache), *outputs_of(outputs),
                                         inputs.seqlen_offset)

        return launch
