"""`GET /metrics`: Prometheus text exposition format (version 0.0.4), written by hand
(it is a few lines per metric; no client library needed).

Names follow vLLM's ``vllm:*`` metrics with our prefix, so dashboards carry over:

    hybridkv:num_requests_running / _waiting           gauge   requests in the engine
    hybridkv:kv_cache_usage_perc                       gauge   used share of cache blocks,
                                                               0..1 (as vLLM's, despite "perc")
    hybridkv:prefix_cache_queries_total                counter prompt tokens looked up
    hybridkv:prefix_cache_hits_total                   counter of those, tokens found cached
    hybridkv:prompt_tokens_total                       counter prompt tokens of accepted requests
    hybridkv:generation_tokens_total                   counter tokens generated
    hybridkv:spec_decode_num_draft_tokens_total        counter draft tokens proposed
    hybridkv:spec_decode_num_accepted_tokens_total     counter draft tokens accepted
    hybridkv:num_preemptions_total                     counter requests preempted
    hybridkv:engine_steps_total                        counter engine steps run
    hybridkv:request_success_total{finished_reason}    counter finished requests ("stop",
                                                               "length", "abort")
    hybridkv:time_to_first_token_seconds               histogram submit -> first token
    hybridkv:e2e_request_latency_seconds               histogram submit -> finished (not
                                                               counting aborted requests)

Every sample carries ``model_name``. Prefix-cache queries and hits count each request
once, at its first admission (its prompt tokens, and the tokens it found cached then);
re-admissions after preemption are not counted.

This module does not import torch.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from hybridkv.errors import InvariantError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "hybridkv:"


# Prometheus' default latency buckets, extended for long generations on a CPU.
LATENCY_BUCKETS_S = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


@dataclass(frozen=True)
class HistogramSnapshot:
    """``counts[i]``: observations <= ``bounds[i]`` (cumulative, as Prometheus' ``le``);
    ``count`` includes those above the last bound (the ``+Inf`` bucket)."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: tuple[int, ...] = (0,) * len(LATENCY_BUCKETS_S)
    total: float = 0.0
    count: int = 0


class Histogram:
    """Observations counted into fixed buckets (one owner thread; `snapshot` to share)."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise InvariantError(f"histogram bounds must increase strictly: {bounds}")
        self.bounds = bounds
        self._per_bucket = [0] * (len(bounds) + 1)  # the last one: above every bound
        self._total = 0.0

    def observe(self, value: float) -> None:
        self._per_bucket[bisect_left(self.bounds, value)] += 1
        self._total += value

    def snapshot(self) -> HistogramSnapshot:
        cumulative, running = [], 0
        for n in self._per_bucket[:-1]:
            running += n
            cumulative.append(running)
        return HistogramSnapshot(self.bounds, tuple(cumulative), self._total, sum(self._per_bucket))

    def check_invariants(self) -> None:
        if any(n < 0 for n in self._per_bucket) or len(self._per_bucket) != len(self.bounds) + 1:
            raise InvariantError(f"histogram buckets {self._per_bucket} for bounds {self.bounds}")
        if self._total < 0:
            raise InvariantError(f"histogram of latencies sums to {self._total} < 0")


@dataclass(frozen=True)
class MetricsSnapshot:
    model_name: str
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens: int
    generation_tokens: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    num_preemptions: int
    num_steps: int
    finished: dict[str, int]
    time_to_first_token: HistogramSnapshot = field(default_factory=HistogramSnapshot)
    e2e_request_latency: HistogramSnapshot = field(default_factory=HistogramSnapshot)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(snapshot: MetricsSnapshot) -> str:
    """The snapshot in the text format (module doc)."""
    model = f'model_name="{_escape(snapshot.model_name)}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {PREFIX}{name} {help_text}")
        lines.append(f"# TYPE {PREFIX}{name} {kind}")
        for labels, value in samples:
            lines.append(f"{PREFIX}{name}{{{labels}}} {_number(value)}")

    s = snapshot
    metric(
        "num_requests_running",
        "gauge",
        "Requests in the running batch.",
        [(model, s.num_requests_running)],
    )
    metric(
        "num_requests_waiting",
        "gauge",
        "Requests waiting to be scheduled.",
        [(model, s.num_requests_waiting)],
    )
    metric(
        "kv_cache_usage_perc",
        "gauge",
        "Share of cache blocks in use (0..1).",
        [(model, s.kv_cache_usage)],
    )
    counters = (
        (
            "prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        ),
        (
            "prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache.",
            s.prefix_cache_hits,
        ),
        ("prompt_tokens_total", "Prompt tokens of accepted requests.", s.prompt_tokens),
        ("generation_tokens_total", "Tokens generated.", s.generation_tokens),
        ("spec_decode_num_draft_tokens_total", "Draft tokens proposed.", s.spec_draft_tokens),
        ("spec_decode_num_accepted_tokens_total", "Draft tokens accepted.", s.spec_accepted_tokens),
        ("num_preemptions_total", "Requests preempted (recomputed later).", s.num_preemptions),
        ("engine_steps_total", "Engine steps run.", s.num_steps),
    )
    for name, help_text, value in counters:
        metric(name, "counter", help_text, [(model, value)])
    reasons = sorted({"stop", "length", "abort", *s.finished})
    metric(
        "request_success_total",
        "counter",
        "Finished requests by finish reason (abort: cancelled or disconnected).",
        [(f'{model},finished_reason="{_escape(r)}"', s.finished.get(r, 0)) for r in reasons],
    )
    histograms = (
        ("time_to_first_token_seconds", "Seconds from submission to the first token.",
         s.time_to_first_token),
        ("e2e_request_latency_seconds", "Seconds from submission to the end (finished only).",
         s.e2e_request_latency),
    )  # fmt: skip
    for name, help_text, h in histograms:
        lines.append(f"# HELP {PREFIX}{name} {help_text}")
        lines.append(f"# TYPE {PREFIX}{name} histogram")
        for bound, count in [*zip(h.bounds, h.counts, strict=True), (float("inf"), h.count)]:
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            lines.append(f'{PREFIX}{name}_bucket{{{model},le="{le}"}} {count}')
        lines.append(f"{PREFIX}{name}_sum{{{model}}} {_number(h.total)}")
        lines.append(f"{PREFIX}{name}_count{{{model}}} {h.count}")
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


def parse(text: str) -> dict[str, float]:
    """``{"name{labels}": value}`` of a rendered text (tests and clients; no comments)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
