"""Dispatch: selection cache, zero-size calls, meta tensors, config, core.lower, threads."""

from __future__ import annotations

import threading

import pytest
import torch

from tileplug import core
from tileplug.core.testing import assert_bytes_equal


class CountingKernel:
    """Delegates to the reference and counts launches and supports() calls."""

    def __init__(self, inner, decline: str | None = None):
        self.inner = inner
        self.decline = decline
        self.launches = 0
        self.supports_calls = 0

    def supports(self, call):
        self.supports_calls += 1
        return self.decline

    def __call__(self, call, inputs, outputs):
        self.launches += 1
        self.inner(call, inputs, outputs)


@pytest.fixture
def counting_backend():
    reference = core.registry.get("reference")
    kernel = CountingKernel(reference.kernels["per_token_cast"])
    backend = core.Backend(
        name="counting", device_types=("cpu",), priority=500, traits=core.ASCEND_LAYOUT,
        kernels={"per_token_cast": kernel},
    )
    core.registry.register(backend)
    yield kernel
    core.registry.unregister("counting")


def test_highest_priority_backend_runs_and_its_layout_is_used(counting_backend):
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    q, sf = core.ops.per_token_cast(x, round_sf=True, use_packed_ue8m0=True)
    assert counting_backend.launches == 1
    assert sf.dtype == torch.int16 and sf.shape == (5, 1)  # Ascend traits: 2 UE8M0 bytes per int16


def test_selection_is_cached_per_signature_not_per_token_count(counting_backend):
    for tokens in (1, 2, 7, 33):
        core.ops.per_token_cast(torch.randn(tokens, 256))
    assert counting_backend.supports_calls == 1
    core.ops.per_token_cast(torch.randn(3, 512))  # another hidden size: another signature
    assert counting_backend.supports_calls == 2


def test_zero_tokens_return_empty_outputs_without_launching(counting_backend):
    q, sf = core.ops.per_token_cast(torch.empty(0, 576, dtype=torch.bfloat16), use_tma_aligned_col_major_sf=True)
    assert counting_backend.launches == 0
    assert q.shape == (0, 576) and q.dtype == torch.float8_e4m3fn
    assert sf.shape == (0, 5) and sf.dtype == torch.float32


def test_declining_kernel_falls_through_with_reason(counting_backend):
    counting_backend.decline = "this kernel declines everything"
    x = torch.randn(2, 128)
    call, _ = core.describe_call(core.ops.per_token_cast, x)
    assert core.registry.explain("per_token_cast", call)["counting"] == "this kernel declines everything"
    backend, _ = core.registry.select("per_token_cast", call)
    assert backend.name == "reference"


def test_no_backend_error_lists_every_candidate_reason(counting_backend):
    counting_backend.decline = "declined for the test"
    with core.use_backend("counting"):
        with pytest.raises(core.NoBackendError) as caught:
            core.ops.per_token_cast(torch.randn(2, 128))
    message = str(caught.value)
    assert "counting: declined for the test" in message
    assert "reference: not tried" in message
    assert caught.value.reasons["counting"] == "declined for the test"


def test_meta_tensors_run_through_the_reference_shapes_only():
    x = torch.empty(4001, 7168, dtype=torch.bfloat16, device="meta")
    q, sf = core.ops.per_block_cast(x, "e4m3", (128, 128), use_tma_aligned_col_major_sf=True)
    assert q.device.type == "meta" and q.shape == (4001, 7168)
    assert sf.shape == (32, 56) and sf.stride() == (1, 32)


def test_config_clamp_override_changes_scales_and_is_scoped():
    x = torch.zeros(1, 128)
    with core.use_backend("reference"):
        default = core.ops.per_token_cast_with_sf_only(x)
        with core.config.amax_clamps({("e4m3", False): 448.0}):
            clamped = core.ops.per_token_cast_with_sf_only(x)
        after = core.ops.per_token_cast_with_sf_only(x)
    assert default.item() == pytest.approx(1e-4 / 448, rel=1e-6)
    assert clamped.item() == 1.0
    assert after.item() == default.item()


def test_config_context_managers_restore_values():
    base = core.config.current()
    with core.config.pdl(True), core.config.sm_count(66), core.config.token_alignment(64):
        inner = core.config.current()
        assert (inner.pdl, inner.sm_count, inner.token_alignment_bytes) == (True, 66, 64)
    assert core.config.current() == base


def test_token_alignment_pads_column_major_sf():
    x = torch.randn(5, 256)
    with core.use_backend("reference"), core.config.token_alignment(64):
        _, sf = core.ops.per_token_cast(x, use_tma_aligned_col_major_sf=True)
    assert sf.stride() == (1, 16)  # 64 bytes of fp32


def test_config_is_per_thread():
    seen = []
    with core.config.pdl(True):
        worker = threading.Thread(target=lambda: seen.append(core.config.current().pdl))
        worker.start()
        worker.join()
    assert seen == [False]


def test_lower_on_a_backend_without_codegen_says_so():
    x = torch.empty(1, 7168, dtype=torch.bfloat16, device="meta")
    with pytest.raises(core.LoweringError, match="does not generate device code"):
        core.lower(core.ops.per_token_cast, x, backend="reference")
    with pytest.raises(core.LoweringError, match="not installed"):
        core.lower(core.ops.per_token_cast, x, backend="no-such-backend")
    with pytest.raises(core.ContractError, match="'num_per_channels'"):
        core.lower(core.ops.per_token_cast, x, backend="reference", num_per_channels=48)


def test_lower_uses_the_backend_lower_hook():
    seen = []
    reference = core.registry.get("reference")
    backend = core.Backend(
        name="lowering", device_types=("npu",), priority=0, traits=core.ASCEND_LAYOUT,
        kernels={"per_token_cast": reference.kernels["per_token_cast"]},
        lower=lambda call: seen.append(call) or f"// source for H={call.hidden} g={call.cast.block[1]}",
    )
    core.registry.register(backend)
    try:
        x = torch.empty(3, 576, dtype=torch.bfloat16, device="meta")
        source = core.lower(core.ops.per_token_cast, x, backend="lowering", num_per_channels=64)
    finally:
        core.registry.unregister("lowering")
    assert source == "// source for H=576 g=64"
    assert seen[0].tokens == 3 and seen[0].op == "per_token_cast"


def test_concurrent_first_calls_agree():
    x = torch.randn(64, 576, dtype=torch.bfloat16)
    with core.use_backend("reference"):
        expected = core.ops.per_token_cast(x, fmt="e2m1", num_per_channels=32)
    core.registry.reload()
    results, errors = [], []

    def work():
        try:
            with core.use_backend("reference"):
                results.append(core.ops.per_token_cast(x, fmt="e2m1", num_per_channels=32))
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(results) == 8
    for q, sf in results:
        assert_bytes_equal(q, expected[0])
        assert_bytes_equal(sf, expected[1])


def test_out_argument_is_written_in_place():
    x = torch.randn(3, 256)
    with core.use_backend("reference"):
        q_expected, sf_expected = core.ops.per_token_cast(x)
        q = torch.empty(3, 256, dtype=torch.float8_e4m3fn)
        sf = torch.empty(3, 2)
        q_out, sf_out = core.ops.per_token_cast(x, out=(q, sf))
    assert q_out is q and sf_out is sf
    assert_bytes_equal(q, q_expected)
    assert_bytes_equal(sf, sf_expected)


class FailingKernel:
    """Accepts every call, then raises while running it."""

    def supports(self, call):
        return None

    def __call__(self, call, inputs, outputs):
        raise RuntimeError("device fell over")


class ExitingSupports:
    def supports(self, call):
        raise SystemExit(3)

    def __call__(self, call, inputs, outputs):  # pragma: no cover - never selected
        raise AssertionError("unreachable")


def test_a_kernel_raising_at_call_time_raises_backend_error_naming_backend_op_and_call():
    backend = core.Backend(name="failing", device_types=("cpu",), priority=700, traits=core.CUDA_LAYOUT,
                           kernels={"per_token_cast": FailingKernel()})
    core.registry.register(backend)
    try:
        with pytest.raises(core.BackendError) as caught:
            core.ops.per_token_cast_with_sf_only(torch.randn(3, 128))
    finally:
        core.registry.unregister("failing")
    error = caught.value
    assert error.backend == "failing" and error.op == "per_token_cast_with_sf_only"
    assert isinstance(error.__cause__, RuntimeError) and "device fell over" in str(error)
    assert "hidden=128" in str(error)
    # no silent fallback: with the failing backend gone, the reference runs the same call
    assert core.ops.per_token_cast_with_sf_only(torch.randn(3, 128)).shape == (3, 1)


def test_supports_raising_system_exit_declines_instead_of_exiting():
    backend = core.Backend(name="exiting", device_types=("cpu",), priority=700, traits=core.CUDA_LAYOUT,
                           kernels={"per_token_cast": ExitingSupports()})
    core.registry.register(backend)
    try:
        x = torch.randn(2, 128)
        call, _ = core.describe_call(core.ops.per_token_cast, x)
        assert core.registry.explain("per_token_cast", call)["exiting"] == "supports() raised SystemExit: 3"
        q, sf = core.ops.per_token_cast(x)  # the reference runs it
        assert q.shape == (2, 128)
    finally:
        core.registry.unregister("exiting")


def test_contract_memo_is_lru_without_a_cliff():
    from tileplug.core.contracts import quant as contracts

    memo = contracts.RecentCalls(limit=64)
    hot = ("hot",)
    memo.put(hot, "hot-call", None)
    for index in range(500):  # far more signatures than the limit, the hot one used throughout
        memo.put((index,), f"call-{index}", None)
        assert memo.get(hot) == "hot-call"
    assert len(memo) == 64 and memo.get((0,)) is None and memo.get((499,)) == "call-499"


@pytest.mark.parametrize("make", [
    lambda x: x,
    lambda x: torch.nn.Parameter(x, requires_grad=False),
    lambda x: torch.nn.Parameter(x),
], ids=["tensor", "parameter", "parameter-requiring-grad"])
def test_fast_path_serves_parameters_and_every_op(make, monkeypatch):
    """A repeated call skips the checks (``read_quant_input`` runs only on the checked path)."""
    from tileplug.core.contracts import quant as contracts

    x = make(torch.randn(3, 256))
    pair = core.ops.per_token_cast(x)
    sf = core.ops.per_token_cast_with_sf_only(x)
    checked = []
    original = contracts.read_quant_input
    monkeypatch.setattr(contracts, "read_quant_input", lambda *a, **k: checked.append(a[0]) or original(*a, **k))
    calls = {
        "per_token_cast": lambda: core.ops.per_token_cast(x),
        "per_block_cast_with_sf_only": lambda: core.ops.per_block_cast_with_sf_only(x),
        "per_token_cast_with_precomputed_sf": lambda: core.ops.per_token_cast_with_precomputed_sf(x, sf=sf),
        "per_channel_cast": lambda: core.ops.per_channel_cast(x),
        "cast_back": lambda: core.ops.cast_back(pair, "bf16", x_block_size=(1, 128)),
        "requantize": lambda: core.ops.per_token_cast(pair, x_block_size=(1, 128), num_per_channels=64),
    }
    for name, call in calls.items():
        call()
        checked.clear()
        result = call()
        assert checked == [], f"{name}: the second identical call ran the checks again"
        for output in result if isinstance(result, tuple) else (result,):
            assert output.grad_fn is None


def test_memo_distinguishes_a_bool_from_an_int_argument():
    x = torch.randn(2, 128)
    core.ops.per_token_cast(x, round_sf=True)
    with pytest.raises(core.ContractError, match="'round_sf'"):
        core.ops.per_token_cast(x, round_sf=1)
    core.ops.per_block_cast(x, block_size=(16, 16))
    with pytest.raises(core.ContractError, match="'block_size'"):
        core.ops.per_block_cast(x, block_size=(16, True))
