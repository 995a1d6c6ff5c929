"""`CacheManager`: the facade an engine or a simulator drives (docs/cache_api.md).

Positions of one request, and what each call moves::

    tokens (verified)  |t0 ....................................... t_{T-1}|
    computed           |<------ c = num_computed ------>|
    step (allocate)                                     |<- n ->|<- L ->|   n new, L drafts
    commit(a accepted)                                  |<- n + a ->|       c2 = c + n + a

    prefill chunk: n = chunk, L = 0, commit(0, ()) or commit(0, (sampled,)) at the end
    decode step  : n = 1 (the last sampled token), L = drafts,
                   commit(a, accepted drafts + bonus token)   -> c2 = T2 - 1

The fast path: each request keeps the limits of `GroupManager.fast_limits` (see
`RequestRecord`), so that an allocate or commit that needs no block, no hash and no
release costs a handful of integer comparisons; everything else goes through the
coordinator, for the groups whose limits the step crosses.

`allocate` returns a `StepDelta` (`cache.delta`): per token-indexed group, the blocks
appended and the positions nulled since the previous delta, for engines that keep
persistent tables. Misuse raises `CacheError` before anything changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from hybridkv.cache.coordinator import Coordinator
from hybridkv.cache.delta import NO_CHANGE, StepDelta
from hybridkv.cache.events import CacheEvent
from hybridkv.cache.free_queue import DEFAULT_EVICTION_POLICY
from hybridkv.cache.hashing import MAX_TOKEN_ID
from hybridkv.cache.junction import enable_junction_copies
from hybridkv.cache.managers import Counters
from hybridkv.cache.request import RequestRecord
from hybridkv.cache.turn_end import enable_turn_end
from hybridkv.cache.validate import (
    all_counts,
    all_valid_token_lists,
    append_tokens,
    check_count,
    check_same_lengths,
    token_array,
)
from hybridkv.cache.views import CacheViews
from hybridkv.errors import CacheError
from hybridkv.ids import BlockId
from hybridkv.plan.types import CachePlan

_new_tuple = tuple.__new__

# extra checkpoint rules: junction (managers/state.py), turn_end (cache/turn_end.py)
CHECKPOINT_RULES = ("junction", "turn_end")
# Both on by default (bench/prefix_policies.py, docs/prefix_policies/results.md):
# junction is never below align and up to 1.6x hits under pressure; turn_end takes
# multi-turn sessions from ~91% to ~97% of the reuse bound with memory to spare, and
# its entries are evicted first, so under pressure it costs at most ~1% of hits.
DEFAULT_CHECKPOINT_RULES = ("junction", "turn_end")


class CacheManager(CacheViews):
    """Blocks, prefix cache and speculative reservations for every group of a plan.

    ``eagle``: the plan's draft layers are an EAGLE / MTP head (their KV at a position
    depends on the next token; groups holding them key blocks one token ahead).
    ``eviction_policy``: ``lru`` or ``chain`` (see `hybridkv.cache.free_queue`).
    ``checkpoint_rules``: extra state checkpoints on top of the plan's state mode;
    ``junction`` (see `hybridkv.cache.managers.state`), ``turn_end`` (a released request
    keeps its partial last block and its state at its last computed token, see
    `hybridkv.cache.turn_end`); None: `DEFAULT_CHECKPOINT_RULES`.
    """

    def __init__(
        self,
        plan: CachePlan,
        *,
        enable_prefix_caching: bool | None = None,
        eagle: bool = False,
        hash_algo: str = "sha256",
        record_events: bool = True,
        eviction_policy: str = DEFAULT_EVICTION_POLICY,
        checkpoint_rules: Sequence[str] | None = None,
    ) -> None:
        self.plan = plan
        self.caching = (
            plan.options.prefix_caching if enable_prefix_caching is None else enable_prefix_caching
        )
        self.eagle = eagle
        self._events: list[CacheEvent] = []
        self._counters = Counters()
        self.coordinator = Coordinator(
            plan,
            caching=self.caching,
            eagle=eagle,
            hash_algo=hash_algo,
            events=self._events if record_events else None,
            counters=self._counters,
            eviction_policy=eviction_policy,
        )
        self._managers = self.coordinator.managers
        self._is_state_group = [m.is_state for m in self._managers]
        self._state_group_ids = [m.group_id for m in self._managers if m.is_state]
        # Accepted drafts per step are bounded by the speculative states kept (state
        # groups); without state groups, only by the lookahead reserved.
        self._max_accept = min(
            (self.plan.group(g).num_spec_states for g in self._state_group_ids),
            default=MAX_TOKEN_ID,
        )
        self._all_groups = range(len(self._managers))
        self._unit = self.coordinator.hasher.unit_tokens
        self._requests: dict[str, RequestRecord] = {}
        self._hit_requests: set[str] = set()  # running requests that started from a hit
        # only the chain policy reads hot releases (`BlockPool.releasing_hot`)
        self._track_hot = eviction_policy == "chain"
        if checkpoint_rules is None:
            checkpoint_rules = DEFAULT_CHECKPOINT_RULES
        unknown = sorted(set(checkpoint_rules) - set(CHECKPOINT_RULES))
        if unknown:
            raise CacheError(
                f"checkpoint rules {unknown} are unknown; use any of {list(CHECKPOINT_RULES)}"
            )
        self.checkpoint_rules = tuple(checkpoint_rules)
        self._junction = "junction" in self.checkpoint_rules and bool(self._state_group_ids)
        for manager in self._managers:
            if manager.is_state:
                manager.junction_rule = self._junction
        self._junctions: dict[str, int] = {}  # junction rule: attention match at lookup
        self._turn_end = "turn_end" in self.checkpoint_rules and self.caching
        if self._turn_end:
            enable_turn_end(self.coordinator)
            if "junction" in self.checkpoint_rules:  # mid-block hits by copy-on-write
                enable_junction_copies(self.coordinator)
        self._num_lookups = self._num_lookup_tokens = self._num_hit_tokens = 0
        self._num_preemptions = self._num_alloc_failures = 0

    # ================================================================== life cycle
    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_id: int | None = None,
    ) -> None:
        if req_id in self._requests:
            raise CacheError(f"request {req_id!r} was already added")
        tokens = token_array(req_id, "prompt_token_ids", prompt_token_ids)
        if not tokens:
            raise CacheError(f"request {req_id!r} has 0 prompt tokens; needs >= 1")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise CacheError(
                f"request {req_id!r}: cache_salt must be a str or None, got "
                f"{type(cache_salt).__name__}"
            )
        if lora_id is not None:
            lora_id = check_count(req_id, "lora_id", lora_id)
        root = self.coordinator.hasher.root(cache_salt, lora_id)
        self._requests[req_id] = RequestRecord(req_id, tokens, root, self._max_accept)

    def lookup(self, req_id: str) -> int:
        """Prefix hit in tokens; remembers it for the next `allocate`. No other effect
        (the hit statistics count admissions: the allocate that starts the request)."""
        r = self._get(req_id)
        if r.started:
            raise CacheError(
                f"lookup of request {req_id!r} with {r.num_computed} computed tokens; "
                "lookup is for requests holding no blocks (new or preempted)"
            )
        hit = 0
        r.pending_states = None
        if self.caching:
            self._ensure_hashes(r, len(r.tokens))
            coordinator = self.coordinator
            found: list[dict[int, BlockId]] = [{} for _ in self._managers]
            hit = coordinator.find_hit(r.hashes, r.tokens, len(r.tokens) - 1, found)
            if hit:
                states = coordinator.hit_states(r.hashes, r.tokens, hit, found)
                if states is not None:
                    r.pending_states = (coordinator.num_evictions(), states)
            if self._junction:
                self._junctions[req_id] = self._attention_match(r, len(r.tokens) - 1, found)
        r.pending_hit = hit
        return hit

    def note_junction(self, req_id: str, num_tokens: int) -> None:
        """Junction rule: ``req_id`` (looked up, not yet admitted) shares its first
        ``num_tokens`` tokens with waiting requests a scheduler holds back for it
        (in-batch dedupe): its admission also checkpoints its state there, so they hit
        every shared token (mid-block: by a junction copy, `cache.junction`)."""
        r = self._get(req_id)
        if self._junction and not r.started and num_tokens > self._junctions.get(req_id, 0):
            self._junctions[req_id] = min(num_tokens, len(r.tokens) - 1)

    def allocate(
        self, req_id: str, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> StepDelta | None:
        """Reserve slots for positions [0, c + n + L): the step's `StepDelta`, or None
        (nothing changed) when it does not fit."""
        return self.allocate_batch((req_id,), (num_new_tokens,), (num_lookahead_tokens,))[0]

    def commit(
        self, req_id: str, num_accepted_tokens: int = 0, new_token_ids: Sequence[int] = ()
    ) -> None:
        """Settle the allocated step: ``num_accepted_tokens`` drafts were accepted and
        ``new_token_ids`` (accepted drafts + sampled token) join the verified tokens."""
        self.commit_batch((req_id,), (num_accepted_tokens,), (new_token_ids,))

    def allocate_batch(
        self,
        req_ids: Sequence[str],
        num_new_tokens: Sequence[int],
        num_lookahead_tokens: Sequence[int],
    ) -> list[StepDelta | None]:
        """`allocate` for each request in order (each independently all-or-nothing;
        mismatched lengths raise before any request is touched)."""
        check_same_lengths(
            "allocate_batch",
            req_ids,
            num_new_tokens=num_new_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
        )
        get, slow = self._requests.get, self._allocate_slow
        out: list[StepDelta | None] = []
        append = out.append
        # one C-speed check of every count; if any is bad, each request checks its own
        counts_ok = all_counts(num_new_tokens) and all_counts(num_lookahead_tokens)
        for req_id, n, lookahead in zip(req_ids, num_new_tokens, num_lookahead_tokens, strict=True):
            r = get(req_id)
            # The fast path (`RequestRecord`): no group needs a block and no delta is owed
            # (``fast_end`` is 0 then). Inline: a call per request costs more than this.
            if counts_ok and r is not None and not r.pending:
                top = r.num_computed + n
                if (
                    top + lookahead <= r.fast_end
                    and lookahead <= r.fast_lookahead
                    and top <= r.fast_verified
                    and top <= len(r.tokens)
                ):
                    r.pending = True
                    r.pend_n = n
                    r.pend_lookahead = lookahead
                    append(NO_CHANGE)
                    continue
            append(slow(r, req_id, n, lookahead))
        return out

    def commit_batch(
        self,
        req_ids: Sequence[str],
        num_accepted_tokens: Sequence[int],
        new_token_ids: Sequence[Sequence[int]],
    ) -> None:
        """`commit` for each request in order (mismatched lengths raise first)."""
        check_same_lengths(
            "commit_batch",
            req_ids,
            num_accepted_tokens=num_accepted_tokens,
            new_token_ids=new_token_ids,
        )
        get, slow, max_accept = self._requests.get, self._commit_slow, self._max_accept
        settle_slow = self._settle_slow
        # one C-speed check of every new id; if any is bad, each request checks its own
        valid = all_valid_token_lists(new_token_ids) and all_counts(num_accepted_tokens)
        for req_id, accepted, new in zip(req_ids, num_accepted_tokens, new_token_ids, strict=True):
            r = get(req_id)
            if valid and r is not None and r.pending:
                c2 = r.num_computed + r.pend_n + accepted
                tokens = r.tokens
                if (
                    accepted <= r.pend_lookahead
                    and accepted <= max_accept
                    and c2 <= len(tokens) + len(new)
                ):
                    tokens.extend(new)
                    if c2 < r.commit_below:
                        # The fast path (`RequestRecord`): no group caches or releases
                        # anything. Inline: a call per request costs more than this.
                        if accepted and r.settlers:
                            for settle, states in r.settlers:
                                settle(states, accepted)
                        r.num_computed = c2
                        r.pending = False
                    else:
                        settle_slow(r, accepted, c2)  # checked above: cache and release
                    continue
            slow(r, req_id, accepted, new)

    def free(self, req_id: str) -> None:
        """Release everything; cached blocks stay in the cache as evictable."""
        r = self._get(req_id)
        self._release(r, reset=False)  # the record is dropped: no need to reset it
        del self._requests[req_id]

    def preempt(self, req_id: str) -> None:
        """Release everything and forget computed tokens; verified tokens are kept."""
        r = self._get(req_id)
        self._release(r)
        self._num_preemptions += 1

    # ================================================================== internals
    def _allocate_slow(
        self, r: RequestRecord | None, req_id: str, n: int, lookahead: int
    ) -> StepDelta | None:
        if r is None:
            r = self._get(req_id)
        if not (type(n) is int is type(lookahead) and n >= 0 and 0 <= lookahead <= MAX_TOKEN_ID):
            n = check_count(req_id, "num_new_tokens", n)
            lookahead = check_count(req_id, "num_lookahead_tokens", lookahead)
        if r.pending:
            raise CacheError(
                f"allocate of request {req_id!r}: the step allocated before ({r.pend_n} new, "
                f"{r.pend_lookahead} lookahead) was not committed"
            )
        touch = not r.started
        c = (r.pending_hit or 0) if touch else r.num_computed
        if c + n > len(r.tokens):
            raise CacheError(
                f"allocate of request {req_id!r}: {c} computed + {n} new tokens exceed its "
                f"{len(r.tokens)} verified tokens; drafts go in num_lookahead_tokens"
            )
        coordinator = self.coordinator
        groups: list[int] | None = None  # all
        if touch:
            states = None
            if r.pending_states is not None:
                evictions, states = r.pending_states
                if evictions != coordinator.num_evictions():
                    states = None  # a block may be gone: look the hit up again below
            if states is None:
                self._ensure_hashes(r, c)
                states = coordinator.hit_states(r.hashes, r.tokens, c, None)
            if states is None:  # a hit block was evicted since lookup: look up again
                r.pending_hit = None
                r.pending_states = None
                self._num_alloc_failures += 1
                return None
            if self._junction:
                match = self._junctions.get(req_id, 0)
                for g in self._state_group_ids:
                    interval = self._managers[g].block_size
                    # with turn_end keys a checkpoint may sit inside an interval: at
                    # the attention match itself (cache/turn_end.py)
                    junction = match // interval * interval
                    if self._turn_end and match > interval:  # a turn-end key needs an anchor
                        junction = match
                    states[g].junction = junction if junction > c else 0
        else:
            states = r.states
            groups = r.groups_to_allocate(n, lookahead)
            if len(groups) == 1 and r.nulled is None:
                # the common slow step: one group needs a block (a decode step crossed
                # a block end); its manager lays it out in one call
                g = groups[0]
                grown = self._managers[g].grow(states[g], c, n, lookahead)
                if grown is None:
                    self._num_alloc_failures += 1
                    return None
                r.pending = True
                r.pend_n = n
                r.pend_lookahead = lookahead
                r.refresh_limits(self._managers, groups)
                if not grown[1]:
                    return NO_CHANGE
                # StepDelta(groups, taken), the cheap way (a named tuple's own __new__
                # is a Python function)
                return _new_tuple(
                    StepDelta, ({} if grown[0] is None else {g: grown[0]}, {g: grown[1]}, False, ())
                )
        delta = coordinator.try_allocate(states, c, n, lookahead, touch, groups, r.nulled)
        if delta is None:
            self._num_alloc_failures += 1
            return None
        if touch:
            # Hit statistics count admissions, not lookups: a scheduler may look a
            # waiting request up many times (ordering, deferral) before admitting it.
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
        r.refresh_limits(self._managers, self._all_groups if groups is None else groups)
        return delta

    def _commit_slow(
        self, r: RequestRecord | None, req_id: str, a: int, new_token_ids: Sequence[int]
    ) -> None:
        if r is None:
            r = self._get(req_id)
        if not r.pending:
            raise CacheError(f"commit of request {req_id!r} without an allocated step")
        if type(a) is not int or a < 0:
            a = check_count(req_id, "num_accepted_tokens", a)
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
        groups = r.groups_to_commit(c2, self._is_state_group)
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

    def _release(self, r: RequestRecord, reset: bool = True) -> None:
        """Release every block ``r`` holds; ``reset``: also forget its computed tokens,
        step and limits (a preempted request stays; a freed one is dropped)."""
        self._junctions.pop(r.req_id, None)
        if r.started and self._turn_end and not r.pending:
            # settled: every group's data at num_computed is final (see cache.turn_end)
            self._ensure_hashes(r, r.num_computed)
            self.coordinator.keep_turn_ends(r.states, r.num_computed, r.hashes, r.tokens)
        if r.started:
            hot = r.req_id in self._hit_requests
            if hot:
                self._hit_requests.discard(r.req_id)
                self._set_hot(True)
            try:
                self.coordinator.release_all(r.states)
            finally:
                if hot:
                    self._set_hot(False)
        if not reset:
            return
        r.states = []
        r.settlers = []
        r.started = False
        r.pending = False
        r.pending_hit = None
        r.pending_states = None
        r.nulled = None
        r.num_computed = 0
        r.clear_limits()

    def _attention_match(
        self, r: RequestRecord, limit: int, found: list[dict[int, BlockId]]
    ) -> int:
        """Longest prefix every non-state group holds (one pass, no state clamp): where
        the prompt leaves the cached chains, the junction rule's checkpoint. ``found``:
        the lookup's blocks per group (reused, extended)."""
        match = limit
        for g, manager in enumerate(self._managers):
            if not manager.is_state:
                match = manager.max_hit(r.hashes, r.tokens, match, found[g])
        return match

    def _set_hot(self, hot: bool) -> None:
        """Blocks released while ``hot`` belong to a request that started from a prefix
        hit; the eviction policy treats them as hit (see `BlockPool.releasing_hot`)."""
        for pool in self.coordinator.pools:
            pool.releasing_hot = hot
