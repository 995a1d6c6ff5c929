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
from typing import SupportsIndex

from hybridkv.cache.coordinator import Coordinator
from hybridkv.cache.events import CacheEvent
from hybridkv.cache.managers import Counters
from hybridkv.cache.request import RequestRecord
from hybridkv.cache.rules import DEFAULT_EVICTION_POLICY, CacheRules
from hybridkv.cache.step_paths import StepPaths
from hybridkv.cache.validate import (
    FAST_MAX_COUNT,
    check_count,
    token_array,
)
from hybridkv.errors import CacheError
from hybridkv.ids import BlockId
from hybridkv.plan.types import CachePlan

_new_tuple = tuple.__new__


class CacheManager(StepPaths):
    """Blocks, prefix cache and speculative reservations for every group of a plan.

    ``eagle``: the plan's draft layers are an EAGLE / MTP head (their KV at a position
    depends on the next token; groups holding them key blocks one token ahead).
    ``eviction_policy``: ``lru`` or ``chain`` (see `hybridkv.cache.free_queue` and
    `hybridkv.cache.chain_queue`).
    ``checkpoint_rules``: extra state checkpoints on top of the plan's state mode;
    ``junction`` (see `hybridkv.cache.managers.state`), ``turn_end`` (a released request
    keeps its partial last block and its state at its last computed token, see
    `hybridkv.cache.turn_end`); None: `cache.rules.DEFAULT_CHECKPOINT_RULES`.
    ``checkpoints_inside_steps``: False for engines that write a state only at the end
    of a step (vLLM's workers): state groups then checkpoint only where a step ends,
    and the scheduler ends prefill chunks on checkpoint boundaries.
    ``state_layout``: ``slots`` (hybridkv's engine, `StepSlots` per step) or ``columns``
    (the positional rows of vLLM's workers, for speculative decoding on state layers:
    `hybridkv.cache.managers.state_columns`).
    ``drafter_lookahead_tokens``: the part of every step's lookahead that reserves the
    drafter's own KV (vLLM's ``num_lookahead_tokens``: K for draft models, EAGLE and MTP,
    0 for n-gram), not drafts being verified: attention groups reserve it, the
    ``columns`` state layout places its running column by the drafts alone.
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
        checkpoints_inside_steps: bool = True,
        state_layout: str = "slots",
        drafter_lookahead_tokens: int = 0,
    ) -> None:
        self.plan = plan
        self.rules = CacheRules.for_plan(
            plan,
            enable_prefix_caching=enable_prefix_caching,
            eagle=eagle,
            hash_algo=hash_algo,
            eviction_policy=eviction_policy,
            checkpoint_rules=checkpoint_rules,
            checkpoints_inside_steps=checkpoints_inside_steps,
            state_layout=state_layout,
            drafter_lookahead_tokens=drafter_lookahead_tokens,
        )
        self.caching = self.rules.prefix_caching
        self.eagle = eagle
        self.checkpoint_rules = self.rules.checkpoint_rules
        self._events: list[CacheEvent] = []
        self._counters = Counters()
        self.coordinator = Coordinator(
            plan,
            self.rules,
            events=self._events if record_events else None,
            counters=self._counters,
        )
        self._managers = self.coordinator.managers
        self._is_state_group = [m.is_state for m in self._managers]
        self._state_group_ids = [m.group_id for m in self._managers if m.is_state]
        # Accepted drafts per step are bounded by the speculative states kept (state
        # groups); without state groups, only by the lookahead reserved.
        self._max_accept = min(
            (self.plan.group(g).num_spec_states for g in self._state_group_ids),
            default=FAST_MAX_COUNT,
        )
        self._all_groups = range(len(self._managers))
        self._unit = self.coordinator.hasher.unit_tokens
        self._requests: dict[str, RequestRecord] = {}
        self._hit_requests: set[str] = set()  # running requests that started from a hit
        # only the chain policy reads hot releases (`BlockPool.set_hot_releases`)
        self._track_hot = self.rules.chain
        self._junction = self.rules.junction
        self._junctions: dict[str, int] = {}  # junction rule: attention match at lookup
        self._turn_end = self.rules.turn_end
        self._num_lookups = self._num_lookup_tokens = self._num_hit_tokens = 0
        self._num_preemptions = self._num_alloc_failures = 0

    # ================================================================== life cycle
    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_id: SupportsIndex | None = None,
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
        lora = None if lora_id is None else check_count(req_id, "lora_id", lora_id)
        root = self.coordinator.hasher.root(cache_salt, lora)
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
            answers: dict[tuple[int, int], int] = {}  # (group, limit) -> max_hit
            limit = len(r.tokens) - 1
            hit = coordinator.find_hit(r.hashes, r.root, r.tokens, limit, found, answers)
            if hit:
                states = coordinator.hit_states(r.hashes, r.root, r.tokens, hit, found)
                if states is not None:
                    r.pending_states = (coordinator.num_evictions(), states)
            if self._junction:  # where the prompt leaves the cached attention chains
                self._junctions[req_id] = coordinator.attention_match(
                    r.hashes, r.root, r.tokens, limit, found, answers
                )
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
    def _release(self, r: RequestRecord, reset: bool = True) -> None:
        """Release every block ``r`` holds; ``reset``: also forget its computed tokens,
        step and limits (a preempted request stays; a freed one is dropped)."""
        self._junctions.pop(r.req_id, None)
        if r.started and self._turn_end and not r.pending:
            # settled: every group's data at num_computed is final (see cache.turn_end)
            self._ensure_hashes(r, r.num_computed)
            self.coordinator.keep_turn_ends(r.states, r.num_computed, r.hashes, r.root, r.tokens)
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
