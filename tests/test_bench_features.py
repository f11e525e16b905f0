"""``tileplug bench`` features for comparing with other libraries (CPU): peers called with
the same arguments, the ratio table, the plot, and their errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tileplug.core import benchmark, ops


def _tk_per_block(x, fmt, block_size, use_tma_aligned_col_major_sf=False, round_sf=False, use_packed_ue8m0=False,
                  out=None):
    return None


def test_peer_arguments_bind_tileplug_defaults() -> None:
    x = torch.empty(2, 256, dtype=torch.bfloat16)
    args, kwargs = benchmark.peer_arguments(ops.per_block_cast, _tk_per_block, (x,), {"block_size": (32, 32)})
    assert args == (x,)
    assert kwargs == {"fmt": "e4m3", "block_size": (32, 32), "use_tma_aligned_col_major_sf": False, "round_sf": False,
                      "use_packed_ue8m0": False, "out": None}


def test_peer_arguments_refuse_what_the_peer_cannot_do() -> None:
    x = torch.empty(2, 256, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="no argument 'x_block_size'"):
        benchmark.peer_arguments(ops.per_block_cast, _tk_per_block, (x,), {"x_block_size": (1, 128)})


def test_a_missing_peer_is_a_note_not_a_failure(monkeypatch) -> None:
    monkeypatch.setitem(benchmark.PEERS, "absent", benchmark.Peer("absent", "no_such_module_here.quant", "absent-pkg"))
    case = benchmark.bench_cases()["per_token_cast"]
    rows = benchmark.measure_case(case, 4, 256, torch.bfloat16, torch.device("cpu"), ["reference"], 1.0,
                                  with_compile=False, with_host_time=False, peers=["absent"])
    peer = [r for r in rows if r.runner == "absent"]
    assert len(peer) == 1 and peer[0].median_us is None
    assert "not importable (pip install absent-pkg)" in peer[0].note
    assert [r for r in rows if r.runner == "reference"][0].median_us > 0


def test_a_peer_is_timed_and_compared(monkeypatch) -> None:
    """A peer module offering the op under its name is timed like a backend, with the ledger
    bytes of the default backend's call, and gets a ratio row."""
    import types

    module = types.ModuleType("fake_peer_quant")
    module.per_token_cast = lambda x, fmt, num_per_channels, **_: ops.per_token_cast(x, fmt, num_per_channels)
    monkeypatch.setitem(sys.modules, "fake_peer_quant", module)
    monkeypatch.setitem(benchmark.PEERS, "fake", benchmark.Peer("fake", "fake_peer_quant", "fake"))
    case = benchmark.bench_cases()["per_token_cast"]
    rows = benchmark.measure_case(case, 4, 256, torch.bfloat16, torch.device("cpu"), ["reference"], 1.0,
                                  with_compile=False, with_host_time=False, peers=["fake"])
    ours, theirs = (next(r for r in rows if r.runner == name) for name in ("reference", "fake"))
    assert theirs.median_us > 0 and theirs.ledger_bytes == ours.ledger_bytes > 0
    ratios = benchmark.peer_ratios(rows, "fake", "reference")
    assert len(ratios) == 1 and ratios[0]["eager"] == pytest.approx(theirs.median_us / ours.median_us)
    assert ratios[0]["graph"] is None  # no graph replay on the CPU


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tileplug.core.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_unknown_peer_is_a_usage_error() -> None:
    done = _cli("bench", "--device", "cpu", "--peer", "nobody", "--tokens", "1")
    assert done.returncode == 2 and "unknown peer(s): nobody" in done.stderr and "tile_kernels" in done.stderr


def test_plot_of_an_unreadable_report_is_a_usage_error(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    done = _cli("plot", str(tmp_path / "missing.json"), "-o", str(tmp_path / "x.png"))
    assert done.returncode == 2 and "cannot read" in done.stderr


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        done = _cli("bench", "--device", "cpu", "--tokens", "1", "--plot", str(tmp_path / "x.png"))
        assert done.returncode == 2 and "tileplug-core[plot]" in done.stderr
    else:
        pytest.skip("matplotlib is installed here")


def test_plot_draws_every_case(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    report = {"device": "cuda", "device_name": "test", "copy_gbps": 4000.0, "rows": [
        {"case": case, "runner": runner, "tokens": t, "hidden": 7168, "gbps": 100.0 * t, "graph_gbps": 90.0 * t}
        for case in ("a", "b") for runner in ("cuda", "tile_kernels") for t in (1, 128, 4096)]}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    done = _cli("plot", str(path), "-o", str(tmp_path / "plot.png"))
    assert done.returncode == 0, done.stderr
    data = (tmp_path / "plot.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10000


def _adapter_signatures(module: str) -> dict[str, list[tuple[str, str | None]]]:
    """Functions of a peer adapter module, read from its source (the peer library itself is
    not installed here): name -> [(parameter, default source or None)]."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module)
    tree = ast.parse(open(spec.origin).read())
    signatures = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            params = node.args.args
            defaults = [None] * (len(params) - len(node.args.defaults)) + [ast.unparse(d) for d in node.args.defaults]
            signatures[node.name] = [(p.arg, d) for p, d in zip(params, defaults)]
    return signatures


@pytest.mark.parametrize("peer", sorted(benchmark.PEERS))
def test_peer_adapters_take_the_ops_arguments(peer: str) -> None:
    """An adapter stands for a tileplug op: same parameter names, order and defaults (so the
    bench binds a case's arguments the same way for both); its names are declared ops."""
    import inspect

    from tileplug.core import opdefs

    adapters = _adapter_signatures(benchmark.PEERS[peer].module)
    assert adapters, f"{peer}: no adapter functions"
    declared = set(opdefs.names())
    checked = 0
    for name, parameters in adapters.items():
        if name not in declared:
            continue  # an op declared on another branch; checked once it is in the table
        ours = inspect.signature(opdefs.get(name).function).parameters
        expected = [(p.name, None if p.default is inspect.Parameter.empty else repr(p.default)) for p in ours.values()]
        assert [p for p, _ in parameters] == [p for p, _ in expected], f"{peer}.{name}"
        for (param, theirs), (_, mine) in zip(parameters, expected):
            if mine is not None:
                assert theirs is not None and eval(theirs) == eval(mine), f"{peer}.{name}({param}): {theirs} != {mine}"
        checked += 1
    assert checked or not declared & set(adapters)


def test_torch_compile_peer_formulations_match_the_reference() -> None:
    """The torch_compile peer's plain PyTorch formulas (here uncompiled) compute the ops: RMSNorm
    with residual and offset, LayerNorm, and NeoX / GPT-J / conjugate RoPE with positions and an
    offset, within 2 ulp of the reference on CPU; cases it cannot express are refused by name."""
    from tileplug.core import ops
    from tileplug.core.ops.rope import make_cos_sin_cache
    from tileplug.core.peers import torch_compile as peer
    from tileplug.core.testing import activation, assert_within_ulps

    x = activation(37, 256, torch.bfloat16, "cpu", seed=1)
    residual = activation(37, 256, torch.bfloat16, "cpu", seed=2)
    weight = (1 + 0.1 * torch.randn(256, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
    bias = (0.1 * torch.randn(256, generator=torch.Generator().manual_seed(4))).to(torch.bfloat16)
    expected, _ = ops.rms_norm(x, weight, residual=residual, weight_offset=1.0)
    assert_within_ulps(peer._rms_norm(x, weight, 1e-6, residual, 1.0), expected, 2, what="rms_norm")
    assert_within_ulps(peer._layer_norm(x, weight, bias, 1e-5, None), ops.layer_norm(x, weight, bias), 2,
                       what="layer_norm")
    cache = make_cos_sin_cache(64, 64)
    positions = torch.randint(0, 60, (37,), generator=torch.Generator().manual_seed(5))
    for interleaved, conjugate in ((False, False), (True, False), (False, True)):
        query = activation(37, 4 * 96, torch.bfloat16, "cpu", seed=6).view(37, 4, 96)
        key = activation(37, 2 * 96, torch.bfloat16, "cpu", seed=7).view(37, 2, 96)
        mine_query, mine_key = query.clone(), key.clone()
        ops.apply_rotary(query, cache, key, positions=positions, interleaved=interleaved, conjugate=conjugate,
                         seqlen_offset=2)
        peer._apply_rotary(mine_query, cache, mine_key, positions.long() + 2, interleaved, conjugate)
        assert_within_ulps(mine_query, query, 2, what=f"query {interleaved} {conjugate}")
        assert_within_ulps(mine_key, key, 2, what=f"key {interleaved} {conjugate}")
    with pytest.raises(TypeError, match="return_rstd"):
        peer.rms_norm(x, weight, return_rstd=True)
