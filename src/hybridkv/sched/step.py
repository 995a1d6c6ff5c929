"""What one scheduler step hands out (`SchedulerOutput`) and what comes back from the
executor (`StepResult` per sampling request), then `StepReport` after the update.

One decode step of request r (c computed, L drafts reserved, a accepted)::

    ScheduledChunk(r, num_computed=c, num_new_tokens=1, num_lookahead=L, decode=True)
    StepResult(num_accepted=a, token_ids=[d1 .. da, bonus])     (a + 1 tokens)
    after update: r.num_computed = c + 1 + a'   (a' <= a: cut at a stop id or a limit)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hybridkv.cache.delta import StepDelta
from hybridkv.sched.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_new_tokens`` tokens of ``request`` from position ``num_computed``, and
    ``num_lookahead`` draft positions reserved after them (decode steps only).
    ``prefix_hit`` is set when the request was (re)admitted this step."""

    request: Request
    num_computed: int
    num_new_tokens: int
    prefix_hit: int | None = None
    num_lookahead: int = 0
    decode: bool = False
    num_proposed: int = 0  # drafts the executor offered (decode steps)

    @property
    def samples(self) -> bool:
        """Whether the chunk reaches the end of the known tokens (its logits are used)."""
        return self.num_computed + self.num_new_tokens == self.request.num_tokens

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_new_tokens + self.num_lookahead


@dataclass(frozen=True)
class Preemption:
    """``request`` lost its blocks this step; ``num_computed`` tokens will be recomputed."""

    request: Request
    num_computed: int


@dataclass(frozen=True)
class SchedulerOutput:
    """One step: chunks in execution order (running requests first, oldest first, then
    admissions), the preemptions made to fit them, and waiting requests deferred because
    a running prefill is computing their next uncached block.

    Block-table changes since the previous output, for persistent tables: ``released``
    (requests whose blocks went back since then: finished or cancelled after it,
    preempted in this step; drop their rows first), then ``deltas`` (the manager's
    `StepDelta` per request whose tables changed in this step's allocate: a whole table
    on admission, new tail blocks, positions nulled). A request absent from ``deltas``
    keeps its table. ``dropped_drafts``: requests whose offered drafts were dropped so
    that the step fits without preempting (newest first); ``avoided_preemption``: those
    drops fit a step where allocating in order (a request drops only its own drafts)
    would have preempted someone (`sched.running`)."""

    step: int
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Preemption, ...] = ()
    deferred: tuple[str, ...] = ()
    deltas: Mapping[str, StepDelta] = field(default_factory=dict)
    released: tuple[str, ...] = ()
    dropped_drafts: tuple[str, ...] = ()
    avoided_preemption: bool = False

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(c.num_scheduled_tokens for c in self.chunks)


@dataclass(frozen=True)
class StepResult:
    """An executor's verdict for one sampling chunk: drafts accepted and the tokens
    produced (accepted drafts + one sampled token). The scheduler cuts them at the
    request's limits and stop ids."""

    num_accepted: int
    token_ids: Sequence[int]


@dataclass
class StepReport:
    """What `Scheduler.update` did: tokens emitted (after cuts), drafts accepted (after
    cuts) per sampling request, and the requests that finished."""

    emitted: dict[str, list[int]] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    finished: list[Request] = field(default_factory=list)
