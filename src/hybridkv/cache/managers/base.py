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
        key_ahead: bool = False,
    ) -> None:
        self.group = group
        self.group_id = group.group_id
        self.block_size = group.block_size
        self.pool = pool
        self.unit_tokens = unit_tokens
        self.caching = caching
        self.counters = counters
        self.verify_tokens = pool.tokens is not None
        # EAGLE / MTP head layers: the head's KV at position p is computed from token
        # p + 1, so a block of a group holding head layers is keyed by its chain hash
        # *and* the token after it ("hash one token ahead"): a hit never reuses head KV
        # computed for another next token, and no block has to be dropped.
        self.key_ahead = key_ahead
        assert group.block_size % unit_tokens == 0

    # -- hashing helpers -----------------------------------------------------------
    def key(self, hashes: Sequence[bytes], tokens: Sequence[int], end_tokens: int) -> bytes:
        """Index key of the block ending at ``end_tokens`` (a multiple of the unit): the
        chain hash, plus token ``end_tokens`` when keyed ahead (the caller checks that
        this token is verified)."""
        chain = hashes[end_tokens // self.unit_tokens - 1]
        if self.key_ahead:
            return chain + int(tokens[end_tokens]).to_bytes(8, "little", signed=True)
        return chain

    def cacheable_end(self, num_computed: int, num_verified: int) -> int:
        """Tokens whose blocks may be cached: computed ones, and for a group keyed ahead
        only those followed by a verified token."""
        return min(num_computed, num_verified - 1) if self.key_ahead else num_computed

    def cached_block(
        self, hashes: Sequence[bytes], tokens: Sequence[int], end_tokens: int
    ) -> BlockId | None:
        """The cached block of this group whose data ends at ``end_tokens``, if any."""
        if end_tokens <= 0 or end_tokens // self.unit_tokens > len(hashes):
            return None
        if self.key_ahead and end_tokens >= len(tokens):
            return None
        span = tokens[end_tokens - self.block_size : end_tokens] if self.verify_tokens else None
        return self.pool.lookup(self.group_id, self.key(hashes, tokens, end_tokens), span)

    def try_cache(
        self, block: BlockId, hashes: Sequence[bytes], tokens: Sequence[int], end_tokens: int
    ) -> bool:
        if self.key_ahead and end_tokens >= len(tokens):
            return False  # the token after the block is not verified yet
        span = tokens[end_tokens - self.block_size : end_tokens] if self.verify_tokens else None
        key = self.key(hashes, tokens, end_tokens)
        return self.pool.cache(block, self.group_id, key, end_tokens, span)

    # -- interface -----------------------------------------------------------------
    def new_state(self) -> Any:
        raise NotImplementedError

    def max_hit(self, hashes: Sequence[bytes], tokens: Sequence[int], limit: int) -> int:
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
