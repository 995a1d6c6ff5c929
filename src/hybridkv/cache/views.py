"""Read-only views of a `CacheManager`: tables, slots, hashes, statistics, invariants.

Split from `cache.manager` along the line between what changes the cache (life cycle
and steps, in `CacheManager`) and what only reads it (here, as a base class), so that
each file stays readable; the public API is `CacheManager`'s, unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import SupportsIndex

from hybridkv.cache.block import BlockInfo
from hybridkv.cache.coordinator import Coordinator
from hybridkv.cache.events import CacheEvent, CacheStats
from hybridkv.cache.managers import Counters, GroupManager, StepSlots
from hybridkv.cache.needs import step_needs, total_step_needs
from hybridkv.cache.request import RequestRecord
from hybridkv.cache.rules import CacheRules
from hybridkv.cache.validate import check_same_lengths
from hybridkv.errors import CacheError, InvariantError
from hybridkv.ids import BlockId


class CacheViews:
    """Queries over the state a `CacheManager` keeps (attributes set by its __init__)."""

    coordinator: Coordinator
    rules: CacheRules
    _managers: list[GroupManager]
    _requests: dict[str, RequestRecord]
    _events: list[CacheEvent]
    _counters: Counters
    _num_lookups: int
    _num_lookup_tokens: int
    _num_hit_tokens: int
    _num_preemptions: int
    _num_alloc_failures: int
    _junction: bool
    _junctions: dict[str, int]
    _state_group_ids: list[int]

    def has_request(self, req_id: str) -> bool:
        return req_id in self._requests

    def num_computed_tokens(self, req_id: str) -> int:
        return self._get(req_id).num_computed

    @property
    def hash_unit_tokens(self) -> int:
        """Tokens per chain hash (the unit of `block_hashes`)."""
        return self.coordinator.hasher.unit_tokens

    def block_hashes(self, req_id: str, start: int = 0, stop: int | None = None) -> list[bytes]:
        """Chain hashes ``[start, stop)`` of the request's full hash units of verified
        tokens (unit i covers tokens ``[i*U, (i+1)*U)``, U = `hash_unit_tokens`). Equal
        hashes mean equal prefixes and cache salt; a scheduler uses them to see which
        requests would compute the same blocks. Read-only (hashes are memoised)."""
        r = self._get(req_id)
        self._ensure_hashes(r, len(r.tokens))
        return r.hashes[start:stop]

    def token_ids(self, req_id: str) -> list[int]:
        """The request's verified tokens (a copy)."""
        return list(self._get(req_id).tokens)

    def block_table(self, req_id: str, group_id: int) -> list[BlockId]:
        """Attention groups: block j covers tokens [j*B, (j+1)*B), null block for released
        positions. State groups: the blocks held (running first); use `state_slots`."""
        r = self._get(req_id)
        self._check_group(group_id)
        if not r.started:
            return []
        manager = self._managers[group_id]
        state = r.states[group_id]
        return manager.held(state) if manager.is_state else list(state.blocks)

    def block_tables(self, req_id: str) -> dict[int, list[BlockId]]:
        return {m.group_id: self.block_table(req_id, m.group_id) for m in self._managers}

    def junction_point(self, req_id: str) -> int:
        """Junction rule, for schedulers of engines that write states only where a step
        ends: the position past the computed tokens where a step should end so that the
        state there is checkpointed (0: none). Before admission, from the lookup."""
        if not self._junction:
            return 0
        r = self._get(req_id)
        g = self._state_group_ids[0]
        if not r.started:
            interval = self._managers[g].block_size
            return self._junctions.get(req_id, 0) // interval * interval
        junction: int = r.states[g].junction
        return junction if junction > r.num_computed else 0

    def state_slots(self, req_id: str, group_id: int) -> StepSlots:
        """Blocks a state group reads and writes in the allocated step (see `StepSlots`)."""
        r = self._get(req_id)
        self._check_group(group_id)
        manager = self._managers[group_id]
        if not manager.is_state:
            raise CacheError(f"group {group_id} is {manager.group.kind}, not a state group")
        if not r.pending:
            raise CacheError(
                f"state_slots of request {req_id!r}: no step allocated (call allocate first)"
            )
        return manager.slots(r.states[group_id], r.num_computed, r.pend_n, r.pend_lookahead)

    def state_slots_many(self, req_ids: Sequence[str], group_id: int) -> list[StepSlots]:
        """`state_slots` of every request in ``req_ids`` for one state group, in order
        (one group check for all: an engine reads every row of a step per state group)."""
        self._check_group(group_id)
        manager = self._managers[group_id]
        if not manager.is_state:
            raise CacheError(f"group {group_id} is {manager.group.kind}, not a state group")
        out = []
        for req_id in req_ids:
            r = self._get(req_id)
            if not r.pending:
                raise CacheError(
                    f"state_slots of request {req_id!r}: no step allocated (call allocate first)"
                )
            out.append(
                manager.slots(r.states[group_id], r.num_computed, r.pend_n, r.pend_lookahead)
            )
        return out

    def block_info(self, pool_id: int, block_id: BlockId) -> BlockInfo:
        return self.coordinator.pools[pool_id].info(block_id)

    def num_free_blocks(self, pool_id: int = 0) -> int:
        return self.coordinator.pools[pool_id].num_free

    def usage(self) -> float:
        pools = self.coordinator.pools
        usable = sum(p.num_usable for p in pools)
        return 1.0 - sum(p.num_free for p in pools) / usable if usable else 0.0

    def stats(self) -> CacheStats:
        pools = self.coordinator.pools
        return CacheStats(
            usage=self.usage(),
            usage_per_pool=tuple(p.usage() for p in pools),
            num_requests=len(self._requests),
            num_lookups=self._num_lookups,
            num_lookup_tokens=self._num_lookup_tokens,
            num_hit_tokens=self._num_hit_tokens,
            num_blocks_stored=sum(p.num_stored for p in pools),
            num_evictions=sum(p.num_evictions for p in pools),
            num_checkpoints_stored=self._counters.checkpoints_stored,
            num_checkpoints_used=self._counters.checkpoints_used,
            num_preemptions=self._num_preemptions,
            num_allocate_failures=self._num_alloc_failures,
        )

    def take_events(self) -> list[CacheEvent]:
        events = self._events[:]
        self._events.clear()
        return events

    def check_invariants(self) -> None:
        """Pools (partition, ref counts, index, null block) and every request's state."""
        refs: list[Counter[int]] = [Counter() for _ in self.coordinator.pools]
        for r in self._requests.values():
            r.check_limits(self._managers)
            if r.num_computed > len(r.tokens):
                raise InvariantError(
                    f"request {r.req_id!r}: {r.num_computed} computed > {len(r.tokens)} tokens"
                )
            if not r.started:
                if r.num_computed or r.pending:
                    raise InvariantError(f"request {r.req_id!r} holds no blocks but is running")
                continue
            for manager, state in zip(self._managers, r.states, strict=True):
                manager.check_state(state, r.num_computed)
                refs[manager.pool.pool_id].update(manager.held(state))
        for pool, expected in zip(self.coordinator.pools, refs, strict=True):
            pool.check_invariants(expected)

    # ================================================================== helpers
    def _get(self, req_id: str) -> RequestRecord:
        r = self._requests.get(req_id)
        if r is None:
            raise CacheError(f"unknown request {req_id!r} ({len(self._requests)} known)")
        return r

    def _check_group(self, group_id: int) -> None:
        if not 0 <= group_id < len(self._managers):
            raise CacheError(f"group {group_id} out of range 0..{len(self._managers) - 1}")

    def _ensure_hashes(self, r: RequestRecord, num_tokens: int) -> None:
        hasher = self.coordinator.hasher
        if (len(r.hashes) + 1) * hasher.unit_tokens <= min(num_tokens, len(r.tokens)):
            hasher.extend(r.hashes, r.root, r.tokens, num_tokens)

    def blocks_needed(
        self,
        req_id: str,
        num_new_tokens: SupportsIndex,
        num_lookahead_tokens: SupportsIndex = 0,
    ) -> list[int]:
        """Per pool, the blocks `allocate(req_id, n, L)` would take now, changing nothing;
        for a running request between steps (see `cache.needs`)."""
        return step_needs(
            self._get(req_id),
            self._managers,
            len(self.coordinator.pools),
            num_new_tokens,
            num_lookahead_tokens,
        )

    def blocks_needed_batch(
        self,
        req_ids: Sequence[str],
        num_new_tokens: Sequence[SupportsIndex],
        num_lookahead_tokens: Sequence[SupportsIndex],
    ) -> list[int]:
        """`blocks_needed` summed over ``req_ids``, per pool (one call per step)."""
        check_same_lengths(
            "blocks_needed_batch",
            req_ids,
            num_new_tokens=num_new_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
        )
        records = [self._get(r) for r in req_ids]
        pools = len(self.coordinator.pools)
        return total_step_needs(
            records, self._managers, pools, num_new_tokens, num_lookahead_tokens
        )
