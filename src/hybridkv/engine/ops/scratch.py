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


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest settable mmap threshold on 64-bit hosts (DEFAULT_MMAP_THRESHOLD_MAX)
_MMAP_THRESHOLD_MAX = 32 << 20


_TRIM_BYTES = 1 << 30

# The same settings for a process about to start (glibc reads them at start-up; see
# mallopt(3)): how a benchmark gives a peer's processes what `keep_freed_pages` gives ours.
KEEP_FREED_PAGES_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(_MMAP_THRESHOLD_MAX),
    "MALLOC_TRIM_THRESHOLD_": str(_TRIM_BYTES),
}


def keep_freed_pages(trim_bytes: int = _TRIM_BYTES) -> bool:
    """Have glibc's malloc keep freed memory for reuse instead of handing it back to the
    OS (process-wide; returns False where it cannot: not glibc, or refused).

    A prefill step allocates and frees hundreds of megabytes of multi-megabyte tensors
    (products, casts, the chunked delta rule's grids). With glibc's defaults the larger
    ones are mapped afresh or the freed top of the heap is trimmed, so the next step
    touches new pages: 70,000-100,000 minor page faults per 4,096-token step of the tiny
    Qwen3-Next model (bf16, 1 thread; ~2 us each on the benchmark VM: an 8 MB float32
    copy took 4 ms when its destination was fresh, 0.9 ms when it was not), against
    4,000-9,000 with these settings, and 4-14% less CPU per step (two sets of
    alternating runs, docs/performance.md). `LLM` calls it on the CPU unless
    ``LLM(keep_freed_pages=False)``. Allocations up to 32 MiB
    then come from the heap (``M_MMAP_THRESHOLD``), and up to ``trim_bytes`` of free
    heap top stays mapped (``M_TRIM_THRESHOLD``): the process keeps its peak working
    set resident, as the tcmalloc / jemalloc preloads of other CPU engines do."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    trim = min(trim_bytes, 2**31 - 1)
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim)
    )
