"""What every group manager provides; the coordinator talks to groups only through this.

A manager is stateless per request: each request's per-group state (a block table, or a
set of state blocks) is an object the manager creates and the request keeps. Positions:
``c`` = tokens computed before the step, ``n`` = verified tokens computed this step,
``L`` = lookahead slots (drafts), ``a`` = accepted drafts, ``c2 = c + n + a``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridkv.cache.block_pool import BlockPool
from hybridkv.ids import BlockId
from hybridkv.plan.types import GroupPlan

INF = 1 << 62


class Counters:
    """Mutable statistics shared by the managers and the facade."""

    def __init__(self) -> None:
        self.checkpoints_stored = 0
        self.checkpoints_used = 0


class GroupManager:
    """Base class; subclasses implement one group kind (see the table in ``__init__``)."""

    def __init__(
        self,
        group: GroupPlan,
        pool: BlockPool,
        *,
        unit_tokens: int,
        caching: bool,
        counters: Counters,
    ) -> None:
        self.group = group
        self.group_id = group.group_id
        self.block_size = group.block_size
        self.pool = pool
        self.unit_tokens = unit_tokens
        self.caching = caching
        self.counters = counters
        self.verify_tokens = pool.tokens is not None
        assert group.block_size % unit_tokens == 0

    # -- hashing helpers -----------------------------------------------------------
    def key(self, hashes: Sequence[bytes], end_tokens: int) -> bytes:
        """Hash of the prefix that ends at ``end_tokens`` (a multiple of the unit)."""
        return hashes[end_tokens // self.unit_tokens - 1]

    def cached_block(
        self, hashes: Sequence[bytes], tokens: Sequence[int], end_tokens: int
    ) -> BlockId | None:
        """The cached block of this group whose data ends at ``end_tokens``, if any."""
        if end_tokens <= 0 or end_tokens // self.unit_tokens > len(hashes):
            return None
        span = tokens[end_tokens - self.block_size : end_tokens] if self.verify_tokens else None
        return self.pool.lookup(self.group_id, self.key(hashes, end_tokens), span)

    def try_cache(
        self, block: BlockId, hashes: Sequence[bytes], tokens: Sequence[int], end_tokens: int
    ) -> bool:
        span = tokens[end_tokens - self.block_size : end_tokens] if self.verify_tokens else None
        key = hashes[end_tokens // self.unit_tokens - 1]  # == self.key(hashes, end_tokens)
        return self.pool.cache(block, self.group_id, key, end_tokens, span)

    # -- interface -----------------------------------------------------------------
    def new_state(self) -> Any:
        raise NotImplementedError

    def max_hit(
        self, hashes: Sequence[bytes], tokens: Sequence[int], limit: int, eagle: bool
    ) -> int:
        """Longest hit <= ``limit`` tokens this group can serve (0 always works)."""
        raise NotImplementedError

    def hit_state(self, hashes: Sequence[bytes], tokens: Sequence[int], hit: int) -> Any:
        """Per-request state holding the hit blocks (not yet touched), or None when one
        of them was evicted since the lookup."""
        raise NotImplementedError

    def num_new_blocks(self, state: Any, c: int, n: int, lookahead: int) -> int:
        raise NotImplementedError

    def allocate(self, state: Any, c: int, n: int, lookahead: int, num_new: int) -> list[BlockId]:
        """Take exactly ``num_new`` blocks (``== num_new_blocks(state, c, n, lookahead)``,
        which the caller computed to check the pool) and lay out the step."""
        raise NotImplementedError

    def commit(
        self,
        state: Any,
        c: int,
        n: int,
        lookahead: int,
        accepted: int,
        hashes: Sequence[bytes],
        tokens: Sequence[int],
    ) -> None:
        """Settle a step: cache what became verified, release what is no longer needed."""
        raise NotImplementedError

    def release_all(self, state: Any) -> None:
        raise NotImplementedError

    def held(self, state: Any) -> list[BlockId]:
        """Every non-null block the request references in this group (with repeats)."""
        raise NotImplementedError

    def fast_limits(self, state: Any, c: int) -> tuple[int, int, int, int]:
        """(alloc_total, alloc_verified, spec_slots, commit_limit) for the fast path.

        An allocate needs no new block while ``c + n + L <= alloc_total``,
        ``c + n <= alloc_verified`` and ``L <= spec_slots``; a commit has nothing to
        cache or release while ``c2 < commit_limit``.
        """
        raise NotImplementedError

    def check_state(self, state: Any, c: int) -> None:
        """Raise InvariantError if the per-request state is inconsistent."""
