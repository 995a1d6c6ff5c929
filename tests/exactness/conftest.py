"""Exactness tests run many tiny matmuls; one intra-op thread avoids oversubscribing
small CI machines (several times faster there, and results do not depend on it)."""

from __future__ import annotations

try:
    import torch
except ImportError:  # the tests themselves skip without torch
    torch = None  # type: ignore[assignment]

if torch is not None:
    torch.set_num_threads(1)
