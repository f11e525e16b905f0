"""The arrival counter of a generator's draws on CUDA (see ``philox.read_the_offset_and_count_the_cta``).

A draw's kernel counts its CTAs on an int32 ``[1]`` device tensor and the last one to count sets it
back to 0, so between draws every counter holds 0. A generator's counter is found by its offset tensor's
data pointer and handed out at the generator's first draw on this backend from a slab of zeroed
counters of the offset's device. The slab is made (zero filled) at a device's first draw and
again when its counters run out, so a generator whose first draw is captured in a CUDA graph (the
bench's copies of a generator, static buffers of ``torch.compile``'s graphs) takes a counter that
already holds 0, not one whose zero fill would be a node of the graph; a slab to make during a
capture is refused by name. An address reused by a later generator finds a counter at 0: as good
as a new one. Two draws of one generator running at once on two streams would share a counter, as
they already share the offset (the stream order of a generator's draws is the caller's, SPEC §9).
Nothing here imports TileLang.
"""

from __future__ import annotations

import threading

import torch

SLAB_COUNTERS = 4096  # counters a slab holds (16 KiB)

_COUNTERS: dict[int, torch.Tensor] = {}
_SLABS: dict[torch.device, tuple[torch.Tensor, int]] = {}  # a device's slab and its counters handed out
_LOCK = threading.Lock()


def arrival_counter(offset: torch.Tensor) -> torch.Tensor:
    """The arrival counter of the generator whose offset tensor is ``offset`` (int32 ``[1]``)."""
    counter = _COUNTERS.get(offset.data_ptr())
    if counter is None:
        with _LOCK:
            counter = _COUNTERS.get(offset.data_ptr())
            if counter is None:
                counter = _COUNTERS[offset.data_ptr()] = _next_counter(offset.device)
    return counter


def _next_counter(device: torch.device) -> torch.Tensor:
    """A counter of ``device``'s slab not handed out before (a new slab when none is left)."""
    slab, used = _SLABS.get(device, (None, SLAB_COUNTERS))
    if used == SLAB_COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a generator's first draw on a device makes its arrival counters: make one draw on "
                               "this device before capturing a CUDA graph")
        with torch.inference_mode(False):
            slab, used = torch.zeros(SLAB_COUNTERS, dtype=torch.int32, device=device), 0
    _SLABS[device] = (slab, used + 1)
    return slab[used:used + 1]
