"""`VllmKVCacheManager`: vLLM's ``KVCacheManager`` calls, answered by hybridkv's
`CacheManager`.

vLLM's scheduler asks its KV-cache manager for a request's prefix hit
(``get_computed_blocks``), for slots (``allocate_slots``: new tokens incl. the drafts
being verified, plus the drafter's lookahead), frees (``free``: finished, aborted or
preempted), and for usage, stats and events. hybridkv's manager wants the same things
as ``lookup`` / ``allocate(n verified, L drafts)`` / ``commit(accepted, new tokens)`` /
``free``. The translation:

* When each step is committed (one schedule late with async scheduling; with drafts,
  a step ahead held on top of the pending one): `hybridkv.vllm.steps`.
* Blocks go to the worker as append-only rows (`hybridkv.vllm.rows`), as vLLM's
  ``KVCacheBlocks`` of light block objects (only ids are read).
* Block copies (a hit on a cached state inside an interval; junction copies) go out
  through ``take_kv_cache_block_copies``, which vLLM's worker runs before the step.

Everything else vLLM's manager offers for KV connectors and offloading is refused at
start-up by `hybridkv.vllm.scheduler`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence, Sized
from types import SimpleNamespace
from typing import Any

from hybridkv.cache import CacheManager
from hybridkv.errors import InvariantError
from hybridkv.vllm.events import VllmEventLog
from hybridkv.vllm.kv_plan import UnsupportedVllmSetup, VllmGroup, plan_for_vllm
from hybridkv.vllm.manager_reads import Block, ManagerReads
from hybridkv.vllm.rows import WorkerRows
from hybridkv.vllm.steps import Step, StepAhead, StepLedger

# hybridkv's rules inside vLLM: align checkpoints where chunks end, junction
# checkpoints (where a prompt leaves the cached prefix, floored to a state boundary: a
# state inside an interval mid-request is something vLLM's append-only rows cannot
# follow) with junction copies of attention blocks, and turn-end checkpoints (multi-turn
# chat resumes at the previous turn's last computed token).
VLLM_CHECKPOINT_RULES = ("junction", "turn_end")
# ``HYBRIDKV_VLLM_CHECKPOINT_RULES``: a comma-separated list instead ("" for align only)
RULES_ENV = "HYBRIDKV_VLLM_CHECKPOINT_RULES"


def checkpoint_rules_from_env() -> tuple[str, ...]:
    value = os.environ.get(RULES_ENV)
    if value is None:
        return VLLM_CHECKPOINT_RULES
    rules = tuple(r.strip() for r in value.split(",") if r.strip())
    unknown = sorted(set(rules) - set(VLLM_CHECKPOINT_RULES))
    if unknown:
        raise UnsupportedVllmSetup(
            f"{RULES_ENV}={value!r}: rules {unknown} are unknown; use any of "
            f"{list(VLLM_CHECKPOINT_RULES)}"
        )
    return rules


def tuple2(src: int, dst: int) -> tuple[int, int]:
    """A block copy as a plain pair (vLLM's ``KVCacheBlockCopy`` is a named pair)."""
    return (src, dst)


class VllmKVCacheManager(ManagerReads):
    """A stand-in for vLLM's ``KVCacheManager`` backed by `CacheManager`.

    ``blocks_cls``: vLLM's ``KVCacheBlocks`` (the scheduler builds its outputs from it);
    ``copy_cls``: vLLM's ``KVCacheBlockCopy`` (the worker's block copies);
    ``events``: where KV-cache events go when vLLM asked for them (`hybridkv.vllm.events`).
    """

    def __init__(
        self,
        groups: list[VllmGroup],
        *,
        num_blocks: int,
        enable_caching: bool,
        state_mode: str,
        num_spec_tokens: int,
        blocks_cls: Any,
        stats_cls: Any = None,
        log_stats: bool = False,
        eviction_policy: str = "chain",
        group_specs: list[Any] | None = None,
        copy_cls: Any = tuple2,
        events: VllmEventLog | None = None,
        num_lookahead_tokens: int = 0,
        async_steps: bool = False,
    ) -> None:
        self.groups = groups
        # vLLM's engine core reads each group's block size and spec from
        # ``coordinator.single_type_managers`` (metadata for logs and KV events)
        self.coordinator = SimpleNamespace(
            single_type_managers=[
                SimpleNamespace(block_size=g.block_size, kv_cache_spec=spec)
                for g, spec in zip(groups, group_specs or [None] * len(groups), strict=True)
            ]
        )
        self.enable_caching = enable_caching
        self.num_kv_cache_groups = len(groups)
        self.plan = plan_for_vllm(
            groups,
            num_blocks=num_blocks,
            num_spec_tokens=num_spec_tokens,
            prefix_caching=enable_caching,
            state_mode=state_mode,
        )
        self.eviction_policy = eviction_policy
        # vLLM's scheduler passes its drafter's lookahead (K for a draft model, EAGLE,
        # MTP) with every allocation; the cache tells it apart from the drafts
        self.num_lookahead_tokens = num_lookahead_tokens
        self.checkpoint_rules = checkpoint_rules_from_env() if enable_caching else ()
        # drafts on state layers: the worker's state rows carry K draft columns and split
        # a state after accepted drafts, which slots cannot express (`state_columns`)
        has_state = any(g.kind == "state" for g in groups)
        self.state_layout = "columns" if num_spec_tokens and has_state else "slots"
        self.events = events  # before the cache: it records events only for a log
        self.cache = self._new_cache()
        self.state_group_ids = [g.group_id for g in groups if g.kind == "state"]
        self.rows = WorkerRows(
            [g.block_size if g.kind == "state" else None for g in groups],
            align=enable_caching and state_mode == "align",
        )
        self._blocks_cls = blocks_cls
        self._copy_cls = copy_cls
        self.empty_kv_cache_blocks = blocks_cls(tuple(() for _ in groups))
        self._stats_cls = stats_cls
        self.log_stats = log_stats and stats_cls is not None
        self.prefix_cache_stats = stats_cls() if self.log_stats else None
        self.ledger = StepLedger(async_steps)  # steps in flight (`hybridkv.vllm.steps`)
        # the output vLLM is processing: request -> index, tokens sampled per index
        self._output: tuple[Mapping[str, int], Sequence[Sized]] | None = None
        self._num_tokens: dict[str, int] = {}  # tokens hybridkv holds per request
        self._copies: list[tuple[int, int]] = []
        self._new_block_ids: list[int] = []
        # chain hashes of the hash units requests admitted in this schedule compute: a
        # request that would compute the same unit waits one step and hits it instead
        self._computing: set[bytes] = set()
        self.num_deferred = 0
        self.async_steps = async_steps

    def _new_cache(self) -> CacheManager:
        return CacheManager(
            self.plan,
            enable_prefix_caching=self.enable_caching,
            eviction_policy=self.eviction_policy,
            checkpoint_rules=self.checkpoint_rules,
            checkpoints_inside_steps=False,
            record_events=self.events is not None,
            state_layout=self.state_layout,
            drafter_lookahead_tokens=self.num_lookahead_tokens,
            eagle=any(g.draft_head for g in self.groups),
        )

    # ------------------------------------------------------------------ steps
    def new_step_starts(self) -> None:
        """vLLM calls this at the top of each schedule."""
        self.ledger.new_schedule()
        self._computing.clear()

    def schedule_done(self) -> None:
        """The schedule returned: vLLM's worker runs every step it allocated."""
        self.ledger.schedule_done()

    def mark_executed(self) -> None:
        """The steps allocated so far ran (their output is being processed)."""
        self.ledger.mark_executed()

    def settle(self, requests: Any) -> None:
        """Commit every step that ran and whose tokens (and accepted count) are known
        (``requests``: vLLM's id -> Request)."""
        for req_id, step in list(self.ledger.steps.items()):
            request = requests.get(req_id)
            if request is not None and self.ledger.committable(step, request):
                self._commit(request)

    def outputs_arriving(
        self, req_id_to_index: Mapping[str, int], sampled_token_ids: Sequence[Sized]
    ) -> None:
        """vLLM is about to process an output (its worker's ``ModelRunnerOutput``): what
        the worker sampled per request, before vLLM drops the tokens past a stop."""
        self._output = (req_id_to_index, sampled_token_ids)

    def _num_sampled(self, req_id: str) -> int | None:
        """Tokens the worker sampled for ``req_id`` in the output being processed."""
        if self._output is None:
            return None
        index, sampled = self._output
        i = index.get(req_id)
        return None if i is None or i >= len(sampled) else len(sampled[i])

    def outputs_processed(self, requests: Any, req_ids: Iterable[str]) -> None:
        """vLLM processed a step's output for ``req_ids``: the pending steps with a step
        ahead commit now, before the step ahead's own output rolls vLLM's count back."""
        self._output = None
        ahead = self.ledger.ahead
        if not ahead:
            return
        for req_id in req_ids:
            if req_id in ahead:
                request = requests.get(req_id)
                step = self.ledger.steps[req_id]
                if request is not None and self.ledger.committable(step, request):
                    self._commit(request)

    def _commit(self, request: Any, go_ahead: bool = True, last: bool = False) -> None:
        """Commit the pending step; the step ahead (if any) becomes the pending one at
        its real start (``go_ahead``) or is dropped. ``last``: the request is being freed."""
        req_id = request.request_id
        ledger = self.ledger
        step = ledger.steps[req_id]
        accepted = ledger.accepted(req_id, step, request)
        del ledger.steps[req_id]
        known = self._num_tokens[req_id]
        new_ids = list(request.all_token_ids[known:])
        kept = len(request.all_token_ids) - step.computed - step.num_new  # sampled, kept
        sampled = self._num_sampled(req_id) if last else None
        if sampled is not None and sampled > kept > 0:
            # The request stopped inside the step and vLLM dropped the tokens past the
            # stop (it does so only while processing an output): every kept token is a
            # draft the worker accepted, so computed (vLLM 0.33 counts the last one as
            # not), and its worker may have accepted more. Counted so, the cache sees no
            # token follow and keeps no state those further drafts may have moved
            # (`state_columns`).
            accepted = kept
        # vLLM's count may include the drafts past a stop (0.32)
        accepted = min(accepted, known + len(new_ids) - step.computed - step.num_new)
        self.cache.commit(req_id, max(accepted, 0), new_ids)
        self._num_tokens[req_id] = known + len(new_ids)
        if self.events is not None:  # blocks it stored need its vLLM hashes now
            self.events.record(self.cache.take_events(), request)
        ahead = ledger.ahead.pop(req_id, None)
        if ahead is not None and go_ahead:
            self._start_ahead(request, ahead)

    def _start_ahead(self, request: Any, ahead: StepAhead) -> None:
        """The step ahead becomes the pending step where the accepted drafts put it; the
        worker got its blocks when it was scheduled, so nothing may be taken or moved."""
        req_id = request.request_id
        c = self.cache.num_computed_tokens(req_id)
        n = ahead.num_scheduled - ahead.num_drafts
        unknown = max(0, c + n - self._num_tokens[req_id])
        delta = self.cache.allocate(req_id, n, ahead.num_drafts + ahead.num_lookahead, unknown)
        rows = None
        if delta is not None and not delta.taken and not delta.copies:
            rows = self.rows.step(req_id, delta, self._state_slots(req_id), ahead.num_scheduled)
        if rows is None or any(rows.appended) or rows.copies:
            raise InvariantError(
                f"request {req_id!r}: its step scheduled in schedule {ahead.step_id}, now "
                f"starting at {c}, needs blocks hybridkv did not hold for it then"
            )
        self.ledger.steps[req_id] = Step(c, n, ahead.step_id, ahead.num_drafts)

    # ------------------------------------------------------------------ lookups
    def _ensure(self, request: Any) -> str:
        req_id: str = request.request_id
        if not self.cache.has_request(req_id):
            tokens = list(request.all_token_ids)
            lora = request.lora_request.lora_int_id if request.lora_request else None
            self.cache.add_request(req_id, tokens, cache_salt=_salt(request), lora_id=lora)
            self._num_tokens[req_id] = len(tokens)
        return req_id

    def get_computed_blocks(self, request: Any, *_: Any) -> tuple[Any, int, int]:
        req_id = self._ensure(request)
        if not self.enable_caching or getattr(request, "skip_reading_prefix_cache", False):
            return self.empty_kv_cache_blocks, 0, 0
        hit = self.cache.lookup(req_id)
        return self.empty_kv_cache_blocks, hit, 0

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        **_: Any,
    ) -> Any:
        req_id = self._ensure(request)
        if num_external_computed_tokens:
            raise InvariantError("external (connector) tokens reached hybridkv's manager")
        ledger = self.ledger
        step = ledger.steps.get(req_id)
        if step is not None:
            if step.step_id == ledger.step_id or req_id in ledger.ahead:  # a retry
                raise InvariantError(f"request {req_id!r} allocated twice in one step")
            if self.async_steps and not ledger.committable(step, request):
                if ledger.output_pending(step, request):
                    return self._allocate_ahead(request, step, num_new_tokens, num_lookahead_tokens)
                raise InvariantError(
                    f"request {req_id!r}: a step is scheduled while two earlier ones wait "
                    f"for output ({request.num_tokens} tokens known, the step before needs "
                    f"{step.computed + step.num_new}); hybridkv keeps one step in flight "
                    "per request, as vLLM's batch queue of 2 does"
                )
            self._commit(request)
        c = self.cache.num_computed_tokens(req_id)
        started = request.num_computed_tokens > 0 or c > 0
        if not started and num_new_computed_tokens == 0 and self.enable_caching:
            # vLLM skipped the hit (prompt logprobs, or a hit too short to pay): start
            # from zero rather than from hybridkv's remembered hit.
            self._forget_hit(request)
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_drafts = _num_drafts(request, total, num_new_tokens)
        num_new = num_new_tokens - num_drafts
        # async scheduling: tokens hybridkv holds no id of (the one the step in flight
        # samples, and any vLLM received since hybridkv's last commit); their ids come
        # with this step's commit
        num_unknown = 0
        if self.async_steps:
            num_unknown = max(0, min(total - num_drafts - self._num_tokens[req_id], num_new))
        units: list[bytes] = []
        if not started and self.enable_caching:
            unit = self.cache.hash_unit_tokens
            first = num_new_computed_tokens // unit
            units = self.cache.block_hashes(
                req_id, first, (num_new_computed_tokens + num_new) // unit
            )
            if units and units[0] in self._computing:
                # vLLM makes a block hittable at allocation; hybridkv once computed: this
                # request would compute what an admission of this schedule computes, so
                # it waits one step (vLLM stops admitting for this step) and hits it then
                self.num_deferred += 1
                return None
        delta = self.cache.allocate(req_id, num_new, num_drafts + num_lookahead_tokens, num_unknown)
        if delta is None:
            return None
        self._computing.update(units)
        c = self.cache.num_computed_tokens(req_id)
        if not started and c != num_new_computed_tokens:
            raise InvariantError(
                f"request {req_id!r}: hybridkv admitted it at {c} computed tokens, vLLM "
                f"at {num_new_computed_tokens}"
            )
        ledger.steps[req_id] = Step(c, num_new, ledger.step_id, num_drafts)
        if (
            started
            and not delta
            and self.state_layout == "slots"
            and self.rows.same_columns(req_id, c + num_new_tokens)
        ):
            return self.empty_kv_cache_blocks  # the common decode step: nothing moved
        return self._hand_out(req_id, delta, num_new_tokens)

    def _allocate_ahead(
        self, request: Any, step: Step, num_new_tokens: int, num_lookahead_tokens: int
    ) -> Any:
        """A step scheduled before ``step``'s accepted count is known (`hybridkv.vllm.
        steps`): vLLM starts it where every draft of ``step`` is accepted."""
        req_id = request.request_id
        start = step.computed + step.num_new + step.num_drafts
        if request.num_computed_tokens != start:
            raise InvariantError(
                f"request {req_id!r}: vLLM schedules a step from {request.num_computed_tokens}"
                f" tokens before the step from {step.computed} ({step.num_new} new, "
                f"{step.num_drafts} drafts) reported; hybridkv expects {start}"
            )
        num_drafts = _num_drafts(request, start + num_new_tokens, num_new_tokens)
        lookahead = num_drafts + num_lookahead_tokens
        delta = self.cache.reserve_next(req_id, num_new_tokens - num_drafts, lookahead)
        if delta is None:
            return None
        self.ledger.ahead[req_id] = StepAhead(
            num_new_tokens, num_drafts, num_lookahead_tokens, self.ledger.step_id
        )
        return self._hand_out(req_id, delta, num_new_tokens)

    def _state_slots(self, req_id: str) -> dict[int, Any]:
        return {g: self.cache.state_slots(req_id, g) for g in self.state_group_ids}

    def _hand_out(self, req_id: str, delta: Any, num_scheduled: int) -> Any:
        """The step's rows for vLLM's worker: the blocks appended, copies queued."""
        rows = self.rows.step(req_id, delta, self._state_slots(req_id), num_scheduled)
        self._copies.extend(rows.copies)
        for copy in delta.copies:
            self._copies.append((copy.src_block, copy.dst_block))
        for gid, taken in delta.taken.items():
            if gid not in self.state_group_ids:
                self._new_block_ids.extend(taken)
        return self._blocks_cls(tuple([Block(b) for b in row] for row in rows.appended))

    def _forget_hit(self, request: Any) -> None:
        req_id = request.request_id
        self.cache.free(req_id)
        del self._num_tokens[req_id]
        self._ensure(request)

    def free(self, request: Any) -> None:
        req_id = request.request_id
        ledger = self.ledger
        step = ledger.steps.get(req_id)
        if step is not None and ledger.committable(step, request):
            ahead = ledger.ahead.get(req_id)
            if ahead is None or not ledger.submitted(ahead.step_id):
                self._commit(request, go_ahead=False, last=True)
            elif self._num_sampled(req_id) == request.num_tokens - step.computed - step.num_new:
                # The worker runs the step ahead after this free, from the request's last
                # token (vLLM kept every token the step sampled): committed too, its
                # drafts unverified, so the turn end covers every token.
                self._commit(request)
                self._commit(request)
            else:
                # vLLM dropped sampled tokens at the stop: the worker runs the step ahead
                # from a token the request does not hold. With state groups it stays
                # pending, so no turn end covers a state it may update in place
                # (`hybridkv.vllm.steps`); attention slots it writes lie past every
                # turn end, which is read only below its length.
                self._commit(request, go_ahead=bool(self.state_group_ids), last=True)
        ledger.drop(req_id)
        if self.cache.has_request(req_id):
            self.cache.free(req_id)
            if self.events is not None:  # turn-end entries it stored
                self.events.record(self.cache.take_events(), request)
        self._num_tokens.pop(req_id, None)
        self.rows.drop(req_id)

    def junction_point(self, request: Any) -> int:
        """Where the request's next prefill chunk should end for a junction checkpoint."""
        req_id = request.request_id
        return self.cache.junction_point(req_id) if self.cache.has_request(req_id) else 0

    def reset_prefix_cache(self) -> bool:
        if self.rows.requests:  # admitted requests hold blocks
            return False
        # waiting requests hold none: they are looked up again in the new cache
        self._num_tokens.clear()
        if self.events is not None:
            self.events.record(self.cache.take_events(), None)
            self.events.clear()
        self.cache = self._new_cache()
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def check_invariants(self) -> None:
        self.cache.check_invariants()
        self.rows.check_invariants()
        self.ledger.check_invariants()
        for req_id, step in self.ledger.steps.items():
            if not self.cache.has_request(req_id):
                raise InvariantError(f"request {req_id!r} has a step but no cache record")
            c = self.cache.num_computed_tokens(req_id)
            if c != step.computed:
                raise InvariantError(
                    f"request {req_id!r}: its step (from {step.computed}, schedule "
                    f"{step.step_id}) does not start at hybridkv's {c} computed tokens"
                )
        for req_id, known in self._num_tokens.items():
            held = len(self.cache.token_ids(req_id))
            if held != known:
                raise InvariantError(
                    f"request {req_id!r}: the facade counts {known} tokens hybridkv holds, "
                    f"hybridkv holds {held}"
                )


def _num_drafts(request: Any, end: int, num_scheduled: int) -> int:
    """Drafts among a step's ``num_scheduled`` tokens ending at ``end``: the tokens past
    the request's known ones and the ones the steps in flight sample (vLLM's output
    placeholders, async scheduling)."""
    placeholders = getattr(request, "num_output_placeholders", 0)
    return max(0, min(end - request.num_tokens - placeholders, num_scheduled))


def _salt(request: Any) -> str | None:
    """vLLM's cache salt, with multimodal inputs folded in: a prompt's placeholder
    tokens are equal for different images, so their identifiers key the cache too."""
    salt = getattr(request, "cache_salt", None)
    features: Iterable[Any] = getattr(request, "mm_features", None) or ()
    idents = [str(getattr(f, "identifier", "")) for f in features]
    if not idents:
        return salt
    return f"{salt or ''}|mm:{','.join(idents)}"
