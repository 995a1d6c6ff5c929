"""Work buffers a runner keeps from step to step.

A decode step at 32 rows gathers each attention layer's K and V pages into fresh
multi-megabyte tensors (32 rows x 5 blocks x 64 tokens x 2 heads x 64 dims x 4 bytes =
10 MB each). Buffers that large come from fresh pages of the OS, so every gather paid
first-touch page faults: `index_select` measured 0.3 ms into a reused buffer against
0.6-1.1 ms into a fresh one (1 thread, the same gather), and up to 8-10 ms per call in
whole decode steps on a loaded host. A `Scratch` hands out views of buffers it keeps
(grown when a step needs more), so the pages are touched once.

A view is valid until the next `take` of the same name: callers use it within one layer
(gather, attend, done) and never return it.
"""

from __future__ import annotations

import math

import torch


class Scratch:
    """Named reusable buffers, one per (name, dtype, device)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def take(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A contiguous ``shape`` view of the buffer ``name`` (contents undefined)."""
        numel = math.prod(shape)
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            # a quarter more than asked: decode steps grow by a block at a time
            buffer = torch.empty(numel + numel // 4, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel].view(shape)

    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
