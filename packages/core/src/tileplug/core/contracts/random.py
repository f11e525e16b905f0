"""Contracts of the random-number ops (SPEC §9): ``fill_rand`` / ``fill_randn`` write one
draw of a Philox4x32-10 generator into a tensor and advance the generator's offset.

A generator's state is two int64 ``[1]`` device tensors: ``seed`` (the key, read) and
``offset`` (the counter's high half, read and advanced by one per non-empty draw); both hold
64-bit values in two's complement. Every failure is a ContractError naming the argument.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from tileplug.core.call import Call, Ledger, call_type, share_memory
from tileplug.core.contracts.checks import describe
from tileplug.core.errors import ContractError
from tileplug.core.quant.layouts import LayoutTraits

FILL_RAND = "fill_rand"
FILL_RANDN = "fill_randn"
VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What a draw may be written as: fp32, or fp32 rounded once to bf16 / fp16."""
VALUE_DTYPE_NAMES = "float32, bfloat16 or float16"
STATE_BYTES = 8
"""One int64 word: the seed, or the offset."""
NORMAL_FLOPS_PER_ELEMENT = 6
"""Per element of a normal draw: half of (log, ·−2, sqrt, cos and sin, two products)."""


class RandomInputs(NamedTuple):
    """What a ``fill_rand`` / ``fill_randn`` kernel reads and writes: ``values`` (written in
    place, contiguous, any shape, element ``i`` in row-major order is draw element ``i``),
    ``seed`` int64 ``[1]`` (read), ``offset`` int64 ``[1]`` (read, then advanced by one)."""

    values: torch.Tensor
    seed: torch.Tensor
    offset: torch.Tensor


@call_type
class RandomCall(Call):
    """One draw: ``dtype`` of the values and ``normal`` (Box–Muller, else uniform). ``tokens``
    is the element count (a draw has no rows)."""

    dtype: torch.dtype
    normal: bool = False

    def ledger(self, traits: LayoutTraits) -> Ledger:
        """Bytes that must move: the values written, seed and offset read, the offset written.
        Flops: one scale per uniform element, :data:`NORMAL_FLOPS_PER_ELEMENT` per normal one
        (the Philox rounds are integer work)."""
        flops = self.tokens * (NORMAL_FLOPS_PER_ELEMENT if self.normal else 1)
        return Ledger(2 * STATE_BYTES, self.tokens * self.dtype.itemsize + STATE_BYTES, flops)


def check_values(op: str, values: Any) -> torch.Tensor:
    """``values``: a contiguous tensor of a draw dtype."""
    if not isinstance(values, torch.Tensor):
        raise ContractError(op, "values", "a torch.Tensor", describe(values))
    if values.dtype not in VALUE_DTYPES:
        raise ContractError(op, "values", f"dtype {VALUE_DTYPE_NAMES}", describe(values))
    if not values.is_contiguous():
        raise ContractError(op, "values", "a contiguous tensor (draws fill it in row-major order)",
                            describe(values))
    return values


def check_state(op: str, name: str, state: Any, device: torch.device) -> torch.Tensor:
    """``seed`` / ``offset``: an int64 ``[1]`` tensor on the values' device, not requiring grad."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.int64 or state.shape != (1,):
        raise ContractError(op, name, "an int64 tensor of shape (1,) (a generator's state)", describe(state))
    if state.device != device:
        raise ContractError(op, name, f"a tensor on {device}, the device of values", describe(state))
    return state


def fill(op: str, values: Any, seed: Any, offset: Any, normal: bool) -> tuple[RandomCall, RandomInputs]:
    """The contract of ``fill_rand`` (``normal=False``) and ``fill_randn``: ``(call, inputs)``."""
    values = check_values(op, values)
    device = values.device
    check_state(op, "seed", seed, device)
    check_state(op, "offset", offset, device)
    if share_memory(offset, seed) or share_memory(offset, values):
        raise ContractError(op, "offset", "a tensor sharing no memory with seed or values", describe(offset))
    count = values.numel()
    call = RandomCall(op, device.type, op, dtype=values.dtype, normal=normal, tokens=count, device=device,
                      empty=count == 0)
    if values.requires_grad:  # written in place, outside autograd: the caller's tensor stays a leaf
        values = values.detach()
    return call, RandomInputs(values, seed, offset)
