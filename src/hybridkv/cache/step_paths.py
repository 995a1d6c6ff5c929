"""The step calls of `CacheManager`: allocate and commit, one request or a batch.

Split from `cache.manager` (life cycle: add, lookup, free, preempt) so that each file
stays readable; the public API is `CacheManager`'s, unchanged.

A running request's step takes the *fast path* when every group's limits allow it
(`RequestRecord`): a few integer comparisons (`RequestRecord.try_fast_allocate`; inline
in `commit_batch`, where a call per request would cost more than the check). Counts and
token ids are checked once per batch at C speed (`validate.all_counts`,
`validate.all_valid_token_lists`); a batch holding a bad value goes request by request
through the checked path, which names the culprit. A step that crosses one group's
limits goes to that group's manager in one call (`GroupManager.grow`); anything else
goes through the coordinator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn, SupportsIndex, cast

from hybridkv.cache.delta import NO_CHANGE, StepDelta
from hybridkv.cache.request import RequestRecord
from hybridkv.cache.validate import (
    FAST_MAX_COUNT,
    all_counts,
    all_valid_token_lists,
    append_tokens,
    check_count,
    check_same_lengths,
    token_array,
)
from hybridkv.cache.views import CacheViews
from hybridkv.errors import CacheError

_new_tuple = tuple.__new__  # a named tuple's own __new__ is a Python function
_Ints = Sequence[int]


class StepPaths(CacheViews):
    """`allocate` / `commit` and their batch forms (attributes set by
    `CacheManager.__init__`)."""

    caching: bool
    _max_accept: int
    _all_groups: range
    _is_state_group: list[bool]
    _state_group_ids: list[int]
    _unit: int
    _hit_requests: set[str]
    _track_hot: bool
    _junction: bool
    _junctions: dict[str, int]
    _turn_end: bool

    def allocate(
        self,
        req_id: str,
        num_new_tokens: SupportsIndex,
        num_lookahead_tokens: SupportsIndex = 0,
        num_unknown_tokens: SupportsIndex = 0,
    ) -> StepDelta | None:
        """Reserve slots for positions [0, c + n + L): the step's `StepDelta`, or None
        (nothing changed) when it does not fit.

        ``num_unknown_tokens``: how many of the ``n`` new tokens (the last ones) have no
        id yet, for an engine that schedules a step before the previous step's sampled
        token reaches the scheduler (vLLM's async scheduling); their ids arrive with this
        step's `commit`, before anything is hashed. Such a step takes the checked path."""
        r = self._requests.get(req_id)
        n, lookahead = num_new_tokens, num_lookahead_tokens
        if num_unknown_tokens:
            return self._allocate_slow(r, req_id, n, lookahead, num_unknown_tokens)
        if (
            r is not None
            and type(n) is int
            and type(lookahead) is int
            and 0 <= n <= FAST_MAX_COUNT
            and 0 <= lookahead <= FAST_MAX_COUNT
        ):
            if r.try_fast_allocate(n, lookahead):
                return NO_CHANGE
            if r.started and not r.pending and r.num_computed + n <= len(r.tokens):
                return self._grow(r, n, lookahead)  # checked: a block or a delta
        return self._allocate_slow(r, req_id, n, lookahead)

    def reserve_next(
        self, req_id: str, num_new_tokens: SupportsIndex, num_lookahead_tokens: SupportsIndex = 0
    ) -> StepDelta | None:
        """With a step pending, hold the blocks of the next one (``num_new_tokens`` new,
        ``num_lookahead_tokens`` lookahead) wherever that step's accepted drafts make it
        start: the `StepDelta` of blocks taken, or None (nothing changed) when they do
        not fit. For an engine that schedules the next step before the pending one's
        accepted count is known (vLLM's async scheduling with drafts). After the pending
        step's `commit`, the next step's `allocate` takes nothing the worker was not given
        here; the blocks of an acceptance that did not happen stay in the request's tables
        until it is freed."""
        r = self._get(req_id)
        n = check_count(req_id, "num_new_tokens", num_new_tokens)
        lookahead = check_count(req_id, "num_lookahead_tokens", num_lookahead_tokens)
        if not r.pending:
            raise CacheError(
                f"reserve_next of request {req_id!r}: no step is pending; allocate the next "
                "step instead"
            )
        drafts = max(0, r.pend_lookahead - self.rules.drafter_lookahead_tokens)
        start_max = r.num_computed + r.pend_n + drafts
        delta = self.coordinator.try_reserve(r.states, start_max, n, lookahead)
        if delta is None:
            self._num_alloc_failures += 1
            return None
        r.refresh_limits(self._managers, self._all_groups)
        return delta

    def commit(
        self,
        req_id: str,
        num_accepted_tokens: SupportsIndex = 0,
        new_token_ids: Sequence[int] = (),
    ) -> None:
        """Settle the allocated step: ``num_accepted_tokens`` drafts were accepted and
        ``new_token_ids`` (accepted drafts + sampled token) join the verified tokens."""
        r = self._requests.get(req_id)
        a = num_accepted_tokens
        # The per-request path of a scheduler: the same checks as `commit_batch`, once
        # for this call (no one-element batch): a plain int count, a list or tuple of
        # valid ids (`append_tokens`: C speed), then the fast path or the slow settle.
        if (
            r is not None
            and r.pending
            and type(a) is int
            and 0 <= a <= r.pend_lookahead
            and a <= self._max_accept
        ):
            c2 = r.num_computed + r.pend_n + a
            tokens = r.tokens
            num_tokens = len(tokens)
            if append_tokens(tokens, new_token_ids):
                if c2 <= len(tokens):
                    if c2 < r.commit_below:
                        if a and r.settlers:  # fast path: as in `commit_batch`
                            for manager, states in r.settlers:
                                manager.settle_fast_all(states, a)
                        r.num_computed = c2
                        r.pending = False
                    else:
                        self._settle_slow(r, a, c2)
                    return
                del tokens[num_tokens:]  # refused below: nothing changed
        self._commit_slow(r, req_id, a, new_token_ids)

    def allocate_batch(
        self,
        req_ids: Sequence[str],
        num_new_tokens: Sequence[SupportsIndex],
        num_lookahead_tokens: Sequence[SupportsIndex],
    ) -> list[StepDelta | None]:
        """`allocate` for each request in order (each independently all-or-nothing;
        mismatched lengths raise before any request is touched)."""
        check_same_lengths(
            "allocate_batch",
            req_ids,
            num_new_tokens=num_new_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
        )
        slow, grow = self._allocate_slow, self._grow
        records = self._records(req_ids)
        # one C-speed check of every count and id; if any is bad, each request goes
        # through the checked path in order (the culprit is named where it stands)
        if records is None or not (all_counts(num_new_tokens) and all_counts(num_lookahead_tokens)):
            get = self._requests.get
            return [
                slow(get(req_id), req_id, n, lookahead)
                for req_id, n, lookahead in zip(
                    req_ids, num_new_tokens, num_lookahead_tokens, strict=True
                )
            ]
        out: list[StepDelta | None] = []
        append = out.append
        # checked above: plain ints
        news, lookaheads = cast(_Ints, num_new_tokens), cast(_Ints, num_lookahead_tokens)
        for r, n, lookahead in zip(records, news, lookaheads, strict=True):
            # The fast path (`RequestRecord.try_fast_allocate`): no group needs a block
            # and no delta is owed; else the checked paths, as `allocate` takes them.
            if r.try_fast_allocate(n, lookahead):
                append(NO_CHANGE)
            elif r.started and not r.pending and r.num_computed + n <= len(r.tokens):
                append(grow(r, n, lookahead))
            else:
                append(slow(r, r.req_id, n, lookahead))
        return out

    def commit_batch(
        self,
        req_ids: Sequence[str],
        num_accepted_tokens: Sequence[SupportsIndex],
        new_token_ids: Sequence[Sequence[int]],
    ) -> None:
        """`commit` for each request in order (mismatched lengths raise first)."""
        check_same_lengths(
            "commit_batch",
            req_ids,
            num_accepted_tokens=num_accepted_tokens,
            new_token_ids=new_token_ids,
        )
        slow, settle_slow = self._commit_slow, self._settle_slow
        records = self._records(req_ids)
        # one C-speed check of every count, token id and request id (as in allocate)
        if (
            records is None
            or not all_valid_token_lists(new_token_ids)
            or not all_counts(num_accepted_tokens, self._max_accept)
        ):
            get = self._requests.get
            for req_id, accepted, new in zip(
                req_ids, num_accepted_tokens, new_token_ids, strict=True
            ):
                slow(get(req_id), req_id, accepted, new)
            return
        accepts = cast(_Ints, num_accepted_tokens)  # checked above: plain ints
        for r, accepted, new in zip(records, accepts, new_token_ids, strict=True):
            if r.pending:
                c2 = r.num_computed + r.pend_n + accepted
                tokens = r.tokens
                if accepted <= r.pend_lookahead and c2 <= len(tokens) + len(new):
                    tokens.extend(new)
                    if c2 < r.commit_below:
                        # The fast path (`RequestRecord`): no group caches or releases
                        # anything. Inline: a call per request costs more than this.
                        if accepted and r.settlers:
                            for manager, states in r.settlers:
                                manager.settle_fast_all(states, accepted)
                        r.num_computed = c2
                        r.pending = False
                    else:
                        settle_slow(r, accepted, c2)  # checked above: cache and release
                    continue
            slow(r, r.req_id, accepted, new)

    def _records(self, req_ids: Sequence[str]) -> list[RequestRecord] | None:
        """The records of ``req_ids`` in one C-speed pass, or None if one is unknown."""
        try:
            return list(map(self._requests.__getitem__, req_ids))
        except (KeyError, TypeError):
            return None

    def _allocate_slow(
        self,
        r: RequestRecord | None,
        req_id: str,
        num_new_tokens: SupportsIndex,
        num_lookahead_tokens: SupportsIndex,
        num_unknown_tokens: SupportsIndex = 0,
    ) -> StepDelta | None:
        if r is None:
            r = self._get(req_id)
        # counts arrive as objects (numpy integers welcome, bools and floats refused,
        # by `check_count`, which names them)
        n = check_count(req_id, "num_new_tokens", num_new_tokens)
        lookahead = check_count(req_id, "num_lookahead_tokens", num_lookahead_tokens)
        unknown = check_count(req_id, "num_unknown_tokens", num_unknown_tokens)
        if r.pending:
            raise CacheError(
                f"allocate of request {req_id!r}: the step allocated before ({r.pend_n} new, "
                f"{r.pend_lookahead} lookahead) was not committed"
            )
        if unknown > n:
            raise CacheError(
                f"allocate of request {req_id!r}: {unknown} unknown tokens but only {n} new "
                "ones; unknown tokens are the last of the new tokens"
            )
        c = r.num_computed if r.started else (r.pending_hit or 0)
        if c + n > len(r.tokens) + unknown:
            raise CacheError(
                f"allocate of request {req_id!r}: {c} computed + {n} new tokens exceed its "
                f"{len(r.tokens)} verified tokens and {unknown} unknown ones; drafts go in "
                "num_lookahead_tokens"
            )
        if r.started:
            return self._grow(r, n, lookahead)
        return self._admit(r, req_id, c, n, lookahead)

    def _admit(
        self, r: RequestRecord, req_id: str, c: int, n: int, lookahead: int
    ) -> StepDelta | None:
        """The first allocate after a lookup (checked): hold the hit blocks of every
        group, take the new ones, hand out whole tables."""
        coordinator = self.coordinator
        states = None
        if r.pending_states is not None:
            evictions, states = r.pending_states
            if evictions != coordinator.num_evictions():
                states = None  # a block may be gone: look the hit up again below
        if states is None:
            self._ensure_hashes(r, c)
            states = coordinator.hit_states(r.hashes, r.root, r.tokens, c, None)
        if states is None:  # a hit block was evicted since lookup: look up again
            r.pending_hit = None
            r.pending_states = None
            self._num_alloc_failures += 1
            return None
        if self._junction:
            match = self._junctions.get(req_id, 0)
            for g in self._state_group_ids:
                interval = self._managers[g].block_size
                # with turn_end keys a checkpoint may sit inside an interval (the first
                # one too: anchored at the chain's root): at the attention match itself
                # (cache/turn_end.py) -- not for engines that write states only at step
                # ends (`checkpoints_inside_steps=False`)
                junction = match // interval * interval
                if self._turn_end and self._managers[g].inside_steps:
                    junction = match
                states[g].junction = junction if junction > c else 0
        delta = coordinator.try_allocate(states, c, n, lookahead, True, None, r.nulled)
        if delta is None:
            self._num_alloc_failures += 1
            return None
        # Hit statistics count admissions, not lookups: a scheduler may look a waiting
        # request up many times (ordering, deferral) before admitting it.
        self._num_lookups += 1
        self._num_lookup_tokens += len(r.tokens)
        self._num_hit_tokens += c
        r.start(self._managers, states)
        r.num_computed = c
        r.pending_hit = None
        r.pending_states = None
        if c:
            self._counters.checkpoints_used += len(self._state_group_ids)
            if self._track_hot:
                self._hit_requests.add(req_id)
        self._junctions.pop(req_id, None)
        r.nulled = None
        r.pending = True
        r.pend_n = n
        r.pend_lookahead = lookahead
        r.refresh_limits(self._managers, self._all_groups)
        return delta

    def _grow(self, r: RequestRecord, n: int, lookahead: int) -> StepDelta | None:
        """The checked step of a running request (counts valid, nothing pending, within
        its verified tokens) that some group's limits refuse."""
        states = r.states
        groups = r.groups_to_allocate(n, lookahead)
        if len(groups) == 1 and r.nulled is None:
            # the common slow step: one group needs a block (a decode step crossed a
            # block end); its manager lays it out in one call
            g = groups[0]
            grown = self._managers[g].grow(states[g], r.num_computed, n, lookahead)
            if grown is None:
                self._num_alloc_failures += 1
                return None
            delta: StepDelta | None = (
                NO_CHANGE
                if not grown[1]
                # StepDelta(groups, taken), the cheap way (a named tuple's own __new__
                # is a Python function)
                else _new_tuple(
                    StepDelta, ({} if grown[0] is None else {g: grown[0]}, {g: grown[1]}, False, ())
                )
            )
        else:
            delta = self.coordinator.try_allocate(
                states, r.num_computed, n, lookahead, False, groups, r.nulled
            )
            if delta is None:
                self._num_alloc_failures += 1
                return None
            r.nulled = None
        r.pending = True
        r.pend_n = n
        r.pend_lookahead = lookahead
        r.refresh_limits(self._managers, groups)
        return delta

    def _commit_slow(
        self,
        r: RequestRecord | None,
        req_id: str,
        num_accepted_tokens: SupportsIndex,
        new_token_ids: Sequence[int],
    ) -> None:
        if r is None:
            r = self._get(req_id)
        if not r.pending:
            raise CacheError(f"commit of request {req_id!r} without an allocated step")
        a = check_count(req_id, "num_accepted_tokens", num_accepted_tokens)
        tokens = r.tokens
        num_tokens = len(tokens)
        if not append_tokens(tokens, new_token_ids):  # not a plain list of valid ids:
            tokens.extend(token_array(req_id, "new_token_ids", new_token_ids))  # or raise
        num_new = len(tokens) - num_tokens
        c, n, lookahead = r.num_computed, r.pend_n, r.pend_lookahead
        c2 = c + n + a
        if a > lookahead or a > self._max_accept or c2 > num_tokens + num_new:
            del tokens[num_tokens:]  # refused: nothing changed
            self._refuse_commit(r, req_id, a, num_tokens, num_new)
        self._settle_slow(r, a, c2)

    def _settle_slow(self, r: RequestRecord, a: int, c2: int) -> None:
        """The checked commit of ``a`` accepted drafts (tokens appended) that crosses
        some group's limits: hash, cache and release in the groups that need it."""
        tokens = r.tokens
        if self.caching and (len(r.hashes) + 1) * self._unit <= c2:  # a unit to hash
            self.coordinator.hasher.extend(r.hashes, r.root, tokens, c2)
        # one group: the failed fast commit says it has work (`groups_to_commit`)
        groups = (
            self._all_groups
            if len(self._is_state_group) == 1
            else r.groups_to_commit(c2, self._is_state_group)
        )
        hot = self._track_hot and r.req_id in self._hit_requests
        if hot:
            self._set_hot(True)
        try:
            nulled = self.coordinator.commit(
                r.states,
                r.num_computed,
                r.pend_n,
                r.pend_lookahead,
                a,
                r.hashes,
                r.root,
                tokens,
                groups,
                r.nulled,
            )
        finally:
            if hot:
                self._set_hot(False)
        r.num_computed = c2
        r.pending = False
        r.refresh_limits(self._managers, groups)
        r.owe_nulled(nulled)

    def _refuse_commit(
        self, r: RequestRecord, req_id: str, a: int, num_tokens: int, num_new: int
    ) -> NoReturn:
        """Raise the CacheError that explains why the commit was refused."""
        if a > r.pend_lookahead:
            raise CacheError(
                f"commit of request {req_id!r}: {a} accepted tokens but {r.pend_lookahead} "
                "were reserved as lookahead"
            )
        if a > self._max_accept:
            raise CacheError(
                f"commit of request {req_id!r}: {a} accepted drafts but the plan keeps "
                f"{self._max_accept} speculative states per request"
            )
        c2 = r.num_computed + r.pend_n + a
        raise CacheError(
            f"commit of request {req_id!r}: {c2} computed tokens would exceed "
            f"{num_tokens} + {num_new} verified tokens"
        )

    def _set_hot(self, hot: bool) -> None:
        """Blocks released while ``hot`` belong to a request that started from a prefix
        hit; the eviction policy treats them as hit (`BlockPool.set_hot_releases`)."""
        for pool in self.coordinator.pools:
            pool.set_hot_releases(hot)
