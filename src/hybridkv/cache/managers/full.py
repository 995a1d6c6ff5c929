"""Full attention (and MLA): one block per ``block_size`` tokens, all kept.

Block table of a request, block size 4, 10 tokens computed, 2 drafts reserved::

    position  0123 4567 89dd
    table     [b5] [b9] [b2]        block j covers tokens [4j, 4j + 4)
    cached    yes  yes  no          a block is cached once all 4 tokens are verified

Subclasses (sliding window, chunked local) differ only in the spec's
``first_live_block``: the first block a step starting at ``c`` computed tokens may read
(`LayerSpec.first_live_block`, the same arithmetic the planner's peak uses). Blocks
before it hold the null block (0) in the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from hybridkv.cache.block import NULL_BLOCK
from hybridkv.cache.delta import GroupDelta
from hybridkv.cache.junction import find_partial, is_copy_source, note_children, span_bytes
from hybridkv.cache.managers.base import NO_GROWTH, UNBOUNDED, Bounds, GroupManager
from hybridkv.cache.turn_end import find_turn_end, store_turn_end
from hybridkv.errors import InvariantError
from hybridkv.ids import BlockId

_new_limits = tuple.__new__  # named tuples built without their Python-level __new__
# Up to this many blocks, a hit scan's Python loop costs less than the C-speed pass's
# set-up (a slice, a map, a zip: large blocks of hybrid plans give tables of a few)
_SHORT_SCAN: Final = 8


@dataclass
class TableBlocks:
    """A request's block table in one token-indexed group (the engine's own table
    type is `hybridkv.engine.ops.context.BlockTable`; this one is the manager's record)."""

    blocks: list[BlockId] = field(default_factory=list)
    num_cached: int = 0  # leading blocks already considered for caching
    first_live: int = 0  # blocks before this index are NULL_BLOCK
    # junction copy (`cache.junction`): the cached block whose first ``copy_tokens``
    # slots the engine copies into block ``num_cached``; referenced until first commit
    copy_src: BlockId = NULL_BLOCK
    copy_tokens: int = 0


class FullAttentionManager(GroupManager):
    """Left-to-right hit scan that stops at the first miss."""

    # Whether blocks ever leave the window (`next_release` not None): subclasses that
    # release set it; full attention skips the window arithmetic on every commit.

    def first_live_block(self, num_computed: int) -> int:
        # the spec's arithmetic (sliding and chunked managers inline their own)
        return self.group.spec.first_live_block(num_computed, self.block_size)

    def next_release(self, first_live: int) -> int | None:
        """Smallest ``c`` with ``first_live_block(c) > first_live`` (None: never)."""
        return None

    def new_state(self) -> TableBlocks:
        return TableBlocks()

    def max_hit(
        self,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
        limit: int,
        found: dict[int, BlockId],
    ) -> int:
        # Hit k blocks needs blocks [0, k) cached (EAGLE / MTP head groups key their
        # blocks one token ahead, so no block is dropped: see `GroupManager.key`).
        B = self.block_size
        max_blocks = min(limit // B, len(hashes) * self.unit_tokens // B)
        num = 0
        # Blocks an earlier pass saw first, then the index directly: one dict get per
        # block (the common plan: one group, one pass, `found` empty).
        while num < max_blocks and (num + 1) * B in found:
            num += 1
        if num < max_blocks:
            if self.key_ahead or self.ghosts:
                while num < max_blocks:
                    end = (num + 1) * B
                    block = self.cached_block(hashes, tokens, end)
                    if block is None:
                        break
                    found[end] = block
                    num += 1
            elif max_blocks - num <= _SHORT_SCAN:  # a few blocks: one dict get each
                get, step = self.index.get, B // self.unit_tokens
                while num < max_blocks:
                    block = get(hashes[(num + 1) * step - 1])
                    if block is None:
                        break
                    num += 1
                    found[num * B] = block
            else:  # one C-speed pass: the blocks under each block end's chain hash
                step = B // self.unit_tokens
                keys = hashes[(num + 1) * step - 1 : max_blocks * step : step]
                blocks: list[BlockId | None] = list(map(self.index.get, keys))
                if None in blocks:
                    del blocks[blocks.index(None) :]
                ends = range((num + 1) * B, (num + len(blocks) + 1) * B, B)
                found.update(zip(ends, blocks, strict=True))  # type: ignore[arg-type]  # no None
                num += len(blocks)
        if self.turn_end and num * B < limit:
            return self._turn_end_hit(hashes, root, tokens, num * B, limit, found)
        return num * B

    def _turn_end_hit(
        self,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
        anchor: int,
        limit: int,
        found: dict[int, BlockId],
    ) -> int:
        """``anchor`` (a block hit), extended into the next block by a turn-end entry
        ending at or below ``limit`` when one matches (see `cache.turn_end`)."""
        entry = find_turn_end(self, hashes, root, tokens, anchor, limit)
        partial = find_partial(self, hashes, root, tokens, anchor, limit)
        if partial is not None and (entry is None or partial[0] > entry[0]):
            entry = partial  # a junction copy reaches further than any turn-end entry
        if entry is None:
            return anchor
        found[entry[0]] = entry[1]
        return entry[0]

    def window_hit(
        self,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
        limit: int,
        found: dict[int, BlockId],
    ) -> int:
        """Largest ``k * B <= limit`` with blocks [first_live_block(kB), k) cached (with
        turn_end, extended into block ``k`` as `_turn_end_hit` does).

        Scans down from the limit; after a miss at block j, only ``k <= j`` can work, so
        every block is looked up at most once::

            window 2 blocks, blocks cached: 0 1 . 3 4 5     (. = miss)
            k=6: needs 4,5 -> hit 6 blocks; k=3 would need 1,2 -> 2 missing
        """
        B = self.block_size
        num_hashed_blocks = len(hashes) * self.unit_tokens // B
        k = min(limit // B, num_hashed_blocks)
        missing: set[int] = set()
        while k > 0:
            lo, hi = self.first_live_block(k * B), k
            miss = None
            for j in range(hi - 1, lo - 1, -1):
                end = (j + 1) * B
                if end not in found and j not in missing:
                    block = self.cached_block(hashes, tokens, end)
                    if block is None:
                        missing.add(j)
                    else:
                        found[end] = block
                if j in missing:
                    miss = j
                    break
            if miss is None:
                if self.turn_end and k * B < limit:
                    return self._turn_end_hit(hashes, root, tokens, k * B, limit, found)
                return k * B
            k = min(k - 1, miss)
        if self.turn_end and limit > 0:  # an end inside the first block needs no block
            return self._turn_end_hit(hashes, root, tokens, 0, limit, found)
        return 0

    def hit_state(
        self,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
        hit: int,
        found: dict[int, BlockId] | None,
    ) -> TableBlocks | None:
        B = self.block_size
        k = hit // B
        lo = min(self.first_live_block(hit), k) if self.releases else 0
        blocks = [NULL_BLOCK] * lo
        ends = range((lo + 1) * B, (k + 1) * B, B)
        seen: list[BlockId | None] = (
            list(map(found.get, ends)) if found is not None else [None] * len(ends)
        )
        if None in seen:  # not seen by the lookup: look each missing block up again
            for i, end in enumerate(ends):
                if seen[i] is None:
                    seen[i] = self.cached_block(hashes, tokens, end)
                    if seen[i] is None:
                        return None  # evicted since the lookup
        blocks += seen  # type: ignore[arg-type]  # every None was replaced or returned
        if hit % B:  # a turn-end hit or a junction copy: the block after the k full ones
            block = found.get(hit) if found is not None else None
            if block is None:
                entry = find_turn_end(self, hashes, root, tokens, k * B, hit, exact=True)
                if entry is None:
                    entry = find_partial(self, hashes, root, tokens, k * B, hit)
                    if entry is None or entry[0] != hit:
                        return None
                block = entry[1]
            if is_copy_source(self, block):  # copied into a fresh block at allocate
                state = TableBlocks(blocks=blocks, num_cached=k, first_live=lo)
                state.copy_src, state.copy_tokens = block, hit - k * B
                return state
            blocks.append(block)
        return TableBlocks(blocks=blocks, num_cached=k, first_live=lo)

    def adopt(self, state: TableBlocks) -> None:
        # the block after the cached ones is a turn-end partial block when it is cached:
        # this request writes it past the entry's end, so it leaves the index
        k = state.num_cached
        if self.turn_end and k < len(state.blocks) and state.blocks[k] in self.pool.hashes:
            self.pool.uncache(state.blocks[k])

    def keep_turn_end(
        self,
        state: TableBlocks,
        c: int,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
    ) -> None:
        end = self.cacheable_end(c, len(tokens))
        j = end // self.block_size
        if not self.caching or end % self.block_size == 0 or j >= len(state.blocks):
            return
        block = state.blocks[j]
        if (
            block != NULL_BLOCK
            and block not in self.pool.hashes
            and store_turn_end(self, block, hashes, root, tokens, end)
        ):
            # released now, first to evict (`cache.turn_end`); release_all skips it
            self.pool.release(block, dead=True)
            state.blocks[j] = NULL_BLOCK

    def num_new_blocks(self, state: TableBlocks, c: int, n: int, lookahead: int) -> int:
        # Table positions [0, cdiv(c + n + L, B)): the spec's blocks_needed plus the
        # null positions before the first live block, which the table already has.
        return max(0, -(-(c + n + lookahead) // self.block_size) - len(state.blocks))

    def reserve_blocks(self, state: TableBlocks, start_max: int, n: int, lookahead: int) -> int:
        # positions are positions: the table covers the latest end any acceptance gives
        return self.num_new_blocks(state, start_max, n, lookahead)

    def reserve(
        self, state: TableBlocks, start_max: int, n: int, lookahead: int, new: list[BlockId]
    ) -> None:
        state.blocks += new

    def grow(
        self, state: TableBlocks, c: int, n: int, lookahead: int
    ) -> tuple[GroupDelta | None, tuple[BlockId, ...]] | None:
        # `GroupManager.grow` in one frame: a decode step's new block every few steps
        blocks = state.blocks
        start = len(blocks)
        num = -(-(c + n + lookahead) // self.block_size) - start
        if num <= 0:
            return NO_GROWTH
        pool = self.pool
        if num > len(pool.free):
            return None
        new = tuple(pool.take_many(num))
        blocks += new
        return _new_limits(GroupDelta, (start, new, None)), new

    def place(
        self, state: TableBlocks, c: int, n: int, lookahead: int, new: list[BlockId]
    ) -> list[BlockId]:
        state.blocks += new
        return new

    def delta(self, state: TableBlocks, new_blocks: Sequence[BlockId], whole: bool) -> GroupDelta:
        # GroupDelta(start, new_blocks, None), built the cheap way (`_new_limits`)
        if whole:
            return _new_limits(GroupDelta, (0, tuple(state.blocks), None))
        return _new_limits(
            GroupDelta, (len(state.blocks) - len(new_blocks), tuple(new_blocks), None)
        )

    def commit(
        self,
        state: TableBlocks,
        c: int,
        n: int,
        lookahead: int,
        accepted: int,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
    ) -> tuple[int, int] | None:
        c2 = c + n + accepted
        B = self.block_size
        if state.copy_src:  # the copy ran before this step: unpin its source
            self.pool.release(state.copy_src)
            state.copy_src, state.copy_tokens = NULL_BLOCK, 0
        num_full = (min(c2, len(tokens) - 1) if self.key_ahead else c2) // B  # cacheable_end
        if num_full > state.num_cached:
            pool = self.pool
            if num_full == state.num_cached + 1 and self.caching:
                # one block filled (a decode step): `cache_table`'s loop body, once, and
                # `note_children`'s (junction copies; groups keyed ahead index none)
                j = num_full - 1
                block = state.blocks[j]
                own = pool.hashes
                if block != NULL_BLOCK and block not in own:
                    end = num_full * B
                    if self.key_ahead:
                        self.try_cache(block, hashes, tokens, end)
                    else:
                        pool.cache(block, self.group_id, hashes[end // self.unit_tokens - 1], end)
                children = pool.children
                if children is not None and not self.key_ahead:
                    step = B // self.unit_tokens
                    if own.get(block) == hashes[num_full * step - 1] and (
                        children.parent_of[block] is None
                    ):
                        children.add(
                            self.group_id,
                            hashes[j * step - 1] if j else root,
                            block,
                            span_bytes(pool, tokens, j * B, num_full * B),
                        )
            elif self.caching and not self.key_ahead:  # keys: chain hashes (`key`)
                fresh = self.pool.cache_table(
                    self.group_id,
                    state.blocks,
                    state.num_cached,
                    num_full,
                    hashes,
                    B // self.unit_tokens,
                    B,
                )
                if self.pool.children is not None:
                    note_children(
                        self, state.blocks, state.num_cached, num_full, hashes, root, tokens, fresh
                    )
            elif self.caching:
                blocks, block_hashes = state.blocks, self.pool.hashes
                for j in range(state.num_cached, num_full):
                    block = blocks[j]
                    if block != NULL_BLOCK and block not in block_hashes:
                        self.try_cache(block, hashes, tokens, (j + 1) * B)
            state.num_cached = num_full
        if not self.releases:
            return None
        # Settled: no step is in flight and no draft can be rejected any more, so the
        # blocks no later token can attend to are released now.
        first = self.first_live_block(c2)
        if first <= state.first_live:
            return None
        blocks = state.blocks
        lo, hi = state.first_live, min(first, len(blocks))
        release = self.pool.release
        for j in range(lo, hi):
            if blocks[j] != NULL_BLOCK:
                # dead: out of this request's window for good (evicted first by chain)
                release(blocks[j], dead=True)
                blocks[j] = NULL_BLOCK
        state.first_live = first
        return (lo, hi) if hi > lo else None

    def detach(self, state: TableBlocks) -> list[BlockId]:
        # Tail first: the end of a sequence is the least likely to be shared, so it is
        # evicted first; then a copy source still pinned (admitted, never committed).
        out = state.blocks[::-1]
        if state.copy_src:
            out.append(state.copy_src)
            state.copy_src, state.copy_tokens = NULL_BLOCK, 0
        state.blocks = []
        state.num_cached = 0
        state.first_live = 0
        return out

    def held(self, state: TableBlocks) -> list[BlockId]:
        blocks = state.blocks
        held = [b for b in blocks if b != NULL_BLOCK] if NULL_BLOCK in blocks else blocks[:]
        if state.copy_src:
            held.append(state.copy_src)  # pinned until the copy has run
        return held

    def copy_order(self, state: TableBlocks) -> tuple[BlockId, BlockId, int] | None:
        """(source, destination, slots) of a pending junction copy, once allocated."""
        k = state.num_cached
        if not state.copy_src or k >= len(state.blocks):
            return None
        return state.copy_src, state.blocks[k], state.copy_tokens

    def fast_bounds(self, state: TableBlocks, c: int) -> Bounds:
        # Allocate: the table's slots. Commit: the next block to fill (to cache it) and
        # the next position where a block leaves the window (to release it); 0 while a
        # junction copy's source is pinned (the next commit unpins it: slow path).
        # end_tokens, verified_tokens, lookahead_tokens, commit_below
        B = self.block_size
        end = len(state.blocks) * B
        if state.copy_src:
            return end, UNBOUNDED, UNBOUNDED, 0
        fill = (state.num_cached + 1) * B if self.caching else UNBOUNDED
        if not self.releases:  # full attention: no window arithmetic
            return end, UNBOUNDED, UNBOUNDED, fill
        release = self.next_release(state.first_live)
        if release is not None and release < fill:
            fill = release
        return end, UNBOUNDED, UNBOUNDED, fill

    def check_state(self, state: TableBlocks, c: int) -> None:
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
