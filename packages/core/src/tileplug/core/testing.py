"""Test helpers for tileplug backends: bytewise comparison, relative error, and shape
generators that favour the sizes kernels get wrong (non-aligned, partial groups).

They live in core (no reference needed) and raise ``AssertionError`` explicitly, so
``python -O`` (which strips ``assert`` statements) changes nothing.

``assert_bytes_equal`` is the bit-exactness check of SPEC.md ("torch.equal on the raw
bytes"); ``assert_sf_equal`` compares scale tensors on the bytes that hold groups only
(padding of a partly filled UE8M0 integer and of a padded column is unspecified).
``assert_within_ulps`` is the tolerance of SPEC §4 ("≤ n ulp of the output dtype"), and
``assert_quantized_close`` compares ``(q, sf)`` pairs made from values that may differ by
an ulp (a fused norm + cast against the reference).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch

from tileplug.core.generator import Generator
from tileplug.core.quant import layouts
from tileplug.core.quant.sf_math import ceil_div, expand_groups

__all__ = [
    "HIDDEN_SIZES", "NAN_FREE_DTYPES", "TOKEN_COUNTS", "activation", "assert_bytes_equal",
    "assert_quantized_close", "assert_sf_equal", "assert_within_ulps", "bytes_equal", "canonical_nans", "cpu_copy",
    "first_difference", "hidden_sizes", "moved", "ordered_bits", "random_shapes", "raw_bytes", "relative_error",
    "PHILOX_KNOWN_ANSWERS", "philox4x32_10_words", "require", "sf_group_bytes", "token_counts", "ulp_distance",
]

PHILOX_WORD_MASK = 0xFFFFFFFF
PHILOX_KNOWN_ANSWERS = (  # Random123's kat_vectors for philox4x32_10: (counter, key, the block's four words)
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
)

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
    element, a dict (keyword arguments) value by value, a ``Generator`` as one over its moved
    state tensors; anything else is returned as it is.
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
    if isinstance(value, Generator):  # a generator over moved copies of its state (its own offset)
        return Generator.over(moved(value.seed_state, device, fresh), moved(value.offset_state, device, fresh))
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


_SIGNED_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def ordered_bits(tensor: torch.Tensor) -> torch.Tensor:
    """A float tensor's values as int64 on a line where neighbouring representable values are
    neighbouring integers (``+0`` and ``−0`` both 0; the largest finite value and infinity
    are neighbours). Any floating dtype, float8 included."""
    bits = layouts.standard_strides(tensor.cpu()).view(_SIGNED_VIEWS[tensor.element_size()]).to(torch.int64)
    magnitude = bits & ((1 << (8 * tensor.element_size() - 1)) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """How many representable values of their (shared floating) dtype lie between each pair
    of elements: 0 equal, 1 neighbours (int64, same shape; NaNs give meaningless values)."""
    require(actual.dtype == expected.dtype, f"ulp_distance: dtype {actual.dtype} != {expected.dtype}")
    return (ordered_bits(actual) - ordered_bits(expected)).abs()


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: int, what: str = "tensor",
                       nan_equal: bool = True) -> None:
    """Assert each element equals ``expected``'s or lies within ``ulps`` representable values
    of it in the shared dtype (SPEC §4: "≤ 1 ulp" is ``ulps=1``); dtype and shape equal.
    A NaN must meet a NaN (any encoding with ``nan_equal``, the default: the arithmetic's NaN
    sign and payload are unspecified), never a number."""
    require(actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}")
    require(actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if actual.numel() == 0:
        return
    if not actual.dtype.is_floating_point:
        require(bytes_equal(actual, expected), f"{what}: {first_difference(actual, expected)}")
        return
    have, want = actual.cpu(), expected.cpu()
    have_nan, want_nan = torch.isnan(have.float()), torch.isnan(want.float())
    nan_mismatch = have_nan != want_nan
    if nan_mismatch.any():
        index = tuple(nan_mismatch.nonzero()[0].tolist())
        raise AssertionError(f"{what}: NaN mismatch at {index}: actual {have[index]!r} vs expected {want[index]!r}")
    if not nan_equal:
        require(bytes_equal(have[have_nan], want[want_nan]), f"{what}: NaN encodings differ")
    distance = torch.where(have_nan, 0, ulp_distance(have, want))
    worst = int(distance.max())
    if worst > ulps:
        index = tuple((distance == worst).nonzero()[0].tolist())
        count = int((distance > ulps).sum())
        raise AssertionError(f"{what}: {count} element(s) more than {ulps} ulp apart; worst {worst} ulp at {index}: "
                             f"actual {have[index].item()!r} vs expected {want[index].item()!r}")


_SPACING_BITS = {torch.bfloat16: (7, -126), torch.float16: (10, -14), torch.float32: (23, -126)}
"""Per dtype: explicit mantissa bits and the smallest normal exponent."""


def value_spacing(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The distance between neighbouring representable values of ``dtype`` at each |value|
    (float64, same shape): ``2^(e − mantissa bits)`` with ``e`` the exponent of the value,
    the subnormal step below the normal range."""
    mantissa_bits, smallest_exponent = _SPACING_BITS[dtype]
    magnitude = values.double().abs()
    _, exponent = torch.frexp(magnitude)
    exponent = torch.where(magnitude == 0, smallest_exponent, torch.clamp(exponent - 1, min=smallest_exponent))
    return torch.ldexp(torch.ones_like(magnitude), exponent - mantissa_bits)


def assert_rotated_within_chain_bound(actual: torch.Tensor, expected: torch.Tensor, rotary_dim: int,
                                      interleaved: bool, what: str = "rotated") -> None:
    """Compare the output ``[..., D]`` of a norm followed by a rotation of its first
    ``rotary_dim`` channels with the reference's, as SPEC §6 derives it through the chain: the
    norm within 1 ulp, then the rotation within 1 ulp of the reference's rotation of the same
    input. Channels past ``rotary_dim`` are the norm alone (≤ 1 ulp). A rotated element
    ``y1·cos − y2·sin`` carries its inputs' ulp through the rotation: it may differ by one
    spacing of itself plus two spacings of its pair's magnitude ``hypot(y1, y2)`` (which the
    rotation preserves, so it is read from the expected pair). Where the rotation cancels,
    that exceeds any fixed ulp count of the (small) result. NaNs must meet NaNs."""
    require(actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}")
    require(actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    have, want = actual.cpu(), expected.cpu()
    assert_within_ulps(have[..., rotary_dim:], want[..., rotary_dim:], 1, what=f"{what} (channels past R)")
    have, want = have[..., :rotary_dim].double(), want[..., :rotary_dim].double()
    if interleaved:  # GPT-J: channel 2i pairs with 2i + 1
        partner = want.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    else:  # NeoX: channel i pairs with i + R/2
        partner = torch.cat([want[..., rotary_dim // 2:], want[..., :rotary_dim // 2]], dim=-1)
    have_nan, want_nan = torch.isnan(have), torch.isnan(want)
    mismatch = have_nan != want_nan
    if mismatch.any():
        index = tuple(mismatch.nonzero()[0].tolist())
        raise AssertionError(f"{what}: NaN mismatch at {index}: actual {have[index].item()!r} vs "
                             f"expected {want[index].item()!r}")
    bound = value_spacing(want, actual.dtype) + 2 * value_spacing(torch.hypot(want, partner), actual.dtype)
    excess = torch.where(want_nan, 0.0, (have - want).abs() - bound)
    worst = float(excess.max()) if excess.numel() else 0.0
    if worst > 0:
        index = tuple((excess == worst).nonzero()[0].tolist())
        count = int((excess > 0).sum())
        raise AssertionError(f"{what}: {count} rotated element(s) outside the chain's bound; worst at {index}: "
                             f"actual {have[index].item()!r} vs expected {want[index].item()!r} "
                             f"(bound {bound[index].item():.3g})")


_QUANT_STEPS = {"e4m3": (2.0 ** -3, 2.0 ** -9), "e2m1": (0.5, 0.5)}
"""Per format: the largest relative spacing of neighbouring normal values and the smallest
absolute step (the subnormal step), in units of the scale."""


def assert_quantized_close(q: torch.Tensor, sf: torch.Tensor, expected_q: torch.Tensor, expected_sf: torch.Tensor,
                           fmt: str, group: int, source_dtype: torch.dtype, what: str = "(q, sf)") -> None:
    """Compare a per-token ``(q, sf)`` (groups ``1 × group``) with the expected pair when the
    quantized values may differ by an ulp of ``source_dtype`` (a fused kernel's norm output
    against the reference's): dtype, shape and strides equal; each group's scale within the
    relative spacing of ``source_dtype`` (plain fp32 scales), one e4m3 step (e4m3-stored) or
    one power of two (UE8M0 and power-of-two scales); each dequantized value within one step
    of the format at the larger of the two scales. Pairs that are bytewise equal pass at once."""
    from tileplug.core.quant import formats

    require(q.dtype == expected_q.dtype and q.shape == expected_q.shape and q.stride() == expected_q.stride(),
            f"{what}: q {q.dtype} {tuple(q.shape)} {q.stride()} vs {expected_q.dtype} {tuple(expected_q.shape)} "
            f"{expected_q.stride()}")
    require(sf.dtype == expected_sf.dtype and sf.shape == expected_sf.shape and sf.stride() == expected_sf.stride(),
            f"{what}: sf {sf.dtype} {tuple(sf.shape)} {sf.stride()} vs {expected_sf.dtype} "
            f"{tuple(expected_sf.shape)} {expected_sf.stride()}")
    tokens = q.shape[0]
    quant_format = formats.QUANT_FORMATS[fmt]
    hidden = q.shape[1] * quant_format.values_per_byte
    block = (1, group)
    try:
        assert_bytes_equal(q, expected_q, nan_equal=True)
        assert_sf_equal(sf, expected_sf, block, tokens, hidden, nan_equal=True)
        return
    except AssertionError:
        pass
    encoding = layouts.encoding_of_dtype(sf.dtype)
    rows, cols = tokens, ceil_div(hidden, group)
    scales = layouts.read(sf.cpu(), encoding, 1, rows, cols)
    expected_scales = layouts.read(expected_sf.cpu(), encoding, 1, rows, cols)
    finite = torch.isfinite(scales) & torch.isfinite(expected_scales)
    require(bool((torch.isfinite(scales) == torch.isfinite(expected_scales)).all()), f"{what}: non-finite scales differ")
    ratio = torch.where(finite, scales / expected_scales.where(expected_scales != 0, 1.0), 1.0)
    if encoding.kind == "fp32":
        powers = bool(((scales.where(finite, 1.0).log2() % 1) == 0).all()) and bool(
            ((expected_scales.where(finite, 1.0).log2() % 1) == 0).all())
        limit = 2.0 if powers else 1.0 + 2.0 * torch.finfo(source_dtype).eps
    elif encoding.kind == "e4m3":
        limit = 1.0 + 2.0 ** -3
    else:
        limit = 2.0
    worst = float(torch.maximum(ratio, 1.0 / ratio).max()) if ratio.numel() else 1.0
    require(worst <= limit * (1 + 1e-6), f"{what}: a group scale differs by a factor {worst:.6g} > {limit:.6g}")
    relative, absolute = _QUANT_STEPS[fmt]
    values = formats.decode(q.cpu(), quant_format)
    expected_values = formats.decode(expected_q.cpu(), quant_format)
    larger_scale = expand_groups(torch.maximum(scales, expected_scales), block, tokens, hidden)
    dequantized = values * expand_groups(scales, block, tokens, hidden)
    expected_dequantized = expected_values * expand_groups(expected_scales, block, tokens, hidden)
    both = torch.isfinite(dequantized) & torch.isfinite(expected_dequantized)
    require(bool((torch.isfinite(dequantized) == torch.isfinite(expected_dequantized)).all()),
            f"{what}: non-finite values differ")
    tolerance = relative * torch.maximum(dequantized.abs(), expected_dequantized.abs()) + absolute * larger_scale
    excess = torch.where(both, (dequantized - expected_dequantized).abs() - tolerance, 0.0)
    if excess.numel() and float(excess.max()) > 0:
        index = tuple((excess == excess.max()).nonzero()[0].tolist())
        raise AssertionError(f"{what}: dequantized value at {index} is {dequantized[index].item()!r}, expected "
                             f"{expected_dequantized[index].item()!r} (beyond one {fmt} step)")


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


def philox4x32_10_words(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32-10 of one block on Python ints, straight from the published algorithm (Salmon et
    al., SC'11): ten rounds of ``(c0, c1, c2, c3) → (hi(M1·c2) ^ c1 ^ k0, lo(M1·c2), hi(M0·c0) ^ c3 ^
    k1, lo(M0·c0))``, the key bumped by the Weyl constants between rounds. An implementation of its
    own (no tensors, no 16-bit halves), the oracle backends' random-number tests check against."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    mask = PHILOX_WORD_MASK
    for index in range(10):
        if index:
            k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
        product0, product1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (product1 >> 32) ^ c1 ^ k0, product1 & mask, (product0 >> 32) ^ c3 ^ k1, product0 & mask
    return c0, c1, c2, c3
