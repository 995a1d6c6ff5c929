"""A scheduler model driving the real `CacheManager` with no model compute.

One step, in the order an engine like vLLM's v1 scheduler does it::

    1. running requests, oldest first: a prefill chunk (tokens not yet computed, up to
       the token budget) or a decode step (1 token + this step's drafts as lookahead);
       when `allocate` returns None, preempt the newest running request (recompute)
       and retry, possibly preempting the request itself
    2. if nothing was preempted: admit waiting requests FIFO while the budget and
       max_num_seqs allow: `lookup` (prefix hit), then `allocate` the rest of the
       prompt, chunked to the budget; a miss on allocate stops admission
    3. advance the clock by `StepCost`, then `commit` every scheduled request: a chunk
       that completes the prompt emits the next output token; a decode step emits
       ``accepted + 1`` tokens from the trace's ``spec`` entry; finished requests `free`

Token accounting of one request (P prompt tokens, k output tokens emitted so far)::

    tokens   = prompt + output[:k]          (verified, known to the cache)
    computed = tokens - 1 while decoding    (the last sampled token is computed next step)

    decode step with d drafts, a accepted:  allocate(1, lookahead=d)
                                            commit(a, output[k : k + a + 1])

A preempted request keeps its tokens and goes back to the front of the waiting queue;
its recompute is a prefill over all its tokens (minus any prefix hit), after which it
samples its next output token as a prefill would.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from hybridkv.errors import SimulationError
from hybridkv.sim.cost import StepCost
from hybridkv.sim.metrics import MetricsRecorder
from hybridkv.sim.trace import TraceRequest


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Batching limits and run options of the scheduler model.

    ``max_spec_tokens`` caps the drafts of a step (the plan's K); ``None`` takes the
    trace's numbers as they are. ``check_every`` runs `check_invariants()` every N steps
    (0: only at the end). ``batched`` uses `allocate_batch` / `commit_batch` for the
    running requests when the manager has them.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_spec_tokens: int | None = None
    check_every: int = 0
    batched: bool = True
    max_steps: int | None = None
    record_usage: bool = True
    chunk_align_tokens: int = 0


class SimRequest:
    """Mutable per-request state of the scheduler model."""

    __slots__ = (
        "admitted",
        "first_token_s",
        "is_running",
        "num_computed",
        "num_emitted",
        "spec_cursor",
        "trace",
        "verified",
    )

    def __init__(self, trace: TraceRequest) -> None:
        self.trace = trace
        self.verified = len(trace.prompt)  # prompt + emitted output tokens
        self.num_emitted = 0
        self.num_computed = 0
        self.spec_cursor = 0
        self.admitted = False  # first admission done (its hit counts as a prefix hit)
        self.is_running = False
        self.first_token_s: float | None = None

    @property
    def id(self) -> str:
        return self.trace.id

    @property
    def decoding(self) -> bool:
        return self.num_emitted > 0 and self.verified - self.num_computed == 1

    def next_spec(self) -> tuple[int, int]:
        spec = self.trace.spec
        if spec is None or self.spec_cursor >= len(spec):
            return (0, 0)
        return spec[self.spec_cursor]


@dataclass(slots=True)
class _Work:
    """One request's share of a step."""

    req: SimRequest
    num_new_tokens: int
    num_lookahead_tokens: int
    num_accepted: int  # decode: drafts the trace accepts (capped to the lookahead)
    decode: bool


class Scheduler:
    """Continuous batching over a trace; `run()` steps until every request finished."""

    def __init__(
        self,
        manager: Any,
        requests: Sequence[TraceRequest],
        config: SchedulerConfig,
        cost: StepCost,
        metrics: MetricsRecorder,
    ) -> None:
        self.manager = manager
        self.config = config
        self.cost = cost
        self.metrics = metrics
        self.pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.clock_s = 0.0
        self.num_steps = 0
        self._batched = config.batched and hasattr(manager, "allocate_batch")
        metrics.prompt_tokens = sum(len(r.prompt) for r in requests)

    # ------------------------------------------------------------------ timing
    def _call(self, name: str, *args: Any) -> Any:
        fn = getattr(self.manager, name)
        start = perf_counter()
        result = fn(*args)
        self.metrics.manager_s += perf_counter() - start
        self.metrics.manager_calls += 1
        return result

    # ------------------------------------------------------------------ step parts
    def _arrive(self) -> None:
        while self.pending and self.pending[0].arrival_s <= self.clock_s:
            trace = self.pending.popleft()
            start = perf_counter()
            self.manager.add_request(trace.id, list(trace.prompt), cache_salt=trace.cache_salt)
            self.metrics.manager_s += perf_counter() - start
            self.metrics.manager_calls += 1
            self.waiting.append(SimRequest(trace))

    def _plan_running(self, budget: int) -> tuple[list[_Work], int]:
        """Token counts for the running requests, oldest first, within the budget."""
        work: list[_Work] = []
        cap = self.config.max_spec_tokens
        for req in self.running:
            if budget <= 0:
                break
            if req.decoding:
                proposed, accepted = req.next_spec()
                if cap is not None:
                    proposed = min(proposed, cap)
                proposed = min(proposed, budget - 1)
                work.append(_Work(req, 1, proposed, min(accepted, proposed), True))
                budget -= 1 + proposed
            else:
                num_new = self._chunk(req.num_computed, req.verified - req.num_computed, budget)
                work.append(_Work(req, num_new, 0, 0, False))
                budget -= num_new
        return work, budget

    def _chunk(self, num_computed: int, num_uncomputed: int, budget: int) -> int:
        """Prefill tokens this step: what fits the budget, cut at a checkpoint boundary.

        With ``chunk_align_tokens`` B, a chunk that stops short of the last boundary
        ``L`` of the known tokens ends on a multiple of B, and a chunk that would cross
        ``L`` stops at it (the tail follows next step), as vLLM's align mode does::

            B = 16, 100 tokens, L = 96, budget 40:  0-32 | 32-64 | 64-96 | 96-100
        """
        num_new = min(num_uncomputed, budget)
        align = self.config.chunk_align_tokens
        if not align:
            return num_new
        end = num_computed + num_new
        last = (num_computed + num_uncomputed) // align * align
        if end < last:
            aligned_end = end // align * align
            if aligned_end > num_computed:
                return aligned_end - num_computed
        elif num_computed < last < end:
            return last - num_computed
        return num_new

    def _preempt_newest(self) -> SimRequest:
        victim = self.running.pop()
        victim.is_running = False
        self._call("preempt", victim.id)
        self.metrics.preemptions += 1
        self.metrics.recomputed_tokens += victim.num_computed
        victim.num_computed = 0
        self.waiting.appendleft(victim)
        return victim

    def _allocate_with_preemption(self, item: _Work) -> bool:
        """Allocate ``item``; preempt newest-first until it fits. False: it was preempted.

        Alone, a request first shrinks its step (half the prefill chunk, or no drafts)
        before giving up with `SimulationError`: nothing else will ever free blocks.
        """
        req = item.req
        while True:
            blocks = self._call("allocate", req.id, item.num_new_tokens, item.num_lookahead_tokens)
            if blocks is not None:
                return True
            if self.running[-1] is not req:
                self._preempt_newest()
            elif len(self.running) > 1:
                self._preempt_newest()
                return False
            elif not item.decode and item.num_new_tokens > 1:
                item.num_new_tokens = self._chunk(
                    req.num_computed, item.num_new_tokens, item.num_new_tokens // 2
                )
            elif item.num_lookahead_tokens:
                item.num_lookahead_tokens = item.num_accepted = 0
            else:
                raise SimulationError(
                    f"request {req.id!r} cannot take its next step alone: "
                    f"{req.num_computed} computed of {req.verified} tokens "
                    f"({len(req.trace.prompt)} prompt), usage {self.manager.usage():.3f}; "
                    "give the plan more memory (--memory) or shorten the request"
                )

    def _schedule_running(self, budget: int) -> tuple[list[_Work], int, bool]:
        work, budget = self._plan_running(budget)
        preempted = False
        results: list[Any] | None = None
        if self._batched and work:
            results = self._call(
                "allocate_batch",
                [w.req.id for w in work],
                [w.num_new_tokens for w in work],
                [w.num_lookahead_tokens for w in work],
            )
        scheduled: list[_Work] = []
        for index, item in enumerate(work):
            if not item.req.is_running:
                continue  # preempted as a victim of an earlier request this step
            if results is not None and results[index] is not None:
                scheduled.append(item)
                continue
            before = self.metrics.preemptions
            ok = self._allocate_with_preemption(item)
            preempted = preempted or self.metrics.preemptions != before
            if ok:
                scheduled.append(item)
        return scheduled, budget, preempted

    def _admit_waiting(self, budget: int) -> list[_Work]:
        admitted: list[_Work] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hit = self._call("lookup", req.id)
            uncomputed = req.verified - hit
            if uncomputed < 1:
                raise SimulationError(
                    f"lookup for {req.id!r} returned a hit of {hit} tokens for "
                    f"{req.verified} known tokens; a hit must leave >= 1 token to compute"
                )
            num_new = self._chunk(hit, uncomputed, budget)
            while self._call("allocate", req.id, num_new, 0) is None:
                # Alone, a smaller chunk may fit where a whole one does not (a window
                # group needs a block per in-flight token); otherwise wait for frees.
                if self.running or num_new == 1:
                    return admitted
                num_new = self._chunk(hit, uncomputed, max(1, num_new // 2))
                if self._call("lookup", req.id) != hit:
                    return admitted  # cannot happen while nothing runs; stay safe
            self.waiting.popleft()
            if req.admitted:
                self.metrics.recompute_hit_tokens += hit
            else:
                req.admitted = True
                self.metrics.prefix_hit_tokens += hit
            req.num_computed = hit
            self.running.append(req)
            req.is_running = True
            admitted.append(_Work(req, num_new, 0, 0, False))
            budget -= num_new
        return admitted

    def _commit(self, work: list[_Work], end_s: float) -> None:
        decode_ids: list[str] = []
        decode_accepted: list[int] = []
        decode_tokens: list[list[int]] = []
        finished: list[SimRequest] = []
        for item in work:
            req = item.req
            output = req.trace.output
            if item.decode:
                remaining = len(output) - req.num_emitted
                num_emit = min(item.num_accepted + 1, remaining)
                new_tokens = list(output[req.num_emitted : req.num_emitted + num_emit])
                self.metrics.drafts_proposed += item.num_lookahead_tokens
                self.metrics.drafts_accepted += num_emit - 1
                if req.trace.spec is not None:
                    req.spec_cursor += 1
                decode_ids.append(req.id)
                decode_accepted.append(num_emit - 1)
                decode_tokens.append(new_tokens)
                req.num_computed += 1 + num_emit - 1
            else:
                req.num_computed += item.num_new_tokens
                new_tokens = []
                if req.num_computed == req.verified:  # prompt (or recompute) complete
                    new_tokens = [output[req.num_emitted]]
                    if req.first_token_s is None:
                        req.first_token_s = end_s
                        self.metrics.ttft_s.append(end_s - req.trace.arrival_s)
                self._call("commit", req.id, 0, new_tokens)
            req.num_emitted += len(new_tokens)
            req.verified += len(new_tokens)
            self.metrics.output_tokens += len(new_tokens)
            if req.num_emitted == len(output):
                finished.append(req)
        if decode_ids:
            if self._batched:
                self._call("commit_batch", decode_ids, decode_accepted, decode_tokens)
            else:
                for req_id, accepted, tokens in zip(
                    decode_ids, decode_accepted, decode_tokens, strict=True
                ):
                    self._call("commit", req_id, accepted, tokens)
        for req in finished:
            self._call("free", req.id)
            self.running.remove(req)
            req.is_running = False
            self.metrics.num_finished += 1
            self.metrics.latency_s.append(end_s - req.trace.arrival_s)

    # ------------------------------------------------------------------ driver
    def done(self) -> bool:
        return not (self.pending or self.waiting or self.running)

    def step(self) -> None:
        """Run one scheduler step (or jump the clock to the next arrival when idle)."""
        self._arrive()
        if not self.running and not self.waiting:
            if self.pending:
                self.clock_s = self.pending[0].arrival_s
                self._arrive()
            else:
                return
        budget = self.config.max_num_batched_tokens
        work, budget, preempted = self._schedule_running(budget)
        if not preempted:
            work.extend(self._admit_waiting(budget))
        if not work and not preempted:
            self._stuck()
        num_tokens = sum(w.num_new_tokens + w.num_lookahead_tokens for w in work)
        context = sum(w.req.num_computed for w in work)
        self.clock_s += self.cost.step_s(
            num_tokens=num_tokens, num_seqs=len(self.running), num_context_tokens=context
        )
        self.metrics.scheduled_tokens += num_tokens
        self.metrics.max_running = max(self.metrics.max_running, len(self.running))
        self._commit(work, self.clock_s)
        self.num_steps += 1
        self.metrics.steps = self.num_steps
        usage = float(self._call("usage"))
        if usage > self.metrics.peak_usage:
            self.metrics.peak_usage = usage
        if self.config.record_usage:
            self.metrics.usage_samples.append((self.clock_s, usage))
        every = self.config.check_every
        if every and self.num_steps % every == 0:
            self.check_invariants()

    def _stuck(self) -> None:
        req = self.waiting[0]
        raise SimulationError(
            f"request {req.id!r} ({req.verified} tokens: {len(req.trace.prompt)} prompt + "
            f"{req.num_emitted} output) cannot be allocated even with no other request "
            f"running (usage {self.manager.usage():.3f}); give the plan more memory "
            "(--memory) or shorten the request"
        )

    def check_invariants(self) -> None:
        self.manager.check_invariants()
        self.metrics.invariant_checks += 1

    def run(self) -> None:
        limit = self.config.max_steps
        while not self.done():
            if limit is not None and self.num_steps >= limit:
                break
            self.step()
