"""`SchedulerConfig`: the limits and switches of the one scheduling policy, and
`config_from_plan`, which reads them from a `CachePlan` the same way for the engine and
the simulator (so both make the same decisions on the same plan)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import SchedulerError
from hybridkv.plan.types import CachePlan


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Per-step limits of the scheduler.

    ``chunk_size`` caps one request's prefill tokens per step (None: the budget).
    ``chunk_align_tokens`` B > 0 ends prefill chunks on multiples of B (state
    checkpoints in ``align`` mode live there; see `Scheduler.chunk`). ``max_model_len``
    caps prompt + output tokens: longer prompts are refused, a request stops with
    ``"length"`` at the limit and its drafts never pass it. ``max_spec_tokens`` caps a
    step's drafts (None: what the executor proposes). ``cache_aware`` turns on
    in-batch prefix dedupe and longest-cached-prefix-first admission among the first
    ``reorder_window`` waiting requests of equal priority (0: plain arrival order).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunk_size: int | None = None
    chunk_align_tokens: int = 0
    max_model_len: int | None = None
    max_spec_tokens: int | None = None
    cache_aware: bool = True
    reorder_window: int = 32
    reorder_refresh_steps: int = 8  # steps an ordering hit is reused before a new lookup
    batch_commits: bool = True  # one `commit_batch` call per step when the manager has it

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "chunk_size",
            "max_model_len",
            "reorder_refresh_steps",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SchedulerError(f"SchedulerConfig.{name}={value}: needs >= 1")
        for name in ("chunk_align_tokens", "max_spec_tokens", "reorder_window"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise SchedulerError(f"SchedulerConfig.{name}={value}: needs >= 0")


def chunk_align_for(plan: CachePlan) -> int:
    """The hit granularity when a state group checkpoints at block boundaries (align
    mode, prefix caching on), else 0 (no alignment needed)."""
    align = any(g.kind == "state" and g.state_mode == "align" for g in plan.groups)
    return plan.hit_granularity_tokens if align and plan.options.prefix_caching else 0


def config_from_plan(plan: CachePlan, **overrides: Any) -> SchedulerConfig:
    """Limits from the plan's options: max_num_seqs, the token budget, K drafts (0
    without a speculative method: the plan reserves no draft slots), chunk alignment
    (`chunk_align_for`); ``overrides`` replace any field."""
    opts = plan.options
    base = SchedulerConfig(
        max_num_seqs=opts.max_num_seqs,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        max_spec_tokens=opts.num_spec_tokens if opts.spec_method else 0,
        chunk_align_tokens=chunk_align_for(plan),
    )
    return dataclasses.replace(base, **overrides)
