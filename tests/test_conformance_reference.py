"""The conformance suite runs end to end on the reference through the public dispatch path,
in both device families' sf layouts (the suite itself is what backends are held to)."""

from __future__ import annotations

import pytest

from tileplug import core
from tileplug.reference import conformance

SUITE = conformance.cases(tokens=(0, 1, 3, 129), hidden=(576,))


@pytest.mark.parametrize("family", ["cuda", "ascend"])
@pytest.mark.parametrize("case", SUITE[::3], ids=lambda c: c.id)
def test_reference_conforms(case: conformance.Case, family: str) -> None:
    with core.config.host_layout(family):
        conformance.check_case(case, "reference", "cpu")


def test_suite_covers_every_op_and_mode() -> None:
    ops = {case.op for case in conformance.cases()}
    assert ops == {
        "per_token_cast", "per_token_cast_with_sf_only", "per_token_cast_with_precomputed_sf",
        "per_block_cast", "per_block_cast_with_sf_only", "per_block_cast_with_precomputed_sf",
        "per_channel_cast", "cast_back",
    }
    flags = [case.kwargs for case in conformance.cases() if case.op == "per_token_cast"]
    assert any(f.get("use_packed_ue8m0") and f.get("use_tma_aligned_col_major_sf") for f in flags)
    assert any(f.get("use_e4m3_sf") for f in flags)


def test_check_case_catches_a_wrong_backend() -> None:
    """A backend whose bytes differ from the reference's must fail the suite."""
    import torch

    class OffByOneKernel:
        def __init__(self, inner):
            self.inner = inner

        def supports(self, call):
            return None

        def __call__(self, call, inputs, outputs):
            self.inner(call, inputs, outputs)
            raw = outputs.q.view(torch.uint8)
            raw[0, 0] ^= 1

    reference = core.registry.get("reference")
    wrong = core.Backend(
        name="off-by-one", device_types=("cpu",), priority=-2000, traits=core.CUDA_LAYOUT,
        kernels={"per_token_cast": OffByOneKernel(reference.kernels["per_token_cast"])},
    )
    core.registry.register(wrong)
    try:
        case = conformance.Case("per_token_cast", 3, 576, kwargs={"num_per_channels": 128})
        with pytest.raises(AssertionError, match="differing byte"):
            conformance.check_case(case, "off-by-one", "cpu")
    finally:
        core.registry.unregister("off-by-one")
