"""The Philox4x32-10 generator object (SPEC §9): a 64-bit seed and a 64-bit offset held in two
int64 ``[1]`` tensors on its device. Its own module (no op imports it depends on), so that
the op declarations can name it in their signatures; users reach it as
``tileplug.core.random.Generator``.
"""

from __future__ import annotations

from typing import Any

import torch

from tileplug.core.contracts.checks import describe
from tileplug.core.errors import ContractError

SEED_LIMIT = 2**64


def as_int64_word(value: int) -> int:
    """A 64-bit unsigned value as the int64 holding the same bits (two's complement)."""
    return value - SEED_LIMIT if value >= 2**63 else value


def check_seed(op: str, seed: Any) -> int:
    """``seed``: an int in ``[0, 2^64)`` (a bool is not a seed)."""
    if seed.__class__ is not int or not 0 <= seed < SEED_LIMIT:
        raise ContractError(op, "seed", "an int in [0, 2^64)", describe(seed))
    return seed


def _device(op: str, device: Any) -> torch.device:
    """A device with its index filled in (``"cuda"`` → the current CUDA device)."""
    try:
        resolved = torch.device(device)
    except (TypeError, RuntimeError) as error:
        raise ContractError(op, "device", "a torch.device or its name", describe(device)) from error
    if resolved.index is None and resolved.type not in ("cpu", "meta"):
        resolved = torch.empty(0, device=resolved).device
    return resolved


class Generator:
    """A Philox4x32-10 generator on ``device``: 64-bit ``seed`` (the key) and 64-bit
    ``offset`` (the counter's high half: how many draws it has made since seeding).

    ``seed_state`` / ``offset_state`` are the int64 ``[1]`` device tensors the kernels read
    (two's complement: a value of 2^63 or more is negative as int64). Made on a CUDA device only
    outside a CUDA-graph capture (RuntimeError): their fills would be nodes of the graph, unset
    until its first replay."""

    def __init__(self, device: str | torch.device = "cpu", seed: int = 0) -> None:
        self.device = _device("Generator", device)
        self._seed = check_seed("Generator", seed)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a generator's state is made by tensor fills: make the generator (the default one: "
                               "by a first draw) before capturing a CUDA graph")
        self.seed_state = torch.tensor([as_int64_word(seed)], dtype=torch.int64, device=self.device)
        self.offset_state = torch.zeros(1, dtype=torch.int64, device=self.device)

    @classmethod
    def over(cls, seed_state: torch.Tensor, offset_state: torch.Tensor) -> Generator:
        """A generator over existing state tensors (no copies): what a custom op rebuilds from
        its schema arguments, and what a test's copy of a generator is. Its ``seed`` is read
        from ``seed_state`` when asked (a host synchronisation)."""
        generator = cls.__new__(cls)
        generator.device = seed_state.device
        generator._seed = None
        generator.seed_state, generator.offset_state = seed_state, offset_state
        return generator

    def manual_seed(self, seed: int) -> Generator:
        """``seed = seed``, ``offset = 0`` (tensor fills: nothing waits on the device)."""
        self._seed = check_seed("manual_seed", seed)
        self.seed_state.fill_(as_int64_word(seed))
        self.offset_state.zero_()
        return self

    @property
    def seed(self) -> int:
        """The 64-bit seed, in ``[0, 2^64)``."""
        if self._seed is None:  # a generator over given state tensors (``over``)
            return int(self.seed_state.item()) % SEED_LIMIT
        return self._seed

    @property
    def offset(self) -> int:
        """The 64-bit offset, in ``[0, 2^64)`` (reads the device tensor: a host synchronisation,
        for inspection only)."""
        return int(self.offset_state.item()) % SEED_LIMIT

    @offset.setter
    def offset(self, value: int) -> None:
        if value.__class__ is not int or not 0 <= value < SEED_LIMIT:
            raise ContractError("Generator.offset", "offset", "an int in [0, 2^64)", describe(value))
        self.offset_state.fill_(as_int64_word(value))

    def __repr__(self) -> str:
        seed = "<state tensor>" if self._seed is None else self._seed
        return f"Generator(device={self.device}, seed={seed})"
