"""Re-blocking and weight-scale layout ops of the quant family (SPEC §11): the public
functions and their op-table declarations.

Shapes: ``per_block_cast_lossless`` reads an e2m1 pair ``(xq [T, H/2] int8, sf)`` and writes
``q`` [T, H] float8_e4m3fn with ``sf`` [ceil(T/bm), ceil(H/bn)] in the layout its flags ask
for (SPEC §2). ``transpose_weight_sf`` reads fp32 weight-block scales ``[*g, R, C]`` and
writes, per weight, ``sf0`` [*g, R·bs, ceil(C/f)] and ``sf1`` [*g, C·bs, ceil(R/f)] of packed
UE8M0 integers, MN-major (``f`` UE8M0 bytes per integer: 4 in int32 on the CUDA layout).

Neither op is differentiable: outputs carry no autograd history.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.compiler import is_compiling

from tileplug.core.contracts import quant_reblock as contracts
from tileplug.core.contracts.quant import QuantCall
from tileplug.core.opdefs import BenchCase, Case, OpDef, bound_contract, checked_case_inputs, declare, run
from tileplug.core.ops.quant import compare_quant, produce, producer_of

QuantizedPair = tuple[torch.Tensor, torch.Tensor]


def per_block_cast_lossless(
    x: QuantizedPair,
    fmt: str,
    x_block_size: tuple[int, int],
    out_block_size: tuple[int, int],
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    out: QuantizedPair | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-quantize an e2m1 pair to e4m3 with new groups, losslessly (SPEC §11) → ``(q, sf)``.

    ``x``: ``(xq, sf_in)``, xq [T, H/2] int8 (two e2m1 values per byte), sf_in the
    power-of-two scales of its ``x_block_size`` groups, fp32 or packed UE8M0 (any layout
    SPEC §2 names). ``fmt``: "e4m3". ``out_block_size``: ``(bm, bn)``, sides in 1, 16, 32,
    64, 128. Each output group's scale is ``2^max(e_max − 6, −127)``, ``e_max`` the largest
    exponent of the input scales it covers; ``q = e4m3(value · sf_in / sf_out)``, exact
    whenever every input scale of the group is at least ``2^-8 · sf_out``, so that
    ``cast_back`` of the result equals ``cast_back`` of ``x`` bytewise.
    ``use_packed_ue8m0`` (needs ``round_sf``) stores the scales as UE8M0 bytes, otherwise as
    fp32; ``use_tma_aligned_col_major_sf``: column-major sf. q: [T, H] float8_e4m3fn;
    sf: [ceil(T/bm), ceil(H/bn)] (packed: last dim / pack factor). ``out``: a preallocated
    ``(q, sf)`` of exactly that layout.
    """
    if is_compiling():
        return PER_BLOCK_CAST_LOSSLESS.traced(x, fmt, x_block_size, out_block_size, use_tma_aligned_col_major_sf,
                                              round_sf, use_packed_ue8m0, out=out)
    call, inputs = contracts.per_block_cast_lossless(x, fmt, x_block_size, out_block_size,
                                                     use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    return run(call, inputs, out)


def transpose_weight_sf(
    sf: torch.Tensor | tuple[torch.Tensor, ...],
    block_size: int = 128,
    transpose_sf1: bool = False,
    out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Lay out weights' fp32 power-of-two block scales as the packed UE8M0, MN-major scales
    DeepGEMM's FP8 GEMMs read (SPEC §11), any number of weights in one call.

    ``sf``: one scale tensor or a tuple of them, each contiguous fp32 ``[R, C]`` (the scales
    of a weight ``[N, K] = [R·bs, C·bs]`` in ``bs × bs`` blocks) or ``[G, R, C]`` (G weights of
    one shape). ``block_size``: ``bs``, 16, 32, 64 or 128. Returns ``(sf0, sf1)`` of each
    weight, flat and in order: sf0 ``[*g, N, ceil(C/f)]`` (the scale of row n and k-block j
    in byte ``j % f`` of integer ``j // f``), strides ``(N·ceil(C/f), 1, N)``; sf1
    ``[*g, K, ceil(R/f)]`` (the same for the transposed weight), strides
    ``(K·ceil(R/f), 1, K)``, or its ``[*g, ceil(R/f), K]`` row-major view with
    ``transpose_sf1``. ``f`` is the backend layout's UE8M0 pack factor (4, int32, on CUDA).
    Each byte is ``e + 127``, ``e = ceil(log2 s)`` clamped at -127 (exact for a power of two;
    zero gives byte 0); a NaN, infinite, negative or > 2^127 scale gives 0xFF; pad bytes are 0.
    ``out``: the flat tuple of outputs of exactly that layout, reused.
    """
    if is_compiling():
        return TRANSPOSE_WEIGHT_SF.traced(sf, block_size, transpose_sf1, out=out)
    call, inputs = contracts.transpose_weight_sf(sf, block_size, transpose_sf1)
    return run(call, inputs, out)


# ---------------------------------------------------------------------- test grids and inputs

LOSSLESS_INPUT_OPTIONS: dict[str, str] = {
    "input_sf": "'fp32' or 'ue8m0': how the e2m1 input's power-of-two scales are stored",
    "input_col_major": "bool: those scales are stored column-major",
    "input_round_sf": "bool: power-of-two input scales (False: fp32 scales that are not, the defined lossy case)",
}
_LOSSLESS_CHOICES: dict[str, tuple] = {
    "input_sf": ("fp32", "ue8m0"), "input_col_major": (False, True), "input_round_sf": (True, False),
}

WEIGHT_INPUT_OPTIONS: dict[str, str] = {
    "weights": "int >= 1: how many weights one call lays out (weight i has (i % 3 + 1) times the rows)",
    "groups": "int >= 1: every weight is a [groups, rows, cols] stack (1: 2-D)",
}


LOSSLESS_DEFAULTS: dict[str, Any] = {"fmt": "e4m3", "x_block_size": (1, 32), "out_block_size": (128, 128)}
"""The required arguments a case, ``tileplug ledger`` or ``bench`` leaves out: MXFP4-style 1 × 32
input groups into DeepGEMM's 128 × 128 blocks."""


def lossless_arguments(tokens: int, hidden: int, dtype: torch.dtype, kwargs: dict[str, Any],
                       inputs: dict[str, Any], device: torch.device, seed: int) -> tuple[tuple, dict]:
    """(args, kwargs) of ``per_block_cast_lossless`` at ``[tokens, hidden]``: a realistic
    activation quantized to e2m1 in ``x_block_size`` groups by the backend in force, with
    power-of-two scales stored as ``input_sf`` asks (on ``meta`` only shapes are made);
    required arguments left out of ``kwargs`` take :data:`LOSSLESS_DEFAULTS`."""
    from tileplug.core.testing import activation

    op = contracts.LOSSLESS
    checked_case_inputs(op, inputs, LOSSLESS_INPUT_OPTIONS, _LOSSLESS_CHOICES)
    kwargs = {**LOSSLESS_DEFAULTS, **kwargs}
    sf_kind = inputs.get("input_sf", "fp32")
    round_input = inputs.get("input_round_sf", True)
    if device.type == "meta":
        plain = torch.empty(tokens, hidden, dtype=dtype, device=device)
    else:
        plain = activation(tokens, hidden, dtype, seed=seed).to(device)
    producer, producer_kwargs = producer_of(tuple(kwargs["x_block_size"]), "e2m1", sf_kind,
                                          inputs.get("input_col_major", False))
    producer_kwargs["round_sf"] = round_input or sf_kind == "ue8m0"
    x = tuple(produce(producer, plain, producer_kwargs))
    return (x,), kwargs


def weight_scale_arguments(tokens: int, hidden: int, dtype: torch.dtype, kwargs: dict[str, Any],
                           inputs: dict[str, Any], device: torch.device, seed: int) -> tuple[tuple, dict]:
    """(args, kwargs) of ``transpose_weight_sf`` for weights of ``tokens`` rows and ``hidden``
    columns: the scales of ``bs × bs`` blocks, ``[ceil(T/bs), ceil(H/bs)]`` (weight i of
    ``weights`` has ``i % 3 + 1`` times the rows; ``groups`` > 1 stacks each), fp32 powers of two
    from 2^-30 to 2^10 (``dtype`` is not used: the scales are fp32). One weight is passed as a
    tensor, several as a tuple."""
    op = contracts.TRANSPOSE
    checked_case_inputs(op, inputs, WEIGHT_INPUT_OPTIONS, {}, default_minimum=1)
    block = kwargs.get("block_size", 128)
    rows, cols = -(-tokens // block), -(-hidden // block)
    groups = inputs.get("groups", 1)
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for index in range(inputs.get("weights", 1)):
        shape = ((groups,) if groups > 1 else ()) + (rows * (index % 3 + 1), cols)
        if device.type == "meta":
            tensors.append(torch.empty(shape, dtype=torch.float32, device=device))
            continue
        exponents = torch.randint(-30, 11, shape, generator=generator, dtype=torch.int32)
        tensors.append(torch.ldexp(torch.ones(shape), exponents.float()).to(device))
    return (tensors[0] if len(tensors) == 1 else tuple(tensors),), dict(kwargs)


_SCALE_MODES: dict[str, dict[str, bool]] = {
    "fp32": {},
    "round": {"round_sf": True},
    "ue8m0": {"round_sf": True, "use_packed_ue8m0": True},
    "ue8m0-col": {"round_sf": True, "use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True},
    "fp32-col": {"use_tma_aligned_col_major_sf": True},
}

_BLOCK_PAIRS = (
    ((1, 32), (128, 128)),  # MXFP4 activations / weights → DeepGEMM's 128 × 128 FP8 weight blocks
    ((1, 32), (1, 128)),
    ((1, 32), (32, 32)),  # the Ascend pair
    ((1, 16), (128, 128)),
    ((32, 32), (128, 128)),
    ((128, 128), (1, 128)),  # output groups inside one input group
    ((1, 128), (128, 32)),  # mixed: wider in rows, narrower in columns
    ((32, 1), (32, 32)),
    ((1, 64), (128, 1)),
)


def lossless_cases() -> list[Case]:
    """Non-aligned hidden sizes first (576: partial 128-groups; 592: partial 32-groups), every
    block pair with every output scale mode, both input scale storages, column-major input
    scales, and non-power-of-two fp32 input scales (the defined lossy case)."""
    op = contracts.LOSSLESS
    cases = []
    for hidden in (576, 592, 2048):
        for (x_block, out_block), mode in itertools.product(_BLOCK_PAIRS, _SCALE_MODES):
            if (hidden, mode) not in ((576, mode), (592, "round"), (2048, "ue8m0-col")):
                continue
            sf_kind = "ue8m0" if len(cases) % 2 else "fp32"
            cases.append(Case.of(op, hidden, inputs={"input_sf": sf_kind}, x_block_size=x_block,
                                 out_block_size=out_block, **_SCALE_MODES[mode]))
    cases += [
        Case.of(op, 576, inputs={"input_sf": "ue8m0", "input_col_major": True}, x_block_size=(1, 32),
                out_block_size=(128, 128), round_sf=True, use_packed_ue8m0=True),
        Case.of(op, 576, inputs={"input_col_major": True}, x_block_size=(128, 128), out_block_size=(32, 32)),
        Case.of(op, 576, inputs={"input_round_sf": False}, x_block_size=(1, 32), out_block_size=(128, 128)),
        Case.of(op, 576, torch.float32, inputs={"input_round_sf": False}, x_block_size=(32, 32),
                out_block_size=(1, 128), round_sf=True, use_packed_ue8m0=True),
        Case.of(op, 7168, x_block_size=(1, 32), out_block_size=(128, 128), round_sf=True, use_packed_ue8m0=True,
                use_tma_aligned_col_major_sf=True),
    ]
    return cases


def weight_scale_cases() -> list[Case]:
    """K not a multiple of the block or of four blocks first (576 = 4.5 · 128), then aligned
    sizes; every block size, several weights of different shapes, stacked groups, sf1
    transposed."""
    op = contracts.TRANSPOSE
    cases = []
    for hidden, block, transposed in itertools.product((576, 200, 7168), contracts.WEIGHT_BLOCK_SIZES, (False, True)):
        if hidden == 7168 and block in (16, 64):
            continue
        cases.append(Case.of(op, hidden, block_size=block, transpose_sf1=transposed))
    cases += [
        Case.of(op, 576, inputs={"weights": 3}, block_size=128),
        Case.of(op, 576, inputs={"weights": 4, "groups": 2}, block_size=32, transpose_sf1=True),
        Case.of(op, 2048, inputs={"groups": 3}, block_size=128),
        Case.of(op, 1040, inputs={"weights": 2}, block_size=16),
    ]
    return cases


def _bench_lossless() -> list[BenchCase]:
    op = contracts.LOSSLESS
    return [
        BenchCase.of(op, op, inputs={"input_sf": "ue8m0"}, x_block_size=(1, 32), out_block_size=(128, 128),
                     round_sf=True, use_packed_ue8m0=True),
        BenchCase.of(f"{op}/1x128-col", op, inputs={"input_sf": "ue8m0"}, x_block_size=(1, 32),
                     out_block_size=(1, 128), round_sf=True, use_packed_ue8m0=True, use_tma_aligned_col_major_sf=True),
    ]


def _bench_weight_scales() -> list[BenchCase]:
    op = contracts.TRANSPOSE
    return [
        BenchCase.of(op, op, block_size=128),
        BenchCase.of(f"{op}/8-weights", op, inputs={"weights": 8}, block_size=128),
    ]


# ---------------------------------------------------------------------- declarations

PER_BLOCK_CAST_LOSSLESS = declare(OpDef(
    name=contracts.LOSSLESS,
    family="quant",
    function=per_block_cast_lossless,
    contract=bound_contract(per_block_cast_lossless, contracts.per_block_cast_lossless),
    outputs=QuantCall.allocation_plan,  # (call, traits) -> AllocationPlan
    result=QuantCall.result,  # (call, outputs) -> (q, sf)
    ledger=QuantCall.ledger,  # (call, traits) -> Ledger
    cases=lossless_cases,
    bench=_bench_lossless,
    arguments=lossless_arguments,
    compare=compare_quant,  # q bytewise, sf on the bytes that hold a group of out_block_size
    input_options=LOSSLESS_INPUT_OPTIONS,
))

TRANSPOSE_WEIGHT_SF = declare(OpDef(
    name=contracts.TRANSPOSE,
    family="quant",
    function=transpose_weight_sf,
    contract=bound_contract(transpose_weight_sf, contracts.transpose_weight_sf),
    outputs=contracts.WeightScaleCall.allocation_plan,
    result=contracts.WeightScaleCall.result,
    ledger=contracts.WeightScaleCall.ledger,
    cases=weight_scale_cases,
    bench=_bench_weight_scales,
    arguments=weight_scale_arguments,
    input_options=WEIGHT_INPUT_OPTIONS,
))
