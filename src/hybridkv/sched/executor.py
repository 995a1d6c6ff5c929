"""The executor protocol: what the scheduler needs from whoever runs a step (the model
in `hybridkv.engine`, trace replay in `hybridkv.sim`), and `run_step`, the one loop::

    ready    = scheduler.decode_ready()          running requests at a decode step
    offered  = executor.propose(ready)           drafts each could carry (0..K)
    output   = scheduler.schedule(offered)       budget, chunks, lookahead, preemption
    results  = executor.execute(output)          verdict per sampling chunk
    report   = scheduler.update(output, results) cut, commit, emit, finish

Drafts are proposed before scheduling, so the scheduler never calls back into the
executor: an n-gram or suffix proposer offers its proposal's length, a draft model
offers up to K (it drafts after the allocation), a trace offers its recorded count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from hybridkv.sched.request import Request
from hybridkv.sched.step import SchedulerOutput, StepReport, StepResult

if TYPE_CHECKING:
    from hybridkv.sched.scheduler import Scheduler


class Executor(Protocol):
    def propose(self, ready: Sequence[Request]) -> dict[str, int]:
        """Drafts each decode-ready request could carry this step (missing: 0)."""
        ...

    def execute(self, output: SchedulerOutput) -> Mapping[str, StepResult]:
        """Run the step; a `StepResult` for every chunk that samples."""
        ...


def run_step(scheduler: Scheduler, executor: Executor) -> tuple[SchedulerOutput, StepReport]:
    """One step of ``scheduler`` executed by ``executor`` (see the module doc)."""
    offered = executor.propose(scheduler.decode_ready())
    output = scheduler.schedule(offered)
    try:
        results = executor.execute(output)
    except BaseException:
        # the step's requests are in an unknown state: cancel them (their blocks go back),
        # so the scheduler is not left waiting for an update that never comes
        scheduler.abandon(output)
        raise
    report = scheduler.update(output, results)
    return output, report
