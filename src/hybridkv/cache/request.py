"""A request's record in the cache manager, and the fast path of a step.

Besides tokens, chain hashes and one state per group, a running request keeps the
limits of `GroupManager.fast_limits` for each group and their minimum over groups::

    allocate(n, L) needs no block in group g while   c + n + L <= total[g]     (slots held)
                                                     c + n     <= verified[g]  (next checkpoint)
                                                     L         <= spec[g]      (spec slots held)
    commit(a) has nothing to cache or release in g while   c + n + a < commit_limit[g]

    full attention B 16, 3 blocks held, 2 cached, c = 40:  total 48, commit_limit 48
    allocate(1, 7): 48 <= 48 -> fast;   allocate(1, 8): 49 > 48 -> slow, one new block

A step within the minimum costs a few comparisons (`try_fast_allocate`,
`try_fast_commit`). A step past it runs only the groups whose own limits it crosses
(`groups_to_allocate`, `groups_to_commit`) and refreshes only their limits.

Limits, except the state groups' checkpoint boundary, do not depend on ``c``; a state
group's boundary is the next multiple of its interval after ``c``, so it holds as long
as a commit stays below it, and every slow commit runs every state group (a state
group's commit past the fast path rotates its spare slots, see `StateManager.commit`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridkv.cache.managers import GroupManager, StateBlocks


class RequestRecord:
    """One request: tokens, hashes, per-group states, the step in flight and limits."""

    __slots__ = (
        "commit_limit",
        "fast_spec",
        "fast_total",
        "fast_verified",
        "group_commit",
        "group_spec",
        "group_total",
        "group_verified",
        "hashes",
        "max_accept",
        "num_computed",
        "pend_lookahead",
        "pend_n",
        "pending",
        "pending_hit",
        "req_id",
        "root",
        "started",
        "state_objs",
        "states",
        "tokens",
    )

    def __init__(self, req_id: str, tokens: list[int], root: bytes, max_accept: int) -> None:
        self.req_id = req_id
        self.tokens = tokens
        self.root = root
        self.max_accept = max_accept  # speculative states kept per state group
        self.hashes: list[bytes] = []
        self.num_computed = 0
        self.started = False  # holds per-group states (first allocate done)
        self.states: list[Any] = []
        self.state_objs: list[StateBlocks] = []
        self.pending = False
        self.pend_n = 0
        self.pend_lookahead = 0
        self.pending_hit: int | None = None
        self.clear_limits()

    # ------------------------------------------------------------------ fast path
    def try_fast_allocate(self, n: int, lookahead: int) -> bool:
        """Record the step and return True if no group needs a block; else change nothing."""
        top = self.num_computed + n
        if (
            not self.pending
            and top + lookahead <= self.fast_total
            and top <= self.fast_verified
            and lookahead <= self.fast_spec
            and top <= len(self.tokens)
            and n >= 0
            and lookahead >= 0
        ):
            self.pending = True
            self.pend_n = n
            self.pend_lookahead = lookahead
            return True
        return False

    def try_fast_commit(self, accepted: int, new_token_ids: Sequence[int]) -> bool:
        """Settle the step and return True if no group caches or releases anything.

        The running state of every state group becomes the spec slot of the last
        accepted draft, and the old running block takes that slot's place.
        """
        c2 = self.num_computed + self.pend_n + accepted
        if not (
            self.pending
            and 0 <= accepted <= self.pend_lookahead
            and accepted <= self.max_accept
            and c2 < self.commit_limit
            and c2 <= len(self.tokens) + len(new_token_ids)
        ):
            return False
        if new_token_ids:
            self.tokens.extend(new_token_ids)
        if accepted:
            i = accepted - 1
            for st in self.state_objs:
                spares = st.spares
                block = spares[i]
                spares[i] = st.running  # type: ignore[assignment]  # running is set: c > 0
                st.running = st.write = block
        self.num_computed = c2
        self.pending = False
        return True

    # ------------------------------------------------------------------ limits
    def clear_limits(self) -> None:
        """No fast path (no blocks held)."""
        self.fast_total = self.fast_verified = self.fast_spec = self.commit_limit = -1
        self.group_total: list[int] = []
        self.group_verified: list[int] = []
        self.group_spec: list[int] = []
        self.group_commit: list[int] = []

    def refresh_limits(self, managers: Sequence[GroupManager], groups: Sequence[int]) -> None:
        """Recompute the limits of ``groups`` (indexes into ``managers``), then the minimum."""
        if not self.group_total:
            num = len(managers)
            self.group_total = [-1] * num
            self.group_verified = [-1] * num
            self.group_spec = [-1] * num
            self.group_commit = [-1] * num
        total, verified, spec, commit = (
            self.group_total,
            self.group_verified,
            self.group_spec,
            self.group_commit,
        )
        c, states = self.num_computed, self.states
        for g in groups:
            total[g], verified[g], spec[g], commit[g] = managers[g].fast_limits(states[g], c)
        if len(total) == 1:
            self.fast_total, self.fast_verified = total[0], verified[0]
            self.fast_spec, self.commit_limit = spec[0], commit[0]
        else:
            self.fast_total, self.fast_verified = min(total), min(verified)
            self.fast_spec, self.commit_limit = min(spec), min(commit)

    def groups_to_allocate(self, n: int, lookahead: int) -> list[int]:
        """Groups whose own limits the step ``(n, lookahead)`` crosses (called once the
        fast path failed for a running request: with one group, that group)."""
        if len(self.group_total) == 1:
            return [0]
        top = self.num_computed + n
        end = top + lookahead
        return [
            g
            for g, (t, v, s) in enumerate(
                zip(self.group_total, self.group_verified, self.group_spec, strict=True)
            )
            if end > t or top > v or lookahead > s
        ]

    def groups_to_commit(self, c2: int, always: Sequence[bool]) -> list[int]:
        """Groups with something to cache or release at ``c2``, plus the ``always`` ones
        (state groups)."""
        return [
            g
            for g, (limit, forced) in enumerate(zip(self.group_commit, always, strict=True))
            if forced or c2 >= limit
        ]
