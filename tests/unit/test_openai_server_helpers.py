"""The pure parts of `hybridkv.vllm.openai_server` (no vLLM needed): Prometheus text and
the traceback filter the serving benchmark and load test rely on."""

from __future__ import annotations

from hybridkv.vllm.openai_server import parse_metrics, unexpected_tracebacks

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"} 1.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1324.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 1.5e-02
process_open_fds 42
"""


def test_parse_metrics_sums_label_sets() -> None:
    got = parse_metrics(METRICS)
    assert got["vllm:num_requests_running"] == 0.0
    assert got["vllm:num_requests_waiting_by_reason"] == 3.0
    assert got["vllm:prefix_cache_hits_total"] == 1324.0
    assert got["vllm:kv_cache_usage_perc"] == 0.015
    assert got["process_open_fds"] == 42.0
    assert not any(name.startswith("#") for name in got)


def test_tokenizer_less_warmup_traceback_is_not_counted() -> None:
    log = """\
(APIServer pid=1) WARNING [base.py:380] Chat template warmup failed
(APIServer pid=1) WARNING [base.py:380] Traceback (most recent call last):
(APIServer pid=1) WARNING [base.py:380] ValueError: Tokenizer not available
(EngineCore pid=2) ERROR [core.py:1] EngineCore encountered an issue
(EngineCore pid=2) ERROR [core.py:1] Traceback (most recent call last):
"""
    found = unexpected_tracebacks(log)
    assert len(found) == 1
    assert "EngineCore" in found[0]
