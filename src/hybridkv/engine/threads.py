"""How many torch CPU threads the engine commands use.

Tiny models (the demo pair, test checkpoints) do microseconds of work per operation, so
intra-op threads only add synchronisation; worse, when another process holds a core,
every operation waits for the descheduled thread (the demo took 24-60 s instead of ~5 s
with two threads on a busy 2-core machine). Below `SMALL_MODEL_BYTES` of weights we run
one thread; above it torch's own default (one per core) pays off.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from hybridkv.errors import EngineError

SMALL_MODEL_BYTES = 256 << 20
MAX_THREADS = 1024


def weights_bytes(folders: Iterable[Path]) -> int:
    """Bytes of ``*.safetensors`` in the checkpoint folders (0 for missing folders)."""
    total = 0
    for folder in folders:
        if folder.is_dir():
            total += sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return total


def choose_threads(requested: int | None, folders: Iterable[Path]) -> int | None:
    """The thread count to set: ``requested`` when given (validated), 1 for small
    checkpoints, else None (leave torch's default)."""
    if requested is not None:
        if isinstance(requested, bool) or not 1 <= requested <= MAX_THREADS:
            raise EngineError(f"--threads={requested!r} must be from 1 to {MAX_THREADS}")
        return requested
    return 1 if weights_bytes(folders) < SMALL_MODEL_BYTES else None


def apply_threads(requested: int | None, folders: Iterable[Path]) -> int:
    """Set torch's intra-op thread count per `choose_threads`; returns the count in use."""
    import torch

    count = choose_threads(requested, folders)
    if count is not None:
        torch.set_num_threads(count)
    return int(torch.get_num_threads())
