"""The arrival counter of a generator's draws on CUDA (see ``philox.advance_after_the_last_cta``).

A draw's kernel counts its CTAs on an int32 ``[1]`` device tensor and the last one sets it back to
0, so between draws every counter holds 0. A generator's counter is found by its offset tensor's
data pointer, made (zeroed, on the offset's device) at the generator's first draw on this backend;
refused while the offset's stream captures a CUDA graph (the zero fill would be a node of the
graph: eager draws before its first replay would count from an unset word).
An address reused by a later generator finds a counter at 0: as good as a new one. Two draws of
one generator running at once on two streams would share a counter, as they already share the
offset (the stream order of a generator's draws is the caller's, SPEC §9). Nothing here imports
TileLang.
"""

from __future__ import annotations

import torch

_COUNTERS: dict[int, torch.Tensor] = {}


def arrival_counter(offset: torch.Tensor) -> torch.Tensor:
    """The arrival counter of the generator whose offset tensor is ``offset`` (int32 ``[1]``)."""
    counter = _COUNTERS.get(offset.data_ptr())
    if counter is None:
        if offset.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a generator's first draw on CUDA makes its arrival counter: make one draw with this "
                               "generator before capturing a CUDA graph")
        counter = _COUNTERS[offset.data_ptr()] = torch.zeros(1, dtype=torch.int32, device=offset.device)
    return counter
