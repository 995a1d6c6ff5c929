"""One pool of blocks, exactly as a `PoolPlan` lays it out.

Blocks ``1 .. num_pages - 1`` are lent to the groups that draw from the pool (one group
in a ``split`` layout, every group in a ``shared`` one); block 0 is the null block.
Per block the pool keeps a reference count and, while the block is cached, its hash and
the group whose index holds it. Each group has its own hash index ``hash -> block``.

Life of a block::

    fresh free --take--> referenced --cache--> referenced+hashed --release(last)--> cached free
        ^                    |                                                   |   |
        +---release(last)----+                  hit (touch): back to referenced <-+   |
        +------------------- take when no fresh block is left: evicted (hash dropped) +

Eviction is lazy: a cached free block keeps its hash until it is taken for reuse. Which
cached free block goes first is the free queue's eviction policy (`free_queue`): the pool
tells it whether a released block was hit since it was stored and whether its manager
released it as dead (out of every window that could still use it).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import Final, cast

from hybridkv.cache.block import NULL_BLOCK, BlockInfo
from hybridkv.cache.chain_queue import ChainQueue
from hybridkv.cache.events import BLOCK_REMOVED, BLOCK_STORED, CacheEvent
from hybridkv.cache.free_queue import PROBATION, PROTECTED, FreeQueue, LruQueue
from hybridkv.cache.indexes import MIN_TURN_END_KEY_BYTES, ChildIndex, PartialIndex
from hybridkv.cache.rules import CacheRules
from hybridkv.errors import CacheError, InvariantError
from hybridkv.ids import BlockId
from hybridkv.plan.types import PoolPlan

# The eviction policies by name (`cache.rules.EVICTION_POLICIES`), siblings on `FreeQueue`
FREE_QUEUES: dict[str, type[FreeQueue]] = {"lru": LruQueue, "chain": ChainQueue}
BARE_RULES = CacheRules()  # a pool built alone (tests): lru, no extra checkpoint rule

# From this many blocks, `cache_table`'s C-speed checks and dict updates cost less than
# its per-block loop (a prefill chunk of full attention; a few blocks of 304 do not pay)
_BULK_CACHE: Final = 8


class BlockPool:
    """Reference counts, free queue and per-group hash indexes of one pool."""

    def __init__(
        self,
        plan: PoolPlan,
        events: list[CacheEvent] | None,
        rules: CacheRules = BARE_RULES,
        *,
        token_groups: frozenset[int] = frozenset(),
        windowed: bool = False,
    ) -> None:
        """``rules``: the manager's (`CacheRules`); ``token_groups``: the groups drawing
        from this pool that index a token table (not state groups); ``windowed``: one of
        them releases blocks out of its window (`FreeQueue.windowed`)."""
        if plan.num_pages < 1:
            raise InvariantError(f"pool {plan.pool_id} has {plan.num_pages} pages; needs >= 1")
        self.pool_id = plan.pool_id
        self.num_blocks = plan.num_pages
        # Per-block integers live in lists (docs/performance.md has the memory cost).
        self.ref_counts = [0] * plan.num_pages
        self.hashes: dict[int, bytes] = {}  # cached blocks only
        self.hash_group = [-1] * plan.num_pages
        self.hash_end = [0] * plan.num_pages  # tokens covered by the hash
        self.index: dict[int, dict[bytes, BlockId]] = {g: {} for g in plan.group_ids}
        queue_cls = FREE_QUEUES.get(rules.eviction_policy)
        if queue_cls is None:
            raise CacheError(
                f"eviction policy {rules.eviction_policy!r} is unknown; use one of "
                f"{', '.join(FREE_QUEUES)}"
            )
        self.free: FreeQueue = queue_cls(
            plan.num_pages, list(range(1, plan.num_pages)), windowed=windowed
        )
        self.was_hit = [0] * plan.num_pages  # hit since stored (cached only)
        # True while the manager releases a request that started from a prefix hit
        # (`set_hot_releases`): a chain that came back once is likely to come back
        # again, and so is its extension (the blocks that request added), so they are
        # released as if hit.
        self.releasing_hot = False
        # chain policy: recently evicted blocks (`ghost_key`) -> evicted from the newest
        # end; a lookup that misses one tells the policy it chose badly. An OrderedDict:
        # dropping the oldest of a plain dict (``next(iter(d))``) scans the deleted
        # entries before it, O(pool) per eviction (7 us at 5.6k blocks); ``popitem``
        # is O(1), same order (insertion, a re-set key keeping its place)
        self.ghosts: OrderedDict[bytes, bool] | None = OrderedDict() if rules.chain else None
        # per group, the fixed-size suffix of its ghosts' keys (`ghost_key`)
        self.ghost_tags: dict[int, bytes] = {g: g.to_bytes(4, "little") for g in plan.group_ids}
        self.events = events
        self.num_evictions = 0
        self.num_stored = 0
        # turn_end rule: entries keyed by a partial last block (`cache.turn_end`); a hit
        # takes such a block over (`uncache`), counted apart from evictions
        self.partial: PartialIndex | None = PartialIndex() if rules.turn_end else None
        self.partial_groups = token_groups  # token-indexed groups (entries stay free)
        self.num_takeovers = 0
        # junction copies: cached full blocks by parent hash (`cache.junction`)
        self.children: ChildIndex | None = (
            ChildIndex(plan.num_pages) if rules.junction_copies else None
        )
        # While the coordinator serves one request's call (lookup, commit, turn-end
        # keep), token spans as bytes by (start, end, kind), shared by the groups that
        # ask for the same span (`junction.span_bytes`); None outside such a call
        # (`open_spans`, `close_spans`)
        self.spans: dict[tuple[int, int, int], bytes] | None = None

    def open_spans(self) -> None:
        """Start sharing token spans between the groups of one coordinator call."""
        self.spans = {}

    def close_spans(self) -> None:
        self.spans = None

    def set_hot_releases(self, hot: bool) -> None:
        """Blocks released while ``hot`` belong to a request that started from a prefix
        hit; the chain policy protects them as if hit."""
        self.releasing_hot = hot

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_usable if self.num_usable else 0.0

    def lookup(self, group_id: int, block_hash: bytes) -> BlockId | None:
        """The cached block of ``group_id`` under ``block_hash``, if any. A miss on a
        recently evicted block (a ghost) tells the chain policy it chose badly."""
        block = self.index[group_id].get(block_hash)
        if block is None and self.ghosts:
            newest = self.ghosts.pop(block_hash + self.ghost_tags[group_id], None)
            if newest is not None:
                self.free.regret(newest)
        return block

    def ghost_key(self, group_id: int, block_hash: bytes) -> bytes:
        """The key of an evicted block of ``group_id`` in ``ghosts``: its hash and a 4-byte
        group tag (fixed size: unique per (group, hash)); bytes are not GC-tracked."""
        return block_hash + self.ghost_tags[group_id]

    def is_cached(self, block_id: BlockId) -> bool:
        return block_id in self.hashes

    def info(self, block_id: BlockId) -> BlockInfo:
        group = self.hash_group[block_id]
        return BlockInfo(
            block_id=block_id,
            pool_id=self.pool_id,
            ref_count=self.ref_counts[block_id],
            block_hash=self.hashes.get(block_id),
            group_id=None if group < 0 else group,
            is_free=block_id != NULL_BLOCK and self.ref_counts[block_id] == 0,
        )

    # ------------------------------------------------------------------ mutations
    def take(self) -> BlockId:
        """A free block with reference count 1; evicts a cached one if no fresh is left."""
        block, was_cached = self.free.pop()
        if was_cached:
            self._evict(block)
        self.ref_counts[block] = 1
        return block

    def take_many(self, num: int) -> list[BlockId]:
        """``num`` calls of `take` (same blocks, same order, same evictions) in one
        pass; the caller has checked that ``num`` blocks are free."""
        fresh, evicted = self.free.pop_many(num)
        if evicted:
            self._evict_many(evicted)
        out: list[BlockId] = fresh + evicted  # type: ignore[assignment]
        refs = self.ref_counts
        for block in out:
            refs[block] = 1
        if len(out) < num and self.free.chain:
            # chain policy: victims chosen one by one (each depends on the last), evicted
            # in one loop
            victims, newest = cast(ChainQueue, self.free).pop_victims(num - len(out))
            self._evict_victims(victims, newest)
            for victim in victims:
                refs[victim] = 1
            out += victims  # type: ignore[arg-type]  # ids from the free queue
        while len(out) < num:  # a queue that evicts through `pop` only (`sim.belady`)
            out.append(self.take())
        return out

    def touch_many(self, block_ids: Sequence[BlockId]) -> None:
        """`touch` for each block in order (a request's hit blocks at admission)."""
        refs, free = self.ref_counts, self.free
        revived = [block for block in block_ids if not refs[block]]
        if revived:  # cached free blocks leave the free queue, in one pass
            if NULL_BLOCK in revived:
                raise InvariantError(f"pool {self.pool_id}: touch of the null block")
            free.take_cached(revived)
        for block in block_ids:
            refs[block] += 1
        if free.chain:  # only chain reads `was_hit` (lru ignores how a block was used)
            was_hit = self.was_hit
            for block in block_ids:
                was_hit[block] = 1

    def touch(self, block_id: BlockId) -> None:
        """Add a reference to a cached block (a prefix hit); revives it if free."""
        assert block_id != NULL_BLOCK
        if self.ref_counts[block_id] == 0:
            self.free.note_hit(block_id)
            self.free.remove_cached(block_id)
        self.ref_counts[block_id] += 1
        self.was_hit[block_id] = 1

    def release(self, block_id: BlockId, *, dead: bool = False) -> None:
        """Drop one reference; ``dead``: the releasing request can no longer read it from
        any position it will compute (the eviction policy may evict it first)."""
        assert block_id != NULL_BLOCK and self.ref_counts[block_id] > 0, block_id
        count = self.ref_counts[block_id] - 1
        self.ref_counts[block_id] = count
        if count == 0:
            if block_id not in self.hashes:
                self.free.push_fresh(block_id)
            else:
                hot = self.releasing_hot or bool(self.was_hit[block_id])
                self.free.push_cached(block_id, dead=dead, was_hit=hot)

    def release_many(self, block_ids: Iterable[int]) -> None:
        """`release` for each block in order (null blocks skipped): a request's whole
        table at `free`, in one loop over local names. The chain policy sees exactly the
        pushes single releases make (one burst of cached blocks until a fresh one ends
        it; hit and hot blocks protected); lru links the cached ones in one pass."""
        refs, hashes = self.ref_counts, self.hashes
        if self.free.chain:
            was_hit, hot = self.was_hit, self.releasing_hot
            freed: list[int] = []
            tiers: list[int] = []  # -1: fresh; else the cached tier single releases pick
            for block in block_ids:
                if not block:  # NULL_BLOCK (0): a plain truth test in the hot loop
                    continue
                count = refs[block] - 1
                if count < 0:
                    raise InvariantError(f"pool {self.pool_id}: block {block} released while free")
                refs[block] = count
                if count == 0:
                    freed.append(block)
                    if block not in hashes:
                        tiers.append(-1)
                    else:
                        tiers.append(PROTECTED if hot or was_hit[block] else PROBATION)
            if freed:
                cast(ChainQueue, self.free).push_chain_many(freed, tiers)
            return
        bad = cast(LruQueue, self.free).release_lru(refs, hashes, block_ids)
        if bad is not None:
            raise InvariantError(f"pool {self.pool_id}: block {bad} released while free")

    def cache(
        self,
        block_id: BlockId,
        group_id: int,
        block_hash: bytes,
        num_tokens: int,
    ) -> bool:
        """Enter a referenced, uncached block into ``group_id``'s index.

        Returns False (and changes nothing) when the index already holds another block
        under this hash: the first copy wins and this one stays private.
        """
        assert self.ref_counts[block_id] > 0 and block_id not in self.hashes
        index = self.index[group_id]
        if block_hash in index:
            return False
        index[block_hash] = block_id
        self.hashes[block_id] = block_hash
        self.hash_group[block_id] = group_id
        self.hash_end[block_id] = num_tokens
        self.num_stored += 1
        if self.events is not None:
            self.events.append(CacheEvent(BLOCK_STORED, group_id, block_id, block_hash, num_tokens))
        return True

    def cache_table(
        self,
        group_id: int,
        blocks: list[BlockId],
        first: int,
        last: int,
        hashes: Sequence[bytes],
        units_per_block: int,
        block_size: int,
    ) -> bool:
        """`cache` each block ``blocks[j]``, j in ``[first, last)``, under the chain hash
        ``hashes[(j + 1) * units_per_block - 1]`` (a token-indexed table's newly full
        blocks), skipping null blocks and blocks already cached; in one loop. True when
        every one of them was stored (none null, cached or keyed already)."""
        index, own, events = self.index[group_id], self.hashes, self.events
        hash_group, hash_end = self.hash_group, self.hash_end
        if events is None and last - first >= _BULK_CACHE:
            # A prefill chunk's blocks, the common case: none null, none cached, no key
            # in the index yet (checked at C speed). The loop below would store every
            # one; the dicts take them in one update each (chain keys of distinct
            # positions are distinct, so no key repeats), and only the lists need a loop
            table = blocks[first:last]
            step = units_per_block
            keys = hashes[(first + 1) * step - 1 : last * step : step]
            if (
                len(keys) == len(table)
                and NULL_BLOCK not in table
                and not any(map(own.__contains__, table))
                and not any(map(index.__contains__, keys))
            ):
                index.update(zip(keys, table, strict=False))  # lengths checked above
                own.update(zip(table, keys, strict=False))
                end = first * block_size
                for block in table:
                    end += block_size
                    hash_group[block] = group_id
                    hash_end[block] = end
                self.num_stored += len(table)
                return True
        stored = 0
        for j in range(first, last):
            block = blocks[j]
            if block == NULL_BLOCK or block in own:
                continue
            key = hashes[(j + 1) * units_per_block - 1]
            if key in index:
                continue  # the first copy wins (see `cache`)
            index[key] = block
            own[block] = key
            hash_group[block] = group_id
            hash_end[block] = (j + 1) * block_size
            stored += 1
            if events is not None:
                events.append(CacheEvent(BLOCK_STORED, group_id, block, key, (j + 1) * block_size))
        self.num_stored += stored
        return stored == last - first

    def uncache(self, block_id: BlockId) -> None:
        """Take a referenced cached block out of its index: a turn-end partial block
        taken over by the request that hit it (it writes the block past the entry's
        end, so the entry must go). Counted in ``num_takeovers``."""
        assert self.ref_counts[block_id] > 0 and block_id in self.hashes
        group, block_hash = self._unindex(block_id)
        self.num_takeovers += 1
        if self.events is not None:
            self.events.append(
                CacheEvent(BLOCK_REMOVED, group, block_id, block_hash, self.hash_end[block_id])
            )

    def _unindex(self, block_id: BlockId) -> tuple[int, bytes]:
        """Drop a cached block from its group's index (and the turn-end entries);
        returns (group, hash). Shared by eviction and turn-end takeover."""
        block_hash = self.hashes[block_id]
        del self.hashes[block_id]
        group = self.hash_group[block_id]
        del self.index[group][block_hash]
        if self.partial is not None:
            self.partial.discard(group, block_hash)
        if self.children is not None:
            self.children.discard(group, block_id)
        self.hash_group[block_id] = -1
        self.was_hit[block_id] = 0
        self.free.forget(block_id)
        return group, block_hash

    def _evict_many(self, block_ids: list[int]) -> None:
        """`_evict` for each block in order; in one loop when nothing else listens
        (no events, ghosts, turn-end or junction entries, no reuse distances)."""
        quiet = self.events is None and self.ghosts is None and self.partial is None
        if not quiet or self.children is not None or self.free.chain:
            for block in block_ids:
                self._evict(block)  # type: ignore[arg-type]  # ids from the free queue
            return
        pop, hash_group, index, was_hit = self.hashes.pop, self.hash_group, self.index, self.was_hit
        for block in block_ids:
            del index[hash_group[block]][pop(block)]
            hash_group[block] = -1
            was_hit[block] = 0
        self.num_evictions += len(block_ids)

    def _evict_victims(self, victims: list[int], newest: list[bool]) -> None:
        """chain: `_evict` for each victim in order, ``newest[i]`` standing for the free
        queue's `last_victim_newest` at its choice; one loop over local names, the
        discards' first tests inline (no victim choice reads what an eviction changes:
        hash indexes, turn-end and junction entries, ghosts, reuse distances)."""
        own, hash_group, index, was_hit = self.hashes, self.hash_group, self.index, self.was_hit
        partial, children, ghosts, events = self.partial, self.children, self.ghosts, self.events
        limit, tags = self.num_blocks, self.ghost_tags
        parents = children.parent_of if children is not None else []
        for i, block in enumerate(victims):
            new = newest[i]
            block_hash = own[block]
            del own[block]
            group = hash_group[block]
            del index[group][block_hash]
            if partial is not None and len(block_hash) >= MIN_TURN_END_KEY_BYTES:
                partial.discard(group, block_hash)
            if children is not None and parents[block] is not None:
                children.discard(group, block)  # type: ignore[arg-type]
            hash_group[block] = -1
            was_hit[block] = 0
            if ghosts is not None:
                ghosts[block_hash + tags[group]] = new
                if len(ghosts) > limit:
                    ghosts.popitem(False)  # positional: no keyword names
            if events is not None:
                events.append(
                    CacheEvent(BLOCK_REMOVED, group, block, block_hash, self.hash_end[block])  # type: ignore[arg-type]
                )
        self.free.forget_many(victims)
        self.num_evictions += len(victims)

    def _evict(self, block_id: BlockId) -> None:
        group, block_hash = self._unindex(block_id)
        if self.ghosts is not None:
            self.ghosts[block_hash + self.ghost_tags[group]] = self.free.last_victim_newest
            if len(self.ghosts) > self.num_blocks:
                self.ghosts.popitem(False)  # positional: no keyword names
        self.num_evictions += 1
        if self.events is not None:
            self.events.append(
                CacheEvent(BLOCK_REMOVED, group, block_id, block_hash, self.hash_end[block_id])
            )

    # ------------------------------------------------------------------ invariants
    def check_invariants(self, expected_refs: Counter[int]) -> None:
        """Free/referenced partition, ref counts, hash index, null block."""

        def fail(msg: str) -> None:
            raise InvariantError(f"pool {self.pool_id}: {msg}")

        self.free.check_invariants()
        fresh = self.free.fresh_ids()
        cached = self.free.cached_ids()
        free = fresh + cached
        if len(free) != len(set(free)) or len(free) != len(self.free):
            fail(f"free queue has duplicates or a wrong count ({len(free)} vs {len(self.free)})")
        if NULL_BLOCK in set(free):
            fail("the null block is in the free queue")
        if self.ref_counts[NULL_BLOCK] != 0 or NULL_BLOCK in self.hashes:
            fail("the null block is referenced or cached")
        free_set = set(free)
        for block in range(1, self.num_blocks):
            refs = self.ref_counts[block]
            if refs != expected_refs.get(block, 0):
                fail(
                    f"block {block} has ref count {refs} but {expected_refs.get(block, 0)} "
                    "references from block tables"
                )
            if (refs == 0) != (block in free_set):
                fail(f"block {block} with ref count {refs} is free={block in free_set}")
        for block in fresh:
            if block in self.hashes:
                fail(f"fresh free block {block} carries a hash")
            if self.was_hit[block]:
                fail(f"fresh free block {block} is marked as hit since stored")
        for block in cached:
            if block not in self.hashes:
                fail(f"cached free block {block} carries no hash")
        num_indexed = 0
        for group, index in self.index.items():
            num_indexed += len(index)
            for block_hash, block in index.items():
                if self.hashes.get(block) != block_hash or self.hash_group[block] != group:
                    fail(f"index of group {group} maps a hash to block {block} holding another")
        num_hashed = len(self.hashes)
        if num_hashed != num_indexed:
            fail(f"{num_hashed} blocks carry hashes but the indexes hold {num_indexed}")
        if self.partial is not None:
            self.partial.check(self, self.partial_groups)
        if self.children is not None:
            self.children.check(self)
