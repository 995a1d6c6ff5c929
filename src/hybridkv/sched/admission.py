"""Cache-aware admission for the `Scheduler`: in which order waiting requests are
admitted, and which of them wait for a running prefill instead of computing a prefix
twice (in-batch dedupe). Neither rule decides whether a request fits; they only order
and defer. Both are off without prefix caching or with ``cache_aware=False``.

    order      (priority, longest cached prefix first, arrival) among the first
               ``reorder_window`` waiting requests, arrival order after them
    dedupe     a waiting request whose next hit granule a running prefill is computing
               waits a step (`PrefixAdmission.computed_by_others`) and hits it later
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridkv.errors import InvariantError
from hybridkv.sched.config import SchedulerConfig
from hybridkv.sched.request import Request


class PrefixAdmission:
    """Ordering and dedupe over ``manager``'s prefix cache (see the module doc)."""

    def __init__(self, manager: Any, config: SchedulerConfig) -> None:
        self.manager = manager
        self.config = config
        self.enabled = config.cache_aware and bool(getattr(manager, "caching", True))
        self.unit = int(manager.hash_unit_tokens) if self.enabled else 0
        # Hits come in granules (state checkpoints, attention blocks): waiting pays only
        # when a running prefill computes the whole next granule of a waiting request.
        granule = getattr(getattr(manager, "plan", None), "hit_granularity_tokens", None)
        self.granule: int = self.unit
        if isinstance(granule, int) and self.unit and granule % self.unit == 0:
            self.granule = granule
        self._order_hits: dict[str, tuple[int, int]] = {}  # req -> (step, hit) for ordering

    def forget(self, req_id: str) -> None:
        """``req_id`` left the waiting queue (admitted, cancelled, finished)."""
        self._order_hits.pop(req_id, None)

    def order(self, waiting: Sequence[Request], step: int) -> list[Request]:
        """Waiting requests in admission order: (priority, longest cached prefix first,
        arrival) among the first ``reorder_window``, arrival order after them.

        The ordering hit of a request is looked up again only every
        ``reorder_refresh_steps`` steps (lookups cost a prefix scan each; a stale key
        only changes the order, admission itself looks up afresh)."""
        window = self.config.reorder_window if self.enabled else 0
        if window < 2 or len(waiting) < 2:
            return list(waiting)
        head = list(waiting[:window])
        refresh = self.config.reorder_refresh_steps
        hits: dict[str, int] = {}
        for r in head:
            memo = self._order_hits.get(r.req_id)
            if memo is None or step - memo[0] >= refresh:
                # no lookup for a request admitted without a hit: the manager's
                # allocate would start from the hit it remembers
                hit = self.manager.lookup(r.req_id) if r.use_prefix_cache else 0
                memo = (step, hit)
                self._order_hits[r.req_id] = memo
            hits[r.req_id] = memo[1]
        head.sort(key=lambda r: (r.priority, -hits[r.req_id], r.seq))
        return head + list(waiting[window:])

    def inflight(self, running: Sequence[Request]) -> set[bytes] | None:
        """Hashes of the units running prefills have still to compute (None: dedupe off)."""
        if not self.enabled:
            return None
        hashes: set[bytes] = set()
        for req in running:
            hashes.update(self.uncomputed(req))
        return hashes

    def uncomputed(self, req: Request) -> list[bytes]:
        """Hashes of the full units a running prefill has still to compute and commit."""
        if req.num_tokens - req.num_computed <= 1:
            return []
        unit = self.unit
        return list(
            self.manager.block_hashes(req.req_id, req.num_computed // unit, req.num_tokens // unit)
        )

    def computed_by_others(self, req: Request, hit: int, inflight: set[bytes]) -> bool:
        """Whether a running prefill computes ``req``'s next hit granule, up to its last
        unit: then ``req`` waits for that commit and hits it instead of computing it
        twice. (Deferring for a partly shared granule would gain nothing: the hit stays
        at the granule start, and the waiters would prefill one after another.)

            G = 64, unit 16, hit 192: wait iff the unit [240, 256) is in flight
        """
        if not inflight:
            return False
        index = (hit // self.granule + 1) * self.granule // self.unit - 1
        nxt = self.manager.block_hashes(req.req_id, index, index + 1)
        return bool(nxt) and nxt[0] in inflight

    def shared_with_waiting(self, req: Request, waiting: Sequence[Request]) -> int:
        """Longest prefix ``req`` shares with another of the first ``reorder_window``
        ``waiting`` requests (their prompts): the junction the others will hit once
        ``req`` computed it (`CacheManager.note_junction`); 0 with dedupe off."""
        if not self.enabled:
            return 0
        best = 0
        mine = req.prompt
        for other in waiting[: self.config.reorder_window]:
            if other is not req:
                best = max(best, common_prefix(mine, other.prompt))
        return best

    def check_invariants(self, waiting: set[str]) -> None:
        """Ordering hits are memoised for waiting requests only (``waiting``: their ids)."""
        stale = set(self._order_hits) - waiting
        if stale:
            raise InvariantError(f"ordering hits kept for requests not waiting: {sorted(stale)}")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token lists (bisection on slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
