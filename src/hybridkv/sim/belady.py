"""Belady's MIN eviction for the simulator: an offline-optimal reference, never an engine
policy (it reads the future of the trace).

MIN evicts the cached block whose next use is furthest in the future (Belady 1966,
"A study of replacement algorithms for a virtual-storage computer"). The simulator
knows the whole trace, so the next use of a cached block is known:

* *time* is the trace's arrival order; a request's use happens when it starts (its
  first `allocate`). ``now`` moves as requests start; a block's next use is the first
  request not started yet whose prompt holds the block's chain hash (the hash digests
  the whole prefix, so a prompt holding it can hit the block).
* chained blocks: a block is only useful while its whole prefix is cached. Any request
  that holds a block's hash holds its parents' hashes, so a parent's next use is never
  later than its child's; ties go to the longer prefix, so a chain is evicted from its
  tail first and MIN never strands a child behind an evicted parent.
* windows: a block of a sliding-window group (or a state checkpoint) only serves a
  request whose hit ends within the group's reach of it (window + one block, or one
  interval). The hit a request will get is taken as its token-exact reuse bound
  (`hybridkv.sim.reuse`), so a block that request would not read is not counted as used
  by it.
* turn-end entries (`cache.turn_end`) are keyed off their anchor block: used by the
  requests holding the anchor whose reuse bound reaches the entry's end (the anchor of
  an entry inside the first block is the chain's root: every request of its tenant
  holds it).

Approximations (why this is a reference, not a proof of optimality): admission order
can differ from arrival order, a preempted request that comes back is not counted as a
future use, and Belady's rule is optimal for one cache of equal-cost pages, not for
pools shared by groups or for hits that need every group at once. The study reports it
as "what an online policy could hope for", next to the online policies.

Use: `belady_manager(plan, trace)` builds a `CacheManager` whose pools use
`BeladyQueue`; pass it to `simulate(..., manager=...)`.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Any

from hybridkv.cache.free_queue import PROBATION, LruQueue
from hybridkv.errors import CacheError, InvariantError
from hybridkv.ids import BlockId
from hybridkv.plan.types import CachePlan
from hybridkv.sim.reuse import reuse_bound_tokens
from hybridkv.sim.trace import TraceRequest

NEVER = 1 << 62  # next use of a block no later request can hit
UNBOUNDED = 1 << 62  # reach of a full-attention group


class FutureUses:
    """Which trace requests can use which chain hash, and which have started."""

    def __init__(self, trace: Sequence[TraceRequest], plan: CachePlan, hasher: Any) -> None:
        order = sorted(range(len(trace)), key=lambda i: (trace[i].arrival_s, trace[i].id))
        bound = reuse_bound_tokens(trace)
        self.time_of: dict[str, int] = {}
        self.hit_tokens: list[int] = []  # per time: the request's reuse bound
        self.users: dict[bytes, list[int]] = {}  # chain hash -> times, ascending
        unit = hasher.unit_tokens
        for time, index in enumerate(order):
            req = trace[index]
            self.time_of[req.id] = time
            self.hit_tokens.append(bound[index])
            hashes: list[bytes] = []
            root = hasher.root(req.cache_salt, None)
            hasher.extend(hashes, root, list(req.prompt), len(req.prompt) - 1)
            for h in [root, *hashes[: bound[index] // unit]] if bound[index] else []:
                self.users.setdefault(h, []).append(time)
        self.started = bytearray(len(order))
        self.low = 0  # every time below has started
        # group id -> tokens before a hit's end that the group still reads
        self.reach: dict[int, int] = {}
        for g in plan.groups:
            window = getattr(g.spec, "sliding_window", None)
            if g.is_state:
                self.reach[g.group_id] = g.block_size
            elif window:
                self.reach[g.group_id] = int(window) + g.block_size
            else:
                self.reach[g.group_id] = UNBOUNDED
        self.waiting: dict[int, list[tuple[BeladyQueue, int, int]]] = {}

    def next_use(self, key: bytes, group: int, end_tokens: int) -> int:
        """First time not started whose request can hit ``key`` (ending at
        ``end_tokens``) in ``group``; `NEVER` if none."""
        times = self.users.get(key)
        if not times:
            return NEVER
        reach = self.reach.get(group, UNBOUNDED)
        started, hits = self.started, self.hit_tokens
        for pos in range(bisect_left(times, self.low), len(times)):
            t = times[pos]
            if started[t]:
                continue
            within = reach == UNBOUNDED or end_tokens > hits[t] - reach
            if within and end_tokens <= hits[t]:
                return t
        return NEVER

    def start(self, req_id: str) -> None:
        """Request ``req_id`` starts: re-key every cached block waiting for it."""
        time = self.time_of.get(req_id)
        if time is None or self.started[time]:
            return
        self.started[time] = 1
        while self.low < len(self.started) and self.started[self.low]:
            self.low += 1
        for queue, block, version in self.waiting.pop(time, []):
            queue.rekey(block, version)


class BeladyQueue(LruQueue):
    """A free queue whose victim is the cached block used furthest in the future.

    Keeps the lru tier (so the base class's listings and invariants hold) plus a max
    heap of (next use, end tokens) with lazy deletion by per-block version."""

    def __init__(self, num_blocks: int, fresh_ids: list[int], future: FutureUses) -> None:
        super().__init__(num_blocks, fresh_ids)
        self.future = future
        self.pool: Any = None  # set by `belady_manager`: hashes of cached blocks
        self._version = [0] * num_blocks
        self._heap: list[tuple[int, int, int, int]] = []  # (-next, -end, block, version)

    def _key(self, block: int) -> tuple[int, int]:
        pool = self.pool
        key = pool.hashes[block]
        group = pool.hash_group[block]
        end = pool.hash_end[block]
        anchor = None if pool.partial is None else pool.partial.anchor(group, key)
        return self.future.next_use(key if anchor is None else anchor, group, end), end

    def _enter(self, block: int) -> None:
        self._version[block] += 1
        version = self._version[block]
        nxt, end = self._key(block)
        heapq.heappush(self._heap, (-nxt, -end, block, version))
        if nxt != NEVER:
            self.future.waiting.setdefault(nxt, []).append((self, block, version))

    def rekey(self, block: int, version: int) -> None:
        """The request this block waited for started: its next use moved."""
        if self._version[block] == version and self.in_cached_tier(block):
            self._enter(block)

    def push_cached(self, block_id: int, *, dead: bool = False, was_hit: bool = False) -> None:
        super().push_cached(block_id, dead=dead, was_hit=was_hit)
        self._enter(block_id)

    def push_cached_many(self, block_ids: list[int]) -> None:
        super().push_cached_many(block_ids)
        for block in block_ids:
            self._enter(block)

    def release_lru(
        self, refs: Any, hashes: dict[int, bytes], block_ids: Iterable[int]
    ) -> int | None:
        # the base links cached blocks in one pass without `push_cached`: key them here
        blocks = list(block_ids)
        bad = super().release_lru(refs, hashes, blocks)
        for block in blocks:
            if block == bad:
                break
            if block and refs[block] == 0 and block in hashes:
                self._enter(block)
        return bad

    def remove_cached(self, block_id: BlockId) -> None:
        super().remove_cached(block_id)
        self._version[block_id] += 1  # its heap entries are stale now

    def pop_many(self, num: int) -> tuple[list[int], list[int]]:
        # fresh blocks in bulk; victims one by one through `pop` (each depends on the last)
        k = min(num, self.num_fresh)
        if not k:
            return [], []
        taken, _ = super().pop_many(k)
        return taken, []

    def victim(self) -> int:
        heap, version = self._heap, self._version
        while heap:
            _, _, block, v = heap[0]
            if version[block] == v and self.in_cached_tier(block):
                return block
            heapq.heappop(heap)
        raise CacheError("pop from an empty free queue")

    def check_invariants(self) -> None:
        super().check_invariants()
        live = {b for _, _, b, v in self._heap if self._version[b] == v}
        cached = set(self.tier_ids(PROBATION))
        if not cached <= live:
            missing = sorted(cached - live)[:5]
            raise InvariantError(f"Belady queue: cached free blocks {missing} have no heap entry")


def belady_manager(
    plan: CachePlan,
    trace: Sequence[TraceRequest],
    *,
    checkpoint_rules: Sequence[str] | None = None,
    enable_prefix_caching: bool | None = None,
) -> Any:
    """A `CacheManager` for ``plan`` evicting by Belady's MIN over ``trace`` (the same
    requests the simulator will replay). Simulator only."""
    from hybridkv.sim.simulator import build_manager

    manager = build_manager(
        plan,
        enable_prefix_caching=enable_prefix_caching,
        eviction_policy="lru",
        checkpoint_rules=checkpoint_rules,
    )
    coordinator = manager.coordinator
    future = FutureUses(trace, plan, coordinator.hasher)
    for pool in coordinator.pools:
        if pool.free.num_cached or pool.num_free != pool.num_usable:
            raise CacheError(f"pool {pool.pool_id}: Belady needs a fresh manager")
        queue = BeladyQueue(pool.num_blocks, list(range(1, pool.num_blocks)), future)
        queue.pool = pool
        pool.free = queue
    return _StartingManager(manager, future)


class _StartingManager:
    """``manager`` whose `allocate` first tells ``future`` that the request starts
    (admission's first allocate: its use is now). A wrapper, not an attribute patch:
    the compiled cache core's classes take no new instance attributes."""

    def __init__(self, manager: Any, future: FutureUses) -> None:
        self._manager = manager
        self._future = future

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def allocate(self, req_id: str, *args: Any, **kwargs: Any) -> Any:
        self._future.start(req_id)
        return self._manager.allocate(req_id, *args, **kwargs)
