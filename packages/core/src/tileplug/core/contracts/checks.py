"""Small argument checks shared by every contract; each raises ContractError naming the argument."""

from __future__ import annotations

from typing import Any

import torch

from tileplug.core.errors import ContractError


def describe(value: Any) -> str:
    """Short text for an offending value in an error message."""
    if isinstance(value, torch.Tensor):
        return (
            f"tensor(shape={tuple(value.shape)}, dtype={value.dtype}, "
            f"stride={tuple(value.stride())}, device={value.device})"
        )
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_bool(op: str, name: str, value: Any) -> bool:
    if value is True or value is False:
        return value
    raise ContractError(op, name, "a bool", describe(value))


def check_choice(op: str, name: str, value: Any, choices: dict | tuple) -> Any:
    if isinstance(value, str) or type(value) is int:
        if value in choices:
            return value
    options = ", ".join(repr(c) for c in choices)
    raise ContractError(op, name, f"one of {options}", describe(value))


def check_tensor(op: str, name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ContractError(op, name, "a torch.Tensor", describe(value))
    return value


def check_matrix(op: str, name: str, value: Any, dtypes: tuple[torch.dtype, ...], what: str) -> torch.Tensor:
    """A 2-D tensor of one of ``dtypes`` with unit stride on its last dim."""
    tensor = check_tensor(op, name, value)
    if tensor.dim() != 2:
        raise ContractError(op, name, f"a 2-D {what} tensor", describe(tensor))
    if tensor.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ContractError(op, name, f"dtype in ({names})", describe(tensor))
    if tensor.stride(1) != 1 and tensor.shape[1] > 1:
        raise ContractError(op, name, "unit stride on the last dim", describe(tensor))
    return tensor


def check_block(op: str, name: str, value: Any, rows: tuple[int, ...], cols: tuple[int, ...]) -> tuple[int, int]:
    """A group shape ``(bm, bn)`` with ``bm`` in ``rows`` and ``bn`` in ``cols``."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        bm, bn = value
        if type(bm) is int and type(bn) is int and bm in rows and bn in cols and (bm, bn) != (1, 1):
            return bm, bn
    raise ContractError(op, name, f"a pair (bm, bn) with bm in {rows} and bn in {cols}", describe(value))


def check_same_device(op: str, name: str, tensor: torch.Tensor, device: torch.device, of: str = "x") -> None:
    """``tensor`` on ``device``, the device of the argument ``of`` (every tensor of a call on one
    device: a kernel launches on that device, and mixing devices would read another GPU's memory)."""
    if tensor.device != device:
        raise ContractError(op, name, f"a tensor on {device}, the device of {of}", describe(tensor))
