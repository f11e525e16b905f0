"""Ascend ``per_token_cast_and_cast_back`` (fake quant in place): LOWERING tests of the shared quant
tile kernel's fake-quant mode, on a CPU machine. Nothing here runs on an NPU.

The op-table grid of tests/test_ascend_lowering.py lowers every case and runs the generic checks
(UB budget, pipelining, vector code); here the generated Ascend C is checked for what is particular
to fake quant: x is the kernel's one GM tensor, read (GM -> UB) and written back (UB -> GM), no q or
sf leaves UB, there is no SIMT region, and each register is narrowed to the format and widened back
before one rounding to x's dtype
(nearest even, not saturating). Also: a column-tiled row (a tail tile) beyond the grid, and the
e2m1 dequantization rule of ``sf_macros.dequantized`` (codes rebuilt arithmetically) against the
reference's encode / decode on edge values.
"""

import re

import pytest
import torch

from tileplug import core
from tileplug.core.quant import formats

pytestmark = pytest.mark.ascend_lower

META = "meta"


def _call(hidden, dtype=torch.bfloat16, op=None, **kwargs):
    with core.config.host_layout("ascend"):
        x = torch.empty(5, hidden, dtype=dtype, device=META)
        call, _ = core.describe_call(op or core.ops.per_token_cast_and_cast_back, x, **kwargs)
    return call


def _kernel():
    from tileplug.backend_ascend.plugin import kernel_table

    return kernel_table()["per_token_cast_and_cast_back"]


def _gm_parameters(source: str) -> list[str]:
    """Names of the ``__gm__`` pointer parameters of the lowered ``__global__`` kernel."""
    signature = re.search(r'extern "C" __global__[^(]*\(([^)]*)\)', source)
    assert signature, "no __global__ kernel in the source"
    return re.findall(r"__gm__ [\w:]+\* (\w+)", signature.group(1))


FAKE_QUANT_CALLS = {
    "e4m3-g128-bf16": dict(hidden=576),
    "e4m3-g32-round-bf16": dict(hidden=576, num_per_channels=32, round_sf=True),
    "e2m1-g16-e4m3sf-fp32": dict(hidden=592, dtype=torch.float32, fmt="e2m1", num_per_channels=16, use_e4m3_sf=True),
    "e4m3-g128-fp32-tiled": dict(hidden=16384, dtype=torch.float32),
}


@pytest.mark.parametrize("name", list(FAKE_QUANT_CALLS))
def test_fake_quant_kernel_writes_x_in_place_and_nothing_else(name):
    """The lowered fake-quant kernel takes x as its only GM tensor, copies it GM -> UB and writes the
    dequantized tile UB -> GM into x; it is pure SIMD (no SIMT pack, no sf store), narrows to the
    format and back in registers, and passes the grid's checks. The per_token_cast of the same
    call has Q and SF in GM (the difference is the mode, not the groups)."""
    from tileplug.backend_ascend import lowering_checks as checks
    from tileplug.backend_ascend.plugin import kernel_table
    from tileplug.backend_ascend.quant.common import spec_of

    kwargs = dict(FAKE_QUANT_CALLS[name])
    call = _call(**kwargs)
    kernel = _kernel()
    assert kernel.supports(call) is None
    lowering = kernel.lowering(call)
    source = lowering.lowered.source
    assert _gm_parameters(source) == ["X"], _gm_parameters(source)
    assert re.search(r"asc_copy_gm2ub\w*\([^;]*&\(X\[", source), "x is not read"
    assert re.search(r"asc_copy_ub2gm\w*\(\(__gm__ uint8_t\*\)\(\(&\(X\[", source), "x is not written"
    assert "__simt_vf__" not in source and "pure SIMD" in lowering.header
    spec = spec_of(call)
    assert spec.fake_quant and spec.out_dtype == spec.in_dtype and not spec.writes_sf
    assert set(spec.plan(spec.hidden)) == {"x_ub", "o_ub"}
    if spec.fmt == "e4m3" or spec.e4m3_sf:  # the code (or the scale) narrowed to e4m3, widened back
        assert "vcvt<fp8_e4_t>" in source and re.search(r"vcvt<float>\((code|stored)", source)
    if spec.fmt == "e2m1":  # the step count rounded to an integer and back (no fp4 convert)
        assert "vcvt<int32_t>(scaled" in source
    rounding = re.findall(r"vcvt<bfloat16_t>\([^;]*?(RS_\w+)", source)
    assert rounding == (["RS_DISABLE"] * len(rounding)) and bool(rounding) == (spec.in_dtype == "bfloat16"), rounding
    for label, (ok, detail) in {
        "ub": checks.check_ub(lowering.lowered.compiler_ub_bytes, lowering.lowered.primfunc_ub_bytes,
                              lowering.plan_bytes, lowering.budget),
        "pipelined": checks.check_pipelined(source),
        "vector": checks.check_vector(source),
    }.items():
        assert ok, (label, detail)
    if name.endswith("tiled"):  # 16384 fp32 columns exceed UB: full tiles and a narrower tail tile
        assert "last tile" in lowering.header, lowering.header
    cast_call = _call(op=core.ops.per_token_cast, **{k: v for k, v in kwargs.items() if k != "use_e4m3_sf"})
    cast_source = kernel_table()["per_token_cast"].lowering(cast_call).lowered.source
    assert {"X", "Q", "SF"} <= set(_gm_parameters(cast_source))


def test_fake_quant_declines_only_what_the_tile_kernel_declines():
    """use_e4m3_sf is served in fake quant (nothing is stored), still declined for per_token_cast;
    a hidden size that is not a multiple of 16 is declined with the kernel's reason."""
    from tileplug.backend_ascend.plugin import kernel_table

    assert _kernel().supports(_call(576, fmt="e2m1", num_per_channels=16, use_e4m3_sf=True)) is None
    why = kernel_table()["per_token_cast"].supports(_call(576, op=core.ops.per_token_cast, use_e4m3_sf=True))
    assert why is not None and "e4m3-stored" in why
    why = _kernel().supports(_call(24, num_per_channels=16))
    assert why is not None and "multiple of 16" in why


def _e2m1_dequantized(y: torch.Tensor) -> torch.Tensor:
    """``sf_macros.dequantized``'s e2m1 rule in torch (fp32): |y| saturated to 6 (NaN -> 6), its
    step count (2|y|, |y|, |y| / 2 below 2, 4, above) rounded to nearest even, times the step,
    with y's sign bit."""
    magnitude = torch.where(torch.isnan(y), torch.tensor(6.0), y.abs().clamp(max=6.0))
    below2, below4 = magnitude < 2.0, magnitude < 4.0
    scaled = torch.where(below2, magnitude * 2.0, torch.where(below4, magnitude, magnitude * 0.5))
    step = torch.where(below2, torch.tensor(0.5), torch.where(below4, torch.tensor(1.0), torch.tensor(2.0)))
    value = torch.round(scaled) * step  # torch.round: ties to even, as ROUND_R
    sign = y.view(torch.int32) & -0x80000000
    return (value.view(torch.int32) | sign).view(torch.float32)


def test_e2m1_dequantization_rule_equals_decode_of_encode():
    """The e2m1 codes' values rebuilt arithmetically equal ``decode(encode(y))`` bit for bit on
    every threshold, tie, signed zero, overflow and NaN (both signs)."""
    points = [0.0, 0.25, 0.2500001, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.9999, 6.0, 7.0, 1e30, float("inf"),
              float("nan"), 1e-45, 0.24999, 2.4999, 4.9999]
    y = torch.tensor(points + [-p for p in points], dtype=torch.float32)
    y = torch.cat([y, torch.linspace(-8.0, 8.0, 4097)])
    expected = formats.decode_e2m1_codes(formats.e2m1_codes(y))
    got = _e2m1_dequantized(y)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (y, got, expected)
