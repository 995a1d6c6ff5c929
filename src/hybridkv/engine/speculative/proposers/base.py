"""The proposer interface: given a request's verified tokens, propose 0..K drafts.

A proposer never sees the cache. The engine asks it for at most ``max_num_tokens``
drafts per step; it may return fewer, or none (then the step is a plain decode step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    """Anything that proposes draft tokens for one request."""

    name: str

    def propose(self, request_id: str, token_ids: Sequence[int], max_num_tokens: int) -> list[int]:
        """Drafts continuing ``token_ids`` (prompt + accepted output), at most
        ``max_num_tokens`` of them."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop per-request state (finished, cancelled or preempted request)."""
        ...
