"""CUDA norm kernels on a GPU (rms_norm, layer_norm, rms_norm_per_token_cast,
rms_norm_backward, layer_norm_backward) against the reference backend.

Run on the GPU host (compute capability >= 9.0), a few minutes::

    hatch run python -m pytest tests/gpu/test_cuda_norm.py -m gpu -q

Every specialisation the module uses (about 100) is compiled up front by
``jit.precompile`` (a spawned process pool over the host's cores), then loaded.

What is checked, per SPEC §4-5:

- **vs the reference** (``test_matches_reference``): D in {64, 576, 1536, 2048, 4096, 5120,
  7168, 16384} × bf16 / fp16 / fp32 and the op's forms (residual, Gemma offset, out_scale,
  weight dtypes, no weight, bias, statistics, 3-D per-head, padded and misaligned row strides,
  every sf layout of the cast) at T in {1, 7, 129, 4001}: first within SPEC's tolerances (the
  op table's ``compare_norm``: outputs ≤ 1 ulp of their dtype, rstd / mean ≤ 4 ulp fp32, the
  cast's (q, sf) by ``assert_quantized_close``), then **bytewise** — the kernels add each row
  in the reference's pairwise order (``backend_cuda/norm/rows.py``) with IEEE roundings at
  the reference's points, so they are designed to give the reference's bytes exactly (the
  backwards' grad_x too; their grad_weight / grad_bias sum the rows in another fixed order:
  SPEC's relative 1e-5 only). A failure of the second assert alone means the design claim broke,
  not the contract.
- **batch invariance** bytewise: a row alone (T = 1) vs the same row inside batches of 1, 7
  and 4001 rows at the first, a middle and the last position; and run-to-run determinism
  (grad_weight included: no atomics, a fixed blocking of the rows).
- **fusion**: ``rms_norm_per_token_cast`` ≡ ``per_token_cast(rms_norm(...))`` on this backend,
  bytewise (q, the sf bytes that hold groups, residual_out, y), every sf layout.
- **in place**: ``out=x`` / ``residual_out=residual`` give the out-of-place bytes.
- **non-finite inputs** (NaN, ±inf in one row): every other row keeps its bytes, the row's
  output is non-finite where SPEC says (a NaN row: all NaN).
- host-side forms: T = 1 with a row stride that is no multiple of the vector (the launcher's
  stride fix), a weight whose data pointer is not 16-byte aligned (the launcher's copy),
  tensors past 2^31 elements (64-bit offsets).

Oracle: the reference on the CPU (``TILEPLUG_ORACLE=gpu`` runs it on the GPU instead: the
same PyTorch code; faster for T = 4001 × D = 16384).
"""

from __future__ import annotations

import os

import pytest
import torch

from tileplug.core import Case, config, opdefs, ops
from tileplug.core.registry import use_backend
from tileplug.core.testing import assert_bytes_equal, assert_sf_equal, moved

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
HIDDEN = (64, 576, 1536, 2048, 4096, 5120, 7168, 16384)
TOKENS = (1, 7, 129, 4001)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
RMS, LAYER, CAST = "rms_norm", "layer_norm", "rms_norm_per_token_cast"
RMS_BACK, LAYER_BACK = "rms_norm_backward", "layer_norm_backward"
ORACLE_ON_GPU = os.environ.get("TILEPLUG_ORACLE", "cpu") == "gpu"

# ---------------------------------------------------------------------- the grid

SF_LAYOUTS = {
    "fp32": {},
    "fp32_col": {"use_tma_aligned_col_major_sf": True},
    "round": {"round_sf": True},
    "ue8m0": {"round_sf": True, "use_packed_ue8m0": True},
    "ue8m0_col": {"round_sf": True, "use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True},
    "e4m3_sf": {"use_e4m3_sf": True},
}


def _grid() -> list[Case]:
    cases = []
    for hidden in HIDDEN:
        for dtype in DTYPES:
            cases.append(Case.of(RMS, hidden, dtype))
            cases.append(Case.of(LAYER, hidden, dtype, inputs={"bias": {BF16: "bf16", FP16: "fp16", FP32: "fp32"}[dtype]}))
        cases.append(Case.of(CAST, hidden))
        cases.append(Case.of(RMS_BACK, hidden))
        cases.append(Case.of(RMS_BACK, hidden, FP32, inputs={"grad_residual": True}))
        cases.append(Case.of(LAYER_BACK, hidden))
        cases.append(Case.of(LAYER_BACK, hidden, FP32, inputs={"grad_residual": True}))
    for hidden in (576, 7168):
        cases += [
            Case.of(RMS, hidden, inputs={"residual": True}, return_rstd=True),
            Case.of(RMS, hidden, FP32, inputs={"residual": True}, return_rstd=True),
            Case.of(RMS, hidden, weight_offset=1.0, out_scale=0.5),
            Case.of(RMS, hidden, FP16, inputs={"weight": "none"}, out_scale=2.0),
            Case.of(RMS, hidden, inputs={"weight": "fp32", "residual": True}),
            Case.of(RMS, hidden, inputs={"row_stride_pad": 8}),  # aligned rows of a wider buffer
            Case.of(RMS, hidden, inputs={"row_stride_pad": 3, "residual": True}),  # misaligned: per-element path
            Case.of(LAYER, hidden, inputs={"residual": True, "bias": "fp32"}, return_stats=True),
            Case.of(LAYER, hidden, FP32, inputs={"residual": True, "bias": "fp32"}, return_stats=True),
            Case.of(LAYER, hidden, FP16, inputs={"weight": "none"}),
            Case.of(LAYER, hidden, inputs={"weight": "none", "bias": "bf16", "row_stride_pad": 3}),
            Case.of(CAST, hidden, FP32, inputs={"residual": True}, return_unquantized=True),
            Case.of(CAST, hidden, inputs={"residual": True, "row_stride_pad": 3}, weight_offset=1.0, out_scale=2.0),
            Case.of(CAST, hidden, fmt="e2m1", num_per_channels=16, **SF_LAYOUTS["ue8m0_col"]),
            Case.of(CAST, hidden, fmt="e2m1", num_per_channels=32, return_unquantized=True),
        ]
        for name, flags in SF_LAYOUTS.items():
            for group in (32, 128):
                cases.append(Case.of(CAST, hidden, num_per_channels=group, **flags))
    cases += [
        Case.of(RMS, 128, inputs={"heads": 8}, return_rstd=True),  # QK-norm shape
        Case.of(RMS, 128, FP32, inputs={"heads": 32, "row_stride_pad": 64}, weight_offset=1.0),
        Case.of(RMS, 576, inputs={"heads": 2, "residual": True}),
        Case.of(RMS, 7168, inputs={"heads": 1}),  # 3-D with one head (a size-1 dim's stride)
        Case.of(RMS, 100, FP16, inputs={"residual": True}, return_rstd=True),  # D no multiple of the vector
        Case.of(RMS, 7, inputs={"residual": True}),  # one thread per row
        Case.of(LAYER, 128, inputs={"heads": 8, "bias": "bf16"}, return_stats=True),
        Case.of(LAYER, 7, FP32, inputs={"bias": "fp32"}, return_stats=True),
        Case.of(LAYER, 1000, inputs={"bias": "bf16", "residual": True}, return_stats=True),
        Case.of(CAST, 128, inputs={"heads": 8}, num_per_channels=64),
        Case.of(CAST, 64, FP32, inputs={"heads": 4}, fmt="e2m1", num_per_channels=32),
        Case.of(CAST, 100, num_per_channels=32),  # a partial last group
        Case.of(CAST, 7, num_per_channels=16, use_e4m3_sf=True),
        Case.of(RMS_BACK, 576, FP16, inputs={"weight": "fp32", "grad_residual": True}),
        Case.of(RMS_BACK, 7168, inputs={"weight": "none"}),
        Case.of(RMS_BACK, 128, FP32, inputs={"heads": 8}, weight_offset=1.0, out_scale=0.5),
        Case.of(RMS_BACK, 1536, inputs={"row_stride_pad": 8}),
        Case.of(RMS_BACK, 100, inputs={"grad_residual": True}),
        Case.of(RMS_BACK, 7, FP32),
        Case.of(LAYER_BACK, 576, FP16, inputs={"weight": "fp32", "grad_residual": True}),
        Case.of(LAYER_BACK, 7168, inputs={"weight": "none"}),
        Case.of(LAYER_BACK, 128, FP32, inputs={"heads": 8}),
        Case.of(LAYER_BACK, 100, inputs={"grad_residual": True, "row_stride_pad": 3}),
    ]
    return list(dict.fromkeys(cases))


GRID = _grid()


def _outputs(result) -> list:
    return list(result) if isinstance(result, tuple) else [result]


def _arguments(case: Case, tokens: int, seed: int | None = None) -> tuple[tuple, dict]:
    """CPU arguments of ``case`` at ``tokens`` (the op table's builder)."""
    return case.arguments(tokens, "cpu", seed=seed)


def _run(op: str, backend: str, args: tuple, kwargs: dict) -> list:
    with use_backend(backend), config.host_layout("cuda"):
        return _outputs(getattr(ops, op)(*args, **kwargs))


def _reference(case: Case, args: tuple, kwargs: dict) -> list:
    if ORACLE_ON_GPU:
        return _run(case.op, "reference", moved(args, DEVICE, fresh=True), moved(kwargs, DEVICE, fresh=True))
    return _run(case.op, "reference", args, kwargs)


def _cuda(case: Case, args: tuple, kwargs: dict) -> list:
    outputs = _run(case.op, "cuda", moved(args, DEVICE, fresh=True), moved(kwargs, DEVICE, fresh=True))
    torch.cuda.synchronize()
    return outputs


def _cuda_under(variables: dict, case: Case, args: tuple, kwargs: dict, monkeypatch: pytest.MonkeyPatch) -> list:
    """:func:`_cuda` with the tuning ``variables`` set (routes prepared before are dropped: they would hide them)."""
    from tileplug.core.registry import registry

    monkeypatch.setattr(registry, "_cache", {})
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    return _cuda(case, args, kwargs)


def _spec(op: str, args: tuple, kwargs: dict, required: bool = True):
    """The CUDA specialisation serving ``op(*args, **kwargs)`` (None where declined and not ``required``)."""
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core.lowering import describe_call

    with config.host_layout("cuda"):
        call, _ = describe_call(getattr(ops, op), *args, **kwargs)
    kernel = _KERNELS[call.op]
    reason = kernel.supports(call)
    assert reason is None or not required, f"{op}: the CUDA kernel declines {call}: {reason}"
    return kernel.spec(call) if reason is None else None


def _case_spec(case: Case):
    return _spec(case.op, *_arguments(case, 3))


def _case_specs(case: Case) -> list:
    """Every specialisation ``case`` runs (a backward's split path and column sums too)."""
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core.opdefs import describe_call

    if not case.op.endswith("_backward"):
        return [_case_spec(case)]
    args, kwargs = _arguments(case, 3)
    with config.host_layout("cuda"):
        call, _ = describe_call(case.op, *args, **kwargs)
    return _KERNELS[call.op].specs(call)


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Compile every specialisation of the module up front, in parallel processes
    (``TILEPLUG_GPU_PRECOMPILE=0``: each kernel on its first call instead, for a run of a few tests)."""
    from tileplug.backend_cuda import jit

    if os.environ.get("TILEPLUG_GPU_PRECOMPILE") == "0":
        return

    cases = GRID + INVARIANCE + IN_PLACE + NONFINITE + [Case.of(LAYER, 7168)] + [case for case, _ in SPLIT]
    specs = [spec for case in dict.fromkeys(cases) for spec in _case_specs(case)]
    specs += [spec for case, form in TREE_FORM_CASES for spec in _form_specs(case, TREE_FORMS[form][0])]
    for hidden, dtype, group, layout in FUSION:
        x = torch.empty(3, hidden, dtype=dtype)
        weight = torch.empty(hidden, dtype=dtype)
        flags = {"num_per_channels": group, **SF_LAYOUTS[layout]}
        for fmt in FORMATS:
            specs.append(_spec(CAST, (x, weight), {"fmt": fmt, "residual": x, "weight_offset": 1.0,
                                                   "return_unquantized": True, **flags}))
            specs.append(_spec("per_token_cast", (x,), {"fmt": fmt, **flags}, required=False))
        specs.append(_spec(RMS, (x, weight), {"residual": x, "weight_offset": 1.0}))
    from tileplug.backend_cuda.norm.backward import ColumnSumSpec

    specs += [ColumnSumSpec(), ColumnSumSpec(segment=True)]
    jit.precompile([spec for spec in specs if spec is not None])


# ---------------------------------------------------------------------- vs the reference


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("case", GRID, ids=[case.id for case in GRID])
def test_matches_reference(case: Case, tokens: int) -> None:
    args, kwargs = _arguments(case, tokens)
    expected = _reference(case, args, kwargs)
    actual = _cuda(case, args, kwargs)
    opdefs.get(case.op).compare(case, tokens, [moved(a, "cpu") for a in actual],
                                [moved(e, "cpu") for e in expected])
    _assert_same_bytes(case, tokens, actual, expected, "vs the reference")


def _assert_same_bytes(case: Case, tokens: int, actual: list, expected: list, what: str) -> None:
    kwargs = dict(case.kwargs)
    for index, (have, want) in enumerate(zip(actual, expected)):
        label = f"{case.id} T={tokens} output {index} ({what})"
        if case.op.endswith("_backward") and index >= 1:
            continue  # grad_weight: another (fixed) order of the sum over rows, compared within SPEC's 1e-5
        if have is None or want is None:
            assert have is None and want is None, label
            continue
        if case.op == CAST and index == 1:  # sf: the bytes that hold groups
            width = case.hidden * dict(case.inputs).get("heads", 1)
            # moved(), not .cpu(): .cpu() makes a padded column-major sf dense (stride (1, T), not (1, align(T, 4)))
            assert_sf_equal(moved(have, "cpu"), moved(want, "cpu"), (1, kwargs.get("num_per_channels", 128)), tokens,
                            width, what=label, nan_equal=True)
        else:
            assert_bytes_equal(have.cpu(), want.cpu(), what=label, nan_equal=True)


LONG_BACKWARD = [  # (case, tokens): thousands of row kernel CTAs, the last one partly past the last row
    (Case.of(RMS_BACK, 1536), 20011),
    (Case.of(LAYER_BACK, 576, inputs={"grad_residual": True}), 66001),  # 16501 tiles: > 8 segments at a block of 32
    (Case.of(RMS_BACK, 128, inputs={"heads": 4}), 33001),
]


@pytest.mark.parametrize("case,tokens", LONG_BACKWARD, ids=[case.id for case, _ in LONG_BACKWARD])
def test_backward_of_a_long_batch(case: Case, tokens: int) -> None:
    """A long batch (more partial rows than one segment of the column sum holds many times over,
    the last CTA's block partly past the last row) matches the reference: grad_x bytewise,
    grad_weight / grad_bias within SPEC's 1e-5, and the same bytes on a second run."""
    from tileplug.backend_cuda.norm.backward import SEGMENT_ROWS
    from tileplug.backend_cuda.norm.spec import BACKWARD_ROW_BLOCK, row_tile

    tiles = -(-tokens * dict(case.inputs).get("heads", 1) // row_tile(case.hidden, case.dtype).rows)
    assert tiles % BACKWARD_ROW_BLOCK and tiles // BACKWARD_ROW_BLOCK > 8 * SEGMENT_ROWS, tiles
    args, kwargs = _arguments(case, tokens, seed=11)
    expected = _reference(case, args, kwargs)
    actual = _cuda(case, args, kwargs)
    opdefs.get(case.op).compare(case, tokens, [moved(a, "cpu") for a in actual],
                                [moved(e, "cpu") for e in expected])
    _assert_same_bytes(case, tokens, actual, expected, "vs the reference")
    for index, (first, second) in enumerate(zip(actual, _cuda(case, args, kwargs))):
        if first is not None:
            assert_bytes_equal(first.cpu(), second.cpu(), what=f"{case.id} run-to-run output {index}")


SPLIT = [  # (case, token counts): the split and half paths of a short batch against the fused row kernel
    (Case.of(RMS_BACK, 7168, inputs={"grad_residual": True}), (2, 17, 129, 1008, 1500)),
    (Case.of(RMS_BACK, 128, inputs={"heads": 4}), (3, 77, 500)),  # 8 rows a tile, 3-D
    (Case.of(LAYER_BACK, 576, inputs={"grad_residual": True}), (2, 9, 333)),  # 4 rows a tile
    (Case.of(LAYER_BACK, 5120), (5, 130)),
    (Case.of(RMS_BACK, 2048, FP32), (40,)),
    (Case.of(RMS_BACK, 7168, inputs={"weight": "none"}), (3, 100)),  # grad_x only: no sums
]


@pytest.mark.parametrize("case,counts", SPLIT, ids=[case.id for case, _ in SPLIT])
def test_split_path_gives_the_fused_bytes(case: Case, counts: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short batch's split path (one row tile a CTA, then the block sums), its half path (a block
    over two CTAs, the second writing its rows' terms; where there are more than half a block of row
    tiles) and the fused row kernel give the same bytes, grad_weight and grad_bias included, on inputs
    with zeros in x (−0 / +0 terms), an inf and a NaN in grad_y; each path launches its own row kernel
    and no other path's (the profiler's kernel names)."""
    from tileplug.backend_cuda.plugin import _KERNELS
    from tileplug.core import CUDA_LAYOUT
    from tileplug.core.opdefs import describe_call

    monkeypatch.setenv("TILEPLUG_CUDA_NORM_BACKWARD_HALF_PATH", "1")  # (an opt-in)
    for tokens in counts:
        args, kwargs = _arguments(case, tokens, seed=17)
        args, kwargs = list(moved(args, DEVICE, fresh=True)), moved(kwargs, DEVICE, fresh=True)
        grad_y, x = args[0], args[1]
        x[..., 0] = 0.0
        grad_y.view(grad_y.shape[0], -1)[0, 3] = float("inf")
        grad_y.view(grad_y.shape[0], -1)[-1, 5] = float("nan")
        with config.host_layout("cuda"):
            call, inputs = describe_call(case.op, *args, **kwargs)
        kernel = _KERNELS[call.op].kernel()
        spec = kernel.spec(call)
        tiles = -(-x.numel() // (case.hidden * spec.tile.rows))
        half_grid = -(-tiles // (spec.row_block // 2))  # split_below at this grid runs the half path
        # never split; split whenever there is more than one row tile; the half path where it differs from the fused
        # (which path a split_below picks: tests/test_cuda_norm_host.py)
        paths = {"fused": 0, "split": 1 << 30}
        if half_grid > -(-tiles // spec.row_block):
            paths["half"] = half_grid
        runs = {}
        row_kernels = {"fused": spec, "split": kernel.split_spec(call), "half": kernel.half_spec(call)}
        names = {row.name for row in row_kernels.values() if row is not None}
        for path, split_below in paths.items():
            outputs = call.allocation_plan(CUDA_LAYOUT).allocate(call.tokens, DEVICE)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
                kernel.prepare(call, split_below=split_below)(inputs, outputs)
                torch.cuda.synchronize()
            launched = {event.name.removesuffix("_kernel") for event in profile.events()
                        if event.device_type == torch.autograd.DeviceType.CUDA}
            expected = spec if tiles <= 1 else row_kernels[path]  # one row tile: the fused kernel on every path
            assert {expected.name} == launched & names, f"{case.id} T={tokens}: the {path} path launched {sorted(launched)}"
            runs[path] = outputs
        for path, outputs in runs.items():
            for name in outputs._fields:
                fused, other = getattr(runs["fused"], name), getattr(outputs, name)
                if fused is not None:
                    assert_bytes_equal(other.cpu(), fused.cpu(), what=f"{case.id} T={tokens} {name} ({path} / fused)",
                                       nan_equal=True)


SUBTREES = "TILEPLUG_CUDA_NORM_BACKWARD_SUBTREES"
PAIRED_SUMS = "TILEPLUG_CUDA_NORM_BACKWARD_PAIRED_SUMS"
SUBTREE_CASES = [  # the backward row kernels' other tree forms against the level-per-barrier one
    Case.of(RMS_BACK, 7168, inputs={"grad_residual": True}),
    Case.of(RMS_BACK, 7168, FP32),
    Case.of(RMS_BACK, 4096, inputs={"weight": "none"}),
    Case.of(RMS_BACK, 2048, FP16, weight_offset=1.0, out_scale=0.5),
    Case.of(RMS_BACK, 576, inputs={"heads": 2}),
    Case.of(LAYER_BACK, 7168),
    Case.of(LAYER_BACK, 5120, FP32, inputs={"grad_residual": True}),
    Case.of(LAYER_BACK, 1536, inputs={"row_stride_pad": 8}),
]
SUBTREE_TOKENS = (1, 7, 129, 1500, 4001)  # one row, split paths, fused grids with a partial last block
LEVELS = {SUBTREES: "0", PAIRED_SUMS: "0"}  # one tree level per barrier, one sum after the other
TREE_FORMS = {  # id: (the variables that select the form, the spec field that marks its kernels)
    "subtrees": ({SUBTREES: "1", PAIRED_SUMS: "0"}, "subtrees"),
    "paired": ({SUBTREES: "0", PAIRED_SUMS: "1"}, "paired_sums"),
    "paired_subtrees": ({SUBTREES: "1", PAIRED_SUMS: "1"}, "paired_sums"),  # the defaults
}
PAIRED_CASES = [case for case in SUBTREE_CASES if case.op == LAYER_BACK] + [
    Case.of(LAYER_BACK, 64, inputs={"weight": "none"}),  # one shuffle tree a row: the sums paired in registers
]
TREE_FORM_CASES = [(case, "subtrees") for case in SUBTREE_CASES] + [
    (case, form) for case in PAIRED_CASES for form in ("paired", "paired_subtrees")]


def _form_specs(case: Case, variables: dict) -> list:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in variables.items():
            patch.setenv(name, value)
        return _case_specs(case)


@pytest.mark.parametrize("case,form", TREE_FORM_CASES, ids=[f"{case.id}-{form}" for case, form in TREE_FORM_CASES])
def test_backward_tree_forms_give_the_levels_bytes(case: Case, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward row kernels' ways of adding a row — the warp-subtree form
    (``TILEPLUG_CUDA_NORM_BACKWARD_SUBTREES=1``, ``_st``), ``layer_norm_backward``'s two sums paired in one pass
    (``TILEPLUG_CUDA_NORM_BACKWARD_PAIRED_SUMS=1``, ``_ps``), and both (the defaults) — give the bytes of the
    level-per-barrier tree with the sums one after the other
    (grad_x, grad_weight, grad_bias), split and fused paths, on inputs with zeros in x, an inf and a NaN in grad_y;
    and the form's kernels ran."""
    from tileplug.backend_cuda import jit

    variables, field = TREE_FORMS[form]
    for tokens in SUBTREE_TOKENS:
        args, kwargs = _arguments(case, tokens, seed=31)
        grad_y, x = args[0], args[1]
        x[..., 0] = 0.0
        grad_y[(0,) * (grad_y.dim() - 1) + (3,)] = float("inf")  # (row strides may be padded: no view)
        grad_y[(-1,) * (grad_y.dim() - 1) + (5,)] = float("nan")
        runs = [_cuda_under(setting, case, args, kwargs, monkeypatch) for setting in (LEVELS, variables)]
        ran = {spec.name for spec, _ in jit._entries if getattr(spec, field, False)}
        assert any(spec.name in ran for spec in _form_specs(case, variables) if getattr(spec, field, False)), case.id
        for index, (levels, other) in enumerate(zip(*runs)):
            if levels is not None:
                assert_bytes_equal(other.cpu(), levels.cpu(), what=f"{case.id} T={tokens} output {index} ({form})",
                                   nan_equal=True)


CHUNKS = "TILEPLUG_CUDA_NORM_CHUNKS"
TILE_CASES = [  # D = 7168 on 4 warps of 7 vectors a lane and 14 warps of 2 (TILEPLUG_CUDA_NORM_CHUNKS) against the default
    Case.of(CAST, 7168, num_per_channels=32),
    Case.of(CAST, 7168, inputs={"residual": True}, fmt="e2m1", num_per_channels=16, return_unquantized=True),
    Case.of(RMS, 7168, inputs={"residual": True}, return_rstd=True),
    Case.of(LAYER, 7168, inputs={"bias": "bf16"}),
    Case.of(RMS_BACK, 7168),
    Case.of(LAYER_BACK, 7168),
]
TILE_CHUNKS = {"7": "_l128r1c7", "2": "_l448r1c2"}  # chunks → the tile in the kernel's name


@pytest.mark.parametrize("case", TILE_CASES, ids=[case.id for case in TILE_CASES])
def test_wider_lanes_give_the_default_tiles_bytes(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long row on fewer lanes of more vectors (``TILEPLUG_CUDA_NORM_CHUNKS=7``: 128 threads × 7 vectors at
    D = 7168) or on more lanes of fewer (``=2``: 448 threads × 2) gives the default tile's bytes — the row's
    additions keep the reference's order on any tile, and a backward's partial rows add each column's rows in
    row order on any one-row tile — and the other tile's kernel ran."""
    from tileplug.backend_cuda import jit

    for tokens in (1, 129, 4001):
        args, kwargs = _arguments(case, tokens, seed=43)
        default = _cuda_under({CHUNKS: "4"}, case, args, kwargs, monkeypatch)
        for chunks, tile in TILE_CHUNKS.items():
            other = _cuda_under({CHUNKS: chunks}, case, args, kwargs, monkeypatch)
            assert any(tile in spec.name for spec, _ in jit._entries), (case.id, chunks)
            for index, (expected, got) in enumerate(zip(default, other)):
                if expected is not None:
                    assert_bytes_equal(got.cpu(), expected.cpu(),
                                       what=f"{case.id} T={tokens} output {index} ({chunks} chunks)", nan_equal=True)


@pytest.mark.parametrize("hidden", [7, 300, 7168])
def test_column_sums_add_each_column_in_row_order(hidden: int) -> None:
    """The backwards' column sums (``backward.column_sum_launcher``: segments of ``SEGMENT_ROWS`` partial
    rows, then the segment sums, each column's values added one after the other in fp32) give the bytes of
    numpy's sequential fp32 running sum in the same two stages, for partial counts around the segment size;
    values of mixed magnitudes (the order shows in the low bits), zeros of both signs."""
    import numpy as np

    from tileplug.backend_cuda import jit
    from tileplug.backend_cuda.norm.backward import SEGMENT_ROWS, column_sum_launcher

    add = column_sum_launcher(jit.entry)
    generator = torch.Generator().manual_seed(hidden)
    for rows in (1, 2, 33, 64, 65, 127, 256, 4097):
        partials = torch.randn(rows, hidden, generator=generator) * torch.exp2(torch.randint(-12, 13, (rows, hidden),
                                                                                              generator=generator))
        partials[rows // 2, : hidden // 2] = 0.0
        partials[-1, hidden // 2:] = -0.0
        total = torch.empty(hidden, device=DEVICE)
        add(partials.to(DEVICE), total)
        values = partials.numpy()
        segments = np.stack([np.cumsum(values[first:first + SEGMENT_ROWS], axis=0, dtype=np.float32)[-1]
                             for first in range(0, rows, SEGMENT_ROWS)])
        expected = segments[0] if len(segments) == 1 else np.cumsum(segments, axis=0, dtype=np.float32)[-1]
        assert_bytes_equal(total.cpu(), torch.from_numpy(expected), what=f"column sums of {rows} x {hidden}")


# ---------------------------------------------------------------------- batch invariance

INVARIANCE = [
    Case.of(RMS, 576, inputs={"residual": True}, return_rstd=True),
    Case.of(RMS, 7168),
    Case.of(RMS, 16384, FP32, inputs={"residual": True}),
    Case.of(RMS, 128, inputs={"heads": 8}),
    Case.of(LAYER, 2048, inputs={"bias": "bf16"}, return_stats=True),
    Case.of(LAYER, 5120, FP32, inputs={"bias": "fp32", "residual": True}),
    Case.of(CAST, 7168, num_per_channels=32, **SF_LAYOUTS["ue8m0_col"]),
    Case.of(CAST, 576, FP32, return_unquantized=True),
    Case.of(RMS_BACK, 7168, inputs={"grad_residual": True}),
    Case.of(RMS_BACK, 576, FP32),
    Case.of(LAYER_BACK, 5120, inputs={"grad_residual": True}),
]


def _rows(output: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return output[start:start + count]


@pytest.mark.parametrize("case", INVARIANCE, ids=[case.id for case in INVARIANCE])
def test_batch_invariance_and_determinism(case: Case) -> None:
    """A row's output bytes do not depend on the batch it is in or on its position."""
    args, kwargs = _arguments(case, BATCH, seed=7)
    full = _cuda(case, args, kwargs)
    again = _cuda(case, args, kwargs)
    for index, (first, second) in enumerate(zip(full, again)):
        if first is not None:
            assert_bytes_equal(first.cpu(), second.cpu(), what=f"{case.id} run-to-run output {index}")
    for tokens in (1, 7, BATCH):
        for position in (0, (BATCH - tokens) // 2, BATCH - tokens):
            sliced_args = tuple(_slice(a, position, tokens) for a in args)
            sliced_kwargs = {k: _slice(v, position, tokens) for k, v in kwargs.items()}
            part = _cuda(case, sliced_args, sliced_kwargs)
            for index, (whole, piece) in enumerate(zip(full, part)):
                if whole is None or (case.op == CAST and index == 1) or (case.op.endswith("_backward") and index >= 1):
                    continue  # scale rows: test_cast_scales_are_batch_invariant; grad_weight sums all rows
                assert_bytes_equal(piece.cpu(), _rows(whole, position, tokens).cpu(),
                                   what=f"{case.id} rows [{position}, {position + tokens}) output {index}")


BATCH = 4001


def _slice(value, start: int, count: int):
    """Rows ``[start, start + count)`` of a ``[T, ...]`` input (T = BATCH: rows, statistics); the
    ``[D]`` vectors and scalars as they are."""
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == BATCH:
        return value[start:start + count]
    return value


def test_cast_scales_are_batch_invariant() -> None:
    """The fused cast's scale rows: a row's group scales alone equal its scales in a batch."""
    case = Case.of(CAST, 7168, num_per_channels=128)
    args, kwargs = _arguments(case, 4001, seed=3)
    _, full_sf = _cuda(case, args, kwargs)[:2]
    for position in (0, 2000, 4000):
        _, sf = _cuda(case, tuple(_slice(a, position, 1) for a in args), kwargs)[:2]
        assert_bytes_equal(sf.cpu(), full_sf[position:position + 1].cpu(), what=f"sf of row {position}")


# ---------------------------------------------------------------------- fusion

FUSION = [(7168, BF16, 32, name) for name in SF_LAYOUTS] + [
    (576, BF16, 128, "fp32"), (1536, FP32, 64, "ue8m0_col"), (100, BF16, 16, "round"), (4096, BF16, 128, "e4m3_sf"),
    (16384, BF16, 128, "ue8m0"),
]
FORMATS = ("e4m3", "e2m1")


@pytest.mark.parametrize("hidden,dtype,group,layout", FUSION, ids=[f"{h}-{d}-g{g}-{n}" for h, d, g, n in FUSION])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_equals_unfused(hidden: int, dtype: torch.dtype, group: int, layout: str, fmt: str) -> None:
    """``rms_norm_per_token_cast`` ≡ ``per_token_cast(rms_norm(...))`` on the CUDA backend, bytewise."""
    tokens = 129
    generator = torch.Generator().manual_seed(hidden + group)
    x = (torch.randn(tokens, hidden, generator=generator) * 3).to(dtype).to(DEVICE)
    residual = torch.randn(tokens, hidden, generator=generator).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(dtype).to(DEVICE)
    flags = dict(SF_LAYOUTS[layout])
    with use_backend("cuda", "reference"):  # the CUDA cast declines H % 16: the chain falls where it must
        q, sf, residual_out, y = ops.rms_norm_per_token_cast(x, weight, fmt=fmt, num_per_channels=group,
                                                             residual=residual, weight_offset=1.0,
                                                             return_unquantized=True, **flags)
        y_chain, residual_chain = ops.rms_norm(x, weight, residual=residual, weight_offset=1.0)
        q_chain, sf_chain = ops.per_token_cast(y_chain, fmt=fmt, num_per_channels=group, **flags)
    torch.cuda.synchronize()
    assert_bytes_equal(y.cpu(), y_chain.cpu(), what="y")
    assert_bytes_equal(residual_out.cpu(), residual_chain.cpu(), what="residual_out")
    assert_bytes_equal(q.cpu(), q_chain.cpu(), what="q", strides=True)
    assert_sf_equal(moved(sf, "cpu"), moved(sf_chain, "cpu"), (1, group), tokens, hidden)  # strides kept


# ---------------------------------------------------------------------- in place


IN_PLACE = [Case.of(RMS, 7168, inputs={"residual": True}), Case.of(RMS, 576, FP16, inputs={"residual": True}),
            Case.of(RMS, 64, FP32, inputs={"residual": True}), Case.of(LAYER, 4096, inputs={"residual": True}),
            Case.of(LAYER, 576, FP32, inputs={"residual": True}), Case.of(CAST, 7168, inputs={"residual": True})]


@pytest.mark.parametrize("op,hidden,dtype", [(case.op, case.hidden, case.dtype) for case in IN_PLACE[:-1]])
def test_in_place(op: str, hidden: int, dtype: torch.dtype) -> None:
    """``out=x, residual_out=residual`` (the serving engines' form) gives the out-of-place bytes."""
    tokens = 4001
    generator = torch.Generator().manual_seed(hidden)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype).to(DEVICE)
    residual = torch.randn(tokens, hidden, generator=generator).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(dtype).to(DEVICE)
    with use_backend("cuda"):
        y, residual_out = getattr(ops, op)(x, weight, residual=residual)
        x_in, residual_in = x.clone(), residual.clone()
        getattr(ops, op)(x_in, weight, residual=residual_in, out=x_in, residual_out=residual_in)
    torch.cuda.synchronize()
    assert_bytes_equal(x_in.cpu(), y.cpu(), what="y in place")
    assert_bytes_equal(residual_in.cpu(), residual_out.cpu(), what="residual_out in place")


def test_fused_cast_in_place_residual() -> None:
    tokens, hidden = 129, 7168
    x = torch.randn(tokens, hidden, device=DEVICE).to(BF16)
    residual = torch.randn(tokens, hidden, device=DEVICE).to(BF16)
    weight = torch.ones(hidden, dtype=BF16, device=DEVICE)
    with use_backend("cuda"):
        q, sf, residual_out = ops.rms_norm_per_token_cast(x, weight, residual=residual)
        residual_in = residual.clone()
        q2, sf2, _ = ops.rms_norm_per_token_cast(x, weight, residual=residual_in, residual_out=residual_in)
    assert_bytes_equal(residual_in.cpu(), residual_out.cpu(), what="residual_out in place")
    assert_bytes_equal(q2.cpu(), q.cpu(), what="q")
    assert_bytes_equal(sf2.cpu(), sf.cpu(), what="sf")


# ---------------------------------------------------------------------- non-finite inputs


NONFINITE = [Case.of(RMS, 7168), Case.of(RMS, 64, FP32), Case.of(LAYER, 576), Case.of(CAST, 7168),
             Case.of(CAST, 576, FP32)]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("op,hidden,dtype", [(case.op, case.hidden, case.dtype) for case in NONFINITE])
def test_nonfinite_input_stays_in_its_row(op: str, hidden: int, dtype: torch.dtype, value: float) -> None:
    """One bad element in row 5: other rows keep their bytes; row 5 is visibly damaged."""
    tokens = 129
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(dtype)
    bad = x.clone()
    bad[5, hidden // 3] = value
    with use_backend("cuda"):
        clean = _outputs(getattr(ops, op)(x.to(DEVICE), weight.to(DEVICE)))
        damaged = _outputs(getattr(ops, op)(bad.to(DEVICE), weight.to(DEVICE)))
    keep = torch.ones(tokens, dtype=torch.bool)
    keep[5] = False
    assert_bytes_equal(damaged[0].cpu()[keep], clean[0].cpu()[keep], what="other rows")
    row = damaged[0].cpu()[5]
    if op == CAST:
        assert_bytes_equal(damaged[1].cpu()[keep], clean[1].cpu()[keep], what="other rows' sf")
        assert not torch.isfinite(damaged[1].cpu()[5].float()).all(), "the row's scales show the damage"
    else:
        assert not torch.isfinite(row.float()).all(), "the row's output shows the damage"
        if value != value:  # NaN: the whole row (its rstd is NaN)
            assert torch.isnan(row.float()).all()
    expected = _run(op, "reference", (bad, weight), {})
    _assert_same_bytes(Case.of(op, hidden, dtype), tokens, [moved(d, "cpu") for d in damaged], expected, "non-finite")


SPECIAL_WEIGHTS = [(RMS, BF16), (RMS, FP16), (CAST, BF16), (RMS, FP32)]


@pytest.mark.parametrize("op,dtype", SPECIAL_WEIGHTS, ids=[f"{op}-{str(dtype)[6:]}" for op, dtype in SPECIAL_WEIGHTS])
def test_weight_zeros_and_subnormals(op: str, dtype: torch.dtype) -> None:
    """A weight of ``-0``, ``+0``, subnormals of both signs and a NaN among ordinary values, at offset 0
    (a 16-bit weight's ``+ 0`` is taken on its packed words, ``rows.plus_zero``): the reference's bytes,
    so ``-0`` becomes ``+0`` before the product (the sign of a zero output follows ``s``) and no
    subnormal is flushed."""
    hidden, tokens = 576, 33
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(dtype)
    tiny = torch.finfo(dtype).smallest_normal
    special = torch.tensor([-0.0, 0.0, tiny / 4, -tiny / 4, tiny / 128, -tiny]).to(dtype)
    for start in (0, 9, 64, 301):  # in several lanes and both halves of a packed word
        weight[start:start + len(special)] = special
    weight[300] = float("nan")  # (past the first cast group, whose zeros' signs are checked below)
    assert weight[0] == 0 and torch.signbit(weight[0]), "the weight holds a -0"
    expected = _run(op, "reference", (x, weight), {})
    actual = [moved(value, "cpu") for value in _run(op, "cuda", moved((x, weight), DEVICE), {})]
    _assert_same_bytes(Case.of(op, hidden, dtype), tokens, actual, expected, "special weights")
    signs = torch.signbit(actual[0].float()[:, 0]) == torch.signbit(x.float()[:, 0])
    assert signs.all(), "a zero output at a -0 weight takes the sign of s (the weight's + 0 made it +0)"


# ---------------------------------------------------------------------- host-side forms


def test_single_row_with_an_odd_row_stride() -> None:
    """T = 1 from a buffer whose row stride is no multiple of the vector (the contract's
    alignment ignores a size-1 dim's stride; the launcher gives the kernel's check one)."""
    buffer = torch.randn(4, 7171, dtype=BF16)
    x = buffer[:1, :7168]
    weight = torch.randn(7168, dtype=BF16)
    expected = _run(RMS, "reference", (x, weight), {})
    actual = _run(RMS, "cuda", moved((x, weight), DEVICE), {})
    assert_bytes_equal(actual[0].cpu(), expected[0], what="y")


def test_misaligned_weight_pointer() -> None:
    """A weight view 2 bytes past a 16-byte boundary is copied by the launcher, not misread."""
    weight_buffer = torch.randn(7169, dtype=BF16, device=DEVICE)
    weight = weight_buffer[1:]
    x = torch.randn(3, 7168, dtype=BF16, device=DEVICE)
    actual = _run(RMS, "cuda", (x, weight), {})
    expected = _run(RMS, "cuda", (x, weight.clone()), {})
    assert_bytes_equal(actual[0].cpu(), expected[0].cpu(), what="y")
    for op in (LAYER, CAST):
        got = _run(op, "cuda", (x, weight), {})
        want = _run(op, "cuda", (x, weight.clone()), {})
        assert_bytes_equal(got[0].cpu(), want[0].cpu(), what=op)


def test_past_two_to_the_31_elements() -> None:
    """T · D > 2^31 (offsets are 64-bit): the last rows equal the reference's."""
    tokens, hidden = 2 ** 31 // 16384 + 3, 16384
    x = torch.empty(tokens, hidden, dtype=BF16, device=DEVICE)
    x[:-3].fill_(0.5)
    tail = torch.randn(3, hidden, dtype=BF16)
    x[-3:] = tail.to(DEVICE)
    weight = torch.ones(hidden, dtype=BF16, device=DEVICE)
    with use_backend("cuda"):
        y = ops.rms_norm(x, weight)
    expected = _run(RMS, "reference", (tail, weight.cpu()), {})[0]
    assert_bytes_equal(y[-3:].cpu(), expected, what="last rows")
    del x, y
    torch.cuda.empty_cache()
