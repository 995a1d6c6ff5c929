"""The one scheduler of hybridkv (torch-free): the request record, the policy and the
executor protocol that the engine (the model) and the simulator (trace replay) implement.

    Request          progress of one request (prompt, output, num_computed, status)
    SchedulerConfig  limits: budget, max_num_seqs, chunking, max_model_len, K drafts
    Scheduler        schedule(offered drafts) -> SchedulerOutput; update(results)
    StepPlanner      the running part of a step: budget, chunks, drafts dropped to fit
    PrefixAdmission  cache-aware admission: longest cached prefix first, in-batch dedupe
    Executor         propose(ready) -> drafts offered; execute(output) -> StepResult
    run_step         one step of a scheduler with an executor
"""

from hybridkv.sched.admission import PrefixAdmission
from hybridkv.sched.config import SchedulerConfig, chunk_align_for, config_from_plan
from hybridkv.sched.executor import Executor, run_step
from hybridkv.sched.request import Request, Status
from hybridkv.sched.running import PlannedStep, RunningPlan, StepPlanner
from hybridkv.sched.scheduler import Scheduler
from hybridkv.sched.step import (
    Preemption,
    ScheduledChunk,
    SchedulerOutput,
    StepReport,
    StepResult,
)

__all__ = [
    "Executor",
    "PlannedStep",
    "Preemption",
    "PrefixAdmission",
    "Request",
    "RunningPlan",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "Status",
    "StepPlanner",
    "StepReport",
    "StepResult",
    "chunk_align_for",
    "config_from_plan",
    "run_step",
]
