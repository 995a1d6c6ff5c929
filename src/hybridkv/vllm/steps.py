"""When hybridkv's cache commits a step inside vLLM: the steps each request has in
flight, and when a step's tokens and accepted count are known.

vLLM moves ``request.num_computed_tokens`` itself: forward at scheduling (drafts
included), back by the rejected drafts when the output arrives. hybridkv's cache holds
one uncommitted step per request, from ``c`` (its computed tokens) with ``n`` verified
tokens and ``d`` drafts; committing it needs the step's input tokens and, with drafts,
how many were accepted: ``num_computed_tokens - (c + n)`` once the output is in.

* Synchronous scheduling: a step allocated in schedule ``k`` ran once its output was
  processed (`StepLedger.mark_executed`); it is committed at the next settle (before
  the next schedule) or before a free. A step that never ran (preempted in the schedule
  that allocated it) is released without a commit.
* Async scheduling (vLLM's batch queue of 2): schedule ``k + 1`` runs while step ``k``
  does, before ``k``'s output reaches the scheduler::

      schedule k     allocate k    [c, c+n)                 its tokens known
      schedule k+1   commit k; allocate k+1 [c+n, c+n+1):   1 unknown (k's sample)
      output k       the sample joins the request's tokens
      schedule k+2   commit k+1 (its token now known); allocate k+2 ...

  A step without drafts commits once its input tokens are known: a commit needs the
  step's inputs, never its output, and vLLM's worker runs steps in order, so whatever a
  later step reads of a committed block (a hit, a state checkpoint) was written before.
* Async scheduling with drafts: where step ``k + 1`` starts depends on how many of
  step ``k``'s ``d`` drafts are accepted, which is unknown when ``k + 1`` is scheduled
  (vLLM schedules it as if all were, and its worker corrects the positions on the
  device). Step ``k + 1`` is then a *step ahead*: the cache holds, on top of the pending
  step ``k``, every block ``k + 1`` may need at any acceptance (`CacheManager.
  reserve_next`), and the worker gets them with schedule ``k + 1``. When ``k``'s output
  is processed its accepted count is vLLM's computed tokens less ``k + 1``'s scheduled
  ones; ``k`` commits and ``k + 1`` becomes the pending step at its real start
  (`CacheManager.allocate`, which takes no block: the worker already has them all)::

      schedule k     allocate k      [c, c+1) + d drafts
      schedule k+1   reserve k+1     starts in [c+1, c+1+d]; blocks for c+1+d+1+K
      output k       a accepted: commit k; allocate k+1 [c+1+a, c+2+a) + K drafts
      schedule k+2   reserve k+2 on top of k+1 ...

A free while steps are in flight commits the pending step when its output (or, without
drafts, its input) is known and the schedule that allocated it returned (vLLM's worker
runs it), and drops it otherwise. Dropping is always safe: the blocks go back uncached,
and later steps that reuse them run after it. A step ahead the worker still runs (the
request stopped at the pending step's output) computes the request's last token: where
vLLM kept every token the worker sampled, it is committed too (its drafts unverified),
so the turn end covers every token; where vLLM dropped tokens past a stop, it runs from
a token the request does not hold, so with state groups it stays pending and the cache
keeps no turn-end entry over a state it may update in place (block-boundary checkpoints
stay; attention-only plans keep their turn ends: it writes past them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridkv.errors import InvariantError


@dataclass(frozen=True)
class Step:
    """The step a request's cache holds uncommitted."""

    computed: int  # c: hybridkv's computed tokens before the step
    num_new: int  # n: verified tokens scheduled
    step_id: int  # the schedule that allocated it
    num_drafts: int = 0  # d: drafts verified by the step


@dataclass(frozen=True)
class StepAhead:
    """A step scheduled before the pending step's accepted count was known."""

    num_scheduled: int  # vLLM's scheduled tokens (new + drafts)
    num_drafts: int
    num_lookahead: int  # the drafter's lookahead vLLM passed with it
    step_id: int


class StepLedger:
    """Each request's steps in flight and the schedule clock (see the module doc)."""

    def __init__(self, async_steps: bool) -> None:
        self.async_steps = async_steps
        self.steps: dict[str, Step] = {}
        self.ahead: dict[str, StepAhead] = {}
        self.step_id = 0  # schedules so far
        self.executed = 0  # synchronous: schedules whose output was processed
        self.scheduling = False  # inside a schedule: its steps may still be dropped

    def new_schedule(self) -> None:
        self.step_id += 1
        self.scheduling = True

    def schedule_done(self) -> None:
        self.scheduling = False

    def mark_executed(self) -> None:
        self.executed = self.step_id

    def committable(self, step: Step, request: Any) -> bool:
        """Whether ``step`` ran and what its commit needs is known."""
        if not self.async_steps:
            return step.step_id <= self.executed
        submitted = self.submitted(step.step_id)
        # its inputs; with drafts also its output (a step that verifies drafts samples)
        known = step.computed + step.num_new + (1 if step.num_drafts else 0)
        return submitted and known <= request.num_tokens

    def submitted(self, step_id: int) -> bool:
        """Whether the schedule ``step_id`` returned (vLLM's worker runs its steps)."""
        return step_id < self.step_id or not self.scheduling

    def output_pending(self, step: Step, request: Any) -> bool:
        """A step with drafts whose inputs are known but whose output is not: the next
        step may go ahead of it."""
        return bool(step.num_drafts) and step.computed + step.num_new == request.num_tokens

    def accepted(self, req_id: str, step: Step, request: Any) -> int:
        """Drafts of ``step`` vLLM counts as accepted (its computed tokens less the step
        ahead's scheduled ones); raises where vLLM rolled back further."""
        ahead = self.ahead.get(req_id)
        later = ahead.num_scheduled if ahead is not None else 0
        accepted: int = request.num_computed_tokens - later - step.computed - step.num_new
        if accepted < 0:
            raise InvariantError(
                f"request {req_id!r}: vLLM reports {request.num_computed_tokens} computed "
                f"tokens after a step from {step.computed} with {step.num_new} new ones"
                + (f" and {later} scheduled ahead" if later else "")
            )
        return accepted

    def drop(self, req_id: str) -> None:
        self.steps.pop(req_id, None)
        self.ahead.pop(req_id, None)

    def check_invariants(self) -> None:
        for req_id, ahead in self.ahead.items():
            step = self.steps.get(req_id)
            if step is None or not step.num_drafts or ahead.step_id <= step.step_id:
                raise InvariantError(
                    f"request {req_id!r}: a step ahead (schedule {ahead.step_id}) needs an "
                    f"earlier pending step with drafts, found {step}"
                )
        for req_id, step in self.steps.items():
            if step.step_id > self.step_id:
                raise InvariantError(
                    f"request {req_id!r}: its step is from schedule {step.step_id}, after "
                    f"{self.step_id}"
                )
