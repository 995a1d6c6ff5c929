"""Full attention (and MLA): one block per ``block_size`` tokens, all kept.

Block table of a request, block size 4, 10 tokens computed, 2 drafts reserved::

    position  0123 4567 89dd
    table     [b5] [b9] [b2]        block j covers tokens [4j, 4j + 4)
    cached    yes  yes  no          a block is cached once all 4 tokens are verified

Subclasses (sliding window, chunked local) only change ``first_live_block``: the first
block a step starting at ``c`` computed tokens may read. Blocks before it hold the null
block (0) in the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridkv.cache.block import NULL_BLOCK
from hybridkv.cache.managers.base import INF, GroupManager
from hybridkv.errors import InvariantError
from hybridkv.ids import BlockId


@dataclass
class BlockTable:
    """A request's blocks in one attention group."""

    blocks: list[BlockId] = field(default_factory=list)
    num_cached: int = 0  # leading blocks already considered for caching
    first_live: int = 0  # blocks before this index are NULL_BLOCK


class FullAttentionManager(GroupManager):
    """Left-to-right hit scan that stops at the first miss."""

    def first_live_block(self, num_computed: int) -> int:
        return 0

    def next_release(self, first_live: int) -> int:
        """Smallest ``c`` with ``first_live_block(c) > first_live``."""
        return INF

    def new_state(self) -> BlockTable:
        return BlockTable()

    def max_hit(self, hashes: Sequence[bytes], tokens: Sequence[int], limit: int) -> int:
        # Hit k blocks needs blocks [0, k) cached.
        max_blocks = min(
            limit // self.block_size, len(hashes) * self.unit_tokens // self.block_size
        )
        num = 0
        while (
            num < max_blocks
            and self.cached_block(hashes, tokens, (num + 1) * self.block_size) is not None
        ):
            num += 1
        return num * self.block_size

    def window_hit(self, hashes: Sequence[bytes], tokens: Sequence[int], limit: int) -> int:
        """Largest ``k * B <= limit`` with blocks [first_live_block(kB), k) cached.

        Scans down from the limit; after a miss at block j, only ``k <= j`` can work, so
        every block is looked up at most once::

            window 2 blocks, blocks cached: 0 1 . 3 4 5     (. = miss)
            k=6: needs 4,5 -> hit 6 blocks; k=3 would need 1,2 -> 2 missing
        """
        B = self.block_size
        num_hashed_blocks = len(hashes) * self.unit_tokens // B
        k = min(limit // B, num_hashed_blocks)
        known: dict[int, bool] = {}
        while k > 0:
            lo, hi = self.first_live_block(k * B), k
            miss = None
            for j in range(hi - 1, lo - 1, -1):
                if j not in known:
                    known[j] = self.cached_block(hashes, tokens, (j + 1) * B) is not None
                if not known[j]:
                    miss = j
                    break
            if miss is None:
                return k * B
            k = min(k - 1, miss)
        return 0

    def hit_state(
        self, hashes: Sequence[bytes], tokens: Sequence[int], hit: int
    ) -> BlockTable | None:
        k = hit // self.block_size
        lo = min(self.first_live_block(hit), k)
        blocks = [NULL_BLOCK] * lo
        for j in range(lo, k):
            block = self.cached_block(hashes, tokens, (j + 1) * self.block_size)
            if block is None:
                return None  # evicted since the lookup
            blocks.append(block)
        return BlockTable(blocks=blocks, num_cached=k, first_live=lo)

    def num_new_blocks(self, state: BlockTable, c: int, n: int, lookahead: int) -> int:
        return max(0, -(-(c + n + lookahead) // self.block_size) - len(state.blocks))

    def allocate(
        self, state: BlockTable, c: int, n: int, lookahead: int, num_new: int
    ) -> list[BlockId]:
        take = self.pool.take
        new = [take() for _ in range(num_new)]
        state.blocks.extend(new)
        return new

    def commit(
        self,
        state: BlockTable,
        c: int,
        n: int,
        lookahead: int,
        accepted: int,
        hashes: Sequence[bytes],
        tokens: Sequence[int],
    ) -> None:
        c2 = c + n + accepted
        B = self.block_size
        num_full = self.cacheable_end(c2, len(tokens)) // B
        if num_full > state.num_cached:
            if self.caching:
                blocks, block_hashes = state.blocks, self.pool.hashes
                for j in range(state.num_cached, num_full):
                    block = blocks[j]
                    if block != NULL_BLOCK and block not in block_hashes:
                        self.try_cache(block, hashes, tokens, (j + 1) * B)
            state.num_cached = num_full
        # Settled: no step is in flight and no draft can be rejected any more, so the
        # blocks no later token can attend to are released now.
        first = self.first_live_block(c2)
        if first > state.first_live:
            blocks = state.blocks
            for j in range(state.first_live, min(first, len(blocks))):
                if blocks[j] != NULL_BLOCK:
                    self.pool.release(blocks[j], dead=True)
                    blocks[j] = NULL_BLOCK
            state.first_live = first

    def release_all(self, state: BlockTable) -> None:
        # Tail first: the end of a sequence is the least likely to be shared, so it
        # is evicted first.
        for block in reversed(state.blocks):
            if block != NULL_BLOCK:
                self.pool.release(block)
        state.blocks = []
        state.num_cached = 0
        state.first_live = 0

    def held(self, state: BlockTable) -> list[BlockId]:
        return [b for b in state.blocks if b != NULL_BLOCK]

    def fast_limits(self, state: BlockTable, c: int) -> tuple[int, int, int, int]:
        B = self.block_size
        commit_limit = (state.num_cached + 1) * B if self.caching else INF
        commit_limit = min(commit_limit, self.next_release(state.first_live))
        return len(state.blocks) * B, INF, INF, commit_limit

    def check_state(self, state: BlockTable, c: int) -> None:
        for j, block in enumerate(state.blocks):
            if (block == NULL_BLOCK) != (j < state.first_live):
                raise InvariantError(
                    f"group {self.group_id}: table entry {j} is {block} but first live "
                    f"block is {state.first_live}"
                )
        if len(state.blocks) * self.block_size < c:
            raise InvariantError(
                f"group {self.group_id}: {len(state.blocks)} blocks cannot hold {c} computed tokens"
            )
