"""The ``chain`` eviction policy (`ChainQueue`): scan resistant, reuse-distance aware,
leaf first. A sibling of `LruQueue` on `FreeQueue`'s tiers, evicted in order:

1. ``dead``: blocks that can no longer serve a hit of the request that computed them
   (sliding-window blocks that left its window); least recently freed first.
2. ``probation``: cached blocks never hit since they were stored.
3. ``protected``: blocks hit since stored, and every block of a request that started
   from a prefix hit (a chain that came back once tends to come back again).

*Loop mode* (`hybridkv.cache.loop_detect`): when hits come back at one regular
distance counted in request releases (sessions served round robin), the victim is the
newest release of tiers 2 and 3 together, its chain's tail first: Belady's choice for
a loop (the session just served is needed furthest in the future), so a stable subset
of whole sessions stays cached. Tiers are ignored there because a loop's first-turn
blocks are never hit yet all come back next turn. It stays off in a pool whose groups
release blocks out of their window (`FreeQueue.windowed`).

Otherwise time is the count of cached releases. A hit measures the block's reuse
distance (the releases since it was freed); blocks never hit assume the pool's typical
one (a moving average), or ``STALE_TURNOVERS`` pool sizes before the first hit. Within
tiers 2 and 3 the victim is one of two candidates, approximating Belady's rule: the
oldest block when it is *overdue* (not back within ``OVERDUE_FACTOR`` times its reuse
distance: a finished conversation), otherwise the one whose predicted next use (freed
at + reuse distance) is later. Lookups that miss a recently evicted block (a bounded
ghost index of hashes, kept by the pool) move a bias toward the other end, as ARC
adapts between recency and frequency: traffic that comes back for the newest blocks
turns the rule into LRU. Releases of one burst (a request's blocks, tail first) are
inserted in reverse so that the newest end of a tier holds the chain's tail: a child
block is useless without its parent, so leaves go first. The oldest burst goes tail
first too (a walk to its newest block, then a kept hint): taking its head strands the
rest.

Example: request A stores blocks 3, 4, 5 (5 its tail) and finishes: they go to
probation as one burst, ``5 4 3`` from the newest end, so eviction takes 5, 4, then 3,
from whichever end it evicts. A later hit on 3 and 4 moves them to protected when
released again.

A burst's insert is written once with its bulk form beside it (`_push_burst` /
`push_chain_many`); the other links are `FreeQueue`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from hybridkv.cache.free_queue import (
    DEAD,
    NONE,
    NUM_TIERS,
    PROBATION,
    PROTECTED,
    TIER_NAMES,
    FreeQueue,
)
from hybridkv.cache.loop_detect import LoopDetector
from hybridkv.errors import CacheError, InvariantError
from hybridkv.ids import BlockId

STALE_TURNOVERS: Final = 8  # reuse distance assumed (in pool sizes) before any hit was seen
OVERDUE_FACTOR: Final = 1  # a block not back within its reuse distance is overdue
TYPICAL_WEIGHT: Final = 0.05  # weight of a new hit in the moving average of reuse distances
REGRET_STEP: Final = 0.05  # bias step per lookup that misses a block the policy evicted


class ChainQueue(FreeQueue):
    """``chain``; see the module docstring."""

    def __init__(self, num_blocks: int, fresh_ids: list[int], *, windowed: bool = False) -> None:
        super().__init__(num_blocks, fresh_ids, windowed=windowed)
        self.chain = True
        self._freed_at = [0] * num_blocks  # release counter at push
        self._distance = [0] * num_blocks  # last reuse distance, 0: none
        self._typical = 0.0  # moving average of reuse distances seen by hits
        # > 0: evicting the oldest was regretted more recently (loops: prefer the newest);
        # < 0: evicting the newest was (recency wins: prefer the oldest). See `regret`.
        self._bias = 0.0
        self.loops = LoopDetector(num_blocks)  # hits at one regular distance: round robin
        self._num_releases = 0
        self._anchors = [NONE] * NUM_TIERS  # insert after this node within a burst
        self._tails = [NONE] * NUM_TIERS  # per tier, the oldest burst's tail (a hint)
        self._burst_freed_at = [0] * NUM_TIERS

    def _end_burst(self) -> None:
        self._anchors[DEAD] = self._anchors[PROBATION] = self._anchors[PROTECTED] = NONE

    # ------------------------------------------------------------------ releases
    def push_fresh(self, block_id: int) -> None:
        self._fresh.append(block_id)
        self._end_burst()

    def push_fresh_many(self, block_ids: list[int]) -> None:
        self._fresh.extend(block_ids)
        self._end_burst()

    def push_cached(self, block_id: int, *, dead: bool = False, was_hit: bool = False) -> None:
        if self._tier[block_id] >= 0:
            raise InvariantError(f"block {block_id} is already in the free queue")
        self._num_releases += 1
        self._freed_at[block_id] = self._num_releases
        self.loops.freed[block_id] = self.loops.clock
        if dead:
            self._link_before(block_id, self._num_blocks + DEAD, DEAD)
            return
        self._push_burst(block_id, PROTECTED if was_hit else PROBATION)

    def _push_burst(self, block_id: int, tier: int) -> None:
        """Link a released block into the burst being released in ``tier``."""
        anchor = self._anchors[tier]
        if anchor == NONE:
            anchor = self._prev[self._num_blocks + tier]  # the newest end before the burst
            self._anchors[tier] = anchor
            self._burst_freed_at[tier] = self._num_releases
        # one release time per burst, so that the order inside it stays tail first
        self._freed_at[block_id] = self._burst_freed_at[tier]
        # insert right after the anchor: earlier pushes of this burst stay closer to the
        # newest end, so they (the chain's tail) are evicted first from that end
        self._link_before(block_id, self._next[anchor], tier)

    def push_cached_many(self, block_ids: list[int]) -> None:
        """One burst: each block as `push_cached` pushes it."""
        for block in block_ids:
            self.push_cached(block)

    def push_chain_many(self, block_ids: list[int], tiers: list[int]) -> None:
        """For each block in order, `push_fresh` (tier < 0) or `push_cached` into
        ``tiers[i]`` (`PROBATION` or `PROTECTED`, never dead): the same links, release
        times and bursts as those calls, in one loop (the bulk form of `_push_burst`)."""
        prev, nxt, tier_of, freed_at = self._prev, self._next, self._tier, self._freed_at
        anchors, burst_at, tier_len = self._anchors, self._burst_freed_at, self._tier_len
        fresh, base = self._fresh, self._num_blocks
        now = self._num_releases
        requests, freed_req = self.loops.tick(), self.loops.freed  # one request's table
        num_cached = 0
        for i, block in enumerate(block_ids):
            tier = tiers[i]
            if tier < 0:
                fresh.append(block)
                anchors[DEAD] = anchors[PROBATION] = anchors[PROTECTED] = NONE
                continue
            now += 1
            anchor = anchors[tier]
            if anchor == NONE:
                anchor = anchors[tier] = prev[base + tier]  # the newest end before the burst
                burst_at[tier] = now
            freed_at[block] = burst_at[tier]
            freed_req[block] = requests
            node = nxt[anchor]  # `_push_burst`'s link, inline: one pass over the table
            nxt[anchor] = block
            prev[block] = anchor
            nxt[block] = node
            prev[node] = block
            tier_of[block] = tier
            tier_len[tier] += 1
            num_cached += 1
        self._num_releases = now
        self._num_cached += num_cached

    # ------------------------------------------------------------------ hits
    def note_hit(self, block_id: BlockId) -> None:
        """Record the block's reuse distance (and a loop sample)."""
        distance = max(1, self._num_releases - self._freed_at[block_id])
        self._distance[block_id] = distance
        if self._typical == 0.0:
            self._typical = float(distance)
        else:
            self._typical += TYPICAL_WEIGHT * (distance - self._typical)
        self.loops.hit(block_id)

    def remove_cached(self, block_id: BlockId) -> None:
        self._unlink(block_id)
        self._end_burst()

    def take_cached(self, block_ids: Sequence[BlockId]) -> None:
        for block in block_ids:
            self.note_hit(block)
        self._unlink_many(block_ids)
        self._end_burst()

    # ------------------------------------------------------------------ reuse
    def pop(self) -> tuple[BlockId, bool]:
        if self._fresh:
            self._end_burst()
            return BlockId(self._fresh.pop()), False
        return BlockId(self.pop_victims(1)[0][0]), True  # one victim choice: pop_victims

    def pop_many(self, num: int) -> tuple[list[int], list[int]]:
        """Fresh blocks only: each victim depends on the evictions before it (the caller
        takes them from `pop_victims`)."""
        fresh = self._fresh
        if not fresh:
            return [], []
        self._end_burst()
        if num == 1:  # a decode step's one new block
            return [fresh.pop()], []
        return self._take_fresh(num), []

    def pop_victims(self, num: int) -> tuple[list[int], list[bool]]:
        """No fresh block left: the ``num`` victims ``num`` calls of `pop` evict, in
        order, each with `last_victim_newest` as it stood after its choice, chosen one at
        a time (each depends on the unlinks before it; no pop changes the release clock,
        typical distance or bias). The caller evicts them (`BlockPool.take_many`).
        Tiers 2-3 outside loop mode: the oldest if overdue or if recency has been
        winning, else the older or newer end, whichever is predicted back later."""
        prev, nxt, tier_of, tier_len = self._prev, self._next, self._tier, self._tier_len
        victims: list[int] = []
        newest: list[bool] = []
        base, freed_at, distance = self._num_blocks, self._freed_at, self._distance
        now, bias, tails = self._num_releases, self._bias, self._tails
        unknown = self._typical or float(STALE_TURNOVERS * base)
        inline = not (self.loops.loop and not self.windowed)
        for _ in range(num):
            if not inline or tier_len[DEAD]:
                victim = self.victim()
            else:
                tier = PROBATION if tier_len[PROBATION] else PROTECTED
                sentinel = base + tier
                victim = nxt[sentinel]  # the oldest block: its burst goes tail first
                if victim == sentinel:
                    raise CacheError("pop from an empty free queue")
                old_at = freed_at[victim]
                tail = tails[tier]  # valid if still in this tier and burst
                if 0 <= tail < base and tier_of[tail] == tier and freed_at[tail] == old_at:
                    victim = tail
                else:  # walk to the burst's newest block (one release time per burst)
                    node = nxt[victim]
                    while node != sentinel and freed_at[node] == old_at:
                        victim = node
                        node = nxt[node]
                    tails[tier] = victim
                last = distance[victim]
                old_distance = float(last) if last else unknown
                went = False
                if now - old_at <= OVERDUE_FACTOR * old_distance and bias >= 0:
                    young = prev[sentinel]
                    last = distance[young]
                    young_next = freed_at[young] + (float(last) if last else unknown)
                    went = young_next >= old_at + old_distance
                    if went:
                        victim = young
                if not went:
                    tails[tier] = prev[victim]  # the burst's next tail, if it has more
                self.last_victim_newest = went
            self._unlink(victim)  # before the next choice: `victim` reads the counts
            victims.append(victim)
            newest.append(self.last_victim_newest)
        if num:
            self._end_burst()
        return victims, newest

    def victim(self) -> int:
        """Dead blocks first, least recently freed first; in loop mode the newest release
        of tiers 2-3, its chain's tail first (other choices in tiers 2-3 are made in
        `pop_victims`)."""
        base = self._num_blocks
        if self._tier_len[DEAD]:
            return self._next[base + DEAD]
        if self.loops.loop and self._num_cached and not self.windowed:
            self.last_victim_newest = True
            newest = self._prev[base + PROBATION]
            other = self._prev[base + PROTECTED]
            if newest == base + PROBATION or (
                other != base + PROTECTED and self._freed_at[other] > self._freed_at[newest]
            ):
                newest = other
            return newest
        if self._num_cached:
            raise InvariantError("chain chooses in tiers 2-3 in pop_victims")
        raise CacheError("pop from an empty free queue")

    def forget(self, block_id: BlockId) -> None:
        self._distance[block_id] = 0

    def forget_many(self, block_ids: list[int]) -> None:
        distance = self._distance
        for block in block_ids:
            distance[block] = 0

    def regret(self, evicted_newest: bool) -> None:
        """Move the bias away from the end a regretted victim came from (as ARC moves
        its target between recency and frequency)."""
        step = -REGRET_STEP if evicted_newest else REGRET_STEP
        self._bias = max(-1.0, min(1.0, self._bias + step))

    # ------------------------------------------------------------------ invariants
    def _check_bursts(self, tier: int, ids: list[int]) -> None:
        """The blocks of one burst (one release time) are contiguous in their tier,
        which eviction's walk to the oldest burst's tail relies on."""
        done: set[int] = set()
        last = -1
        for block in ids:
            freed_at = self._freed_at[block]
            if freed_at != last:
                if freed_at in done:
                    raise InvariantError(
                        f"free queue tier {TIER_NAMES[tier]}: the burst released at "
                        f"{freed_at} is split (block {block} is apart from the rest)"
                    )
                done.add(freed_at)
                last = freed_at

    def check_invariants(self) -> None:
        super().check_invariants()
        for tier in (PROBATION, PROTECTED):
            self._check_bursts(tier, self.tier_ids(tier))
        self.loops.check_invariants(set(self.cached_ids()), chain=True)
