"""Helpers of the HTTP tests: /metrics as a dict, waiting for the engine to go idle."""

from __future__ import annotations

import time

from hybridkv.serve.metrics import parse


def metrics(client) -> dict[str, float]:
    """``/metrics`` as ``{"hybridkv:name": value}`` (the model label dropped)."""
    text = client.get("/metrics").text
    out = {}
    for key, value in parse(text).items():
        name, _, labels = key.partition("{")
        reason = [p for p in labels.rstrip("}").split(",") if p.startswith("finished_reason")]
        out[name + (f"[{reason[0].split('=')[1].strip(chr(34))}]" if reason else "")] = value
    return out


def wait_idle(client, idle_usage: float, timeout_s: float = 20.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and usage is back to ``idle_usage``."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(client)
        idle = (
            m["hybridkv:num_requests_running"] == 0
            and m["hybridkv:num_requests_waiting"] == 0
            and m["hybridkv:kv_cache_usage_perc"] == idle_usage
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)
