"""`simulate(trace, plan)`: replay a trace through the scheduler model and a real
`CacheManager`, then check that the run left nothing behind.

After the last request finishes every block must be free (cached free blocks count as
free: they are evictable); ``leaked_blocks`` reports the referenced blocks left over,
summed over pools, and `check_invariants()` runs once more at the end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from time import perf_counter
from typing import Any

from hybridkv.plan.types import CachePlan
from hybridkv.sched import SchedulerConfig, SchedulerOutput, StepReport, config_from_plan
from hybridkv.sim.cost import StepCost
from hybridkv.sim.metrics import MetricsRecorder, SimResult, finalize
from hybridkv.sim.scheduler import ReplayOptions, TraceReplay
from hybridkv.sim.trace import TraceRequest, read_trace

EAGLE_METHODS = ("eagle", "mtp")  # drafters that read their own KV at the hit position


def build_manager(
    plan: CachePlan,
    *,
    enable_prefix_caching: bool | None = None,
    eviction_policy: str | None = None,
    checkpoint_rules: Sequence[str] | None = None,
) -> Any:
    """The plan's `CacheManager` as the simulator uses it (no event log: runs are long).
    ``eviction_policy`` and ``checkpoint_rules`` None: the manager's defaults."""
    from hybridkv.cache import CacheManager

    eagle = plan.options.spec_method in EAGLE_METHODS
    extra: dict[str, Any] = {} if eviction_policy is None else {"eviction_policy": eviction_policy}
    return CacheManager(
        plan,
        enable_prefix_caching=enable_prefix_caching,
        eagle=eagle,
        record_events=False,
        checkpoint_rules=checkpoint_rules,
        **extra,
    )


def leaked_blocks(manager: Any, plan: CachePlan) -> int:
    """Blocks still referenced (usable minus free), summed over the plan's pools."""
    return sum(
        pool.num_usable_blocks - manager.num_free_blocks(pool.pool_id) for pool in plan.pools
    )


def simulate(
    trace: Sequence[TraceRequest] | str | Path,
    plan: CachePlan,
    *,
    check_every: int = 0,
    batched: bool = True,
    cost: StepCost | None = None,
    max_steps: int | None = None,
    record_usage: bool = True,
    enable_prefix_caching: bool | None = None,
    config: SchedulerConfig | None = None,
    manager: Any = None,
    on_step: Callable[[SchedulerOutput, StepReport], None] | None = None,
    eviction_policy: str | None = None,
    checkpoint_rules: Sequence[str] | None = None,
) -> SimResult:
    """Replay ``trace`` (requests or a JSONL path) under ``plan``; returns the metrics.

    ``check_every=N`` calls the manager's `check_invariants()` every N steps (always
    once at the end); ``max_steps`` stops the replay early; ``record_usage`` samples
    the cache usage after every step. ``config`` is the
    scheduler's (`hybridkv.sched.SchedulerConfig`, the engine's own type: pass
    ``llm.scheduler.config`` to replay under an engine's limits); None reads it from
    ``plan.options`` as the engine does (`config_from_plan`), with ``batched`` as its
    ``batch_commits`` (the running requests go through `allocate_batch` /
    `commit_batch`). ``manager`` lets a caller pass its own;
    ``on_step(output, report)`` sees every step's decisions (to compare with an engine);
    ``eviction_policy`` and ``checkpoint_rules`` configure the manager built otherwise.
    Raises `TraceError` for a bad trace file and `SimulationError` when a request
    cannot fit alone.
    """
    requests = read_trace(trace) if isinstance(trace, str | Path) else list(trace)
    if config is None:
        config = config_from_plan(plan, batch_commits=batched)
    options = ReplayOptions(check_every=check_every, max_steps=max_steps, record_usage=record_usage)
    if manager is None:
        manager = build_manager(
            plan,
            enable_prefix_caching=enable_prefix_caching,
            eviction_policy=eviction_policy,
            checkpoint_rules=checkpoint_rules,
        )
    recorder = MetricsRecorder()
    scheduler = TraceReplay(
        manager, requests, config, cost or StepCost(), recorder, on_step, options
    )
    start = perf_counter()
    scheduler.run()
    wall_s = perf_counter() - start
    scheduler.check_invariants()
    stats = manager.stats()
    stats_dict = dataclasses.asdict(stats)
    return finalize(
        recorder,
        num_requests=len(requests),
        cache_stats={k: v for k, v in stats_dict.items() if not isinstance(v, tuple)},
        leaked_blocks=leaked_blocks(manager, plan) if scheduler.done() else -1,
        sim_time_s=scheduler.clock_s,
        wall_s=wall_s,
        layout=plan.layout,
    )
