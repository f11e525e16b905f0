"""Shared TileLang Ascend-dialect macros of the row kernels (norm and RoPE families).

No ``from __future__ import annotations`` here: TileLang parses the macros' source.

A row kernel streams rows through UB: ``T.Kernel(C)``; vector core ``cid`` takes rows
``cid, cid + C, ...`` in one :func:`row_loop` (``T.Pipelined``, every cross-stage UB buffer
annotated with :data:`~tileplug.backend_ascend.ub.VERSIONS` versions, so the DMA of the next
row overlaps the vector work on this one and the write-back of the previous one). A row of
``D`` values sits in a 1-D UB buffer padded to whole 64-lane registers; the vector work is in
``T.SimdVF`` regions over those registers, fp32 in the registers whatever the storage dtype
(16-bit rows are widened on load with ``UNPK_B16`` + ``vcvt`` and narrowed on store with
``vcvt`` + ``PK_B32``, rounding to nearest even, no saturation, so inf / NaN stay visible).

Reductions over a row are fixed-order: lane ``j`` of one fp32 register accumulates the
row's elements ``j, j + 64, j + 128, ...`` in order, the tail register masked to the true
``D`` (lanes past it add exactly zero), then the register's lanes are summed by ``vcadd``.
The order depends on ``D`` alone, so a row's bytes never depend on ``T`` or its position.
"""

import tilelang.ascend.language as T

from tileplug.backend_ascend.device import check_budget  # noqa: F401 - looked up at trace time (bad kernels patch it)
from tileplug.backend_ascend.ub import LANES

F32 = "float32"
DIV_EXACT = "vdiv_0ulp_ftz_true"
"""Correctly rounded fp32 division (the reference divides in IEEE fp32)."""
SQRT_EXACT = "vsqrt_0ulp_ftz_false"
"""Correctly rounded fp32 square root, denormals kept."""


def chunks(width: int) -> tuple[int, int]:
    """``(full registers, lanes of the partial last register)`` of a row ``width`` wide."""
    return width // LANES, width % LANES


def registers(width: int) -> int:
    """64-lane registers that cover ``width`` values (the last one maybe partial)."""
    full, tail = chunks(width)
    return full + (1 if tail else 0)


def choose(flag, when_true, when_false):
    """``when_true`` if ``flag`` else ``when_false`` (a trace-time choice, e.g. of a buffer)."""
    return when_true if flag else when_false


def plan_buffers(plan: dict) -> tuple[dict, dict]:
    """``(buffers, versions)`` of a spec's ``plan()`` (name -> (shape, dtype, versions)), inside a
    kernel: each buffer allocated in UB in the plan's order, and the buffers of more than one
    version with their count (what :func:`row_loop` annotates)."""
    buffers = {name: T.alloc_shared(*entry[:2]) for name, entry in plan.items()}
    return buffers, {buffers[name]: entry[2] for name, entry in plan.items() if entry[2] > 1}


def row_loop(extent, versions: dict, num_stages: int = 2):
    """The loop over a core's rows, as a ``for`` iterator: every buffer in ``versions``
    (buffer -> versions) annotated, then ``T.Pipelined`` over ``num_stages`` stages (TileLang
    inserts the MTE2 / V / MTE3 syncs and the version rotation). Looked up at trace time;
    tests/ascend_bad_kernels.py replaces it with a serial loop to show the pipelining check
    failing."""
    T.annotate_buffer_versions(versions)
    return T.Pipelined(extent, num_stages=num_stages)


@T.macro
def load_f32(buf, off, dtype):
    """One register of ``buf`` (a UB row of ``dtype``) from element ``off`` (an index, or a tuple of
    indices of a 2-D buffer), as fp32 lanes."""
    if dtype == F32:
        return T.simd.vld(buf[off])
    else:
        return T.simd.vcvt(T.simd.vld(buf[off], dist="UNPK_B16"), F32, part=0)


@T.macro
def store_rounded(buf, off, value, dtype):
    """Store the fp32 register ``value`` into ``buf`` (a UB row of ``dtype``) at ``off``,
    rounded once to ``dtype`` (nearest even, no saturation)."""
    if dtype == F32:
        T.simd.vsts(buf[off], value)
    else:
        T.simd.vsts(buf[off], T.simd.vcvt(value, dtype, round="ROUND_R", sat=False, part=0), dist="PK_B32")


@T.macro
def tail_only(value, lanes):
    """``value`` with the lanes at or past ``lanes`` set to +0 (a partial last register)."""
    return T.simd.vsel(value, T.simd.vdup(T.float32(0.0), F32), T.simd.update_mask(lanes, 32))


def at(row, off):
    """The UB index of column ``off``: of a 1-D row buffer (``row`` None) or of row ``row`` of a
    2-D buffer (one head per row)."""
    return off if row is None else (row, off)


@T.macro
def row_sum_at(width, term_at):
    """Sum over the columns ``[0, width)`` of a row of ``term_at(off)`` (the fp32 register of
    the columns ``off .. off + 63``, from one or more UB rows), in the fixed order of this
    module; the total is in lane 0 of the result."""
    full, tail = chunks(width)
    acc = T.simd.alloc_var(F32)
    acc = T.simd.vdup(T.float32(0.0), F32)
    for c in T.serial(full):
        acc = T.simd.vadd(acc, term_at(c * LANES))
    if tail > 0:
        acc = T.simd.vadd(acc, tail_only(term_at(full * LANES), tail))
    return T.simd.vcadd(acc)


@T.macro
def row_sum(buf, dtype, width, term, row):
    """Sum over a UB row of ``width`` values of ``term(v)`` (``v``: a register of the row as
    fp32), in the fixed order of this module; the total is in lane 0 of the result. ``row``:
    None for a 1-D buffer, else the row of a 2-D one."""
    return row_sum_at(width, lambda off: term(load_f32(buf, at(row, off), dtype)))


@T.macro
def mean_of(total, width):
    """``total / width`` (correctly rounded fp32 division), lane 0."""
    return T.simd.vdiv(total, T.simd.vdup(T.float32(width), F32), precision=DIV_EXACT)


@T.macro
def rsqrt_plus(mean, eps):
    """``1 / sqrt(mean + eps)``: a correctly rounded square root, then a correctly rounded
    reciprocal (the reference's two roundings)."""
    root = T.simd.vsqrt(T.simd.vadds(mean, T.float32(eps)), precision=SQRT_EXACT)
    return T.simd.vdiv(T.simd.vdup(T.float32(1.0), F32), root, precision=DIV_EXACT)


@T.macro
def residual_add(x_ub, r_ub, dtype, width):
    """``r_ub = round_to(dtype, x + r)`` over a row (the residual sum, written over the
    residual row: it is ``residual_out``), then a barrier so the sum can be read back."""
    for c in T.serial(registers(width)):
        s = T.simd.vadd(load_f32(x_ub, c * LANES, dtype), load_f32(r_ub, c * LANES, dtype))
        store_rounded(r_ub, c * LANES, s, dtype)
    T.simd.mem_bar("VST_VLD")


@T.macro
def prepare_vector(raw_ub, out_ub, dtype, width, offset, scale):
    """``out_ub = (float(raw) + offset) * scale`` over a vector of ``width`` in fp32, in the
    reference's order (the offset added in fp32, then the scale); ``offset`` / ``scale`` None:
    ``out_ub = float(raw)``. In place when ``raw_ub`` is ``out_ub`` (an fp32 vector)."""
    with T.SimdVF():
        for c in T.serial(registers(width)):
            if offset is None:
                T.simd.vsts(out_ub[c * LANES], load_f32(raw_ub, c * LANES, dtype))
            else:
                shifted = T.simd.vadds(load_f32(raw_ub, c * LANES, dtype), T.float32(offset))
                T.simd.vsts(out_ub[c * LANES], T.simd.vmuls(shifted, T.float32(scale)))
