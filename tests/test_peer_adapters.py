"""The TileKernels peer adapter's MoE gates (``tileplug.core.peers.tile_kernels``), without
TileKernels: the adapter imported over a stand-in ``tile_kernels`` package that records each
call, so what tileplug's arguments become in TileKernels' spelling, and what the adapter
refuses (a ``TypeError`` naming the argument: the bench's "not comparable"), are checked here."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from tileplug.core import benchmark, ops

ADAPTER = "tileplug.core.peers.tile_kernels"


class Recorded:
    """A stand-in TileKernels function: records its arguments, returns fixed outputs."""

    def __init__(self, result) -> None:
        self.calls: list[tuple[tuple, dict]] = []
        self.result = result

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result


@pytest.fixture
def tile_kernels(monkeypatch):
    """A stand-in ``tile_kernels`` (``quant``, ``moe``, ``transform``) and the adapter imported over it."""
    idx, weights = torch.zeros(3, 9, dtype=torch.int64), torch.zeros(3, 9)

    def topk_gate(scores, num_topk):  # TileKernels' signature (its docstring)
        return idx[:, :num_topk]

    def normalize_weight(topk_weights):
        return topk_weights.sum(1), topk_weights

    moe = types.SimpleNamespace(moe_topk_gate_forward=Recorded((idx, weights)),
                                moe_topk_gate_backward=Recorded(torch.zeros(3, 64)),
                                topk_gate=topk_gate, normalize_weight=normalize_weight)
    quant_names = ("cast_back", "norm_backward", "norm_forward", "norm_forward_and_per_token_cast", "per_block_cast",
                   "per_channel_cast", "swiglu_forward", "swiglu_forward_and_per_token_cast", "per_token_cast",
                   "swiglu_backward")
    adapter = _adapter_over(monkeypatch, ADAPTER, "tile_kernels", {"moe": vars(moe), "quant": {
        n: Recorded(None) for n in quant_names}, "transform": {"apply_rotary": Recorded(None)}})
    yield adapter, moe
    sys.modules.pop(ADAPTER, None)


def _adapter_over(monkeypatch, adapter: str, package: str, modules: dict[str, dict]) -> types.ModuleType:
    """``adapter`` imported over a stand-in ``package`` whose submodules (``"ops.rms_norm"``, …) hold ``modules``'
    members (every parent package made too)."""
    made = {package: types.ModuleType(package)}
    for name, members in modules.items():
        parts = f"{package}.{name}".split(".")
        for depth in range(2, len(parts) + 1):
            made.setdefault(".".join(parts[:depth]), types.ModuleType(".".join(parts[:depth])))
        made[f"{package}.{name}"].__dict__.update(members)
    for name, module in made.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, adapter, raising=False)
    return importlib.import_module(adapter)


def test_the_same_named_gates_are_tile_kernels_own(tile_kernels) -> None:
    adapter, moe = tile_kernels
    assert adapter.topk_gate is moe.topk_gate and adapter.normalize_weight is moe.normalize_weight


def test_moe_topk_gate_is_spelt_as_the_forward_gate(tile_kernels) -> None:
    """sqrtsoftplus with a bias, one shared expert, a mask and the scores: ``use_shared_as_routed``,
    the shared count, the factor, expert-parallel rank 0, and a fresh fp32 scores tensor."""
    adapter, moe = tile_kernels
    logits, bias, mask = torch.randn(3, 64), torch.randn(64), torch.tensor([True, False, True])
    idx, weights, scores = adapter.moe_topk_gate(logits, 8, "sqrtsoftplus", bias=bias, routed_scaling_factor=2.5,
                                                 num_shared_experts=1, mask=mask, return_scores=True)
    ((args, kwargs),) = moe.moe_topk_gate_forward.calls
    assert args == (logits, 8, True, 1, 2.5, 0)
    assert kwargs["scoring_func"] == "sqrtsoftplus" and kwargs["bias"] is bias and kwargs["mask"] is mask
    assert kwargs["scores"] is scores and scores.shape == logits.shape and scores.dtype == torch.float32
    adapter.moe_topk_gate(logits, 8, "sqrtsoftplus")
    args, kwargs = moe.moe_topk_gate_forward.calls[-1]
    assert args[2:4] == (False, 0) and kwargs["scores"] is None and kwargs["bias"] is None


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"scoring": "softmax"}, "scoring='softmax'"),
    ({"scoring": "sigmoid"}, "scoring='sigmoid'"),
    ({"renormalize": False}, "'renormalize'"),
    ({"num_groups": 8, "topk_groups": 4}, "'num_groups'"),
    ({"num_shared_experts": 3}, "3"),
    ({"dtype": torch.bfloat16}, "bfloat16"),
])
def test_moe_topk_gate_refuses_what_tile_kernels_does_not_compute(tile_kernels, kwargs, named) -> None:
    adapter, moe = tile_kernels
    kwargs = {"scoring": "sqrtsoftplus", **kwargs}
    logits = torch.randn(3, 64, dtype=kwargs.pop("dtype", torch.float32))
    with pytest.raises(TypeError, match="TileKernels") as error:
        adapter.moe_topk_gate(logits, 8, **kwargs)
    assert named in str(error.value)
    assert not moe.moe_topk_gate_forward.calls


def test_the_gate_backward_is_spelt_as_tile_kernels_and_refuses_a_mask(tile_kernels) -> None:
    adapter, moe = tile_kernels
    scores, idx = torch.rand(3, 64), torch.zeros(3, 8, dtype=torch.int64)
    weights, grad = torch.rand(3, 8), torch.rand(3, 8)
    adapter.moe_topk_gate_backward(scores, idx, weights, grad, "sqrtsoftplus", routed_scaling_factor=1.5)
    ((args, kwargs),) = moe.moe_topk_gate_backward.calls
    assert args == (scores, idx, weights, grad, 1.5) and kwargs == {"scoring_func": "sqrtsoftplus"}
    with pytest.raises(TypeError, match="auxiliary-loss"):
        adapter.moe_topk_gate_backward(scores, idx, weights, grad, "sqrtsoftplus", mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="sqrtsoftplus only"):
        adapter.moe_topk_gate_backward(scores, idx, weights, grad, "sigmoid")


def test_the_bench_spells_its_gate_cases_for_the_adapter(tile_kernels) -> None:
    """``peer_arguments`` binds each MoE gate bench case's call to the adapter's signature (the
    sqrtsoftplus case entirely; the others are refused by the adapter itself, not by a missing
    argument)."""
    adapter, _ = tile_kernels
    functions = {"topk_gate": ops.topk_gate, "moe_topk_gate": ops.moe_topk_gate}
    cases = [case for case in benchmark.bench_cases().values() if case.op in functions]
    assert len(cases) == 6
    for case in cases:
        args, kwargs = case.arguments(4, 256, torch.float32, torch.device("cpu"))
        peer_args, peer_kwargs = benchmark.peer_arguments(functions[case.op], getattr(adapter, case.op), args, kwargs)
        assert peer_args[0] is args[0], case.name
        if case.name == "moe_topk_gate/sqrtsoftplus-shared1":
            adapter.moe_topk_gate(*peer_args, **peer_kwargs)  # comparable: TileKernels makes this call


# ---------------------------------------------------------------------- Liger's norm backwards

LIGER_ADAPTER = "tileplug.core.peers.liger"


@pytest.fixture
def liger(monkeypatch):
    """A stand-in ``liger_kernel`` (the ops modules the adapter imports) and the adapter imported over it."""
    stand_ins = {
        "layer_norm": {"LigerLayerNormFunction": object(), "layer_norm_backward": Recorded(("dx", "dw", "db"))},
        "rms_norm": {"LigerRMSNormFunction": object(), "rms_norm_backward": Recorded(("dx", "dw"))},
        "swiglu": {"swiglu_forward": Recorded(None), "swiglu_backward": Recorded(None)},
        "utils": {"calculate_settings": Recorded((8192, 16))},
    }
    adapter = _adapter_over(monkeypatch, LIGER_ADAPTER, "liger_kernel",
                            {f"ops.{name}": members for name, members in stand_ins.items()})
    yield adapter, {name: types.SimpleNamespace(**members) for name, members in stand_ins.items()}
    sys.modules.pop(LIGER_ADAPTER, None)


def test_liger_rms_norm_backward_is_spelt_as_its_autograd_backward(liger) -> None:
    """tileplug's saved tensors go to Liger's ``rms_norm_backward`` with the block size and warps its forward
    picks for D, Llama casting and in place (``LigerRMSNormFunction``'s default); what Liger has no argument
    for is refused by name."""
    adapter, liger_ops = liger
    grad_y, x, weight, rstd = torch.rand(3, 7168), torch.rand(3, 7168), torch.rand(7168), torch.rand(3)
    assert adapter.rms_norm_backward(grad_y, x, weight, rstd, weight_offset=1.0) == ("dx", "dw")
    ((args, kwargs),) = liger_ops["rms_norm"].rms_norm_backward.calls
    assert args[:4] == (grad_y, x, weight, rstd) and args[4:] == (1.0, "llama", 8192, 16, True, None) and not kwargs
    assert liger_ops["utils"].calculate_settings.calls == [((7168,), {})]
    for kwargs, named in (({"out_scale": 2.0}, "out_scale"), ({"grad_residual_out": grad_y}, "grad_residual_out")):
        with pytest.raises(TypeError, match=f"'{named}'"):
            adapter.rms_norm_backward(grad_y, x, weight, rstd, **kwargs)
    with pytest.raises(TypeError, match="needs a weight"):
        adapter.rms_norm_backward(grad_y, x, None, rstd)


def test_liger_layer_norm_backward_passes_the_weight_for_the_bias_dtype(liger) -> None:
    adapter, liger_ops = liger
    grad_y, x, weight, mean, rstd = torch.rand(3, 64), torch.rand(3, 64), torch.rand(64), torch.rand(3), torch.rand(3)
    assert adapter.layer_norm_backward(grad_y, x, weight, mean, rstd) == ("dx", "dw", "db")
    ((args, kwargs),) = liger_ops["layer_norm"].layer_norm_backward.calls
    assert args == (grad_y, x, weight, weight, mean, rstd) and not kwargs
    with pytest.raises(TypeError, match="'grad_residual_out'"):
        adapter.layer_norm_backward(grad_y, x, weight, mean, rstd, grad_residual_out=grad_y)
    with pytest.raises(TypeError, match="needs a weight"):
        adapter.layer_norm_backward(grad_y, x, None, mean, rstd)


def test_the_bench_spells_its_norm_backward_cases_for_liger(liger) -> None:
    """``peer_arguments`` binds each norm backward bench case to the Liger adapter, which accepts it (the bench
    compares these cases beside Liger, not only TileKernels)."""
    adapter, liger_ops = liger
    functions = {"rms_norm_backward": ops.rms_norm_backward, "layer_norm_backward": ops.layer_norm_backward}
    cases = [case for case in benchmark.bench_cases().values() if case.op in functions]
    assert {case.op for case in cases} == set(functions)
    for case in cases:
        args, kwargs = case.arguments(4, 7168, torch.bfloat16, torch.device("cpu"))
        peer_args, peer_kwargs = benchmark.peer_arguments(functions[case.op], getattr(adapter, case.op), args, kwargs)
        getattr(adapter, case.op)(*peer_args, **peer_kwargs)
    assert len(liger_ops["rms_norm"].rms_norm_backward.calls) + len(liger_ops["layer_norm"].layer_norm_backward.calls) \
        == len(cases)
