"""Test helpers for tileplug backends: bytewise comparison, relative error, and shape
generators that favour the sizes kernels get wrong (non-aligned, partial groups).

They live in core (no reference needed) and raise ``AssertionError`` explicitly, so
``python -O`` (which strips ``assert`` statements) changes nothing.

``assert_bytes_equal`` is the bit-exactness check of SPEC.md ("torch.equal on the raw
bytes"); ``assert_sf_equal`` compares scale tensors on the bytes that hold groups only
(padding of a partly filled UE8M0 integer and of a padded column is unspecified).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch

from tileplug.core.quant import layouts
from tileplug.core.quant.sf_math import ceil_div

__all__ = [
    "HIDDEN_SIZES", "NAN_FREE_DTYPES", "TOKEN_COUNTS", "activation", "assert_bytes_equal", "assert_sf_equal",
    "assert_within_ulps", "bytes_equal", "canonical_nans", "cpu_copy", "first_difference", "hidden_sizes", "moved", "random_shapes",
    "raw_bytes",
    "relative_error", "require", "sf_group_bytes", "token_counts", "ulp_distance",
]

TOKEN_COUNTS = (0, 1, 3, 4001)
"""Token counts every op is tested at (0: empty; odd sizes: tails)."""

HIDDEN_SIZES = (576, 7168)
"""Hidden sizes every op is tested at (576 leaves partial 128-groups)."""


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as uint8, last dim widened by the item size (logical order)."""
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    if tensor.numel() == 0:  # an empty tensor counts as contiguous whatever its strides
        shape = (*tensor.shape[:-1], tensor.shape[-1] * tensor.element_size())
        return torch.empty(shape, dtype=torch.uint8)
    return layouts.standard_strides(tensor).view(torch.uint8)


def first_difference(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Where two same-shaped tensors first differ in their bytes ("" when they do not)."""
    a, e = raw_bytes(actual).cpu(), raw_bytes(expected).cpu()
    different = (a != e).nonzero()
    if different.numel() == 0:
        return ""
    index = tuple(different[0].tolist())
    element = list(index)
    element[-1] //= max(1, actual.element_size())
    element_index = tuple(element)
    return (
        f"{different.shape[0]} differing byte(s); first at element {element_index}: "
        f"actual {actual.cpu()[element_index]!r} vs expected {expected.cpu()[element_index]!r}"
    )


def bytes_equal(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """True when dtype, shape and every byte match."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return False
    return bool(torch.equal(raw_bytes(actual).cpu(), raw_bytes(expected).cpu()))


def moved(value: Any, device: str | torch.device, fresh: bool = False) -> Any:
    """``value`` on ``device``: a tensor keeps its shape and strides (``.to()`` / ``.cpu()``
    make a padded row stride or a padded column-major sf dense), a tuple or list element by
    element, a dict (keyword arguments) value by value; anything else is returned as it is.
    A tensor already on ``device`` is returned as it is, or copied when ``fresh``."""
    device = torch.device(device)
    if isinstance(value, torch.Tensor):
        if value.device == device and not fresh:
            return value
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device).copy_(value)
    if isinstance(value, (tuple, list)):
        return type(value)(moved(v, device, fresh) for v in value)
    if isinstance(value, dict):
        return {key: moved(v, device, fresh) for key, v in value.items()}
    return value


def cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy with the same shape and strides (the tensor itself when on the CPU)."""
    return moved(tensor, "cpu")


NAN_FREE_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def canonical_nans(tensor: torch.Tensor) -> torch.Tensor:
    """A copy on the CPU where every NaN has one encoding (floating dtypes; others as they are)."""
    tensor = tensor.cpu()
    if tensor.dtype in NAN_FREE_DTYPES or tensor.numel() == 0:
        return tensor
    nan = torch.isnan(tensor.float())
    canonical = torch.full((), float("nan"), dtype=tensor.dtype)
    return torch.where(nan, canonical, tensor)


def require(condition: bool, message: str) -> None:
    """Raise ``AssertionError(message)`` unless ``condition`` (kept under ``python -O``)."""
    if not condition:
        raise AssertionError(message)


def assert_bytes_equal(
    actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor", strides: bool = False, nan_equal: bool = False
) -> None:
    """Assert bit-exact equality (dtype, shape, bytes; strides too when ``strides``).

    ``nan_equal``: any NaN equals any NaN (sign and payload of a NaN the arithmetic
    creates are unspecified, docs/numerics.md); every other byte must match.
    """
    require(actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}")
    require(actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if strides:
        require(actual.stride() == expected.stride(), f"{what}: stride {actual.stride()} != {expected.stride()}")
    if nan_equal:
        actual, expected = canonical_nans(actual), canonical_nans(expected)
    require(bytes_equal(actual, expected), f"{what}: {first_difference(actual, expected)}")


_BITS_DTYPES = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
                torch.float64: torch.int64}


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """How many representable values of the (shared) float dtype lie between each pair of
    elements, int64, on the CPU: 0 equal (``+0`` and ``-0`` too), 1 neighbours. A pair with
    exactly one NaN is ``2^62`` apart; two NaNs are 0 apart (SPEC §4: a NaN output is
    compared as "non-finite", not by its payload)."""
    require(actual.dtype == expected.dtype and actual.dtype in _BITS_DTYPES,
            f"ulp_distance: float dtypes that match, got {actual.dtype} and {expected.dtype}")
    require(actual.shape == expected.shape, f"ulp_distance: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    bits_dtype = _BITS_DTYPES[actual.dtype]
    width = bits_dtype.itemsize * 8
    magnitude_mask = (1 << (width - 1)) - 1

    def ordered(tensor: torch.Tensor) -> torch.Tensor:
        # sign-magnitude bits → a monotonic integer line (negative floats mirrored below 0)
        bits = tensor.detach().cpu().contiguous().view(bits_dtype).to(torch.int64)
        magnitude = bits & magnitude_mask
        return torch.where(bits < 0, -magnitude, magnitude)

    distance = (ordered(actual) - ordered(expected)).abs()
    nan_a, nan_e = torch.isnan(actual.detach().cpu()), torch.isnan(expected.detach().cpu())
    distance = torch.where(nan_a & nan_e, 0, distance)
    return torch.where(nan_a ^ nan_e, 1 << 62, distance)


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: int = 1, what: str = "tensor") -> None:
    """Assert every element of ``actual`` is within ``ulps`` units in the last place of
    ``expected`` in their dtype (SPEC §4: "≤ 1 ulp" = equal or a neighbour); NaN only where
    ``expected`` has NaN. Dtype and shape must match."""
    require(actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}")
    require(actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if actual.numel() == 0:
        return
    distance = ulp_distance(actual, expected)
    worst = int(distance.max())
    if worst > ulps:
        index = tuple(int(i) for i in (distance == worst).nonzero()[0])
        count = int((distance > ulps).sum())
        raise AssertionError(
            f"{what}: {count} element(s) differ by more than {ulps} ulp; worst {worst} ulp at {index}: "
            f"actual {actual.detach().cpu()[index].item()!r} vs expected {expected.detach().cpu()[index].item()!r}"
        )


def sf_group_bytes(sf: torch.Tensor, block: tuple[int, int], tokens: int, hidden: int) -> torch.Tensor:
    """The bytes of ``sf`` that hold groups, as uint8 [rows, cols, itemsize] (packed UE8M0 unpacked)."""
    rows, cols = ceil_div(tokens, block[0]), ceil_div(hidden, block[1])
    encoding = layouts.encoding_of_dtype(sf.dtype)
    if encoding is not None and encoding.kind == "ue8m0":
        unpacked = layouts.unpack_ue8m0(sf.cpu(), layouts.pack_axis_of_block(block), rows, cols)
        return unpacked.reshape(rows, cols, 1)
    return raw_bytes(sf.cpu()).reshape(rows, cols, sf.element_size())


def assert_sf_equal(
    actual: torch.Tensor,
    expected: torch.Tensor,
    block: tuple[int, int],
    tokens: int,
    hidden: int,
    what: str = "sf",
    nan_equal: bool = False,
) -> None:
    """Scales equal on every byte that holds a group; dtype, shape and strides equal too
    (``nan_equal``: fp32 / e4m3 NaN scales compare equal whatever their encoding)."""
    require(actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}")
    require(actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    require(actual.stride() == expected.stride(), f"{what}: stride {actual.stride()} != {expected.stride()}")
    if nan_equal:
        actual, expected = canonical_nans(actual), canonical_nans(expected)
    a = sf_group_bytes(actual, block, tokens, hidden)
    e = sf_group_bytes(expected, block, tokens, hidden)
    different = (a != e).any(dim=-1).nonzero()
    if different.numel():
        first = tuple(different[0].tolist())
        raise AssertionError(
            f"{what}: {different.shape[0]} group(s) differ; first group {first}: "
            f"actual bytes {a[first].tolist()} vs expected {e[first].tolist()}"
        )


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """``||actual - reference|| / ||reference||`` in fp64 over finite reference entries
    (0.0 for an all-zero reference equal to ``actual``)."""
    a = actual.detach().to(torch.float64).cpu()
    r = reference.detach().to(torch.float64).cpu()
    finite = torch.isfinite(r)
    a, r = a[finite], r[finite]
    denominator = r.norm().item()
    numerator = (a - r).norm().item()
    if denominator == 0.0:
        return 0.0 if numerator == 0.0 else float("inf")
    return numerator / denominator


def hidden_sizes(multiple_of: int = 16, upper: int = 8192, count: int = 8, seed: int = 0) -> list[int]:
    """Hidden sizes that are multiples of ``multiple_of``, mostly not of 128: the common
    model sizes with a tail (576, 7168), then random non-aligned ones."""
    rng = random.Random(seed)
    sizes = [s for s in (576, 7168, multiple_of, 3 * multiple_of) if s % multiple_of == 0 and s <= upper]
    while len(sizes) < count:
        size = rng.randrange(1, upper // multiple_of + 1) * multiple_of
        if size % 128 or rng.random() < 0.2:
            sizes.append(size)
    return sizes[:count]


def token_counts(upper: int = 8192, count: int = 8, seed: int = 0) -> list[int]:
    """Token counts with the edge cases first (0, 1, 3, 4001), then odd random ones."""
    rng = random.Random(seed)
    counts = [t for t in TOKEN_COUNTS if t <= upper]
    while len(counts) < count:
        counts.append(rng.randrange(1, upper + 1) | 1)
    return counts[:count]


def random_shapes(count: int, multiple_of: int = 2, upper_tokens: int = 300, upper_hidden: int = 1100,
                  seed: int = 0) -> Iterator[tuple[int, int]]:
    """``count`` (T, H) pairs favouring non-aligned sizes (H a multiple of ``multiple_of``)."""
    rng = random.Random(seed)
    for _ in range(count):
        tokens = rng.choice((0, 1, 3, rng.randrange(1, upper_tokens + 1)))
        hidden = rng.randrange(1, upper_hidden // multiple_of + 1) * multiple_of
        yield tokens, hidden


def activation(tokens: int, hidden: int, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
               seed: int = 0, outliers: bool = True) -> torch.Tensor:
    """A realistic LLM activation [T, H]: normal values, a few outlier channels ×50."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(tokens, hidden, generator=generator)
    if outliers and hidden >= 8:
        channels = torch.randperm(hidden, generator=generator)[: max(1, hidden // 256)]
        values[:, channels] *= 50.0
    return values.to(dtype=dtype, device=device)
