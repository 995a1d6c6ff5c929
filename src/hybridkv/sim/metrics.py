"""What a simulation measured: counters filled during the run, frozen into `SimResult`.

Hit accounting: ``prefix_hit_tokens`` counts, for each request, the prefix hit of its
*first* admission only, so ``prefix_hit_rate = prefix_hit_tokens / prompt_tokens`` is a
share of the trace's prompt tokens in [0, 1]. Hits found when a preempted request is
recomputed are counted apart (``recompute_hit_tokens``) because they measure how much
of the preemption cost the cache absorbed, not how much the workload shares.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


def _percentile(sorted_values: list[float], fraction: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, int(fraction * len(sorted_values)))
    return sorted_values[index]


class MetricsRecorder:
    """Mutable counters the scheduler updates in place (cheap attribute increments)."""

    def __init__(self) -> None:
        self.steps = 0
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.scheduled_tokens = 0
        self.prefix_hit_tokens = 0
        self.recompute_hit_tokens = 0
        self.recomputed_tokens = 0
        self.preemptions = 0
        self.peak_usage = 0.0
        self.max_running = 0
        self.drafts_proposed = 0
        self.drafts_accepted = 0
        self.manager_s = 0.0
        self.manager_calls = 0
        self.invariant_checks = 0
        self.ttft_s: list[float] = []
        self.latency_s: list[float] = []
        self.usage_samples: list[tuple[float, float]] = []  # (clock_s, usage) per step
        self.num_finished = 0


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """Everything `simulate` reports; ``to_dict()`` is the ``--json`` payload."""

    num_requests: int
    num_finished: int
    prompt_tokens: int
    output_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    recompute_hit_tokens: int
    recomputed_tokens: int
    preemptions: int
    peak_usage: float
    steps: int
    scheduled_tokens: int
    max_running: int
    drafts_proposed: int
    drafts_accepted: int
    manager_us_per_step: float
    manager_calls: int
    manager_s: float
    state_checkpoints_stored: int
    state_checkpoints_used: int
    cache_stats: dict[str, Any]
    leaked_blocks: int
    invariant_checks: int
    sim_time_s: float
    wall_s: float
    mean_ttft_s: float
    p99_ttft_s: float
    mean_latency_s: float
    p99_latency_s: float
    layout: str
    usage_samples: tuple[tuple[float, float], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        payload = asdict(self)
        payload.pop("usage_samples")
        for key, value in payload.items():
            if isinstance(value, float):
                payload[key] = round(value, 6)
        return payload


def finalize(
    recorder: MetricsRecorder,
    *,
    num_requests: int,
    cache_stats: dict[str, Any],
    leaked_blocks: int,
    sim_time_s: float,
    wall_s: float,
    layout: str,
) -> SimResult:
    ttft = sorted(recorder.ttft_s)
    latency = sorted(recorder.latency_s)
    steps = recorder.steps
    return SimResult(
        num_requests=num_requests,
        num_finished=recorder.num_finished,
        prompt_tokens=recorder.prompt_tokens,
        output_tokens=recorder.output_tokens,
        prefix_hit_tokens=recorder.prefix_hit_tokens,
        prefix_hit_rate=(
            recorder.prefix_hit_tokens / recorder.prompt_tokens if recorder.prompt_tokens else 0.0
        ),
        recompute_hit_tokens=recorder.recompute_hit_tokens,
        recomputed_tokens=recorder.recomputed_tokens,
        preemptions=recorder.preemptions,
        peak_usage=recorder.peak_usage,
        steps=steps,
        scheduled_tokens=recorder.scheduled_tokens,
        max_running=recorder.max_running,
        drafts_proposed=recorder.drafts_proposed,
        drafts_accepted=recorder.drafts_accepted,
        manager_us_per_step=recorder.manager_s * 1e6 / steps if steps else 0.0,
        manager_calls=recorder.manager_calls,
        manager_s=recorder.manager_s,
        state_checkpoints_stored=int(cache_stats.get("num_checkpoints_stored", 0)),
        state_checkpoints_used=int(cache_stats.get("num_checkpoints_used", 0)),
        cache_stats=cache_stats,
        leaked_blocks=leaked_blocks,
        invariant_checks=recorder.invariant_checks,
        sim_time_s=sim_time_s,
        wall_s=wall_s,
        mean_ttft_s=sum(ttft) / len(ttft) if ttft else 0.0,
        p99_ttft_s=_percentile(ttft, 0.99),
        mean_latency_s=sum(latency) / len(latency) if latency else 0.0,
        p99_latency_s=_percentile(latency, 0.99),
        layout=layout,
        usage_samples=tuple(recorder.usage_samples),
    )
