"""Contract of ``stochastic_cast`` (docs/spec.md §10.2): one element-wise narrowing of ``x``
into ``result`` that rounds with the words of one Philox draw under a generator's
``(seed, offset)``, then advances the offset by one.

Pairs: fp32 → bf16, fp32 → e4m3, bf16 → e4m3. ``x`` and ``result`` are contiguous tensors of one
shape on one device (element ``i`` in row-major order takes the ``i``-th field of the draw's words,
:data:`RANDOM_FIELD_BITS` wide); ``seed`` and
``offset`` the generator's int64 ``[1]`` state tensors there. Every failure is a
ContractError naming the argument.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from tileplug.core.call import Call, Ledger, call_type, share_memory
from tileplug.core.contracts.checks import describe
from tileplug.core.contracts.random import STATE_BYTES, check_state
from tileplug.core.errors import ContractError
from tileplug.core.quant.layouts import LayoutTraits

STOCHASTIC_CAST = "stochastic_cast"
STOCHASTIC_TARGETS: dict[torch.dtype, tuple[torch.dtype, ...]] = {
    torch.float32: (torch.bfloat16, torch.float8_e4m3fn),
    torch.bfloat16: (torch.float8_e4m3fn,),
}
"""The narrowings that round stochastically: source dtype → its targets."""
CAST_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
"""The dtypes the deterministic ``cast`` converts between (every pair)."""
CAST_DTYPE_NAMES = "float32, bfloat16 or float8_e4m3fn"
RANDOM_FIELD_BITS: dict[tuple[torch.dtype, torch.dtype], int] = {
    (torch.float32, torch.bfloat16): 16,
    (torch.float32, torch.float8_e4m3fn): 8,
    (torch.bfloat16, torch.float8_e4m3fn): 8,
}
"""(source, target) → the random bits ``w`` each element of a stochastic narrowing takes (docs/spec.md
§10.2): 16 for a bf16 target (the 16 bits an fp32 pattern drops), 8 for an e4m3 target. From bf16
the 8 cover the 4 dropped bits exactly; from fp32 they are the top 8 of the 20 dropped bits, a bias
toward zero under 2^-8 of a step — the precision TileKernels' ``cvt.rs`` casts round fp8 with (one
32-bit word for four values), for a Philox block per 16 elements. A 32-bit word of the draw holds
``32 // w`` fields, the first at its top, so element ``i`` takes field ``i mod (32 // w)`` of word
``i // (32 // w)``. The stochastic per-token / per-block casts narrow fp32 values ``x·inv``:
:data:`QUANT_RANDOM_FIELD_BITS`."""
QUANT_RANDOM_FIELD_BITS = 8
"""``w`` of the stochastic per-token / per-block casts (docs/spec.md §10.2): the narrowing of the fp32
``x·inv`` to e4m3 or e2m1 takes an 8-bit field, four a word, as fp32 → e4m3 does (its normal steps
drop 20 and 22 bits: a bias toward zero under 2^-8 of a step). The Philox rounds are most of the
tile's integer work: a block per 16 elements instead of 8 (16 bits, two a word, before the
forty-second session; with a whole word an element the per-token cast ran at 38 % of its
deterministic form on an H200, with 16 bits at 80 % on an H100)."""


class StochasticCastInputs(NamedTuple):
    """What the kernel reads and writes: ``result`` (written), ``x`` (read), ``seed`` (read),
    ``offset`` (read, then advanced by one)."""

    result: torch.Tensor
    x: torch.Tensor
    seed: torch.Tensor
    offset: torch.Tensor


@call_type
class StochasticCastCall(Call):
    """One stochastic narrowing of ``source`` to ``target``; ``tokens`` is the element count."""

    source: torch.dtype
    target: torch.dtype

    @property
    def random_field_bits(self) -> int:
        """The random bits each element rounds with (:data:`RANDOM_FIELD_BITS`)."""
        return RANDOM_FIELD_BITS[self.source, self.target]

    def ledger(self, traits: LayoutTraits) -> Ledger:
        """``x`` and the two state words read; ``result`` and the advanced offset written. Flops:
        one add and one compare per element (the Philox rounds are integer work)."""
        return Ledger(self.tokens * self.source.itemsize + 2 * STATE_BYTES,
                      self.tokens * self.target.itemsize + STATE_BYTES, 2 * self.tokens)


def _contiguous_tensor(op: str, name: str, value: Any, wanted: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ContractError(op, name, "a torch.Tensor", describe(value))
    if not value.is_contiguous():
        raise ContractError(op, name, f"a contiguous tensor ({wanted})", describe(value))
    return value


def _element_pair(op: str, result: Any, x: Any, sources: Any, targets_of: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(result, x)`` of an element-wise cast: contiguous tensors of one shape on one device,
    ``x`` of a dtype in ``sources``, ``result`` of one in ``targets_of(x.dtype)``."""
    x = _contiguous_tensor(op, "x", x, "element i takes draw field i in row-major order" if op == STOCHASTIC_CAST
                           else "read in row-major order")
    if x.dtype not in sources:
        names = " or ".join(str(dtype).removeprefix("torch.") for dtype in sources)
        raise ContractError(op, "x", f"dtype {names}", describe(x))
    result = _contiguous_tensor(op, "result", result, "written in row-major order")
    targets = targets_of(x.dtype)
    if result.dtype not in targets:
        names = " or ".join(str(target).removeprefix("torch.") for target in targets)
        raise ContractError(op, "result", f"dtype {names} (a cast of {x.dtype})", describe(result))
    if result.shape != x.shape or result.device != x.device:
        raise ContractError(op, "result", f"a tensor of x's shape {tuple(x.shape)} on {x.device}", describe(result))
    return result, x


def stochastic_cast(result: Any, x: Any, seed: Any, offset: Any) -> tuple[StochasticCastCall, StochasticCastInputs]:
    """``(call, inputs)`` of ``stochastic_cast(result, x, seed, offset)``."""
    result, x = _element_pair(STOCHASTIC_CAST, result, x, tuple(STOCHASTIC_TARGETS), STOCHASTIC_TARGETS.__getitem__)
    device = x.device
    check_state(STOCHASTIC_CAST, "seed", seed, device)
    check_state(STOCHASTIC_CAST, "offset", offset, device)
    if share_memory(result, x) or share_memory(result, seed) or share_memory(result, offset):
        raise ContractError(STOCHASTIC_CAST, "result", "a tensor sharing no memory with x, seed or offset",
                            describe(result))
    if share_memory(offset, seed) or share_memory(offset, x):
        raise ContractError(STOCHASTIC_CAST, "offset", "a tensor sharing no memory with seed or x",
                            describe(offset))
    count = x.numel()
    call = StochasticCastCall(STOCHASTIC_CAST, device.type, STOCHASTIC_CAST, source=x.dtype, target=result.dtype,
                              tokens=count, device=device, empty=count == 0)
    # written and read outside autograd: the caller's tensors stay leaves, no history recorded
    return call, StochasticCastInputs(result.detach() if result.requires_grad else result,
                                      x.detach() if x.requires_grad else x, seed, offset)


# ---------------------------------------------------------------------- the deterministic cast

NEAREST_CAST = "nearest_cast"


class NearestCastInputs(NamedTuple):
    """What the kernel reads and writes: ``result`` (written), ``x`` (read)."""

    result: torch.Tensor
    x: torch.Tensor


@call_type
class NearestCastCall(Call):
    """One round-to-nearest conversion of ``source`` to ``target``; ``tokens`` is the element count."""

    source: torch.dtype
    target: torch.dtype

    def ledger(self, traits: LayoutTraits) -> Ledger:
        """``x`` read, ``result`` written; one conversion per element."""
        return Ledger(self.tokens * self.source.itemsize, self.tokens * self.target.itemsize, self.tokens)


def nearest_cast(result: Any, x: Any) -> tuple[NearestCastCall, NearestCastInputs]:
    """``(call, inputs)`` of ``nearest_cast(result, x)``: any pair of :data:`CAST_DTYPES`."""
    result, x = _element_pair(NEAREST_CAST, result, x, CAST_DTYPES, lambda _: CAST_DTYPES)
    if share_memory(result, x):
        raise ContractError(NEAREST_CAST, "result", "a tensor sharing no memory with x", describe(result))
    count = x.numel()
    call = NearestCastCall(NEAREST_CAST, x.device.type, NEAREST_CAST, source=x.dtype, target=result.dtype,
                           tokens=count, device=x.device, empty=count == 0)
    return call, NearestCastInputs(result.detach() if result.requires_grad else result,
                                   x.detach() if x.requires_grad else x)
