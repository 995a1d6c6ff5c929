"""Free blocks of one pool, in reuse order, with O(1) removal: `FreeQueue`, the base
of the eviction policies, and `LruQueue`.

*Fresh* blocks hold no cached data; they are always reused first, last freed first (a
stack). *Cached* free blocks still carry a hash and can be hit again; they sit in
*tiers*, each a doubly linked list kept in two int lists indexed by block id, with one
sentinel per tier at index ``num_blocks + tier``::

    sentinel <-> b7 <-> b3 <-> b9 <-> sentinel
                 ^ oldest            ^ freed last

A hit removes a block from the middle of its tier in O(1) (``prev``/``next`` joined).

Policies are sibling classes of `FreeQueue` (the pool picks one by name from
`cache.rules.EVICTION_POLICIES`):

* ``lru`` (`LruQueue`): one tier, least recently freed first. A cyclic scan larger than
  the cache (sessions served round robin) evicts every block just before it is needed.
* ``chain`` (`cache.chain_queue.ChainQueue`): scan resistant, reuse-distance aware,
  leaf first, over three tiers.
* the simulator's offline Belady queue (`sim.belady`) extends `LruQueue` through its
  public methods and the `victim` hook.

`FreeQueue` owns the structure: the fresh stack, the tiers' links and counts, the reads
and their invariants. Each change of the links is written once here, its bulk form
beside it (`_link_before` / `_append_run`, `_unlink` / `_unlink_many`); a policy
decides where a released block goes (`push_cached`) and which cached block is evicted
(`victim`, `pop`, `pop_many`), and may listen to hits, evictions and regretted
evictions (`note_hit`, `forget`, `regret`: nothing by default).

Measured and dropped: lru's links as numpy operations on the link arrays (and caching a
prefill chunk's blocks with numpy and dict updates) were no faster for tables of ~100
blocks, and twice slower per `free` in `bench/manager_step.py` (numpy's per-call cost
is a few microseconds; the loop's is ~40 bytecodes per block).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

from hybridkv.cache.rules import DEFAULT_EVICTION_POLICY as DEFAULT_EVICTION_POLICY
from hybridkv.errors import CacheError, InvariantError
from hybridkv.ids import BlockId

try:  # class options of the compiled build (docs/compiled_core.md)
    from mypy_extensions import mypyc_attr
except ImportError:  # pragma: no cover - the pure-Python install without the dev extra

    def mypyc_attr(*attrs: str, **kwattrs: object) -> Any:  # type: ignore[misc]
        return lambda cls: cls


# Tier indexes (``lru`` uses only PROBATION).
DEAD: Final = 0
PROBATION: Final = 1
PROTECTED: Final = 2
TIER_NAMES = ("dead", "probation", "protected")
NUM_TIERS: Final = 3
NONE: Final = -1  # no link, no tier


@mypyc_attr(allow_interpreted_subclasses=True)  # policies outside the core (`sim.belady`)
class FreeQueue:
    """Free block ids of one pool under an eviction policy (a subclass); see the module
    docstring for the order and for what a policy provides."""

    def __init__(self, num_blocks: int, fresh_ids: list[int], *, windowed: bool = False) -> None:
        self.chain = False  # the chain policy (`ChainQueue`: its pool takes its bulk paths)
        self._num_blocks = num_blocks
        size = num_blocks + NUM_TIERS
        self._prev = [NONE] * size
        self._next = [NONE] * size
        self._tier = [NONE] * num_blocks
        for tier in range(NUM_TIERS):
            s = num_blocks + tier
            self._prev[s] = self._next[s] = s
        self._tier_len = [0] * NUM_TIERS
        self._num_cached = 0
        # A group of this pool releases blocks out of its window: a hit needs the window's
        # blocks at its end, so a policy that evicts a session tail first (chain's loop
        # mode) loses its whole hit; such policies read this to stay off.
        self.windowed = windowed
        # The end of its tier the last victim came from (newest: True), for the pool's
        # ghost index (`BlockPool.lookup` tells `regret` of a miss on it)
        self.last_victim_newest = False
        # Stack: the last element is reused first, so push in reverse to hand out
        # the lowest ids first (readable golden scenarios).
        self._fresh = fresh_ids[::-1]

    # ------------------------------------------------------------------ reads
    def __len__(self) -> int:
        return len(self._fresh) + self._num_cached

    @property
    def num_cached(self) -> int:
        return self._num_cached

    @property
    def num_fresh(self) -> int:
        return len(self._fresh)

    def in_cached_tier(self, block_id: int) -> bool:
        return self._tier[block_id] >= 0

    def tier_of(self, block_id: int) -> str | None:
        tier = self._tier[block_id]
        return None if tier < 0 else TIER_NAMES[tier]

    def fresh_ids(self) -> list[int]:
        return list(self._fresh)

    def tier_ids(self, tier: int) -> list[int]:
        """Cached free blocks of one tier, oldest (LRU end) first."""
        out = []
        sentinel = self._num_blocks + tier
        node = self._next[sentinel]
        while node != sentinel:
            out.append(node)
            node = self._next[node]
        return out

    def cached_ids(self) -> list[int]:
        """Every cached free block, tier by tier in eviction order of the tiers."""
        return [b for tier in range(NUM_TIERS) for b in self.tier_ids(tier)]

    # ------------------------------------------------------------------ links
    def _link_before(self, block_id: int, node: int, tier: int) -> None:
        """Link ``block_id`` into ``tier`` just before ``node`` (the tier's sentinel: at
        its newest end)."""
        prev = self._prev[node]
        self._next[prev] = block_id
        self._prev[block_id] = prev
        self._next[block_id] = node
        self._prev[node] = block_id
        self._tier[block_id] = tier
        self._tier_len[tier] += 1
        self._num_cached += 1

    def _append_run(self, block_ids: list[int], tier: int) -> None:
        """`_link_before` the sentinel of ``tier`` for each block in order, in one pass."""
        prev, nxt, tier_of = self._prev, self._next, self._tier
        sentinel = self._num_blocks + tier
        last = prev[sentinel]
        for block in block_ids:
            tier_of[block] = tier
            nxt[last] = block
            prev[block] = last
            last = block
        nxt[last] = sentinel
        prev[sentinel] = last
        self._tier_len[tier] += len(block_ids)
        self._num_cached += len(block_ids)

    def _unlink(self, block_id: int) -> None:
        """Take a cached free block out of its tier, O(1) (``prev``/``next`` joined)."""
        tier = self._tier[block_id]
        if tier < 0:
            raise InvariantError(f"block {block_id} is not a cached free block")
        prev, nxt = self._prev, self._next
        before, after = prev[block_id], nxt[block_id]
        nxt[before] = after
        prev[after] = before
        self._tier[block_id] = NONE  # its own links go stale: nothing reads them
        self._tier_len[tier] -= 1
        self._num_cached -= 1

    def _unlink_many(self, block_ids: Sequence[int]) -> None:
        """`_unlink` for each block in order, in one loop."""
        prev, nxt, tier_of, tier_len = self._prev, self._next, self._tier, self._tier_len
        for block in block_ids:
            tier = tier_of[block]
            if tier < 0:
                raise InvariantError(f"block {block} is not a cached free block")
            before, after = prev[block], nxt[block]
            nxt[before] = after
            prev[after] = before
            tier_of[block] = NONE
            tier_len[tier] -= 1
        self._num_cached -= len(block_ids)

    def _take_fresh(self, num: int) -> list[int]:
        """Up to ``num`` fresh blocks, in the order ``num`` pops hand them out."""
        fresh = self._fresh
        k = min(num, len(fresh))
        if k == 1:
            return [fresh.pop()]
        taken = fresh[len(fresh) - k :]
        taken.reverse()  # pop order: the stack's top first
        del fresh[len(fresh) - k :]
        return taken

    # ------------------------------------------------------------------ the policy's part
    def push_fresh(self, block_id: int) -> None:
        self._fresh.append(block_id)

    def push_fresh_many(self, block_ids: list[int]) -> None:
        """`push_fresh` for each block in order."""
        self._fresh.extend(block_ids)

    def push_cached(self, block_id: int, *, dead: bool = False, was_hit: bool = False) -> None:
        """A cached block was freed: ``dead`` when it can no longer serve a hit of the
        request that freed it, ``was_hit`` when a prefix hit used it since stored."""
        raise NotImplementedError

    def push_cached_many(self, block_ids: list[int]) -> None:
        """`push_cached` for each block in order (the last one is freed last), none dead
        or hit: a request's table at `free`."""
        raise NotImplementedError

    def remove_cached(self, block_id: BlockId) -> None:
        """Unlink a cached free block (it was hit, or is being evicted), O(1)."""
        self._unlink(block_id)

    def take_cached(self, block_ids: Sequence[BlockId]) -> None:
        """`note_hit` and `remove_cached` for each block in order (cached free blocks a
        prefix hit takes back)."""
        self._unlink_many(block_ids)

    def victim(self) -> int:
        """The cached block `pop` evicts next (not unlinked yet); `CacheError` when none
        is left."""
        raise NotImplementedError

    def pop(self) -> tuple[BlockId, bool]:
        """The next block to reuse and whether it comes from a cached tier (eviction)."""
        raise NotImplementedError

    def pop_many(self, num: int) -> tuple[list[int], list[int]]:
        """``num`` blocks in the order ``num`` calls of `pop` hand them out, as (fresh,
        evicted): the caller must evict the second list's blocks. A policy whose victims
        depend on the evictions before them may hand out fewer (fresh ones only): the
        caller takes the rest one by one (`BlockPool.take_many`)."""
        raise NotImplementedError

    def note_hit(self, block_id: BlockId) -> None:
        """A prefix hit takes this cached free block (before `remove_cached`)."""

    def forget(self, block_id: BlockId) -> None:
        """The block was evicted or taken over: its history no longer applies."""

    def forget_many(self, block_ids: list[int]) -> None:
        """`forget` for each block."""

    def regret(self, evicted_newest: bool) -> None:
        """A lookup missed a block this policy evicted from the ``evicted_newest`` end."""

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Links are symmetric, tier marks and counts agree, no block twice."""
        seen: set[int] = set()
        for tier in range(NUM_TIERS):
            ids = self.tier_ids(tier)
            if len(ids) != self._tier_len[tier]:
                raise InvariantError(
                    f"free queue tier {TIER_NAMES[tier]}: {len(ids)} linked blocks, "
                    f"count says {self._tier_len[tier]}"
                )
            for block in ids:
                if self._tier[block] != tier or block in seen:
                    raise InvariantError(
                        f"free queue: block {block} linked in tier {TIER_NAMES[tier]} but "
                        f"marked {self._tier[block]} (or linked twice)"
                    )
                if self._prev[self._next[block]] != block:
                    raise InvariantError(f"free queue: broken links around block {block}")
                seen.add(block)
        if len(seen) != self._num_cached:
            raise InvariantError(
                f"free queue: {len(seen)} cached blocks linked, count says {self._num_cached}"
            )
        marked = sum(1 for t in self._tier if t >= 0)
        if marked != self._num_cached:
            raise InvariantError(
                f"free queue: {marked} blocks marked cached-free, count says {self._num_cached}"
            )
        if seen & set(self._fresh):
            raise InvariantError("free queue: a block is both fresh and cached")


@mypyc_attr(allow_interpreted_subclasses=True)  # `sim.belady.BeladyQueue` extends it
class LruQueue(FreeQueue):
    """``lru``: one tier (`PROBATION`), least recently freed first."""

    def push_cached(self, block_id: int, *, dead: bool = False, was_hit: bool = False) -> None:
        if self._tier[block_id] >= 0:
            raise InvariantError(f"block {block_id} is already in the free queue")
        self._link_before(block_id, self._num_blocks + PROBATION, PROBATION)

    def push_cached_many(self, block_ids: list[int]) -> None:
        self._append_run(block_ids, PROBATION)

    def release_lru(
        self, refs: list[int], hashes: dict[int, bytes], block_ids: Iterable[int]
    ) -> int | None:
        """Drop one reference of each block (null blocks skipped) and push those that
        reach 0, in order: cached ones onto the newest end, the others onto the fresh
        stack -- `BlockPool.release_many` in one pass, with `_append_run`'s links made
        as it meets each cached block (a second pass over a list of them cost ~15% of
        `free`). Returns a block released while free (the loop stops there, links
        closed; the caller raises), else None."""
        prev, nxt, tier_of = self._prev, self._next, self._tier
        sentinel = self._num_blocks + PROBATION
        last = prev[sentinel]
        fresh: list[int] = []
        bad = None
        num = 0
        for block in block_ids:
            if not block:  # NULL_BLOCK (0): a plain truth test in the hot loop
                continue
            count = refs[block] - 1
            if count:
                if count < 0:
                    bad = block
                    break
                refs[block] = count  # still shared
            else:
                refs[block] = 0
                if block in hashes:
                    tier_of[block] = PROBATION
                    nxt[last] = block
                    prev[block] = last
                    last = block
                    num += 1
                else:
                    fresh.append(block)
        if num:
            nxt[last] = sentinel
            prev[sentinel] = last
            self._tier_len[PROBATION] += num
            self._num_cached += num
        if fresh:
            self.push_fresh_many(fresh)
        return bad

    def victim(self) -> int:
        if self._tier_len[PROBATION]:
            return self._next[self._num_blocks + PROBATION]
        raise CacheError("pop from an empty free queue")

    def pop(self) -> tuple[BlockId, bool]:
        if self._fresh:
            return BlockId(self._fresh.pop()), False
        victim = self.victim()
        self.remove_cached(BlockId(victim))
        return BlockId(victim), True

    def pop_many(self, num: int) -> tuple[list[int], list[int]]:
        """Its victims are the oldest, which no eviction before them changes: all in
        bulk, the oldest first."""
        fresh = self._fresh
        if num == 1 and fresh:  # a decode step's one new block
            return [fresh.pop()], []
        taken = self._take_fresh(num) if fresh else []
        k = num - len(taken)
        if not k:
            return taken, []
        if k > self._num_cached:
            raise CacheError(f"pop of {num} blocks from a free queue holding {len(self)}")
        evicted: list[int] = []  # the k oldest of its one tier
        nxt = self._next
        node = nxt[self._num_blocks + PROBATION]
        for _ in range(k):
            evicted.append(node)
            node = nxt[node]
        self._unlink_many(evicted)
        return taken, evicted

    def check_invariants(self) -> None:
        super().check_invariants()
        for tier in (DEAD, PROTECTED):
            if self._tier_len[tier]:
                raise InvariantError(f"lru free queue uses tier {TIER_NAMES[tier]}")
