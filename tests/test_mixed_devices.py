"""Tensors of one call on different devices: every op of the op table, every tensor argument of
its test grid (each op's cases, deduplicated by argument) moved alone to another device than
the rest → ContractError before any backend runs, naming the moved argument, or naming the
argument that disagrees with it and saying the moved one's device is what it expected. On the
CPU the two devices are ``cpu`` and ``meta``; a GPU host mixes ``cuda:0`` and ``cuda:1`` the
same way (tests/gpu/test_cuda_multigpu.py)."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from tileplug.core import opdefs
from tileplug.core.errors import ContractError
from tileplug.core.generator import Generator


def _tensor_count(value) -> int:
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, (tuple, list)):
        return sum(_tensor_count(item) for item in value)
    return 2 if isinstance(value, Generator) else 0  # its seed and offset tensors


def _to_meta(value, part: int | None = None):
    """``value`` on meta; ``part``: only that element of a tuple / list of tensors."""
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(item) if part in (None, index) else item for index, item in enumerate(value))
    if isinstance(value, Generator):
        return Generator.over(value.seed_state.to("meta"), value.offset_state.to("meta"))
    return value


def _moves() -> list[tuple[str, str, int | None, object]]:
    """(op, argument, part, case) for the first case of each op that passes that argument a
    tensor alongside other tensors; ``part``: the last tensor of a tuple / list argument (the
    sf of an ``(xq, sf)`` pair, the last weight of a list), moved without the rest."""
    moves, seen = [], set()
    for opdef in opdefs.all_ops():
        names = list(inspect.signature(opdef.function).parameters)
        for case in opdef.cases():
            args, kwargs = case.arguments(5, "cpu")
            bound = dict(zip(names, args), **kwargs)
            total = sum(_tensor_count(value) for value in bound.values())
            for name, value in bound.items():
                count = _tensor_count(value)
                parts = [None] if count < total else []
                if isinstance(value, (tuple, list)) and count > 1 and isinstance(value[-1], torch.Tensor):
                    parts.append(len(value) - 1)
                for part in parts:
                    if count and (opdef.name, name, part) not in seen:
                        seen.add((opdef.name, name, part))
                        moves.append((opdef.name, name, part, case))
    return moves


MOVES = _moves()


def _all_arguments(case) -> list:
    args, kwargs = case.arguments(5, "cpu")
    return [*args, *kwargs.values()]


def test_the_grid_moves_every_tensor_argument_of_the_table() -> None:
    moved_ops = {op for op, _, _, _ in MOVES}
    with_several_tensors = {opdef.name for opdef in opdefs.all_ops()
                            if any(_tensor_count(_all_arguments(case)) > 1 for case in opdef.cases())}
    assert len(with_several_tensors) >= 25 and moved_ops == with_several_tensors, with_several_tensors ^ moved_ops
    for op, argument in [("rms_norm", "residual"), ("apply_rotary", "key"), ("moe_topk_gate", "mask"),
                         ("swiglu", "expert_ends"), ("per_token_cast_with_precomputed_sf", "sf"),
                         ("rms_norm_rope_per_token_cast", "cos_sin_cache"), ("moe_unpermute", "topk_weights")]:
        assert (op, argument) in {(o, a) for o, a, _, _ in MOVES}, (op, argument)


@pytest.mark.parametrize(("op", "argument", "part", "case"), MOVES,
                         ids=[f"{op}-{argument}" + ("" if part is None else f"[{part}]") for op, argument, part, _ in MOVES])
def test_a_tensor_on_another_device_is_a_contract_error_naming_it(op: str, argument: str, part, case) -> None:
    opdef = opdefs.get(op)
    names = list(inspect.signature(opdef.function).parameters)
    args, kwargs = case.arguments(5, "cpu")
    bound = dict(zip(names, args), **kwargs)
    bound[argument] = _to_meta(bound[argument], part)
    with pytest.raises(ContractError) as raised:
        opdef.function(**bound)
    error = raised.value
    named = error.argument == argument or re.search(rf"\b{re.escape(argument)}\b", error.expected)
    assert named, str(error)
    assert "meta" in str(error) and "cpu" in str(error), str(error)
