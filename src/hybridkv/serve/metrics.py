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

Every sample carries ``model_name``. A preempted request looks its prompt up again, so
queries count each admission (as vLLM's do).

This module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "hybridkv:"


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
