"""Free blocks of one pool, in reuse order, with O(1) removal, under an eviction policy.

*Fresh* blocks hold no cached data; they are always reused first, last freed first (a
stack). *Cached* free blocks still carry a hash and can be hit again; they sit in
*tiers*, each a doubly linked list kept in two int lists indexed by block id, with one
sentinel per tier at index ``num_blocks + tier``::

    sentinel <-> b7 <-> b3 <-> b9 <-> sentinel
                 ^ oldest            ^ freed last

A hit removes a block from the middle of its tier in O(1) (``prev``/``next`` joined).

Policies (``EVICTION_POLICIES``):

* ``lru``: one tier, least recently freed first. A cyclic scan larger than the cache
  (sessions served round robin) evicts every block just before it is needed.
* ``chain`` (scan resistant, reuse-distance aware, leaf first), tiers evicted in order:

  1. ``dead``: blocks that can no longer serve a hit of the request that computed them
     (sliding-window blocks that left its window); least recently freed first.
  2. ``probation``: cached blocks never hit since they were stored.
  3. ``protected``: blocks hit since stored, and every block of a request that started
     from a prefix hit (a chain that came back once tends to come back again).

  *Loop mode* (`hybridkv.cache.loop_detect`): when hits come back at one regular
  distance counted in request releases (sessions served round robin), the victim is
  the newest release of tiers 2 and 3 together, its chain's tail first: Belady's
  choice for a loop (the session just served is needed furthest in the future), so a
  stable subset of whole sessions stays cached. Tiers are ignored there because a
  loop's first-turn blocks are never hit yet all come back next turn.

  Otherwise time is the count of cached releases. A hit measures the block's reuse
  distance (the releases since it was freed); blocks never hit assume the pool's
  typical one (a moving average), or ``STALE_TURNOVERS`` pool sizes before the first
  hit. Within tiers 2 and 3 the victim is one of two candidates, approximating
  Belady's rule: the oldest block when it is *overdue* (not back within
  ``OVERDUE_FACTOR`` times its reuse distance: a finished conversation), otherwise
  the one whose predicted next use (freed at + reuse distance) is later. Lookups
  that miss a recently evicted block (a bounded ghost index of hashes, kept by the
  pool) move a bias toward the other end, as ARC adapts between recency and
  frequency: traffic that comes back for the newest blocks turns the rule into LRU.
  Releases of one burst (a request's blocks, tail first) are inserted in reverse so
  that the newest end of a tier holds the chain's tail: a child block is useless
  without its parent, so leaves go first. The oldest burst goes tail first too (a
  walk to its newest block, then a kept hint): taking its head strands the rest.

Example (``chain``): request A stores blocks 3, 4, 5 (5 its tail) and finishes: they
go to probation as one burst, ``5 4 3`` from the newest end, so eviction takes 5, 4,
then 3, from whichever end it evicts. A later hit on 3 and 4 moves them to protected
when released again.

Each change of the links is written once, its bulk form beside it: `_link_before` /
`_append_run` (a run at the newest end), `_push_burst` / `push_chain_many` (chain's
insert into a burst), `_unlink` / `_unlink_many`; every operation is built on them
(`push_cached` / `push_cached_many`, `remove_cached` / `take_cached`, `pop` /
`pop_many`, `pop_victims`). An offline policy (the simulator's Belady queue, `sim.belady`) extends
`FreeQueue` through its public methods and the `victim` hook; the links stay private.

Measured and dropped: the lru links as numpy operations on the link arrays (and caching
a prefill chunk's blocks with numpy and dict updates) were no faster for tables of ~100
blocks, and twice slower per `free` in `bench/manager_step.py` (numpy's per-call cost
is a few microseconds; the loop's is ~40 bytecodes per block).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

from hybridkv.cache.loop_detect import LoopDetector
from hybridkv.cache.rules import DEFAULT_EVICTION_POLICY as DEFAULT_EVICTION_POLICY
from hybridkv.cache.rules import EVICTION_POLICIES
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
_NUM_TIERS: Final = 3
_NONE: Final = -1
STALE_TURNOVERS: Final = 8  # reuse distance assumed (in pool sizes) before any hit was seen
OVERDUE_FACTOR: Final = 1  # a block not back within its reuse distance is overdue
TYPICAL_WEIGHT: Final = 0.05  # weight of a new hit in the moving average of reuse distances
REGRET_STEP: Final = 0.05  # bias step per lookup that misses a block the policy evicted


@mypyc_attr(allow_interpreted_subclasses=True)  # `sim.belady.BeladyQueue` extends it
class FreeQueue:
    """Free block ids of one pool; see the module docstring for the order."""

    def __init__(
        self, num_blocks: int, fresh_ids: list[int], policy: str = "lru", *, windowed: bool = False
    ) -> None:
        if policy not in EVICTION_POLICIES:
            raise CacheError(
                f"eviction policy {policy!r} is unknown; use one of {', '.join(EVICTION_POLICIES)}"
            )
        self.policy = policy
        self._chain = self.chain = policy == "chain"
        self._num_blocks = num_blocks
        size = num_blocks + _NUM_TIERS
        self._prev = [_NONE] * size
        self._next = [_NONE] * size
        self._tier = [-1] * num_blocks
        self._freed_at = [0] * num_blocks  # release counter at push
        self._distance = [0] * num_blocks  # last reuse distance, 0: none
        self._typical = 0.0  # moving average of reuse distances seen by hits
        # > 0: evicting the oldest was regretted more recently (loops: prefer the newest);
        # < 0: evicting the newest was (recency wins: prefer the oldest). See `regret`.
        self._bias = 0.0
        self.last_victim_newest = False
        self.loops = LoopDetector(num_blocks)  # hits at one regular distance: round robin
        # A group of this pool releases blocks out of its window: a hit needs the window's
        # blocks at its end, so a session evicted tail first loses its whole hit and loop
        # mode's partial evictions would break every session; loop mode stays off
        # (measured: round robin on swa60 at 6 GiB, 0.630 with it vs 0.678 without).
        self.windowed = windowed
        for tier in range(_NUM_TIERS):
            s = num_blocks + tier
            self._prev[s] = self._next[s] = s
        self._tier_len = [0] * _NUM_TIERS
        self._num_cached = 0
        self._num_releases = 0
        self._anchors = [_NONE] * _NUM_TIERS  # insert after this node within a burst
        self._tails = [_NONE] * _NUM_TIERS  # per tier, the oldest burst's tail (a hint)
        self._burst_freed_at = [0] * _NUM_TIERS
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
        return [b for tier in range(_NUM_TIERS) for b in self.tier_ids(tier)]

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

    def _append_run(self, block_ids: list[int]) -> None:
        """lru: `_link_before` the sentinel for each block in order, in one pass."""
        prev, nxt, tier_of = self._prev, self._next, self._tier
        sentinel = self._num_blocks + PROBATION
        last = prev[sentinel]
        for block in block_ids:
            tier_of[block] = PROBATION
            nxt[last] = block
            prev[block] = last
            last = block
        nxt[last] = sentinel
        prev[sentinel] = last
        self._tier_len[PROBATION] += len(block_ids)
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
        prev[block_id] = nxt[block_id] = self._tier[block_id] = _NONE
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
            prev[block] = nxt[block] = tier_of[block] = _NONE
            tier_len[tier] -= 1
        self._num_cached -= len(block_ids)

    def _end_burst(self) -> None:
        self._anchors[DEAD] = self._anchors[PROBATION] = self._anchors[PROTECTED] = _NONE

    # ------------------------------------------------------------------ releases
    def push_fresh(self, block_id: int) -> None:
        self._fresh.append(block_id)
        self._end_burst()

    def push_fresh_many(self, block_ids: list[int]) -> None:
        """`push_fresh` for each block in order."""
        self._fresh.extend(block_ids)
        self._end_burst()

    def push_cached(self, block_id: int, *, dead: bool = False, was_hit: bool = False) -> None:
        """A cached block was freed: ``dead`` when it can no longer serve a hit of the
        request that freed it, ``was_hit`` when a prefix hit used it since stored."""
        if self._tier[block_id] >= 0:
            raise InvariantError(f"block {block_id} is already in the free queue")
        if not self._chain:  # lru keeps no release times
            self._link_before(block_id, self._num_blocks + PROBATION, PROBATION)
            return
        self._num_releases += 1
        self._freed_at[block_id] = self._num_releases
        self.loops.freed[block_id] = self.loops.clock
        if dead:
            self._link_before(block_id, self._num_blocks + DEAD, DEAD)
            return
        self._push_burst(block_id, PROTECTED if was_hit else PROBATION)

    def _push_burst(self, block_id: int, tier: int) -> None:
        """chain: link a released block into the burst being released in ``tier``."""
        anchor = self._anchors[tier]
        if anchor == _NONE:
            anchor = self._prev[self._num_blocks + tier]  # the newest end before the burst
            self._anchors[tier] = anchor
            self._burst_freed_at[tier] = self._num_releases
        # one release time per burst, so that the order inside it stays tail first
        self._freed_at[block_id] = self._burst_freed_at[tier]
        # insert right after the anchor: earlier pushes of this burst stay closer to the
        # newest end, so they (the chain's tail) are evicted first from that end
        self._link_before(block_id, self._next[anchor], tier)

    def push_cached_many(self, block_ids: list[int]) -> None:
        """`push_cached` for each block in order (the last one is freed last), none dead
        or hit: a request's table at `free`. lru links them in one pass; chain pushes
        each one as `push_cached` does (one burst)."""
        if self._chain:
            for block in block_ids:
                self.push_cached(block)
            return
        self._append_run(block_ids)

    def push_chain_many(self, block_ids: list[int], tiers: list[int]) -> None:
        """chain: for each block in order, `push_fresh` (tier < 0) or `push_cached` into
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
                anchors[DEAD] = anchors[PROBATION] = anchors[PROTECTED] = _NONE
                continue
            now += 1
            anchor = anchors[tier]
            if anchor == _NONE:
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

    def release_lru(
        self, refs: list[int], hashes: dict[int, bytes], block_ids: Iterable[int]
    ) -> int | None:
        """lru: drop one reference of each block (null blocks skipped) and push those
        that reach 0, in order: cached ones onto the newest end, the others onto the
        fresh stack -- `BlockPool.release_many` in one pass. Returns a block released
        while free (the loop stops there, what was released before it is pushed; the
        caller raises), else None."""
        cached: list[int] = []
        fresh: list[int] = []
        bad = None
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
                    cached.append(block)
                else:
                    fresh.append(block)
        if cached:
            self._append_run(cached)
        if fresh:
            self.push_fresh_many(fresh)
        return bad

    # ------------------------------------------------------------------ hits
    def note_hit(self, block_id: BlockId) -> None:
        """A prefix hit takes this cached free block: record its reuse distance."""
        if not self._chain:
            return
        distance = max(1, self._num_releases - self._freed_at[block_id])
        self._distance[block_id] = distance
        if self._typical == 0.0:
            self._typical = float(distance)
        else:
            self._typical += TYPICAL_WEIGHT * (distance - self._typical)
        self.loops.hit(block_id)

    def remove_cached(self, block_id: BlockId) -> None:
        """Unlink a cached free block (it was hit, or is being evicted), O(1)."""
        self._unlink(block_id)
        self._end_burst()

    def take_cached(self, block_ids: Sequence[BlockId]) -> None:
        """`note_hit` and `remove_cached` for each block in order (cached free blocks a
        prefix hit takes back)."""
        if self._chain:
            for block in block_ids:
                self.note_hit(block)
        self._unlink_many(block_ids)
        self._end_burst()

    # ------------------------------------------------------------------ reuse
    def pop(self) -> tuple[BlockId, bool]:
        """The next block to reuse and whether it comes from a cached tier (eviction)."""
        if self._fresh:
            self._end_burst()
            return BlockId(self._fresh.pop()), False
        if self._chain:  # one victim choice for both: `pop_victims`
            return BlockId(self.pop_victims(1)[0][0]), True
        victim = self.victim()
        self.remove_cached(BlockId(victim))
        return BlockId(victim), True

    def pop_many(self, num: int) -> tuple[list[int], list[int]]:
        """``num`` blocks in the order ``num`` calls of `pop` hand them out, as (fresh,
        evicted): the caller must evict the second list's blocks. Only lru evicts in bulk
        (its victims, the oldest, do not depend on the evictions before them); chain
        hands out fresh blocks only (the caller takes the rest from `pop_victims`)."""
        fresh = self._fresh
        if num == 1 and fresh:  # a decode step's one new block
            if self._chain:  # only chain inserts by bursts
                self._end_burst()
            return [fresh.pop()], []
        k = min(num, len(fresh))
        taken: list[int] = []
        if k:
            taken = fresh[len(fresh) - k :]
            taken.reverse()  # pop order: the stack's top first
            del fresh[len(fresh) - k :]
            self._end_burst()
        k = num - k
        if not k or self._chain:
            return taken, []
        if k > self._num_cached:
            raise CacheError(f"pop of {num} blocks from a free queue holding {len(self)}")
        evicted: list[int] = []  # lru: the k oldest of its one tier
        nxt = self._next
        node = nxt[self._num_blocks + PROBATION]
        for _ in range(k):
            evicted.append(node)
            node = nxt[node]
        self._unlink_many(evicted)
        self._end_burst()
        return taken, evicted

    def pop_victims(self, num: int) -> tuple[list[int], list[bool]]:
        """chain, no fresh block left: the ``num`` victims ``num`` calls of `pop` evict,
        in order, each with `last_victim_newest` as it stood after its choice, chosen one
        at a time (each depends on the unlinks before it; no pop changes the release
        clock, typical distance or bias). The caller evicts them (`BlockPool.take_many`).
        Tiers 2-3 outside loop mode: the oldest if overdue or if recency has been
        winning, else the older or newer end, whichever is predicted back later."""
        prev, nxt, tier_of, tier_len = self._prev, self._next, self._tier, self._tier_len
        victims: list[int] = []
        newest: list[bool] = []
        base, freed_at, distance = self._num_blocks, self._freed_at, self._distance
        now, bias, tails = self._num_releases, self._bias, self._tails
        unknown = self._typical or float(STALE_TURNOVERS * base)
        inline = self._chain and not (self.loops.loop and not self.windowed)
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
        """The cached block `pop` evicts next (not unlinked yet). The hook an offline
        policy overrides (`sim.belady`); chain's choice in tiers 2-3 outside loop mode
        is made in `pop_victims`."""
        base = self._num_blocks
        if self._tier_len[DEAD]:
            return self._next[base + DEAD]
        if self.loops.loop and self._num_cached and not self.windowed:
            # the newest release of either tier, its chain's tail first
            self.last_victim_newest = True
            newest = self._prev[base + PROBATION]
            other = self._prev[base + PROTECTED]
            if newest == base + PROBATION or (
                other != base + PROTECTED and self._freed_at[other] > self._freed_at[newest]
            ):
                newest = other
            return newest
        for tier in (PROBATION, PROTECTED):
            if self._tier_len[tier]:
                if self._chain:
                    raise InvariantError("chain chooses in tiers 2-3 in pop_victims")
                return self._next[base + tier]
        raise CacheError("pop from an empty free queue")

    def forget(self, block_id: BlockId) -> None:
        """The block was evicted: its reuse history no longer applies."""
        self._distance[block_id] = 0

    def forget_many(self, block_ids: list[int]) -> None:
        """`forget` for each block."""
        distance = self._distance
        for block in block_ids:
            distance[block] = 0

    def regret(self, evicted_newest: bool) -> None:
        """A lookup missed a block evicted from the ``evicted_newest`` end: move the bias
        away from that end (as ARC moves its target between recency and frequency)."""
        step = -REGRET_STEP if evicted_newest else REGRET_STEP
        self._bias = max(-1.0, min(1.0, self._bias + step))

    # ------------------------------------------------------------------ invariants
    def _check_bursts(self, tier: int, ids: list[int]) -> None:
        """chain: the blocks of one burst (one release time) are contiguous in their
        tier, which eviction's walk to the oldest burst's tail relies on."""
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
        """Links are symmetric, tier marks and counts agree, no block twice."""
        seen: set[int] = set()
        for tier in range(_NUM_TIERS):
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
            if not self._chain and tier != PROBATION and ids:
                raise InvariantError(f"lru free queue uses tier {TIER_NAMES[tier]}")
            if self._chain and tier != DEAD:
                self._check_bursts(tier, ids)
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
        self.loops.check_invariants(seen, chain=self._chain)
