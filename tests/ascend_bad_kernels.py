"""Deliberately bad Ascend kernels, one per lowering check, to show each check failing.

Test-only: each builds the production prim_func (``tile_kernel.build``) with exactly one
production piece replaced, for the duration of the trace only:

* :func:`over_budget` -- ``check_budget`` skipped, so an over-budget tiling gets traced;
* :func:`serial_loop` -- ``row_loop`` is a ``T.serial`` loop with no buffer versions;
* :func:`scalar_tiles` -- ``tile_compute`` is per-element scalar code instead of the SIMD region;

and the same three for the row kernels of the norm and RoPE families (:func:`row_over_budget`,
:func:`row_serial_loop`, :func:`rms_scalar_rows` / :func:`rotary_scalar_tokens`).

Lower the results with ``lowering.lower_prim_func`` (never the disk-cached ``lower_spec`` /
``lower_cached``: their keys do not know about these replacements).

No ``from __future__ import annotations``: TileLang parses the macros' source.
"""

from unittest import mock

import tilelang.ascend.language as T

from tileplug.backend_ascend.quant import tile_kernel
from tileplug.backend_ascend.quant.spec import TileSpec, Tiling
from tileplug.core.quant.formats import QUANT_FORMATS
from tileplug.core.quant.sf_math import ceil_div


def over_budget(spec: TileSpec, tiling: Tiling):
    """The prim_func of ``spec`` tiled by ``tiling`` even when its UB plan exceeds the budget
    (the production builder raises ``UBBudgetError`` there; TileLang itself would not)."""
    with mock.patch.object(tile_kernel, "check_budget", lambda footprint, budget, what: None):
        return tile_kernel.build(spec, tiling)


def _serial_row_loop(extent, num_stages, versions):
    """A plain serial loop: no buffer versions annotated, nothing pipelined."""
    return T.serial(extent)


def serial_loop(spec: TileSpec):
    """The prim_func of ``spec`` with its item loop serial and single-buffered."""
    with mock.patch.object(tile_kernel, "row_loop", _serial_row_loop):
        return tile_kernel.build(spec, Tiling(spec))


def _scalar_tile_compute(spec: TileSpec, width: int, simd_tile):
    """Per-element scalar code for one row (e4m3 out, plain fp32 sf, bf16/fp32 in): group amax,
    scale and quantize element by element on the scalar unit, no SIMD region."""
    assert spec.kind == "token" and spec.fmt == "e4m3" and spec.writes_q and spec.writes_sf
    assert spec.qin is None and spec.given is None and not (spec.packed or spec.round_sf)
    bn = spec.block[1]
    ng = ceil_div(width, bn)
    fmax = QUANT_FORMATS[spec.fmt].max_value
    f32 = T.float32

    @T.macro
    def compute(x_ub, d_ub, s_ub, q_ub, code_ub, o_ub, sf_ub, e_ub, gsf_ub, ginv_ub, nv):
        amax = T.alloc_var(T.float32)
        for j in T.serial(ng):
            amax = T.float32(0)
            for k in T.serial(bn):
                if j * bn + k < width:
                    amax = T.max(amax, T.abs(T.Cast("float32", x_ub[0, j * bn + k])))
            sf_ub[j] = T.max(amax, f32(spec.clamp_min)) / f32(fmax)
            for k in T.serial(bn):
                if j * bn + k < width:
                    q_ub[0, j * bn + k] = T.Cast(
                        "float8_e4m3fn",
                        T.Cast("float32", x_ub[0, j * bn + k]) * (f32(fmax) / T.max(amax, f32(spec.clamp_min))),
                    )

    return compute


def scalar_tiles(spec: TileSpec):
    """The prim_func of a plain e4m3 per-token ``spec`` whose tiles compute in scalar code."""
    with mock.patch.object(tile_kernel, "tile_compute", _scalar_tile_compute):
        return tile_kernel.build(spec, Tiling(spec))


# ---------------------------------------------------------------------- the row kernels (norm, RoPE)

def row_over_budget(build, spec):
    """The prim_func of a norm / RoPE ``spec`` even when its UB plan exceeds the budget
    (``rows.check_budget`` skipped; the production builders raise ``UBBudgetError``)."""
    from tileplug.backend_ascend import rows

    with mock.patch.object(rows, "check_budget", lambda footprint, budget, what: None):
        return build(spec)


def _serial_rows(extent, versions, num_stages=2):
    """A plain serial row loop: no buffer versions annotated, nothing pipelined."""
    return T.serial(extent)


def row_serial_loop(build, spec):
    """The prim_func of a norm / RoPE ``spec`` with its row loop serial and single-buffered."""
    from tileplug.backend_ascend import rows

    with mock.patch.object(rows, "row_loop", _serial_rows):
        return build(spec)


def _scalar_rms_compute(spec):
    """Per-element scalar RMSNorm of one row (no residual, no statistics, with a weight)."""
    assert spec.kind == "rms" and not spec.residual and not spec.stats and spec.weight_dtype is not None
    D, dt = spec.hidden, spec.in_dtype

    @T.macro
    def compute(buffers):
        x_ub, w_ub = buffers["x_ub"], buffers["w_ub"]
        total = T.alloc_var(T.float32)
        total = T.float32(0)
        for k in T.serial(D):
            total = total + T.Cast("float32", x_ub[k]) * T.Cast("float32", x_ub[k])
        rstd = T.float32(1.0) / T.sqrt(total / T.float32(D) + T.float32(spec.eps))
        for k in T.serial(D):
            x_ub[k] = T.Cast(dt, T.Cast("float32", x_ub[k]) * rstd * w_ub[k])

    return compute


def rms_scalar_rows(spec):
    """The prim_func of an ``rms_norm`` ``spec`` whose rows are normalized in scalar code."""
    from tileplug.backend_ascend.norm import rms_norm

    with mock.patch.object(rms_norm, "row_compute", _scalar_rms_compute):
        return rms_norm.build(spec)


def _scalar_rotate_compute(spec):
    """Per-element scalar NeoX rotation of one token's query heads (no key)."""
    assert not spec.interleaved and spec.key_heads is None
    dt = spec.dtype

    @T.macro
    def compute(buffers, valid):
        first, second = buffers["q1"], buffers["q2"]
        for h in T.serial(spec.query_heads):
            for p in T.serial(spec.half):
                x1 = T.Cast("float32", first[h, p])
                x2 = T.Cast("float32", second[h, p])
                c = buffers["cos_ub"][p]
                n = buffers["sin_ub"][p]
                first[h, p] = T.Cast(dt, x1 * c - x2 * n)
                second[h, p] = T.Cast(dt, x2 * c + x1 * n)

    return compute


def rotary_scalar_tokens(spec):
    """The prim_func of an ``apply_rotary`` ``spec`` whose tokens are rotated in scalar code."""
    from tileplug.backend_ascend.rope import apply_rotary

    with mock.patch.object(apply_rotary, "rotate_compute", _scalar_rotate_compute):
        return apply_rotary.build(spec)


# ---------------------------------------------------------------------- the norm backward (rows reduced)

def backward_atomic_partials(build, spec):
    """The prim_func of a norm backward ``spec`` whose blocks add their partial sums into one
    shared row with a store-mode atomic add (the order of accumulation then varies run to run)."""
    from tileplug.backend_ascend.norm import backward

    @T.macro
    def atomic_store(accumulator, partials, block, width):
        T.set_atomic("add", "float32")
        T.copy(accumulator[0:width], partials[0, 0:width])
        T.set_atomic_none()

    with mock.patch.object(backward, "store_partial", atomic_store):
        return build(spec)


def backward_split_by_cores(build, spec):
    """The prim_func of a norm backward ``spec`` whose rows are split by the vector-core count
    (row ``r`` into partial ``r % C``): its summation order then depends on the device."""
    from tileplug.backend_ascend.norm import backward

    with mock.patch.object(backward, "PARTIALS", spec.vector_cores):
        return build(spec)


def _scalar_rms_backward_compute(spec):
    """Per-element scalar RMSNorm backward of one row (weight, no grad_residual)."""
    assert spec.kind == "rms" and spec.weight_dtype is not None and not spec.grad_residual
    D, dt = spec.hidden, spec.in_dtype

    @T.macro
    def compute(buffers):
        gy_ub, x_ub, w_ub, gw_acc = buffers["gy_ub"], buffers["x_ub"], buffers["w_ub"], buffers["gw_acc"]
        rstd = buffers["rstd_ub"][0]
        total = T.alloc_var(T.float32)
        total = T.float32(0)
        for k in T.serial(D):
            total = total + T.Cast("float32", gy_ub[k]) * w_ub[k] * T.Cast("float32", x_ub[k]) * rstd
        for k in T.serial(D):
            x_hat = T.Cast("float32", x_ub[k]) * rstd
            gw_acc[k] = gw_acc[k] + T.Cast("float32", gy_ub[k]) * x_hat
            gy_ub[k] = T.Cast(dt, rstd * (T.Cast("float32", gy_ub[k]) * w_ub[k] - x_hat * total / T.float32(D)))

    return compute


def rms_backward_scalar_rows(spec):
    """The prim_func of an ``rms_norm_backward`` ``spec`` whose rows are computed in scalar code."""
    from tileplug.backend_ascend.norm import backward

    return backward.build_rows(spec, _scalar_rms_backward_compute)


# ---------------------------------------------------------------------- the MoE routing kernels

def _scalar_topk_compute(spec):
    """Per-element scalar top-k of one row on the scalar unit: k rounds of a max scan and a
    first-index scan over the UB row, the taken column overwritten, no SIMD region."""
    E, k = spec.experts, spec.topk

    @T.macro
    def compute(s_ub, o_ub):
        best = T.alloc_var(T.float32)
        where = T.alloc_var(T.int32)
        for j in T.serial(k):
            best = s_ub[0]
            where = 0
            for c in T.serial(E):
                if s_ub[c] > best:
                    best = s_ub[c]
                    where = c
            o_ub[2 * j] = where
            o_ub[2 * j + 1] = 0
            s_ub[where] = T.float32(-3.4e38)

    return compute


def topk_scalar_rows(spec):
    """The prim_func of a ``topk_gate`` ``spec`` whose rows are ranked in scalar code."""
    from tileplug.backend_ascend.moe import topk_gate

    with mock.patch.object(topk_gate, "select_compute", _scalar_topk_compute):
        return topk_gate.build(spec)


def _scalar_gate_compute(spec):
    """Per-element scalar sigmoid gate of one row (no bias, no renormalize): the scores on the
    scalar unit, then the same scalar top-k rounds."""
    E, k = spec.experts, spec.topk

    @T.macro
    def compute(buffers, keep):
        x_ub, u_ub, s_ub, o_ub, w_ub = (buffers[n] for n in ("x_ub", "u_ub", "s_ub", "o_ub", "w_ub"))
        for c in T.serial(E):
            u_ub[c] = T.float32(1.0) / (T.float32(1.0) + T.exp(-T.Cast("float32", x_ub[c])))
            s_ub[c] = u_ub[c]
        best = T.alloc_var(T.float32)
        where = T.alloc_var(T.int32)
        for j in T.serial(k):
            best = s_ub[0]
            where = 0
            for c in T.serial(E):
                if s_ub[c] > best:
                    best = s_ub[c]
                    where = c
            o_ub[2 * j] = where
            o_ub[2 * j + 1] = 0
            w_ub[j] = u_ub[where]
            s_ub[where] = T.float32(-3.4e38)

    return compute


def gate_scalar_rows(spec):
    """The prim_func of a ``moe_topk_gate`` ``spec`` whose rows are scored and ranked in scalar code."""
    from tileplug.backend_ascend.moe import moe_topk_gate

    with mock.patch.object(moe_topk_gate, "gate_compute", _scalar_gate_compute):
        return moe_topk_gate.build(spec)


def _scalar_normalize_compute(spec):
    """Per-element scalar normalize_weight of one row: the slot sum and the divisions on the
    scalar unit, no SIMD region."""
    K = spec.slots

    @T.macro
    def compute(w_ub, n_ub, d_ub):
        total = T.alloc_var(T.float32)
        total = w_ub[0]
        for j in T.serial(K - 1):
            total = total + w_ub[j + 1]
        for j in T.serial(K):
            n_ub[j] = w_ub[j] / total
        d_ub[0] = total

    return compute


def normalize_scalar_rows(spec):
    """The prim_func of a ``normalize_weight`` ``spec`` whose rows are summed and divided in scalar code."""
    from tileplug.backend_ascend.moe import normalize_weight

    with mock.patch.object(normalize_weight, "normalize_compute", _scalar_normalize_compute):
        return normalize_weight.build(spec)


def _scalar_count_compute(spec):
    """Per-pair scalar counting of one row of int32 indices: ``acc[idx] += 1`` on the scalar unit."""
    assert spec.index_dtype == "int32"
    E, K = spec.experts, spec.slots

    @T.macro
    def compute(buffers):
        i_ub, acc_ub = buffers["i_ub"], buffers["acc_ub"]
        for j in T.serial(K):
            if i_ub[j] >= 0 and i_ub[j] < E:
                acc_ub[i_ub[j]] = acc_ub[i_ub[j]] + T.float32(1.0)

    return compute


def counts_scalar_rows(spec):
    """The prim_func of a ``moe_expert_counts`` count ``spec`` whose pairs are counted in scalar code."""
    from tileplug.backend_ascend.moe import expert_counts

    with mock.patch.object(expert_counts, "count_compute", _scalar_count_compute):
        return expert_counts.build_count(spec)


def counts_atomic_partials(spec):
    """The prim_func of a count ``spec`` whose blocks add their counts into one shared row with
    a store-mode atomic add (the order of accumulation then varies run to run)."""
    from tileplug.backend_ascend.moe import expert_counts

    @T.macro
    def atomic_store(accumulator, partials, block, width):
        T.set_atomic("add", "float32")
        T.copy(accumulator[0:width], partials[0, 0:width])
        T.set_atomic_none()

    with mock.patch.object(expert_counts, "store_partial", atomic_store):
        return expert_counts.build_count(spec)


def counts_split_by_cores(spec):
    """The prim_func of a count ``spec`` whose rows are split by the vector-core count (row
    ``r`` counted by block ``r % C``): its Ascend C then depends on the device."""
    from tileplug.backend_ascend.moe import expert_counts

    with mock.patch.object(expert_counts, "PARTIALS", spec.vector_cores):
        return expert_counts.build_count(spec)


def _scalar_unpermute_compute(spec, rows_total):
    """Per-element scalar weighted sum of one (token, column tile) of int32 rows on the scalar unit."""
    assert spec.index_dtype == "int32"
    K, W, dt = spec.slots, spec.width, spec.dtype
    width = (W + 63) // 64 * 64

    @T.macro
    def compute(buffers):
        p_ub, w_ub, y_ub, o_ub = (buffers[n] for n in ("p_ub", "w_ub", "y_ub", "o_ub"))
        acc = T.alloc_var(T.float32)
        for c in T.serial(W):
            acc = T.float32(0.0)
            for j in T.serial(K):
                if p_ub[j] >= 0:
                    acc = acc + w_ub[j] * T.Cast("float32", y_ub[j * width + c])
            o_ub[c] = T.Cast(dt, acc)

    return compute


def unpermute_scalar_rows(spec):
    """The prim_func of a ``moe_unpermute`` ``spec`` whose weighted sums are computed in scalar code."""
    from tileplug.backend_ascend.moe import unpermute

    with mock.patch.object(unpermute, "unpermute_compute", _scalar_unpermute_compute):
        return unpermute.build(spec)


def _scalar_place_compute(spec):
    """Per-pair scalar placement of one row of int32 indices: ``permutation[slot] = cursor[idx]++``
    on the scalar unit."""
    assert spec.index_dtype == "int32"
    E, K = spec.experts, spec.slots

    @T.macro
    def compute(buffers):
        p_ub, acc_ub, o_ub = buffers["p_ub"], buffers["acc_ub"], buffers["o_ub"]
        for j in T.serial(K):
            o_ub[j] = -1
            if p_ub[j] >= 0 and p_ub[j] < E:
                o_ub[j] = T.Cast("int32", acc_ub[p_ub[j]])
                acc_ub[p_ub[j]] = acc_ub[p_ub[j]] + T.float32(1.0)

    return compute


def permute_scalar_place(spec):
    """The prim_func of a ``moe_permute`` index ``spec`` whose pairs are placed in scalar code."""
    from tileplug.backend_ascend.moe import permute

    with mock.patch.object(permute, "place_compute", _scalar_place_compute):
        return permute.build_index(spec)


def _scalar_copy_compute(spec):
    """Word-by-word scalar copy of one tile (no scale rows) on the scalar unit."""
    assert spec.sf_words == 0
    W = spec.width

    @T.macro
    def compute(buffers):
        x_ub, o_ub = buffers["x_ub"], buffers["o_ub"]
        for c in T.serial(W):
            o_ub[c] = x_ub[c]

    return compute


def permute_scalar_copy(spec):
    """The prim_func of a ``moe_permute`` copy ``spec`` whose tile is copied word by word in scalar code."""
    from tileplug.backend_ascend.moe import permute

    with mock.patch.object(permute, "copy_compute", _scalar_copy_compute):
        return permute.build_copy(spec)


def _scalar_backward_compute(spec):
    """Per-element scalar ``moe_topk_gate_backward`` of one row of int32 indices (sigmoid, no
    renormalization, no mask) on the scalar unit."""
    assert spec.index_dtype == "int32" and spec.scoring == "sigmoid" and not spec.renormalize
    E, K, factor = spec.experts, spec.slots, spec.routed_scaling_factor

    @T.macro
    def compute(buffers, keep):
        s_ub, i_ub, g_ub, o_ub = buffers["s_ub"], buffers["i_ub"], buffers["g_ub"], buffers["o_ub"]
        for e in T.serial(E):
            o_ub[e] = T.float32(0.0)
        for j in T.serial(K):
            if i_ub[j] >= 0 and i_ub[j] < E:
                o_ub[i_ub[j]] = o_ub[i_ub[j]] + g_ub[j] * T.float32(factor)
        for e in T.serial(E):
            o_ub[e] = o_ub[e] * (s_ub[e] * (T.float32(1.0) - s_ub[e]))

    return compute


def backward_scalar_rows(spec):
    """The prim_func of a ``moe_topk_gate_backward`` ``spec`` whose gradient is computed in scalar code."""
    from tileplug.backend_ascend.moe import gate_backward

    with mock.patch.object(gate_backward, "backward_compute", _scalar_backward_compute):
        return gate_backward.build(spec)


# ---------------------------------------------------------------------- the SwiGLU kernels

def _swiglu_scalar_variant(op, tile_compute, spec):
    """The prim_func of SwiGLU ``op``'s ``spec`` with its ``tile_compute`` replaced."""
    import importlib

    module = importlib.import_module(f"tileplug.backend_ascend.swiglu.{op}")
    with mock.patch.object(module, "tile_compute", tile_compute):
        return module.build(spec)


def _scalar_swiglu_compute(spec, width):
    """Per-element scalar SwiGLU of one tile (no weights, clamp or experts): ``y = g · sigmoid(g)
    · u`` for ``swiglu``, ``grad_x`` over the gate / up values for ``swiglu_backward``."""
    assert not spec.weighted and spec.clamp is None and spec.experts is None and spec.scaling == 1.0
    backward = spec.op == "swiglu_backward"
    dt, ot = spec.in_dtype, spec.out_dtype

    @T.macro
    def compute(buffers, row, tile):
        gate_ub, up_ub = buffers["gate_ub"], buffers["up_ub"]
        for k in T.serial(width):
            g = T.Cast("float32", gate_ub[k])
            s = T.float32(1.0) / (T.float32(1.0) + T.exp(-g))
            if backward:
                grad = T.Cast("float32", buffers["grad_ub"][k])
                u = T.Cast("float32", up_ub[k])
                gate_ub[k] = T.Cast(dt, grad * u * s * (T.float32(1.0) + g * (T.float32(1.0) - s)))
                up_ub[k] = T.Cast(dt, grad * g * s)
            else:
                buffers["y_ub"][k] = T.Cast(ot, g * s * T.Cast("float32", up_ub[k]))

    return compute


def swiglu_scalar_tiles(spec):
    """The prim_func of a ``swiglu`` ``spec`` whose tiles are computed in scalar code."""
    return _swiglu_scalar_variant("swiglu", _scalar_swiglu_compute, spec)


def _scalar_swiglu_cast_compute(spec, width):
    """The production ``y`` (SIMD), then the e4m3 cast with plain fp32 scales in scalar code:
    group amax, scale and quantize element by element on the scalar unit."""
    from tileplug.backend_ascend.swiglu.swiglu import store_activation

    fmt, group, round_sf, clamp_min, _, packed = spec.cast
    assert fmt == "e4m3" and not (round_sf or packed) and spec.experts is None
    values = store_activation(spec, width, 0, "float32")
    fmax = QUANT_FORMATS[fmt].max_value

    @T.macro
    def compute(buffers, row, tile):
        y_ub, q_ub, sf_ub = buffers["y_ub"], buffers["q_ub"], buffers["sf_ub"]
        with T.SimdVF():
            values(buffers, y_ub, None)
        amax = T.alloc_var(T.float32)
        for j in T.serial(ceil_div(width, group)):
            amax = T.float32(0)
            for k in T.serial(group):
                if j * group + k < width:
                    amax = T.max(amax, T.abs(y_ub[0, j * group + k]))
            sf_ub[j] = T.max(amax, T.float32(clamp_min)) / T.float32(fmax)
            for k in T.serial(group):
                if j * group + k < width:
                    q_ub[0, j * group + k] = T.Cast("float8_e4m3fn", y_ub[0, j * group + k] / sf_ub[j])

    return compute


def swiglu_cast_scalar_tiles(spec):
    """The prim_func of a plain e4m3 ``swiglu_per_token_cast`` ``spec`` whose cast is scalar code."""
    return _swiglu_scalar_variant("swiglu_per_token_cast", _scalar_swiglu_cast_compute, spec)


def swiglu_backward_scalar_tiles(spec):
    """The prim_func of a ``swiglu_backward`` ``spec`` whose tiles are computed in scalar code."""
    return _swiglu_scalar_variant("swiglu_backward", _scalar_swiglu_compute, spec)
