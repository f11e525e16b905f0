"""``OpDef.unfused`` and ``tileplug ledger``'s unfused block: the eager decompositions of the
norms reproduce the seed chapter's byte ledger, and a fused op's chain equals the ledgers of
the ops it fuses, as those ops declare them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tileplug.core import CUDA_LAYOUT, opdefs
from tileplug.core.opdefs import describe_call


def _ledger_json(*arguments: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "tileplug.core.cli", "ledger", *arguments], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("arguments, fused_mb, unfused_mb, ratio", [
    (("rms_norm",), 67.12, 234.99, 3.50),  # the seed: 67.12 MB, 234.99 MB, 3.50x (4096 x 4096, 16-bit)
    (("layer_norm", "-i", "bias=bf16"), 67.13, 335.69, 5.00),  # the seed: 67.13 MB, 335.59 MB, 5.00x
])
def test_norm_eager_decompositions_give_the_seed_ratios(arguments, fused_mb, unfused_mb, ratio) -> None:
    report = _ledger_json(*arguments, "--tokens", "4096", "--hidden", "4096")
    assert round(report["bytes_total"] / 1e6, 2) == fused_mb
    assert round(report["unfused"]["bytes_total"] / 1e6, 2) == unfused_mb
    assert round(report["unfused"]["ratio"], 2) == ratio
    assert sum(step["bytes_total"] for step in report["unfused"]["steps"]) == report["unfused"]["bytes_total"]


def _ledger(name: str, *args, **kwargs):
    call, _ = describe_call(name, *args, **kwargs)
    return opdefs.get(name).ledger(call, CUDA_LAYOUT)


@pytest.mark.parametrize("positions", [None, torch.int32])
@pytest.mark.parametrize("cast", [False, True])
def test_fused_rope_chain_is_the_ledgers_of_the_ops_it_fuses(positions, cast) -> None:
    tokens, heads, head_dim, rotary = 37, 8, 128, 64
    x = torch.empty(tokens, heads, head_dim, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(head_dim, dtype=torch.bfloat16, device="meta")
    cache = torch.empty(4096, rotary, dtype=torch.float32, device="meta")
    where = None if positions is None else torch.empty(tokens, dtype=positions, device="meta")
    name = "rms_norm_rope_per_token_cast" if cast else "rms_norm_rope"
    options = {"num_per_channels": 64} if cast else {}
    call, _ = describe_call(name, x, weight, cache, where, **options)
    steps = opdefs.get(name).unfused(call, CUDA_LAYOUT)
    expected = [("rms_norm", _ledger("rms_norm", x, weight)),
                ("apply_rotary", _ledger("apply_rotary", x[..., :rotary], cache, positions=where))]
    if cast:
        expected.append(("per_token_cast", _ledger("per_token_cast", x.view(tokens, heads * head_dim), "e4m3", 64)))
    assert [(step, ledger.bytes_read, ledger.bytes_written) for step, ledger in steps] == \
        [(step, ledger.bytes_read, ledger.bytes_written) for step, ledger in expected]


@pytest.mark.parametrize("residual", [False, True])
def test_norm_cast_chain_is_rms_norm_then_per_token_cast(residual) -> None:
    x = torch.empty(9, 576, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(576, dtype=torch.bfloat16, device="meta")
    r = torch.empty_like(x) if residual else None
    call, _ = describe_call("rms_norm_per_token_cast", x, weight, residual=r, num_per_channels=64)
    steps = opdefs.get("rms_norm_per_token_cast").unfused(call, CUDA_LAYOUT)
    norm = _ledger("rms_norm", x, weight, residual=r)
    cast = _ledger("per_token_cast", x, "e4m3", 64)
    assert [name for name, _ in steps] == ["rms_norm", "per_token_cast"]
    assert (steps[0][1].bytes_read, steps[0][1].bytes_written) == (norm.bytes_read, norm.bytes_written)
    assert steps[1][1] == cast


def test_ops_without_an_unfused_form_have_none() -> None:
    assert opdefs.get("per_token_cast").unfused is None
    assert "unfused" not in _ledger_json("per_token_cast", "--tokens", "4", "--hidden", "256")
