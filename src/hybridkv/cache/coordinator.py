"""Across groups: the common prefix hit, and all-or-nothing allocation.

Prefix hit (fixed point). Each group reports the longest hit <= a limit it can serve;
the limit shrinks until no group lowers it::

    tokens 40, limit 39 (one token must be computed to sample from)
    full attention, B 4   : blocks cached up to 36          -> 36
    state, interval 16    : checkpoints at 16 and 32        -> 32
    sliding W 8, B 4      : at 32 needs blocks 6, 7 cached  -> 32   (fixed point: 32)

Full attention can serve any length up to its scan, but a sliding window or a state
group can only serve particular lengths, so one pass is not enough in general: a
window miss can push the limit below a checkpoint, which pushes it below another
window position, and so on. Every group's answer is idempotent (it can serve what it
returns), so the groups are visited round robin and the scan stops as soon as every
group has agreed with the current limit once since it last moved: one group needs one
call, and a limit no group lowers costs one call per group. Every cached block a group
saw goes into ``found``; `hit_states` reuses them while nothing has been evicted.

Allocation is check-then-commit: count new blocks per pool (plus hit blocks that sit in
the free queue and will leave it), fail with nothing changed if any pool is short, then
touch every hit block of every group before taking any new block, so that taking a
block cannot evict another group's hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import gcd
from typing import Any

from hybridkv.cache.block_pool import BlockPool
from hybridkv.cache.delta import NO_CHANGE, GroupDelta, StepDelta
from hybridkv.cache.events import CacheEvent
from hybridkv.cache.hashing import BlockHasher
from hybridkv.cache.junction import junction_copies
from hybridkv.cache.managers import MANAGER_TABLE, STATE_LAYOUTS, Counters, GroupManager
from hybridkv.cache.rules import CacheRules
from hybridkv.errors import CacheError
from hybridkv.ids import BlockId
from hybridkv.plan.types import CachePlan, GroupPlan

_new_tuple = tuple.__new__  # a named tuple's own constructor is a Python function


def hash_unit_tokens(plan: CachePlan) -> int:
    """The finest unit that divides every group's block size (see `hashing`)."""
    unit = 0
    for group in plan.groups:
        unit = gcd(unit, group.block_size)
    return max(unit, 1)


def _manager_class(group: GroupPlan, state_layout: str) -> type[GroupManager]:
    """The manager class of ``group``: by its kind (`MANAGER_TABLE`), a state group by
    the layout its engine reads (`STATE_LAYOUTS`)."""
    manager_cls = MANAGER_TABLE.get(group.kind)
    if group.is_state:
        manager_cls = STATE_LAYOUTS.get(state_layout)
        if manager_cls is None:
            raise CacheError(
                f"state layout {state_layout!r}; known layouts: {sorted(STATE_LAYOUTS)}"
            )
    if manager_cls is None:
        raise CacheError(
            f"group {group.group_id} has kind {group.kind!r}; known kinds: {sorted(MANAGER_TABLE)}"
        )
    return manager_cls


class Coordinator:
    """Owns the pools and one manager per group; knows nothing about requests."""

    def __init__(
        self,
        plan: CachePlan,
        rules: CacheRules,
        *,
        events: list[CacheEvent] | None,
        counters: Counters,
    ) -> None:
        if not plan.groups:
            raise CacheError("the plan has 0 groups; nothing to manage")
        self.hasher = BlockHasher(rules.hash_algo, hash_unit_tokens(plan))
        self.caching = rules.prefix_caching
        self.eagle = rules.eagle
        self.turn_end = rules.turn_end  # turn_end rule (`cache.turn_end`)
        self.copies = rules.junction_copies  # junction copies (`cache.junction`)
        classes = [_manager_class(group, rules.state_layout) for group in plan.groups]
        self.pools = []
        for pool in plan.pools:
            mine = [g for g, group in enumerate(plan.groups) if group.pool_id == pool.pool_id]
            self.pools.append(
                BlockPool(
                    pool,
                    events,
                    rules,
                    token_groups=frozenset(
                        plan.groups[g].group_id for g in mine if not classes[g].is_state
                    ),
                    # loop eviction stays off where a group releases blocks out of its
                    # window (`FreeQueue.windowed`)
                    windowed=any(classes[g].releases for g in mine),
                )
            )
        self.managers: list[GroupManager] = [
            manager_cls(
                group,
                self.pools[group.pool_id],
                unit_tokens=self.hasher.unit_tokens,
                rules=rules,
                counters=counters,
                key_ahead=rules.eagle and any(ref.model == "draft" for ref in group.layers),
            )
            for group, manager_cls in zip(plan.groups, classes, strict=True)
        ]
        self._all_groups = range(len(self.managers))
        self._one_pool = len(self.pools) == 1

    def num_evictions(self) -> int:
        """Blocks evicted or taken over (turn-end partial blocks) so far in every pool: a
        lookup's ``found`` stays valid while this does not change."""
        return sum(pool.num_evictions + pool.num_takeovers for pool in self.pools)

    def _spans_on(self) -> bool:
        """Open every pool's span cache (`junction.span_bytes`) for one request's call
        in which several groups may build the same token spans (callers ask only with
        several groups and the turn_end rule, which the junction rule needs); False
        when a call this one is part of opened it already. The caller closes it
        (`_spans_off`) when done."""
        if self.pools[0].spans is not None:
            return False
        for pool in self.pools:
            pool.open_spans()
        return True

    def _spans_off(self) -> None:
        for pool in self.pools:
            pool.close_spans()

    def find_hit(
        self,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
        limit: int,
        found: list[dict[int, BlockId]],
        answers: dict[tuple[int, int], int] | None = None,
    ) -> int:
        """Longest prefix (<= ``limit`` tokens) every group can serve; ``found[g]``
        collects the cached blocks group ``g`` saw; ``answers`` (if given) collects
        each ``(group, limit) -> max_hit`` asked (for `attention_match`). ``hashes``
        and ``root``: the request's chain (`GroupManager.max_hit`)."""
        if not self.caching or limit <= 0:
            return 0
        managers = self.managers
        num = len(managers)
        agreed = g = 0
        opened = num > 1 and self.turn_end and self._spans_on()
        try:
            while agreed < num:
                new_limit = managers[g].max_hit(hashes, root, tokens, limit, found[g])
                if answers is not None:
                    answers[(g, limit)] = new_limit
                if new_limit == 0:
                    return 0
                if new_limit < limit:
                    limit, agreed = new_limit, 1  # this group agrees with its own answer
                else:
                    agreed += 1
                g = g + 1 if g + 1 < num else 0
        finally:
            if opened:
                self._spans_off()
        return limit

    def attention_match(
        self,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
        limit: int,
        found: list[dict[int, BlockId]],
        answers: dict[tuple[int, int], int],
    ) -> int:
        """Longest prefix every non-state group holds (one pass, no state clamp): the
        junction rule's checkpoint. ``found`` and ``answers``: `find_hit`'s, of the same
        lookup. Within a lookup nothing changes the cache, so a group's `max_hit` at a
        limit it was asked already answers the same (and a repeat would have no effect:
        the blocks it records are the same, and a ghost it misses is gone already):
        ``answers`` serves it, and only the limits `find_hit` never asked cost a scan."""
        match = limit
        opened = len(self.managers) > 1 and self.turn_end and self._spans_on()
        try:
            for g, manager in enumerate(self.managers):
                if not manager.is_state:
                    known = answers.get((g, match))
                    if known is None:
                        known = manager.max_hit(hashes, root, tokens, match, found[g])
                    match = known
        finally:
            if opened:
                self._spans_off()
        return match

    def hit_states(
        self,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
        hit: int,
        found: list[dict[int, BlockId]] | None,
    ) -> list[Any] | None:
        """Per-group states holding the hit blocks, or None if one was evicted.
        ``found``: the lookup's blocks, only when nothing was evicted since."""
        states = []
        for g, manager in enumerate(self.managers):
            if hit:
                state = manager.hit_state(
                    hashes, root, tokens, hit, None if found is None else found[g]
                )
            else:
                state = manager.new_state()
            if state is None:
                return None
            states.append(state)
        return states

    def try_allocate(
        self,
        states: list[Any],
        c: int,
        n: int,
        lookahead: int,
        touch: bool,
        groups: Sequence[int] | None = None,
        nulled: dict[int, tuple[int, int]] | None = None,
    ) -> StepDelta | None:
        """Reserve blocks for positions [0, c + n + lookahead) in every group, or change
        nothing and return None. ``touch``: the states hold hit blocks not yet referenced
        (admission: the delta holds whole tables). ``groups``: the only groups that can
        need a block (default: all), in order. ``nulled``: positions released since the
        last delta, per group, to hand out with this one."""
        managers = self.managers
        todo = self._all_groups if groups is None else groups
        counts = [managers[g].num_new_blocks(states[g], c, n, lookahead) for g in todo]
        held = [m.held(states[g]) for g, m in enumerate(managers)] if touch else []
        if self._one_pool:  # the common plan: one pool, one sum
            pool = self.pools[0]
            need = sum(counts)
            if touch:
                refs = pool.ref_counts
                for blocks in held:  # hit blocks that sit in the free queue leave it
                    need += list(map(refs.__getitem__, blocks)).count(0)
            if need and need > len(pool.free):
                return None
        else:
            needs = [0] * len(self.pools)
            for i, count in enumerate(counts):
                needs[managers[todo[i]].pool.pool_id] += count
            for g, blocks in enumerate(held):
                refs = managers[g].pool.ref_counts
                needs[managers[g].pool.pool_id] += list(map(refs.__getitem__, blocks)).count(0)
            for pool in self.pools:
                num_blocks = needs[pool.pool_id]
                if num_blocks and num_blocks > len(pool.free):
                    return None
        if touch:
            for g, blocks in enumerate(held):
                managers[g].pool.touch_many(blocks)
            if self.turn_end:
                for g, manager in enumerate(managers):
                    manager.adopt(states[g])
        deltas: dict[int, GroupDelta] = {}
        taken: dict[int, tuple[BlockId, ...]] = {}
        # One pool: every group's blocks in one `take_many`, sliced in group order (the
        # same blocks, order and evictions as one call per group; the counts were
        # computed before any take, and no take can evict a block a group holds)
        total = sum(counts) if self._one_pool else 0
        pending = self.pools[0].take_many(total) if total else []
        start = 0
        for i, count in enumerate(counts):
            g = todo[i]
            manager = managers[g]
            if not count and not manager.is_state:
                continue  # a table that needs no block: nothing to lay out
            if self._one_pool:
                new = manager.place(states[g], c, n, lookahead, pending[start : start + count])
                start += count
            else:
                new = manager.allocate(states[g], c, n, lookahead, count)
            if new:
                ids = taken[g] = tuple(new)
                if not touch and not manager.is_state:  # state groups: slots, no delta
                    delta = manager.delta(states[g], ids, False)
                    if delta is not None:
                        deltas[g] = delta
        if touch:
            for g, manager in enumerate(managers):
                delta = manager.delta(states[g], [], True)
                if delta is not None:
                    deltas[g] = delta
        elif nulled:
            for g, span in nulled.items():
                base = deltas.get(g) or managers[g].delta(states[g], [], False)
                if base is not None:  # base._replace(nulled_range=span), the cheap way
                    deltas[g] = _new_tuple(GroupDelta, (base[0], base[1], span))
        copies = junction_copies(managers, states) if touch and self.copies else ()
        if not deltas and not taken and not copies:
            return NO_CHANGE
        # StepDelta(groups=deltas, taken=taken, admitted=touch, copies), the cheap way
        return _new_tuple(StepDelta, (deltas, taken, touch, copies))

    def try_reserve(
        self, states: list[Any], start_max: int, n: int, lookahead: int
    ) -> StepDelta | None:
        """Hold in every group the blocks a next step may need while the step before it
        is pending (`GroupManager.reserve_blocks`), or change nothing and return None."""
        managers = self.managers
        counts = [
            m.reserve_blocks(states[g], start_max, n, lookahead) for g, m in enumerate(managers)
        ]
        needs = [0] * len(self.pools)
        for g, count in enumerate(counts):
            needs[managers[g].pool.pool_id] += count
        if any(need > len(pool.free) for pool, need in zip(self.pools, needs, strict=True)):
            return None
        deltas: dict[int, GroupDelta] = {}
        taken: dict[int, tuple[BlockId, ...]] = {}
        for g, count in enumerate(counts):
            if not count:
                continue
            manager = managers[g]
            new = manager.pool.take_many(count)
            manager.reserve(states[g], start_max, n, lookahead, new)
            taken[g] = tuple(new)
            delta = None if manager.is_state else manager.delta(states[g], new, False)
            if delta is not None:  # state groups: slots, no delta
                deltas[g] = delta
        if not taken:
            return NO_CHANGE
        return StepDelta(groups=deltas, taken=taken, admitted=False, copies=())

    def commit(
        self,
        states: list[Any],
        c: int,
        n: int,
        lookahead: int,
        accepted: int,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
        groups: Sequence[int] | None = None,
        nulled: dict[int, tuple[int, int]] | None = None,
    ) -> dict[int, tuple[int, int]] | None:
        """Settle a step in every group, or in ``groups`` (in order) when the others have
        nothing to do. Returns ``nulled`` extended with the table positions that became
        the null block (merged per group: released positions are contiguous)."""
        managers = self.managers
        todo = range(len(managers)) if groups is None else groups
        # the groups that cache one block build its bytes once
        opened = len(todo) > 1 and self.turn_end and self._spans_on()
        try:
            for g in todo:
                span = managers[g].commit(
                    states[g], c, n, lookahead, accepted, hashes, root, tokens
                )
                if span is not None:
                    if nulled is None:
                        nulled = {}
                    old = nulled.get(g)
                    nulled[g] = (
                        span if old is None else (min(old[0], span[0]), max(old[1], span[1]))
                    )
        finally:
            if opened:
                self._spans_off()
        return nulled

    def keep_turn_ends(
        self,
        states: list[Any],
        c: int,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
    ) -> None:
        """turn_end rule: every group caches what holds its data at ``c`` (the request's
        settled computed tokens) before `release_all` (see `cache.turn_end`)."""
        # one end for every group: a hit needs all of them there
        end = min(m.turn_end_tokens(states[g], c) for g, m in enumerate(self.managers))
        if end <= 0:
            return
        # one key per span, not one per group
        opened = len(self.managers) > 1 and self.turn_end and self._spans_on()
        try:
            for g, manager in enumerate(self.managers):
                manager.keep_turn_end(states[g], end, hashes, root, tokens)
        finally:
            if opened:
                self._spans_off()

    def release_all(self, states: list[Any]) -> None:
        # Groups in reverse so that, in a shared pool, the first group's blocks are
        # freed last and thus evicted last.
        managers = self.managers
        if self._one_pool and len(managers) > 1 and not self.pools[0].free.chain:
            # lru: one `release_many` of every group's blocks in that order releases
            # exactly as one per group (cached ones linked in order, fresh ones stacked
            # in order); chain counts a tick of its loop clock per call, so it keeps them
            blocks: list[BlockId] = []
            for manager, state in zip(reversed(managers), reversed(states), strict=True):
                blocks += manager.detach(state)
            self.pools[0].release_many(blocks)
            return
        for g in range(len(managers) - 1, -1, -1):
            managers[g].release_all(states[g])
