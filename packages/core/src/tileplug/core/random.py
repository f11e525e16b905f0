"""Counter-based random numbers (SPEC §9): Philox4x32-10 generators and the draws users call.

    from tileplug import core
    core.random.manual_seed(1234)
    x = core.random.randn(4096, 1024, dtype=torch.bfloat16, device="cuda")

A :class:`Generator` holds a 64-bit ``seed`` and a 64-bit ``offset`` in two int64 ``[1]``
tensors on its device. Each draw of ``n`` elements reads both (on the device, no host
synchronisation) through the op table's ``fill_rand`` / ``fill_randn``, whose kernel then
advances the offset by one: a captured CUDA / NPU graph draws fresh numbers on every replay.
The same ``(seed, offset, shape)`` gives the same words on every backend.

Each device has a default generator (seed 0 until :func:`manual_seed`), made on first use.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from tileplug.core.contracts.checks import describe
from tileplug.core.contracts.random import VALUE_DTYPE_NAMES, VALUE_DTYPES
from tileplug.core.errors import ContractError
from tileplug.core.generator import SEED_LIMIT, Generator, _device, as_int64_word, check_seed  # noqa: F401
from tileplug.core.ops.random import fill_rand, fill_randn

__all__ = ["Generator", "default_generator", "manual_seed", "rand", "rand_like", "randn", "randn_like"]


_defaults: dict[torch.device, Generator] = {}
_defaults_lock = threading.Lock()
_default_seed = 0


def default_generator(device: str | torch.device = "cpu") -> Generator:
    """The default generator of ``device`` (made on first use, seeded with the last
    :func:`manual_seed` given no device, else 0)."""
    resolved = device if isinstance(device, torch.device) and (device.index is not None or device.type in (
        "cpu", "meta")) else _device("default_generator", device)
    generator = _defaults.get(resolved)
    if generator is None:
        with _defaults_lock:
            generator = _defaults.get(resolved)
            if generator is None:
                generator = _defaults[resolved] = Generator(resolved, _default_seed)
    return generator


def manual_seed(seed: int, device: str | torch.device | None = None) -> Generator | None:
    """Seed the default generator of ``device`` (``seed = seed``, ``offset = 0``) and return it;
    ``device=None``: every default generator, and those made later (returns None)."""
    global _default_seed
    check_seed("manual_seed", seed)
    if device is not None:
        return default_generator(device).manual_seed(seed)
    with _defaults_lock:
        _default_seed = seed
        generators = list(_defaults.values())
    for generator in generators:
        generator.manual_seed(seed)
    return None


def _size(op: str, size: Sequence[Any]) -> tuple[int, ...]:
    """``rand(2, 3)`` or ``rand((2, 3))`` → ``(2, 3)``: non-negative ints."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    for dim in size:
        if dim.__class__ is not int or dim < 0:
            raise ContractError(op, "size", "non-negative ints", describe(tuple(size)))
    return tuple(size)


def _dtype(op: str, dtype: Any) -> torch.dtype:
    if dtype not in VALUE_DTYPES:
        raise ContractError(op, "dtype", VALUE_DTYPE_NAMES, describe(dtype))
    return dtype


def generator_of_draw(op: str, generator: Generator | None, device: Any, of: str = "the draw") -> Generator:
    """The generator a draw uses: the one given (on ``device``, the device of ``of``, when a
    device is named), else the default of ``device`` (cpu when None)."""
    if generator is None:
        return default_generator("cpu" if device is None else device)
    if not isinstance(generator, Generator):
        raise ContractError(op, "generator", "a tileplug.core.random.Generator or None", describe(generator))
    if device is not None and device != generator.device and _device(op, device) != generator.device:
        raise ContractError(op, "generator", f"a generator on {_device(op, device)}, the device of {of}",
                            repr(generator))
    return generator


def _draw(op: str, fill: Any, size: Sequence[Any], dtype: Any, device: Any, generator: Generator | None
          ) -> torch.Tensor:
    shape = _size(op, size)
    dtype = _dtype(op, dtype)
    state = generator_of_draw(op, generator, device)
    values = torch.empty(shape, dtype=dtype, device=state.device)
    fill(values, state.seed_state, state.offset_state)
    return values


def rand(*size: Any, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None,
         generator: Generator | None = None) -> torch.Tensor:
    """Uniform values in ``[0, 1)`` of shape ``size`` → a fresh contiguous tensor.

    ``size``: non-negative ints (or one tuple of them); ``dtype`` fp32 / bf16 / fp16 (fp32
    rounded once: a 16-bit value may be 1.0); ``device`` the generator's when None (the default
    generator of cpu when both are None). Element ``i`` (row-major) is ``(r_i >> 8) · 2^-24``
    of Philox word ``i``; the generator's offset advances by one (not for an empty draw)."""
    return _draw("rand", fill_rand, size, dtype, device, generator)


def randn(*size: Any, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None,
          generator: Generator | None = None) -> torch.Tensor:
    """Standard normal values of shape ``size`` → a fresh contiguous tensor (Box–Muller on each
    Philox block's word pairs, SPEC §9); arguments as :func:`rand`."""
    return _draw("randn", fill_randn, size, dtype, device, generator)


def rand_like(tensor: torch.Tensor, dtype: torch.dtype | None = None, generator: Generator | None = None
              ) -> torch.Tensor:
    """:func:`rand` of ``tensor``'s shape, on its device, in ``dtype`` (default: its dtype)."""
    return _like("rand_like", fill_rand, tensor, dtype, generator)


def randn_like(tensor: torch.Tensor, dtype: torch.dtype | None = None, generator: Generator | None = None
               ) -> torch.Tensor:
    """:func:`randn` of ``tensor``'s shape, on its device, in ``dtype`` (default: its dtype)."""
    return _like("randn_like", fill_randn, tensor, dtype, generator)


def _like(op: str, fill: Any, tensor: Any, dtype: Any, generator: Generator | None) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ContractError(op, "tensor", "a torch.Tensor", describe(tensor))
    if dtype is None and tensor.dtype not in VALUE_DTYPES:
        raise ContractError(op, "tensor", f"dtype {VALUE_DTYPE_NAMES} (or pass dtype=)", describe(tensor))
    return _draw(op, fill, (tuple(tensor.shape),), tensor.dtype if dtype is None else dtype, tensor.device,
                 generator)
