"""`Scheduler`: the one continuous-batching policy over a `CacheManager`, for the
engine and the simulator alike (torch-free). A step::

    1. running requests, oldest first, while the token budget lasts (`running`):
         decode step   1 token + L drafts, L = min(offered, K, budget - 1, left - 1)
         prefill chunk min(uncomputed, budget, chunk_size), cut at a checkpoint (`chunk`)
       planned first: while the plan does not fit the free blocks, the newest request
       with drafts drops them (drafts go before anyone is preempted); then allocate; on
       a miss: preempt the newest running request (recompute) and retry; the newest
       preempts itself; alone, a prefill chunk halves; a step that cannot fit alone is
       a `SchedulerError`
    2. if nobody was preempted: admit waiting requests by (priority, longest cached
       prefix among the first `reorder_window`, arrival) while budget and max_num_seqs
       allow: lookup (prefix hit), allocate a chunk from the hit; a request whose next
       uncached block a running prefill is computing is deferred (in-batch dedupe), a
       request that does not fit stops admission (ordering and dedupe: `admission`)
    3. the executor runs the step; `update` cuts each verdict at the request's limits and
       stop ids, commits accepted tokens, emits, frees finished requests

The output carries what changed in the block tables since the previous output, for an
engine's persistent tables: the manager's `StepDelta` of every allocate that changed
one, and the requests whose blocks were released (finished, cancelled, preempted) --
apply ``released`` first, then ``deltas``.

Example, budget 8, chunk size 4: running A decodes (1 token + 2 drafts: budget 5),
B prefills 4 of 10 (budget 1); waiting C (prompt 9, hit 4) gets 1 token. Waiting D and E
share an uncached 64-token prefix: D is admitted and computes it; E's next uncached block
is one D computes, so E waits and hits D's blocks once D's chunks commit.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from hybridkv.cache.delta import StepDelta
from hybridkv.errors import InvariantError, SchedulerError
from hybridkv.sched.admission import PrefixAdmission
from hybridkv.sched.config import SchedulerConfig
from hybridkv.sched.request import Request, Status
from hybridkv.sched.running import PlannedStep, StepPlanner
from hybridkv.sched.step import (
    Preemption,
    ScheduledChunk,
    SchedulerOutput,
    StepReport,
    StepResult,
)


class Scheduler:
    """Requests waiting and running over ``manager`` (a `CacheManager` or a proxy)."""

    def __init__(self, manager: Any, config: SchedulerConfig) -> None:
        self.manager = manager
        self.config = config
        self.waiting: list[Request] = []  # kept in (priority, arrival) order
        self.running: list[Request] = []  # admission order: the last is the newest
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_deferrals = 0  # waiting-request steps deferred by in-batch dedupe
        self._seq = itertools.count()
        self._live: dict[str, Request] = {}
        self._pending: SchedulerOutput | None = None
        self._released: list[str] = []  # blocks released since the last output
        self.admission = PrefixAdmission(manager, config)
        self.planner = StepPlanner(manager, config)

    # ------------------------------------------------------------------ requests
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, req_id: str) -> Request | None:
        """A waiting or running request."""
        return self._live.get(req_id)

    def add(self, req: Request) -> bool:
        """Queue ``req``; False (status REFUSED, `Request.refusal` says why) when its
        prompt leaves no room for an output token under ``max_model_len``."""
        if req.req_id in self._live:
            raise SchedulerError(f"request {req.req_id!r} was already added")
        if req.status is not Status.WAITING or req.output or req.num_computed:
            raise SchedulerError(
                f"request {req.req_id!r}: only a new request can be added (status "
                f"{req.status.value}, {len(req.output)} output, {req.num_computed} computed)"
            )
        limit = self.config.max_model_len
        if limit is not None:
            req.max_total_tokens = (
                limit if req.max_total_tokens is None else min(limit, req.max_total_tokens)
            )
        if req.max_total_tokens is not None and req.num_tokens >= req.max_total_tokens:
            req.status = Status.REFUSED
            req.finish_reason = "refused"
            req.refusal = (
                f"request {req.req_id!r}: prompt of {req.num_tokens} tokens leaves no room "
                f"for output under max_model_len={req.max_total_tokens} (it needs at most "
                f"{req.max_total_tokens - 1}); shorten the prompt or raise max_model_len"
            )
            return False
        self.manager.add_request(req.req_id, list(req.prompt), cache_salt=req.cache_salt)
        req.seq = next(self._seq)
        self._live[req.req_id] = req
        self._insert_waiting(req)
        return True

    def cancel(self, req: Request) -> None:
        """Drop a waiting or running request and release its blocks (between steps)."""
        if req.status not in (Status.WAITING, Status.RUNNING):
            return
        if self._pending is not None:
            raise SchedulerError(
                f"cancel of request {req.req_id!r} while step {self._pending.step} is in "
                "flight; cancel between update() and the next schedule()"
            )
        if req.status is Status.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._retire(req, Status.CANCELLED)

    def decode_ready(self) -> list[Request]:
        """Running requests whose next step is a decode step (they may carry drafts)."""
        return [r for r in self.running if r.decode_ready]

    # ------------------------------------------------------------------ schedule
    def schedule(self, offered: Mapping[str, int] | None = None) -> SchedulerOutput:
        """Decide this step (module doc); ``offered`` drafts per decode-ready request."""
        if self._pending is not None:
            raise SchedulerError(
                f"schedule() called while step {self._pending.step} awaits update()"
            )
        budget = self.config.max_num_batched_tokens
        plan = self.planner.plan(self.running, budget, offered or {})
        dropped = plan.dropped
        chunks: list[ScheduledChunk] = []
        preempted: list[Preemption] = []
        deltas: dict[str, StepDelta] = {}
        for planned in plan.steps:
            if planned.request.status is not Status.RUNNING:
                continue  # preempted earlier in this loop to make room
            chunk = self._allocate_running(planned, preempted, dropped, deltas)
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.num_scheduled_tokens
        deferred: list[str] = []
        # vLLM's rule too: no admissions in a step that had to preempt.
        if not preempted:
            self._admit(budget, chunks, deferred, deltas)
        if not chunks and self.has_work:
            raise SchedulerError(
                f"no request could be scheduled ({len(self.running)} running, "
                f"{len(self.waiting)} waiting); the cache is too small for one request"
            )
        out = SchedulerOutput(
            self.num_steps,
            tuple(chunks),
            tuple(preempted),
            tuple(deferred),
            deltas=deltas,
            released=tuple(self._released),
            dropped_drafts=tuple(dropped),
            avoided_preemption=plan.avoided_preemption,
        )
        self._released.clear()
        self._pending = out
        return out

    def _allocate_running(
        self,
        planned: PlannedStep,
        preempted: list[Preemption],
        dropped: list[str],
        deltas: dict[str, StepDelta],
    ) -> ScheduledChunk | None:
        """Allocate a planned step; on a miss (the plan could not fit even without
        drafts, or the manager cannot tell): drop its drafts, then preempt the newest
        running request (the newest preempts itself), alone halve a prefill chunk."""
        req = planned.request
        c = req.num_computed
        n, lookahead = planned.num_new_tokens, planned.num_lookahead
        while (delta := self.manager.allocate(req.req_id, n, lookahead)) is None:
            if lookahead:  # drafts go before anyone is preempted
                lookahead = 0
                dropped.append(req.req_id)
            elif self.running[-1] is not req:
                preempted.append(self._preempt(self.running[-1]))
            elif len(self.running) > 1:
                preempted.append(self._preempt(req))
                return None
            elif n > 1:  # alone: a smaller chunk needs fewer live blocks
                n = self.chunk(c, n, n // 2)
            else:
                raise SchedulerError(
                    f"request {req.req_id!r} cannot take its next step alone: {c} computed "
                    f"of {req.num_tokens} tokens ({len(req.prompt)} prompt), usage "
                    f"{self.manager.usage():.3f}; give the plan more memory or shorten "
                    "the request"
                )
        if delta:
            deltas[req.req_id] = delta
        return ScheduledChunk(req, c, n, None, lookahead, planned.decode, planned.num_proposed)

    def chunk(self, num_computed: int, num_uncomputed: int, budget: int) -> int:
        """Prefill tokens this step (`StepPlanner.chunk`)."""
        return self.planner.chunk(num_computed, num_uncomputed, budget)

    def _preempt(self, req: Request) -> Preemption:
        self.running.remove(req)
        self.manager.preempt(req.req_id)
        self._released.append(req.req_id)
        lost = req.num_computed
        req.status = Status.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._insert_waiting(req)
        return Preemption(req, lost)

    # ------------------------------------------------------------------ admission
    def _admit(
        self,
        budget: int,
        chunks: list[ScheduledChunk],
        deferred: list[str],
        deltas: dict[str, StepDelta],
    ) -> None:
        cfg = self.config
        if not self.waiting or budget <= 0 or len(self.running) >= cfg.max_num_seqs:
            return
        admission = self.admission
        order = admission.order(self.waiting, self.num_steps)
        inflight = admission.inflight(self.running)
        for req in order:
            if budget <= 0 or len(self.running) >= cfg.max_num_seqs:
                break
            hit = self.manager.lookup(req.req_id) if req.use_prefix_cache else 0
            if (
                inflight is not None
                and req.use_prefix_cache
                and admission.computed_by_others(req, hit, inflight)
            ):
                deferred.append(req.req_id)
                self.num_deferrals += 1
                continue
            alone = not self.running and not chunks
            note = getattr(self.manager, "note_junction", None)  # junction rule, in batch
            if inflight is not None and note is not None:
                shared = admission.shared_with_waiting(req, order)
                if shared > hit:
                    note(req.req_id, shared)
            n = self._first_chunk(req, hit, budget)
            blocks = self.manager.allocate(req.req_id, n)
            while blocks is None and alone and n > 1:
                # Alone, a smaller chunk may fit (a window group needs a block per
                # in-flight token); look up again: a failed allocate forgets the hit.
                hit = self.manager.lookup(req.req_id) if req.use_prefix_cache else 0
                n = self._first_chunk(req, hit, max(1, n // 2))
                blocks = self.manager.allocate(req.req_id, n)
            if blocks is None:
                if alone:
                    raise SchedulerError(
                        f"request {req.req_id!r} ({req.num_tokens} tokens: "
                        f"{len(req.prompt)} prompt + {len(req.output)} output) cannot be "
                        f"allocated even with no other request running (usage "
                        f"{self.manager.usage():.3f}); give the plan more memory or "
                        "shorten the request"
                    )
                break
            if blocks:
                deltas[req.req_id] = blocks
            self.waiting.remove(req)
            admission.forget(req.req_id)
            req.status = Status.RUNNING
            req.num_computed = hit
            req.prefix_hit_tokens += hit
            req.admitted = True
            self.running.append(req)
            chunks.append(ScheduledChunk(req, hit, n, hit))
            budget -= n
            if inflight is not None:
                inflight.update(admission.uncomputed(req))

    def _first_chunk(self, req: Request, hit: int, budget: int) -> int:
        if not 0 <= hit < req.num_tokens:
            raise SchedulerError(
                f"lookup of request {req.req_id!r} returned a hit of {hit} tokens for "
                f"{req.num_tokens} known tokens; a hit must leave >= 1 token to compute"
            )
        return self.chunk(hit, req.num_tokens - hit, self.planner.prefill_budget(budget))

    def _insert_waiting(self, req: Request) -> None:
        key = (req.priority, req.seq)
        index = len(self.waiting)
        while index > 0 and (self.waiting[index - 1].priority, self.waiting[index - 1].seq) > key:
            index -= 1
        self.waiting.insert(index, req)

    # ------------------------------------------------------------------ update
    def update(self, output: SchedulerOutput, results: Mapping[str, StepResult]) -> StepReport:
        """Settle ``output`` with the executor's ``results`` (module doc, step 3)."""
        if output is not self._pending:
            raise SchedulerError(
                f"update() for step {output.step}, but the step in flight is "
                f"{None if self._pending is None else self._pending.step}"
            )
        report = StepReport()
        ids: list[str] = []
        accepted_counts: list[int] = []
        new_tokens: list[list[int]] = []
        for chunk in output.chunks:
            req = chunk.request
            ids.append(req.req_id)
            if not chunk.samples:
                accepted_counts.append(0)
                new_tokens.append([])
                continue
            tokens, accepted = self._cut(chunk, results.get(req.req_id))
            accepted_counts.append(accepted)
            new_tokens.append(tokens)
            report.emitted[req.req_id] = tokens
            report.accepted[req.req_id] = accepted
        self._commit(ids, accepted_counts, new_tokens)
        for chunk, accepted, tokens in zip(output.chunks, accepted_counts, new_tokens, strict=True):
            req = chunk.request
            req.num_steps += 1
            req.num_computed = chunk.num_computed + chunk.num_new_tokens + accepted
            if tokens:
                req.emit(tokens)
            if req.done:
                self.running.remove(req)
                self._retire(req, Status.FINISHED)
                report.finished.append(req)
        self._pending = None
        self.num_steps += 1
        return report

    def abandon(self, output: SchedulerOutput) -> list[Request]:
        """The step ``output`` will never be settled (its executor raised): cancel its
        requests, releasing their blocks, so the others go on. Returns the cancelled."""
        if output is not self._pending:
            raise SchedulerError(
                f"abandon() for step {output.step}, but the step in flight is "
                f"{None if self._pending is None else self._pending.step}"
            )
        self._pending = None
        self.num_steps += 1
        cancelled: list[Request] = []
        for chunk in output.chunks:
            req = chunk.request
            if req.status is Status.RUNNING:
                self.running.remove(req)
                self._retire(req, Status.CANCELLED)
                cancelled.append(req)
        return cancelled

    def _cut(self, chunk: ScheduledChunk, result: StepResult | None) -> tuple[list[int], int]:
        req = chunk.request
        if result is None:
            raise SchedulerError(
                f"step {self.num_steps}: no result for request {req.req_id!r}, whose chunk "
                f"({chunk.num_new_tokens} tokens from {chunk.num_computed}) samples"
            )
        a = result.num_accepted
        if not 0 <= a <= chunk.num_lookahead or len(result.token_ids) != a + 1:
            raise SchedulerError(
                f"step {self.num_steps}, request {req.req_id!r}: {a} accepted drafts and "
                f"{len(result.token_ids)} tokens for {chunk.num_lookahead} reserved drafts; "
                "a result carries accepted + 1 tokens, accepted <= reserved"
            )
        k = req.num_to_emit(result.token_ids)
        if k < 1:
            raise SchedulerError(f"request {req.req_id!r} sampled while already finished")
        return [int(t) for t in result.token_ids[:k]], k - 1

    def _commit(self, ids: list[str], accepted: list[int], tokens: list[list[int]]) -> None:
        batch = getattr(self.manager, "commit_batch", None)
        if self.config.batch_commits and batch is not None:
            batch(ids, accepted, tokens)
            return
        for req_id, a, new in zip(ids, accepted, tokens, strict=True):
            self.manager.commit(req_id, a, new)

    def _retire(self, req: Request, status: Status) -> None:
        self.admission.forget(req.req_id)
        self.manager.free(req.req_id)
        self._released.append(req.req_id)
        del self._live[req.req_id]
        req.status = status

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Queues partition the live requests with matching statuses; progress agrees
        with the manager's record; limits hold."""
        seen: set[str] = set()
        for queue, status in ((self.waiting, Status.WAITING), (self.running, Status.RUNNING)):
            for req in queue:
                if req.status is not status or req.req_id in seen:
                    raise InvariantError(
                        f"request {req.req_id!r} is {req.status.value} in the "
                        f"{status.value} queue (or in two queues)"
                    )
                seen.add(req.req_id)
                self._check_request(req)
        if seen != set(self._live):
            raise InvariantError(
                f"live requests {sorted(set(self._live) - seen)} are in no queue, "
                f"{sorted(seen - set(self._live))} are queued but not live"
            )
        if len(self.running) > self.config.max_num_seqs:
            raise InvariantError(
                f"{len(self.running)} running > max_num_seqs {self.config.max_num_seqs}"
            )
        keys = [(r.priority, r.seq) for r in self.waiting]
        if keys != sorted(keys):
            raise InvariantError("the waiting queue is out of (priority, arrival) order")
        self.admission.check_invariants({r.req_id for r in self.waiting})
        self.planner.check_invariants()
        if self._pending is None and any(r.req_id in self._released for r in self.running):
            raise InvariantError(
                f"running requests {[r.req_id for r in self.running if r.req_id in self._released]}"
                " are queued for release from the block tables"
            )

    def _check_request(self, req: Request) -> None:
        if not self.manager.has_request(req.req_id):
            raise InvariantError(f"request {req.req_id!r} is queued but unknown to the manager")
        if req.status is Status.WAITING and req.num_computed:
            raise InvariantError(
                f"waiting request {req.req_id!r} has {req.num_computed} computed tokens"
            )
        pending = self._pending is not None and any(c.request is req for c in self._pending.chunks)
        if req.status is Status.RUNNING and not pending:
            held = self.manager.num_computed_tokens(req.req_id)
            if held != req.num_computed or not 0 < req.num_computed < req.num_tokens + 1:
                raise InvariantError(
                    f"request {req.req_id!r}: {req.num_computed} computed here, {held} in the "
                    f"manager, {req.num_tokens} tokens"
                )
        if len(req.output) > req.max_new_tokens or (
            req.max_total_tokens is not None and req.num_tokens > req.max_total_tokens
        ):
            raise InvariantError(
                f"request {req.req_id!r}: {len(req.output)} output of {req.max_new_tokens}, "
                f"{req.num_tokens} tokens of {req.max_total_tokens}"
            )
        if req.done:
            raise InvariantError(f"request {req.req_id!r} finished but is still queued")
