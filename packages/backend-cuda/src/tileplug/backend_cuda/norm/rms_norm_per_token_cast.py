"""CUDA ``rms_norm_per_token_cast``: ``rms_norm`` then ``per_token_cast`` of its output
(``[T, N·D]``), in one pass: the same bytes as this backend's two kernels (SPEC §4).

The norm is ``rms_norm.RmsNormMacros`` itself (so ``y`` rounded to x.dtype is the
``rms_norm`` kernel's, bit for bit); the cast reads that rounded ``y`` from registers with
the quant family's scale macros (``quant.sf_math``) in the quant kernel's order of
operations: amax on the bits of ``|y|`` (NaN-propagating integer max), reduced over the
``group / VEC`` lanes of a group with xor shuffles (a max: any order gives the same bits),
``group_inverse`` / ``group_scale``, ``q = saturate(float(y) · inv)`` (e4m3 by the
hardware's saturating conversion, e2m1 by ``sf_math.e2m1_code``). A group never leaves a
row's lanes: a vector of a row is ``VEC`` consecutive columns, ``VEC`` divides the group,
and a group's vectors sit in adjacent lanes of one chunk (``rows``' layout). A partial last
group's amax covers its valid columns only.

Served: e4m3 / e2m1, groups 16 / 32 / 64 / 128, fp32 / e4m3-stored / packed UE8M0 (4 per
int32) scales, row- or TMA-aligned column-major; 3-D inputs whose ``D`` is a multiple of
the group (declined otherwise: a group would straddle two heads' rows).

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.norm.rms_norm import RmsNormMacros
from tileplug.backend_cuda.norm.rows import RowMacros, aligned_strides, row_buffer, vector_buffer
from tileplug.backend_cuda.norm.spec import NormKernelSpec
from tileplug.backend_cuda.quant import sf_math
from tileplug.core.quant.formats import QUANT_FORMATS

SF_DTYPES = {"fp32": "float32", "e4m3": "float8_e4m3fn", "ue8m0": "uint8"}


def build(spec: NormKernelSpec):
    """The ``T.prim_func`` of an ``rms_norm_per_token_cast`` specialisation: buffers ``(x,
    weight, residual, residual_out, y, q, sf)`` (``sf``: the bytes of packed UE8M0 storage),
    an absent one replaced by ``x`` (never read)."""
    quant = spec.quant
    M = T.dynamic("M")
    R = M if spec.heads is None else M * spec.heads
    rows = RowMacros(spec, R)
    IN = spec.in_dtype
    VEC = spec.vec
    D = spec.hidden
    HEADS = spec.heads
    E2M1 = quant.fmt == "e2m1"
    VPB = 2 if E2M1 else 1  # values per byte of q
    QDT = "int8" if E2M1 else "float8_e4m3fn"
    QW = D * (HEADS or 1) // VPB
    FMAX = QUANT_FORMATS[quant.fmt].max_value
    FRCP = sf_math.f32(1.0 / FMAX)
    CMIN_BITS = sf_math.f32_bits(quant.clamp_min)
    ROUND = quant.round_sf
    E4M3_SF = quant.sf_kind == "e4m3"
    PACKED = quant.sf_kind == "ue8m0"
    SF_COL = quant.sf_col_major
    GROUP = quant.group
    GROUP_LANES = min(GROUP // VEC, rows.LANES)  # lanes holding one group's values (fewer: the row is shorter)
    GROUP_STEPS = [d for d in (16, 8, 4, 2, 1) if d < GROUP_LANES]
    LANES_PER_GROUP = GROUP // VEC
    CHUNK_INDICES, VALUE_INDICES = list(range(rows.CHUNKS)), list(range(VEC))  # unrolled while tracing

    x_t = row_buffer(spec, "x", IN, M)
    w_t = vector_buffer(spec, "w", spec.weight_dtype)
    r_t = row_buffer(spec, "r", IN, M, spec.residual)
    ro_t = row_buffer(spec, "ro", IN, M, spec.residual)
    y_t = row_buffer(spec, "y", IN, M, quant.unquantized)
    q_t = T.Tensor((M, QW), QDT)
    sf_t = T.StridedTensor((T.dynamic("OR"), T.dynamic("OC")), (T.dynamic("OS0"), T.dynamic("OS1")),
                           SF_DTYPES[quant.sf_kind])
    STRIDES = aligned_strides(spec, x_t, *((r_t, ro_t) if spec.residual else ()), *((y_t,) if quant.unquantized else ()))
    rms = RmsNormMacros(spec, rows)

    def amax_key(yv, i, inside):
        """int32 amax key of output value ``i`` (the bits of |y|; 0 past D)."""
        key = sf_math.bf16_abs_bits(yv[i]) if IN == "bfloat16" else sf_math.abs_bits(yv[i])
        return key if inside is True else T.if_then_else(inside, key, 0)

    def flat_column(n, col):
        """Column of the quantized row ``[N·D]`` of a head's column."""
        return col if HEADS is None else n * D + col

    @T.macro
    def store_scale(sf, t, gc, value):
        if not PACKED:
            sf[t, gc] = value
        elif SF_COL:
            sf[gc // 4, t * 4 + gc % 4] = value
        else:
            sf[t, gc] = value

    @T.prim_func
    def kernel(x: x_t, weight: w_t, residual: r_t, residual_out: ro_t, y: y_t, q: q_t, sf: sf_t):
        with T.Kernel(rows.grid(), threads=rows.THREADS) as bx:
            for stride in STRIDES:
                T.assume(stride % VEC == 0)
            tx = T.get_thread_binding()
            t, n, lane, valid = rows.coords(bx, tx)
            s, rv, wv, yv, terms, acc, tree = RmsNormMacros.locals(spec, rows)
            amax = T.alloc_local((rows.CHUNKS,), "int32")
            inv = T.alloc_local((rows.CHUNKS,), "float32")
            qv = T.alloc_local((VEC // VPB,), QDT)
            rms.normalize(x, weight, residual, residual_out, x, s, rv, wv, yv, terms, acc, tree, t, n, lane, valid, tx)
            if quant.unquantized:
                rows.store_row(y, yv, t, n, lane, valid)
            for k in CHUNK_INDICES:
                amax[k] = 0
                for j in VALUE_INDICES:
                    amax[k] = T.max(amax[k], amax_key(yv, k * VEC + j, rows.in_row(k, j, lane)))
                for d in GROUP_STEPS:
                    amax[k] = T.max(amax[k], T.shfl_xor(amax[k], d))
                inv[k] = sf_math.group_inverse(amax[k], CMIN_BITS, FMAX, FRCP, ROUND, E4M3_SF)
                col = rows.column(k, lane)
                flat = flat_column(n, col)
                if valid and col < D and lane % LANES_PER_GROUP == 0:
                    store_scale(sf, t, flat // GROUP,
                                sf_math.group_scale(amax[k], CMIN_BITS, FMAX, FRCP, ROUND, E4M3_SF, PACKED))
                if E2M1:
                    for j in T.unroll(VEC // 2):
                        qv[j] = T.cast(
                            sf_math.e2m1_code(T.cast(yv[k * VEC + 2 * j], "float32") * inv[k])
                            | T.shift_left(sf_math.e2m1_code(T.cast(yv[k * VEC + 2 * j + 1], "float32") * inv[k]), 4),
                            "int8",
                        )
                else:
                    for j in T.vectorized(VEC):
                        qv[j] = T.cast(T.cast(yv[k * VEC + j], "float32") * inv[k], "float8_e4m3fn")
                if spec.vectorize:
                    if valid and col < D:
                        for j in T.vectorized(VEC // VPB):
                            q[t, flat // VPB + j] = qv[j]
                else:
                    for j in T.unroll(VEC // VPB):
                        if valid and col + j * VPB < D:
                            q[t, flat // VPB + j] = qv[j]

    return kernel.with_attr("global_symbol", spec.name)
