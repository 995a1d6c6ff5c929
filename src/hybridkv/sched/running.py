"""The running requests' part of a step, planned before anything is allocated: what
each takes under the token budget, and which drafts go when the step does not fit.

    plan      running requests, oldest first, while the budget lasts:
                decode step   1 token + L drafts, L = min(offered, K, budget - 1, left - 1)
                prefill chunk min(uncomputed, budget, chunk_size), cut at a checkpoint
    fit       ask the manager what each planned step needs (`CacheManager.blocks_needed`,
              exact and additive for running requests); while the sum exceeds the free
              blocks of a pool, the newest request that still carries drafts drops them
              (nothing else changes: the budget freed goes to admissions)

Drafts are dropped globally, before anyone is preempted: `allocate` cannot be undone, so
allocating in order, a request late in the step that does not fit could only drop its
own drafts while the drafts reserved before it stay. Example, blocks of 4 tokens, 2 free;
a and b have 6 tokens computed, c has 4 (next positions 6.. and 4..)::

    a: 1 + 3 drafts, positions 6..9: 1 block    without drafts: 0
    b: 1 + 3 drafts, positions 6..9: 1 block    without drafts: 0
    c: 1 + 4 drafts, positions 4..8: 2 blocks   without drafts: 1
    plan: 4 > 2 -> c drops its drafts: 3 > 2 -> b drops its drafts: 2 <= 2, all fit
    in order instead: a and b take the 2 blocks, c needs 1 even without drafts and is
    preempted (`tests/sched/test_global_drafts.py`)

A manager without `blocks_needed` gets the old rule: a request that does not fit drops
its own drafts before anyone is preempted (`Scheduler` does that on a failed allocate).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hybridkv.errors import InvariantError
from hybridkv.sched.config import SchedulerConfig
from hybridkv.sched.request import Request


class PlannedStep(NamedTuple):
    """``num_new_tokens`` + ``num_lookahead`` drafts for running ``request`` (a named
    tuple: one is built per running request per step)."""

    request: Request
    num_new_tokens: int
    num_lookahead: int
    decode: bool
    num_proposed: int  # drafts offered (decode steps)


@dataclass(frozen=True)
class RunningPlan:
    """``steps`` in running order; ``dropped``: requests whose drafts were dropped,
    newest first; ``avoided_preemption``: the drops made every step fit where the rule
    without planning (in order, a request that misses drops only its own drafts) would
    have preempted someone."""

    steps: list[PlannedStep]
    dropped: list[str] = field(default_factory=list)
    avoided_preemption: bool = False


class StepPlanner:
    """Budget, chunking and drafts of the running requests (module doc)."""

    def __init__(self, manager: Any, config: SchedulerConfig) -> None:
        self.manager = manager
        self.config = config
        self._needs: Any = getattr(manager, "blocks_needed", None)
        self._needs_batch: Any = getattr(manager, "blocks_needed_batch", None)
        self.num_dropped = 0  # requests whose drafts were dropped to fit a step
        self.num_preemptions_avoided = 0  # steps `RunningPlan.avoided_preemption`

    def plan(
        self, running: Sequence[Request], budget: int, offered: Mapping[str, int]
    ) -> RunningPlan:
        """The running part of the step and the requests whose drafts were dropped to
        fit it, newest first (module doc). A drop changes nothing else in the plan: the
        budget it frees goes to admissions, never to a bigger chunk that could need
        the very blocks the drop saved."""
        steps = self._plan(running, budget, offered)
        needs_of = self._needs
        if needs_of is None or not any(s.num_lookahead for s in steps):
            return RunningPlan(steps)
        total = self._total(steps)
        free = [self.manager.num_free_blocks(pool) for pool in range(len(total))]
        if all(t <= f for t, f in zip(total, free, strict=True)):
            return RunningPlan(steps)  # the usual case: one manager call
        planned = list(steps)
        needs = [needs_of(s.request.req_id, s.num_new_tokens, s.num_lookahead) for s in steps]
        dropped: list[str] = []
        i = len(steps)
        while any(t > f for t, f in zip(total, free, strict=True)):
            i -= 1
            while i >= 0 and not steps[i].num_lookahead:
                i -= 1
            if i < 0:
                break  # no drafts left: the scheduler preempts
            s = steps[i]
            steps[i] = s._replace(num_lookahead=0)
            need = needs_of(s.request.req_id, s.num_new_tokens, 0)
            total = [t - old + new for t, old, new in zip(total, needs[i], need, strict=True)]
            dropped.append(s.request.req_id)
        if not dropped:
            return RunningPlan(steps)
        self.num_dropped += len(dropped)
        fits = i >= 0
        avoided = fits and self._in_order_preempts(planned, needs, free)
        self.num_preemptions_avoided += avoided
        return RunningPlan(steps, dropped, avoided)

    def _total(self, steps: Sequence[PlannedStep]) -> list[int]:
        """Per pool, what the planned steps need together."""
        if self._needs_batch is not None:
            return list(
                self._needs_batch(
                    [s.request.req_id for s in steps],
                    [s.num_new_tokens for s in steps],
                    [s.num_lookahead for s in steps],
                )
            )
        needs = [self._needs(s.request.req_id, s.num_new_tokens, s.num_lookahead) for s in steps]
        return [sum(column) for column in zip(*needs, strict=True)]

    def _in_order_preempts(
        self, steps: Sequence[PlannedStep], needs: Sequence[Sequence[int]], free: Sequence[int]
    ) -> bool:
        """Whether allocating ``steps`` in order, each dropping only its own drafts on a
        miss (the rule without planning), would have preempted someone (the needs are
        exact and additive, so this is arithmetic)."""
        left = list(free)
        for s, need in zip(steps, needs, strict=True):
            if any(n > f for n, f in zip(need, left, strict=True)) and s.num_lookahead:
                need = self._needs(s.request.req_id, s.num_new_tokens, 0)
            if any(n > f for n, f in zip(need, left, strict=True)):
                return True
            left = [f - n for f, n in zip(left, need, strict=True)]
        return False

    def _plan(
        self, running: Sequence[Request], budget: int, offered: Mapping[str, int]
    ) -> list[PlannedStep]:
        steps: list[PlannedStep] = []
        for req in running:
            if budget <= 0:
                break
            c = req.num_computed
            if req.decode_ready:
                proposed = max(0, int(offered.get(req.req_id, 0)))
                lookahead = self.lookahead(req, proposed, budget - 1)
                steps.append(PlannedStep(req, 1, lookahead, True, proposed))
            else:
                n = self.chunk(c, req.num_tokens - c, self.prefill_budget(budget))
                steps.append(PlannedStep(req, n, 0, False, 0))
            budget -= steps[-1].num_new_tokens + steps[-1].num_lookahead
        return steps

    def check_invariants(self) -> None:
        """A step that avoided a preemption dropped at least one request's drafts."""
        if not 0 <= self.num_preemptions_avoided <= self.num_dropped:
            raise InvariantError(
                f"{self.num_preemptions_avoided} preemptions avoided by dropping drafts of "
                f"{self.num_dropped} requests"
            )

    def lookahead(self, req: Request, proposed: int, budget: int) -> int:
        """Drafts to reserve: the offer, capped by K, the budget and the request's
        limits (accepted drafts + the bonus token never pass them)."""
        cap = self.config.max_spec_tokens
        lookahead = proposed if cap is None else min(proposed, cap)
        return max(0, min(lookahead, budget, req.num_tokens_left - 1))

    def prefill_budget(self, budget: int) -> int:
        size = self.config.chunk_size
        return budget if size is None else min(budget, size)

    def chunk(self, num_computed: int, num_uncomputed: int, budget: int) -> int:
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
