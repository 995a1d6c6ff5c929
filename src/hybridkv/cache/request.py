"""A request's record in the cache manager, and the fast path of a step.

Besides tokens, chain hashes and one state per group, a running request keeps each
group's `FastLimits` (what that group's manager says a step may do without its slow
path), as the plain ints of `GroupManager.fast_bounds`, and their minimum over groups::

    allocate(n, L) needs no block in any group while   c + n + L <= min end_tokens
                                                       c + n     <= min verified_tokens
                                                       L         <= min lookahead_tokens
    commit(a) has nothing to cache or release while    c2 = c + n + a < min commit_below

    full attention B 16, 3 blocks held, 2 cached, c = 40:  end 48, commit below 48
    allocate(1, 7): 48 <= 48 -> fast;   allocate(1, 8): 49 > 48 -> slow, one new block

A step within the minimum costs a few comparisons (`try_fast_allocate`; inline in
`CacheManager.commit_batch`); a fast commit lets each manager whose
state moves on it (`GroupManager.moves_on_fast_commit`: state groups) settle its own
state with `GroupManager.settle_fast_all` (one call per manager kind) -- the record
never touches manager internals. A step past the minimum runs only the groups whose
own limits it crosses (`groups_to_allocate`, `groups_to_commit`) and refreshes only
their limits. While positions nulled by a commit are owed to the next delta,
``fast_end`` is 0 (`owe_nulled`), so that step takes the slow path that hands them out.

Limits, except a state group's checkpoint boundary, do not depend on ``c``; the
boundary is the next multiple of the interval after ``c``, so it holds as long as a
commit stays below it, and every slow commit runs every state group.
`check_limits` recomputes every group's limits and compares them with the cached ones.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

from hybridkv.cache.managers import Bounds, GroupManager
from hybridkv.errors import InvariantError


class GroupLimits:
    """One group's `GroupManager.fast_bounds` (end, verified, lookahead, commit below),
    made once per group when a request starts and overwritten at each refresh."""

    __slots__ = ("commit_below", "end", "lookahead", "verified")

    def __init__(self) -> None:
        self.end = self.verified = self.lookahead = self.commit_below = 0

    def bounds(self) -> Bounds:
        return self.end, self.verified, self.lookahead, self.commit_below


class RequestRecord:
    """One request: tokens, hashes, per-group states, the step in flight and limits."""

    __slots__ = (
        "commit_below",
        "fast_end",
        "fast_lookahead",
        "fast_verified",
        "hashes",
        "limits",
        "max_accept",
        "nulled",
        "num_computed",
        "pend_lookahead",
        "pend_n",
        "pending",
        "pending_hit",
        "pending_states",
        "req_id",
        "root",
        "settlers",
        "started",
        "states",
        "tokens",
    )

    def __init__(self, req_id: str, tokens: array[int], root: bytes, max_accept: int) -> None:
        self.req_id = req_id
        self.tokens = tokens
        self.root = root
        self.max_accept = max_accept  # speculative states kept per state group
        self.hashes: list[bytes] = []
        self.num_computed = 0
        self.started = False  # holds per-group states (first allocate done)
        self.states: list[Any] = []
        # (a manager of one kind, the states of its groups) for the groups whose state
        # moves on a fast commit: ``manager.settle_fast_all(states, accepted)``
        self.settlers: list[tuple[GroupManager, list[Any]]] = []
        self.pending = False
        self.pend_n = 0
        self.pend_lookahead = 0
        self.pending_hit: int | None = None
        # states holding the looked-up hit blocks, and the pools' eviction count then
        self.pending_states: tuple[int, list[Any]] | None = None
        # per group: table positions [lo, hi) nulled since the last delta handed out
        self.nulled: dict[int, tuple[int, int]] | None = None
        self.limits: list[GroupLimits] = []  # per group: `GroupManager.fast_bounds`
        self.clear_limits()

    # ------------------------------------------------------------------ fast path
    def try_fast_allocate(self, n: int, lookahead: int) -> bool:
        """Record the step and return True if no group needs a block and no delta is
        owed (``fast_end`` is 0 then); else change nothing. ``n`` and ``lookahead`` are
        ints in [0, 2^63), checked by the caller (once per batch at C speed)."""
        if self.pending:
            return False
        top = self.num_computed + n
        if (
            top + lookahead <= self.fast_end
            and lookahead <= self.fast_lookahead
            and top <= self.fast_verified
            and top <= len(self.tokens)
        ):
            self.pending = True
            self.pend_n = n
            self.pend_lookahead = lookahead
            return True
        return False

    # ------------------------------------------------------------------ limits
    def clear_limits(self) -> None:
        """No fast path (no blocks held)."""
        self.fast_end = self.fast_verified = self.fast_lookahead = self.commit_below = 0
        self.limits = []

    def start(self, managers: Sequence[GroupManager], states: list[Any]) -> None:
        """Hold ``states`` (one per group), as the first allocate after a lookup does."""
        self.started = True
        self.states = states
        by_kind: dict[type[GroupManager], list[Any]] = {}
        first: dict[type[GroupManager], GroupManager] = {}
        for g, m in enumerate(managers):
            s = states[g]
            if m.moves_on_fast_commit:
                by_kind.setdefault(type(m), []).append(s)
                first.setdefault(type(m), m)
        # one call per kind, on a manager object
        self.settlers = [(first[kind], group) for kind, group in by_kind.items()]
        self.limits = [GroupLimits() for _ in managers]

    def refresh_limits(self, managers: Sequence[GroupManager], groups: Sequence[int]) -> None:
        """Recompute the limits of ``groups`` (indexes into ``managers``), then the minimum."""
        limits, c, states = self.limits, self.num_computed, self.states
        if len(limits) == 1:  # one group: its limits are the minimum
            end, verified, lookahead, commit = managers[0].fast_bounds(states[0], c)
            lim = limits[0]
            lim.end, lim.verified, lim.lookahead, lim.commit_below = (
                end,
                verified,
                lookahead,
                commit,
            )
            self.fast_end, self.fast_verified = end, verified
            self.fast_lookahead, self.commit_below = lookahead, commit
            return
        for g in groups:
            lim = limits[g]
            lim.end, lim.verified, lim.lookahead, lim.commit_below = managers[g].fast_bounds(
                states[g], c
            )
        # the minima of the four bounds in one loop
        first = limits[0]
        end, verified, lookahead, commit = (
            first.end,
            first.verified,
            first.lookahead,
            first.commit_below,
        )
        for lim in limits:
            if lim.end < end:
                end = lim.end
            if lim.verified < verified:
                verified = lim.verified
            if lim.lookahead < lookahead:
                lookahead = lim.lookahead
            if lim.commit_below < commit:
                commit = lim.commit_below
        self.fast_end, self.fast_verified = end, verified
        self.fast_lookahead, self.commit_below = lookahead, commit

    def group_limits(self, g: int) -> Bounds:
        """The cached limits of group ``g``."""
        return self.limits[g].bounds()

    def owe_nulled(self, nulled: dict[int, tuple[int, int]] | None) -> None:
        """After a slow commit (limits refreshed): positions ``nulled`` are owed to the
        next delta, so no allocate may take the fast path until it hands them out."""
        self.nulled = nulled
        if nulled is not None:
            self.fast_end = 0

    def check_limits(self, managers: Sequence[GroupManager]) -> None:
        """The cached limits are each manager's own, and the minima theirs."""
        if not self.started:
            if self.limits or self.fast_end or self.commit_below:
                raise InvariantError(f"request {self.req_id!r} holds no blocks but has limits")
            return
        if len(self.limits) != len(managers):
            raise InvariantError(
                f"request {self.req_id!r}: {len(self.limits)} cached limits for "
                f"{len(managers)} groups"
            )
        for g, manager in enumerate(managers):
            fresh = manager.fast_bounds(self.states[g], self.num_computed)
            cached = self.group_limits(g)
            if fresh != cached:
                raise InvariantError(
                    f"request {self.req_id!r} group {g}: cached fast limits {cached} but the "
                    f"manager says {fresh} at {self.num_computed} computed tokens"
                )
        every = [lim.bounds() for lim in self.limits]
        minima = [min(bounds[i] for bounds in every) for i in range(4)]
        if self.nulled is not None:
            minima[0] = 0  # a delta is owed: the next allocate takes the slow path
        if tuple(minima) != (
            self.fast_end,
            self.fast_verified,
            self.fast_lookahead,
            self.commit_below,
        ):
            raise InvariantError(f"request {self.req_id!r}: fast-path minima {minima} are stale")

    def groups_to_allocate(self, n: int, lookahead: int) -> list[int]:
        """Groups whose own limits the step ``(n, lookahead)`` crosses (called once the
        fast path failed for a running request)."""
        limits = self.limits
        if len(limits) == 1:
            return [0]
        top = self.num_computed + n
        end = top + lookahead
        out: list[int] = []
        for g, lim in enumerate(limits):
            if end > lim.end or top > lim.verified or lookahead > lim.lookahead:
                out.append(g)
        return out

    def groups_to_commit(self, c2: int, always: list[bool]) -> list[int]:
        """Groups with something to cache or release at ``c2``, plus the ``always`` ones
        (state groups)."""
        limits = self.limits
        if len(limits) == 1:
            return [0]  # called once the fast commit failed: the one group has work
        out: list[int] = []
        for g, forced in enumerate(always):
            if forced or c2 >= limits[g].commit_below:
                out.append(g)
        return out
