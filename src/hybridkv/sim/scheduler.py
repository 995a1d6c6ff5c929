"""Trace replay over the one scheduler (`hybridkv.sched`): the simulator's executor and
its clock. The policy (budget, chunks, drafts, preemption, admission) is not here; this
module only supplies what a model would have produced::

    propose    a decode-ready request offers its trace's next ``[num_proposed, _]``
    execute    a prefill that completes the known tokens emits the next output token;
               a decode step with L drafts reserved emits min(accepted, L) + 1 tokens
               (``spec`` entries are used one per decode step, in order)
    clock      advanced by `StepCost` for the step's scheduled tokens

Token accounting of one request (P prompt tokens, k output tokens emitted so far)::

    tokens   = prompt + output[:k]          (verified, known to the cache)
    computed = tokens - 1 while decoding    (the last sampled token is computed next step)

    decode step with d drafts, a accepted:  allocate(1, lookahead=d)
                                            commit(a, output[k : k + a + 1])

A preempted request keeps its tokens and goes back to the waiting queue; its recompute
is a prefill over all its tokens (minus any prefix hit), after which it samples its next
output token as a prefill would. Manager time is measured around every manager call
(`TimedManager`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from hybridkv import sched
from hybridkv.errors import SchedulerError, SimulationError
from hybridkv.sim.cost import StepCost
from hybridkv.sim.metrics import MetricsRecorder
from hybridkv.sim.trace import TraceRequest


@dataclass(frozen=True, kw_only=True)
class ReplayOptions:
    """How a replay runs, apart from the scheduler's limits (`hybridkv.sched.SchedulerConfig`,
    the one the engine runs with). ``check_every`` N runs `check_invariants()` every N steps
    (0: only at the end); ``max_steps`` stops the replay after that many steps (None: when
    every request finished); ``record_usage`` samples the cache usage after every step."""

    check_every: int = 0
    max_steps: int | None = None
    record_usage: bool = True

    def __post_init__(self) -> None:
        if self.check_every < 0:
            raise SimulationError(
                f"check_every={self.check_every}: needs >= 0 (0 checks only at the end)"
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise SimulationError(f"max_steps={self.max_steps}: needs >= 1, or None for no limit")


class TimedManager:
    """A `CacheManager` whose calls add their time to ``metrics.manager_s``."""

    def __init__(self, manager: Any, metrics: MetricsRecorder) -> None:
        self._manager = manager
        self._metrics = metrics
        self.caching = getattr(manager, "caching", True)
        self.hash_unit_tokens = manager.hash_unit_tokens

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._manager, name)
        if not callable(fn):
            return fn
        metrics = self._metrics

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = perf_counter()
            result = fn(*args, **kwargs)
            metrics.manager_s += perf_counter() - start
            metrics.manager_calls += 1
            return result

        return timed


class TraceExecutor:
    """Plays the model for trace requests (module doc): drafts and tokens from the trace."""

    def __init__(self, traces: Mapping[str, TraceRequest]) -> None:
        self.traces = traces
        self.spec_cursor: dict[str, int] = {}

    def _next_spec(self, req_id: str) -> tuple[int, int]:
        spec = self.traces[req_id].spec
        cursor = self.spec_cursor.get(req_id, 0)
        if spec is None or cursor >= len(spec):
            return (0, 0)
        return spec[cursor]

    def propose(self, ready: Sequence[sched.Request]) -> dict[str, int]:
        return {r.req_id: self._next_spec(r.req_id)[0] for r in ready}

    def execute(self, output: sched.SchedulerOutput) -> dict[str, sched.StepResult]:
        results: dict[str, sched.StepResult] = {}
        for chunk in output.chunks:
            if not chunk.samples:
                continue
            req = chunk.request
            trace = self.traces[req.req_id]
            k = len(req.output)
            accepted = 0
            if chunk.decode:
                accepted = min(self._next_spec(req.req_id)[1], chunk.num_lookahead)
                if trace.spec is not None:
                    self.spec_cursor[req.req_id] = self.spec_cursor.get(req.req_id, 0) + 1
            num_emit = min(accepted + 1, len(trace.output) - k)
            results[req.req_id] = sched.StepResult(
                num_emit - 1, list(trace.output[k : k + num_emit])
            )
        return results


class TraceReplay:
    """Continuous batching over a trace; `run()` steps until every request finished."""

    def __init__(
        self,
        manager: Any,
        requests: Sequence[TraceRequest],
        config: sched.SchedulerConfig,
        cost: StepCost,
        metrics: MetricsRecorder,
        on_step: Callable[[sched.SchedulerOutput, sched.StepReport], None] | None = None,
        options: ReplayOptions | None = None,
    ) -> None:
        self.manager = manager
        self.config = config
        self.options = ReplayOptions() if options is None else options
        self.cost = cost
        self.metrics = metrics
        self.on_step = on_step
        self.pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        self.scheduler = sched.Scheduler(TimedManager(manager, metrics), config)
        self.executor = TraceExecutor({r.id: r for r in requests})
        self.requests: dict[str, sched.Request] = {}
        self.clock_s = 0.0
        metrics.prompt_tokens = sum(len(r.prompt) for r in requests)

    @property
    def num_steps(self) -> int:
        return self.scheduler.num_steps

    def _arrive(self) -> None:
        while self.pending and self.pending[0].arrival_s <= self.clock_s:
            trace = self.pending.popleft()
            req = sched.Request(
                trace.id,
                list(trace.prompt),
                len(trace.output),
                arrival_s=trace.arrival_s,
                cache_salt=trace.cache_salt,
            )
            self.requests[trace.id] = req
            if not self.scheduler.add(req):
                self.metrics.num_finished += 1  # refused: finished with no output
                self.metrics.latency_s.append(0.0)

    def done(self) -> bool:
        return not (self.pending or self.scheduler.has_work)

    def step(self) -> None:
        """Run one scheduler step (or jump the clock to the next arrival when idle)."""
        self._arrive()
        if not self.scheduler.has_work:
            if not self.pending:
                return
            self.clock_s = self.pending[0].arrival_s
            self._arrive()
            if not self.scheduler.has_work:
                return
        try:
            output, report = sched.run_step(self.scheduler, self.executor)
        except SchedulerError as err:
            raise SimulationError(str(err)) from None
        self._account(output, report)
        if self.on_step is not None:
            self.on_step(output, report)

    def _account(self, output: sched.SchedulerOutput, report: sched.StepReport) -> None:
        m = self.metrics
        for p in output.preempted:
            m.preemptions += 1
            m.recomputed_tokens += p.num_computed
        context = 0
        for chunk in output.chunks:
            context += chunk.num_computed
            if chunk.prefix_hit is not None:
                if chunk.request.num_preemptions:
                    m.recompute_hit_tokens += chunk.prefix_hit
                else:
                    m.prefix_hit_tokens += chunk.prefix_hit
            if chunk.decode:
                m.drafts_proposed += chunk.num_lookahead
                m.drafts_accepted += report.accepted.get(chunk.request.req_id, 0)
        num_tokens = output.num_scheduled_tokens
        self.clock_s += self.cost.step_s(
            num_tokens=num_tokens,
            num_seqs=len(self.scheduler.running) + len(report.finished),
            num_context_tokens=context,
        )
        m.scheduled_tokens += num_tokens
        m.max_running = max(m.max_running, len(self.scheduler.running) + len(report.finished))
        for req_id, tokens in report.emitted.items():
            m.output_tokens += len(tokens)
            req = self.requests[req_id]
            if len(req.output) == len(tokens):  # its first tokens
                m.ttft_s.append(self.clock_s - req.arrival_s)
        for req in report.finished:
            m.num_finished += 1
            m.latency_s.append(self.clock_s - req.arrival_s)
        m.steps = self.num_steps
        usage = float(self.manager.usage())
        m.peak_usage = max(m.peak_usage, usage)
        if self.options.record_usage:
            m.usage_samples.append((self.clock_s, usage))
        every = self.options.check_every
        if every and self.num_steps % every == 0:
            self.check_invariants()

    def check_invariants(self) -> None:
        self.manager.check_invariants()
        self.scheduler.check_invariants()
        self.metrics.invariant_checks += 1

    def run(self) -> None:
        limit = self.options.max_steps
        while not self.done():
            if limit is not None and self.num_steps >= limit:
                break
            self.step()


Scheduler = TraceReplay  # the name this module's driver had before `hybridkv.sched`
__all__ = [
    "ReplayOptions",
    "Scheduler",
    "SimulationError",
    "TimedManager",
    "TraceExecutor",
    "TraceReplay",
]
