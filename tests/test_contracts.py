"""Contract errors of the quant ops and the runtime config (SPEC.md §0, §3).

Every bad input raises ``core.ContractError`` (a ValueError) whose message names the argument
in quotes and whose ``argument`` attribute is that name; never a bare ``assert`` (which would
vanish under ``python -O``), never another exception type.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from tileplug import core

OPS = core.ops
CORE_SRC = pathlib.Path(core.__file__).parent


@pytest.fixture(autouse=True)
def _reference_backend():
    with core.use_backend("reference"):
        yield


# ---------------------------------------------------------------------- inputs

T, H = 4, 256


def x_bf16(tokens: int = T, hidden: int = H) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


def pair(**kwargs):
    """A valid per-token (q, sf) pair, groups (1, 128)."""
    with core.use_backend("reference"):
        return OPS.per_token_cast(x_bf16(), **kwargs)


def q_only():
    return pair()[0]


def sf_only():
    return pair()[1]


def strided_sf():
    # a [4, 2] sf whose strides are (4, 2): neither row- nor column-major
    sf = torch.ones(T, 4)[:, ::2]
    assert sf.shape == (T, 2) and sf.stride() == (4, 2)
    return sf


def enter(context_manager) -> None:
    with context_manager:
        pass


# (id, callable, argument the error must name)
BAD_INPUTS = [
    # ---------------------------------------------------------------- x itself
    ("x-str", lambda: OPS.per_token_cast("not a tensor"), "x"),
    ("x-none", lambda: OPS.per_token_cast(None), "x"),
    ("x-list-of-floats", lambda: OPS.per_block_cast([[1.0, 2.0]]), "x"),
    ("x-1d", lambda: OPS.per_token_cast(torch.randn(H)), "x"),
    ("x-3d", lambda: OPS.per_token_cast(torch.randn(2, T, H)), "x"),
    ("x-int32", lambda: OPS.per_token_cast(torch.ones(T, H, dtype=torch.int32)), "x"),
    ("x-int8-plain", lambda: OPS.per_token_cast(torch.ones(T, H, dtype=torch.int8)), "x"),
    ("x-float16", lambda: OPS.per_token_cast(torch.randn(T, H).half()), "x"),
    ("x-float64", lambda: OPS.per_token_cast(torch.randn(T, H).double()), "x"),
    ("x-float64-per-block", lambda: OPS.per_block_cast(torch.randn(T, H).double()), "x"),
    ("x-float16-per-channel", lambda: OPS.per_channel_cast(torch.randn(T, H).half()), "x"),
    ("x-transposed", lambda: OPS.per_token_cast(torch.randn(H, T).t()), "x"),
    ("x-transposed-per-channel", lambda: OPS.per_channel_cast(torch.randn(H, T).t()), "x"),
    ("x-column-step-2", lambda: OPS.per_block_cast(torch.randn(T, 2 * H)[:, ::2]), "x"),
    ("x-odd-h-e2m1", lambda: OPS.per_token_cast(torch.randn(T, 255), "e2m1"), "x"),
    ("x-odd-h-e2m1-per-block", lambda: OPS.per_block_cast(torch.randn(T, 255), "e2m1"), "x"),
    ("x-odd-h-e2m1-per-channel", lambda: OPS.per_channel_cast(torch.randn(T, 255), "e2m1"), "x"),
    ("x-odd-h-e2m1-sf-only", lambda: OPS.per_token_cast_with_sf_only(torch.randn(T, 255), "e2m1", 16), "x"),
    # ---------------------------------------------------------------- fmt
    ("fmt-unknown", lambda: OPS.per_token_cast(x_bf16(), "fp8"), "fmt"),
    ("fmt-output-format", lambda: OPS.per_block_cast(x_bf16(), "bf16"), "fmt"),
    ("fmt-none", lambda: OPS.per_channel_cast(x_bf16(), None), "fmt"),
    ("fmt-upper-case", lambda: OPS.per_token_cast(x_bf16(), "E4M3"), "fmt"),
    ("fmt-cast-back-e4m3", lambda: OPS.cast_back(pair(), "e4m3", (1, 128)), "fmt"),
    ("fmt-cast-back-fp16", lambda: OPS.cast_back(pair(), "fp16", (1, 128)), "fmt"),
    # ---------------------------------------------------------------- group sizes
    ("npc-48", lambda: OPS.per_token_cast(x_bf16(), num_per_channels=48), "num_per_channels"),
    ("npc-256", lambda: OPS.per_token_cast(x_bf16(), num_per_channels=256), "num_per_channels"),
    ("npc-0", lambda: OPS.per_token_cast(x_bf16(), num_per_channels=0), "num_per_channels"),
    ("npc-true", lambda: OPS.per_token_cast(x_bf16(), num_per_channels=True), "num_per_channels"),
    ("npc-float", lambda: OPS.per_token_cast(x_bf16(), num_per_channels=128.0), "num_per_channels"),
    ("npc-str", lambda: OPS.per_token_cast_with_sf_only(x_bf16(), num_per_channels="128"), "num_per_channels"),
    (
        "npc-precomputed",
        lambda: OPS.per_token_cast_with_precomputed_sf(x_bf16(), num_per_channels=8, sf=torch.ones(T, 32)),
        "num_per_channels",
    ),
    ("block-size-side-1", lambda: OPS.per_block_cast(x_bf16(), block_size=(128, 1)), "block_size"),
    ("block-size-48", lambda: OPS.per_block_cast(x_bf16(), block_size=(48, 48)), "block_size"),
    ("block-size-int", lambda: OPS.per_block_cast(x_bf16(), block_size=128), "block_size"),
    ("block-size-triple", lambda: OPS.per_block_cast(x_bf16(), block_size=(128, 128, 1)), "block_size"),
    ("block-size-float", lambda: OPS.per_block_cast_with_sf_only(x_bf16(), block_size=(128.0, 128)), "block_size"),
    ("block-size-256", lambda: OPS.per_block_cast_with_sf_only(x_bf16(), block_size=(256, 256)), "block_size"),
    ("npt-64", lambda: OPS.per_channel_cast(x_bf16(), num_per_tokens=64), "num_per_tokens"),
    ("npt-16", lambda: OPS.per_channel_cast(x_bf16(), num_per_tokens=16), "num_per_tokens"),
    ("npt-true", lambda: OPS.per_channel_cast(x_bf16(), num_per_tokens=True), "num_per_tokens"),
    ("npt-none", lambda: OPS.per_channel_cast(x_bf16(), num_per_tokens=None), "num_per_tokens"),
    # ---------------------------------------------------------------- flags
    ("round-sf-and-e4m3-sf", lambda: OPS.per_token_cast(x_bf16(), round_sf=True, use_e4m3_sf=True), "use_e4m3_sf"),
    (
        "round-sf-and-e4m3-sf-sf-only",
        lambda: OPS.per_token_cast_with_sf_only(x_bf16(), round_sf=True, use_e4m3_sf=True),
        "use_e4m3_sf",
    ),
    ("packed-without-round-sf", lambda: OPS.per_token_cast(x_bf16(), use_packed_ue8m0=True), "use_packed_ue8m0"),
    ("packed-without-round-sf-block", lambda: OPS.per_block_cast(x_bf16(), use_packed_ue8m0=True), "use_packed_ue8m0"),
    (
        "packed-without-round-sf-channel",
        lambda: OPS.per_channel_cast(x_bf16(), use_packed_ue8m0=True),
        "use_packed_ue8m0",
    ),
    (
        "packed-and-e4m3-sf",
        lambda: OPS.per_token_cast(x_bf16(), use_packed_ue8m0=True, use_e4m3_sf=True),
        "use_packed_ue8m0",
    ),
    ("round-sf-int", lambda: OPS.per_token_cast(x_bf16(), round_sf=1), "round_sf"),
    ("round-sf-none-channel", lambda: OPS.per_channel_cast(x_bf16(), round_sf=None), "round_sf"),
    ("round-sf-str-block", lambda: OPS.per_block_cast(x_bf16(), round_sf="yes"), "round_sf"),
    (
        "col-major-str",
        lambda: OPS.per_token_cast(x_bf16(), use_tma_aligned_col_major_sf="yes"),
        "use_tma_aligned_col_major_sf",
    ),
    (
        "col-major-int-block",
        lambda: OPS.per_block_cast_with_sf_only(x_bf16(), use_tma_aligned_col_major_sf=0),
        "use_tma_aligned_col_major_sf",
    ),
    ("packed-none", lambda: OPS.per_token_cast(x_bf16(), round_sf=True, use_packed_ue8m0=None), "use_packed_ue8m0"),
    ("e4m3-sf-int", lambda: OPS.per_token_cast(x_bf16(), use_e4m3_sf=0), "use_e4m3_sf"),
    ("e4m3-sf-tensor", lambda: OPS.per_token_cast(x_bf16(), use_e4m3_sf=torch.tensor(True)), "use_e4m3_sf"),
    # ---------------------------------------------------------------- quantized (xq, sf) inputs
    ("pair-one-element", lambda: OPS.per_token_cast((q_only(),), x_block_size=(1, 128)), "x"),
    ("pair-three-elements", lambda: OPS.per_token_cast((*pair(), sf_only()), x_block_size=(1, 128)), "x"),
    ("pair-empty-tuple", lambda: OPS.per_block_cast((), x_block_size=(1, 128)), "x"),
    ("pair-xq-bf16", lambda: OPS.per_token_cast((x_bf16(), sf_only()), x_block_size=(1, 128)), "x"),
    ("pair-xq-float32", lambda: OPS.per_block_cast((x_bf16().float(), sf_only()), x_block_size=(1, 128)), "x"),
    ("pair-xq-not-tensor", lambda: OPS.per_token_cast(("q", sf_only()), x_block_size=(1, 128)), "x"),
    ("pair-missing-x-block-size", lambda: OPS.per_token_cast(pair()), "x_block_size"),
    ("pair-missing-x-block-size-block", lambda: OPS.per_block_cast(pair()), "x_block_size"),
    ("pair-x-block-size-1x1", lambda: OPS.per_token_cast(pair(), x_block_size=(1, 1)), "x_block_size"),
    ("pair-x-block-size-48", lambda: OPS.per_token_cast(pair(), x_block_size=(1, 48)), "x_block_size"),
    ("pair-sf-shape", lambda: OPS.per_token_cast((q_only(), sf_only()[:, :1]), x_block_size=(1, 128)), "x"),
    ("pair-sf-grouping-mismatch", lambda: OPS.per_token_cast(pair(), x_block_size=(1, 64)), "x"),
    ("pair-sf-float64", lambda: OPS.per_token_cast((q_only(), sf_only().double()), x_block_size=(1, 128)), "x"),
    ("pair-sf-uint8", lambda: OPS.per_token_cast((q_only(), torch.ones(T, 2, dtype=torch.uint8)), x_block_size=(1, 128)), "x"),
    ("pair-sf-1d", lambda: OPS.per_token_cast((q_only(), sf_only().flatten()), x_block_size=(1, 128)), "x"),
    ("pair-sf-not-tensor", lambda: OPS.per_token_cast((q_only(), [[1.0, 1.0]] * T), x_block_size=(1, 128)), "x"),
    ("pair-sf-strides", lambda: OPS.per_token_cast((q_only(), strided_sf()), x_block_size=(1, 128)), "x"),
    ("pair-sf-strides-cast-back", lambda: OPS.cast_back((q_only(), strided_sf()), "bf16", (1, 128)), "x"),
    ("plain-x-with-x-block-size", lambda: OPS.per_token_cast(x_bf16(), x_block_size=(1, 128)), "x_block_size"),
    ("plain-x-with-x-block-size-block", lambda: OPS.per_block_cast(x_bf16(), x_block_size=(1, 128)), "x_block_size"),
    (
        "plain-x-with-x-block-size-precomputed",
        lambda: OPS.per_token_cast_with_precomputed_sf(x_bf16(), sf=torch.ones(T, 2), x_block_size=(1, 128)),
        "x_block_size",
    ),
    (
        "channel-num-per-channels-with-plain-x",
        lambda: OPS.per_channel_cast(x_bf16(), num_per_channels=128),
        "num_per_channels",
    ),
    ("channel-pair-missing-num-per-channels", lambda: OPS.per_channel_cast(pair()), "num_per_channels"),
    ("channel-pair-num-per-channels-48", lambda: OPS.per_channel_cast(pair(), num_per_channels=48), "num_per_channels"),
    ("channel-pair-sf-mismatch", lambda: OPS.per_channel_cast(pair(), num_per_channels=64), "x"),
    # ---------------------------------------------------------------- cast_back
    ("cast-back-plain-tensor", lambda: OPS.cast_back(x_bf16(), "bf16", (1, 128)), "x"),
    ("cast-back-q-only", lambda: OPS.cast_back(q_only(), "bf16", (1, 128)), "x"),
    ("cast-back-missing-x-block-size", lambda: OPS.cast_back(pair(), "bf16"), "x_block_size"),
    ("cast-back-x-block-size-int", lambda: OPS.cast_back(pair(), "bf16", 128), "x_block_size"),
    ("cast-back-sf-shape", lambda: OPS.cast_back((q_only(), torch.ones(T, 3)), "fp32", (1, 128)), "x"),
    ("cast-back-one-element", lambda: OPS.cast_back((q_only(),), "fp32", (1, 128)), "x"),
    # ---------------------------------------------------------------- precomputed sf
    ("precomputed-sf-missing", lambda: OPS.per_token_cast_with_precomputed_sf(x_bf16()), "sf"),
    ("precomputed-sf-missing-block", lambda: OPS.per_block_cast_with_precomputed_sf(x_bf16()), "sf"),
    ("precomputed-sf-shape", lambda: OPS.per_token_cast_with_precomputed_sf(x_bf16(), sf=torch.ones(T, 3)), "sf"),
    ("precomputed-sf-transposed-shape", lambda: OPS.per_token_cast_with_precomputed_sf(x_bf16(), sf=torch.ones(2, T)), "sf"),
    ("precomputed-sf-shape-block", lambda: OPS.per_block_cast_with_precomputed_sf(x_bf16(), sf=torch.ones(T, 2)), "sf"),
    ("precomputed-sf-float64", lambda: OPS.per_token_cast_with_precomputed_sf(x_bf16(), sf=torch.ones(T, 2).double()), "sf"),
    ("precomputed-sf-bf16", lambda: OPS.per_token_cast_with_precomputed_sf(x_bf16(), sf=torch.ones(T, 2).bfloat16()), "sf"),
    ("precomputed-sf-list", lambda: OPS.per_token_cast_with_precomputed_sf(x_bf16(), sf=[[1.0, 1.0]] * T), "sf"),
    ("precomputed-sf-3d", lambda: OPS.per_token_cast_with_precomputed_sf(x_bf16(), sf=torch.ones(1, T, 2)), "sf"),
    ("precomputed-sf-strides", lambda: OPS.per_token_cast_with_precomputed_sf(x_bf16(), sf=strided_sf()), "sf"),
    (
        "precomputed-packed-sf-wrong-count",  # 2 groups pack into 1 int32, not 2
        lambda: OPS.per_token_cast_with_precomputed_sf(x_bf16(), sf=torch.ones(T, 2, dtype=torch.int32)),
        "sf",
    ),
    # ---------------------------------------------------------------- out=
    ("out-single-tensor", lambda: OPS.per_token_cast(x_bf16(), out=torch.empty(T, H, dtype=torch.float8_e4m3fn)), "out"),
    (
        "out-q-shape",
        lambda: OPS.per_token_cast(x_bf16(), out=(torch.empty(T, H + 1, dtype=torch.float8_e4m3fn), torch.empty(T, 2))),
        "out",
    ),
    (
        "out-q-dtype",
        lambda: OPS.per_token_cast(x_bf16(), out=(torch.empty(T, H, dtype=torch.int8), torch.empty(T, 2))),
        "out",
    ),
    (
        "out-sf-dtype",
        lambda: OPS.per_token_cast(
            x_bf16(), out=(torch.empty(T, H, dtype=torch.float8_e4m3fn), torch.empty(T, 2, dtype=torch.float64))
        ),
        "out",
    ),
    (
        "out-sf-shape",
        lambda: OPS.per_token_cast(x_bf16(), out=(torch.empty(T, H, dtype=torch.float8_e4m3fn), torch.empty(T, 3))),
        "out",
    ),
    (
        "out-sf-row-major-for-col-major",
        lambda: OPS.per_token_cast(
            x_bf16(), use_tma_aligned_col_major_sf=True, out=(torch.empty(T, H, dtype=torch.float8_e4m3fn), torch.empty(T, 2))
        ),
        "out",
    ),
    (
        "out-q-stride",
        lambda: OPS.per_token_cast(
            x_bf16(), out=(torch.empty(T, 2 * H, dtype=torch.float8_e4m3fn)[:, :H], torch.empty(T, 2))
        ),
        "out",
    ),
    (
        "out-not-tensor",
        lambda: OPS.per_token_cast(x_bf16(), out=("q", "sf")),
        "out",
    ),
    (
        "out-sf-only-shape",
        lambda: OPS.per_token_cast_with_sf_only(x_bf16(), out=torch.empty(T, 3)),
        "out",
    ),
    (
        "out-precomputed-dtype",
        lambda: OPS.per_token_cast_with_precomputed_sf(x_bf16(), sf=torch.ones(T, 2), out=torch.empty(T, H)),
        "out",
    ),
    # ---------------------------------------------------------------- devices (meta stands in for another device)
    ("pair-sf-other-device", lambda: OPS.per_token_cast((q_only(), sf_only().to("meta")), x_block_size=(1, 128)), "x"),
    (
        "precomputed-sf-other-device",
        lambda: OPS.per_token_cast_with_precomputed_sf(x_bf16(), sf=torch.ones(T, 2, device="meta")),
        "sf",
    ),
    (
        "out-other-device",
        lambda: OPS.per_token_cast(
            x_bf16(), out=(torch.empty(T, H, dtype=torch.float8_e4m3fn, device="meta"), torch.empty(T, 2, device="meta"))
        ),
        "out",
    ),
    # ---------------------------------------------------------------- runtime config
    ("config-pdl-int", lambda: enter(core.config.override(pdl=1)), "pdl"),
    ("config-pdl-helper-str", lambda: enter(core.config.pdl("yes")), "pdl"),
    ("config-clamp-zero", lambda: enter(core.config.amax_clamps({("e4m3", False): 0.0})), "amax_clamps"),
    ("config-clamp-negative", lambda: enter(core.config.amax_clamps({("e4m3", True): -1e-4})), "amax_clamps"),
    ("config-clamp-inf", lambda: enter(core.config.amax_clamps({("e2m1", False): float("inf")})), "amax_clamps"),
    ("config-clamp-nan", lambda: enter(core.config.amax_clamps({("e2m1", True): float("nan")})), "amax_clamps"),
    ("config-clamp-bool", lambda: enter(core.config.amax_clamps({("e4m3", False): True})), "amax_clamps"),
    ("config-clamp-str", lambda: enter(core.config.amax_clamps({("e4m3", False): "1e-4"})), "amax_clamps"),
    ("config-clamp-bad-key", lambda: enter(core.config.amax_clamps({("e5m2", False): 1e-4})), "amax_clamps"),
    ("config-clamp-bad-key-shape", lambda: enter(core.config.amax_clamps({"e4m3": 1e-4})), "amax_clamps"),
    ("config-sm-count-zero", lambda: enter(core.config.sm_count(0)), "sm_count"),
    ("config-sm-count-float", lambda: enter(core.config.override(sm_count=8.0)), "sm_count"),
    ("config-token-alignment-negative", lambda: enter(core.config.token_alignment(-16)), "token_alignment_bytes"),
    ("config-host-layout-unknown", lambda: enter(core.config.host_layout("tpu")), "host_layout"),
    ("config-host-layout-int", lambda: enter(core.config.host_layout(4)), "host_layout"),
    ("config-unknown-switch", lambda: enter(core.config.override(pdl_enabled=True)), "pdl_enabled"),
    ("config-set-pdl-int", lambda: core.config.set(pdl=1), "pdl"),
    ("use-backend-no-names", lambda: enter(core.use_backend()), "names"),
    ("use-backend-empty-name", lambda: enter(core.use_backend("")), "names"),
]


def test_at_least_35_distinct_bad_inputs():
    ids = [case[0] for case in BAD_INPUTS]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 35


@pytest.mark.parametrize("make_call, argument", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_contract_error_naming_the_argument(make_call, argument):
    with pytest.raises(core.ContractError) as info:
        make_call()
    error = info.value
    assert error.argument == argument, f"error names {error.argument!r}, expected {argument!r}: {error}"
    assert f"'{argument}'" in str(error), str(error)
    assert "expected" in str(error) and "got" in str(error), str(error)


# Config inputs a user can plausibly pass that are not even the right kind of container. SPEC §0:
# a bad input is a ContractError naming the argument, never a stray TypeError from inside.
NON_MAPPING_CLAMPS = [5, None, 1e-4, [("e4m3", False, 1e-4)]]


# Regression: a non-mapping once reached dict() and raised a bare TypeError / ValueError.
@pytest.mark.parametrize("clamps", NON_MAPPING_CLAMPS, ids=repr)
def test_config_amax_clamps_not_a_mapping(clamps):
    with pytest.raises(core.ContractError) as info:
        enter(core.config.override(amax_clamps=clamps))
    assert info.value.argument == "amax_clamps"


# ---------------------------------------------------------------------- error class, state


def test_contract_error_is_a_value_error():
    assert issubclass(core.ContractError, ValueError)
    assert issubclass(core.ContractError, core.TileplugError)
    with pytest.raises(ValueError):
        OPS.per_token_cast(x_bf16(), num_per_channels=48)


def test_contract_error_carries_its_parts():
    with pytest.raises(core.ContractError) as info:
        OPS.per_token_cast(x_bf16(), num_per_channels=48)
    error = info.value
    assert error.op == "per_token_cast" and error.argument == "num_per_channels"
    assert "48" in str(error) and "16" in error.expected and "128" in error.expected


def test_rejected_config_leaves_the_config_unchanged():
    before = core.config.current()
    with pytest.raises(core.ContractError):
        core.config.set(pdl=1)
    with pytest.raises(core.ContractError):
        enter(core.config.amax_clamps({("e4m3", False): 0.0}))
    assert core.config.current() == before


def test_good_inputs_still_pass():
    # the neighbours of the bad inputs above are accepted
    x = x_bf16()
    OPS.per_token_cast(x, num_per_channels=16)
    OPS.per_token_cast(x, round_sf=True, use_packed_ue8m0=True)
    OPS.per_token_cast(pair(), x_block_size=(1, 128))
    OPS.per_block_cast(x, block_size=(16, 128))
    OPS.per_channel_cast(x, num_per_tokens=32)
    OPS.per_channel_cast(pair(), num_per_channels=128)
    OPS.per_token_cast_with_precomputed_sf(x, sf=torch.ones(T, 2))
    q, sf = OPS.per_token_cast(x, use_tma_aligned_col_major_sf=True)
    OPS.per_token_cast(x, use_tma_aligned_col_major_sf=True, out=(torch.empty_like(q), torch.empty_strided(sf.shape, sf.stride())))
    OPS.per_token_cast(x, out=(torch.empty(T, H, dtype=torch.float8_e4m3fn), torch.empty(T, 2)))
    OPS.cast_back(pair(), "fp32", (1, 128))
    with core.config.amax_clamps({("e4m3", False): 1e-6}):
        pass


def test_out_is_written_and_returned():
    x = x_bf16()
    q_out, sf_out = torch.empty(T, H, dtype=torch.float8_e4m3fn), torch.empty(T, 2)
    q, sf = OPS.per_token_cast(x, out=(q_out, sf_out))
    assert q is q_out and sf is sf_out
    q_new, sf_new = OPS.per_token_cast(x)
    assert torch.equal(q.view(torch.uint8), q_new.view(torch.uint8)) and torch.equal(sf, sf_new)


# ---------------------------------------------------------------------- no bare asserts


def test_contract_errors_survive_python_dash_o():
    # under -O every `assert` statement is stripped: a check written as one would not fire.
    script = textwrap.dedent(
        """
        import sys, torch
        from tileplug import core
        assert sys.flags.optimize == 1
        x = torch.randn(4, 256, dtype=torch.bfloat16)
        q, sf = core.ops.per_token_cast(x)
        calls = [
            lambda: core.ops.per_token_cast(x, use_packed_ue8m0=True),
            lambda: core.ops.per_token_cast(x, num_per_channels=48),
            lambda: core.ops.per_token_cast(torch.randn(256, 4).t()),
            lambda: core.ops.per_token_cast((q, sf[:, :1]), x_block_size=(1, 128)),
            lambda: core.ops.per_token_cast_with_precomputed_sf(x, sf=torch.ones(4, 3)),
            lambda: core.ops.cast_back(q, "bf16", (1, 128)),
            lambda: core.ops.per_token_cast(x, out=(q, torch.empty(4, 3))),
        ]
        for call in calls:
            try:
                with core.use_backend("reference"):
                    call()
            except core.ContractError as error:
                print("ContractError", error.argument)
            else:
                print("NO ERROR")
        """
    )
    result = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    assert [line for line in lines if line] == [
        "ContractError use_packed_ue8m0",
        "ContractError num_per_channels",
        "ContractError x",
        "ContractError x",
        "ContractError sf",
        "ContractError x",
        "ContractError out",
    ], result.stdout + result.stderr


def test_argument_checks_contain_no_assert_statements():
    # the shared argument checks and the config validation must raise, not assert
    for path in (CORE_SRC / "contracts" / "checks.py", CORE_SRC / "config.py", CORE_SRC / "errors.py"):
        tree = ast.parse(path.read_text())
        asserts = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
        assert not asserts, f"{path.name}: assert statements at lines {asserts}"
    # in the quant contracts, the builders (every function taking user arguments) assert nothing
    tree = ast.parse((CORE_SRC / "contracts" / "quant.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            asserts = [n.lineno for n in ast.walk(node) if isinstance(n, ast.Assert)]
            assert not asserts, f"quant.py:{node.name}: assert statements at lines {asserts}"


# ---------------------------------------------------------------------- clamps the config accepts


# Regression: a clamp small enough for c / max to underflow once gave sf = 0, inv = inf and
# NaN q for an all-zero (finite) group. Such clamps are now refused (or, were one accepted,
# the cast must stay finite).
@pytest.mark.parametrize(
    "fmt, e4m3_sf, clamp",
    [("e4m3", True, 1e-4), ("e2m1", True, 1e-6), ("e4m3", False, 1e-44), ("e2m1", False, 1e-45)],
    ids=["e4m3-e4m3sf-1e-4", "e2m1-e4m3sf-1e-6", "e4m3-plain-1e-44", "e2m1-plain-1e-45"],
)
def test_accepted_amax_clamp_keeps_finite_input_finite(fmt, e4m3_sf, clamp):
    try:
        enter(core.config.amax_clamps({(fmt, e4m3_sf): clamp}))
    except core.ContractError as error:
        assert error.argument == "amax_clamps"
        return  # refusing the clamp is a fix too
    x = torch.zeros(2, 32)
    x[1, 0] = 1e-3  # a tiny, non-zero group
    with core.config.amax_clamps({(fmt, e4m3_sf): clamp}):
        q, sf = OPS.per_token_cast(x, fmt, 32, use_e4m3_sf=e4m3_sf)
    scales = sf.float()
    assert torch.isfinite(scales).all() and (scales > 0).all(), f"sf {scales.tolist()}"
    y = OPS.cast_back((q, sf), "fp32", (1, 32))
    assert torch.isfinite(y).all()
    assert y[0].abs().max().item() == 0.0  # zeros stay zeros
    assert y[1, 0].item() > 0  # the tiny value survives with its sign


# ---------------------------------------------------------------------- allocation plans

PLAN_KINDS = [
    ("per_token_cast", {}),
    ("per_token_cast", {"use_tma_aligned_col_major_sf": True}),
    ("per_token_cast", {"round_sf": True, "use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True}),
    ("per_token_cast", {"fmt": "e2m1", "num_per_channels": 16, "round_sf": True, "use_packed_ue8m0": True}),
    ("per_block_cast", {"block_size": (128, 128)}),
    ("per_block_cast", {"block_size": (32, 32), "round_sf": True, "use_packed_ue8m0": True}),
    ("per_block_cast", {"block_size": (128, 128), "use_tma_aligned_col_major_sf": True}),
    ("per_channel_cast", {"num_per_tokens": 32}),
    ("per_channel_cast", {"num_per_tokens": 128, "round_sf": True, "use_packed_ue8m0": True}),
    ("per_token_cast_with_sf_only", {"round_sf": True, "use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True}),
    ("per_token_cast_with_precomputed_sf", {"sf": torch.ones(3, 4)}),
]


@pytest.mark.parametrize(("op", "kwargs"), PLAN_KINDS,
                         ids=[f"{op}{sorted(k for k in kw)}" for op, kw in PLAN_KINDS])
def test_allocation_plans_give_the_layout_spec_2_names(op, kwargs):
    """Every plan allocates what SPEC §2 says for its call (shape, strides, dtype), at token
    counts that leave partial groups, and for T = 0 (an empty sf row-major)."""
    from tileplug.core.quant.layouts import CUDA_LAYOUT

    call, _ = core.describe_call(op, torch.zeros(3, 512, dtype=torch.bfloat16), **kwargs)
    plan = call.allocation_plan(CUDA_LAYOUT)
    for tokens in (0, 1, 3, 17, 128, 129, 4001):
        q, sf = plan.allocate(tokens, torch.device("meta"))
        if plan.q_columns is None:
            assert q is None
        else:
            assert (q.shape, q.stride(), q.dtype) == ((tokens, plan.q_columns), (plan.q_columns, 1), plan.q_dtype)
        if plan.sf_dtype is None:
            assert sf is None
            continue
        rows = -(-tokens // plan.bm)  # row groups, then (packed along tokens) integers of them
        if plan.pack_axis == 0:
            rows = -(-rows // plan.pack_factor)
        columns = plan.sf_columns
        if plan.col_major_multiple and rows and columns:
            strides = (1, -(-rows // plan.col_major_multiple) * plan.col_major_multiple)
        else:
            strides = (columns, 1)
        assert (sf.shape, sf.stride(), sf.dtype) == ((rows, columns), strides, plan.sf_dtype), tokens
