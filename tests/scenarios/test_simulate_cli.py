"""`hybridkv trace-gen` + `hybridkv simulate` end to end on a Qwen3.5-like preset."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import hybridkv.cli.sim  # noqa: F401  (registers the commands on the app)
from hybridkv.cli import app

runner = CliRunner()


def _run(args: list[str]) -> tuple[int, dict]:
    result = runner.invoke(app, args)
    return result.exit_code, (json.loads(result.stdout) if result.stdout.strip() else {})


def test_suffix_trace_of_200_long_requests_on_qwen35(tmp_path) -> None:
    """200 requests of 2K-8K prompt tokens, drafts jumping between 0 and 16, align-mode
    prefix caching: everything finishes, hits are non-zero, no block leaks."""
    trace = tmp_path / "code.jsonl"
    code, summary = _run(
        [
            "trace-gen",
            "suffix",
            str(trace),
            "--num-requests",
            "200",
            "--seed",
            "0",
            "--max-drafts",
            "16",
            "--json",
        ]
    )
    assert code == 0 and summary["num_requests"] == 200
    code, result = _run(
        [
            "simulate",
            str(trace),
            "qwen3.5-0.8b",
            "--spec-method",
            "suffix",
            "--num-spec",
            "16",
            "--memory",
            "8GiB",
            "--prefix-caching",
            "--check-every",
            "25",
            "--json",
        ]
    )
    assert code == 0, result
    assert result["num_requests"] == result["num_finished"] == 200
    assert result["prefix_hit_rate"] > 0 and result["prefix_hit_tokens"] > 0
    assert result["leaked_blocks"] == 0
    assert result["state_checkpoints_stored"] > 0 and result["state_checkpoints_used"] > 0
    assert result["layout"] in ("shared", "split", "vllm")
    for key in ("prompt_tokens", "preemptions", "peak_usage", "steps", "manager_us_per_step"):
        assert key in result


def test_tight_memory_preempts_and_still_finishes(tmp_path) -> None:
    # Long shared prefixes in a small pool: requests that keep their state spec slots
    # (sticky spares) still run out and are preempted (2 preemptions at 384-512 MiB).
    trace = tmp_path / "chat.jsonl"
    code, _ = _run(
        [
            "trace-gen",
            "chat",
            str(trace),
            "--num-requests",
            "60",
            "--seed",
            "3",
            "--max-drafts",
            "4",
            "--rate",
            "50",
            "--prefix-len",
            "2048:4096",
            "--json",
        ]
    )
    assert code == 0
    code, result = _run(
        [
            "simulate",
            str(trace),
            "qwen3.5-0.8b",
            "--spec-method",
            "ngram",
            "--num-spec",
            "4",
            "--memory",
            "448MiB",
            "--layout",
            "split",
            "--max-model-len",
            "16384",
            "--max-num-seqs",
            "64",
            "--check-every",
            "10",
            "--json",
        ]
    )
    assert code == 0, result
    assert result["preemptions"] > 0
    assert result["num_finished"] == 60 and result["leaked_blocks"] == 0


@pytest.mark.parametrize(
    "line", ['{"id": "a"}', '{"id": "a", "arrival_s": 0, "prompt": [1], "output": [2], "bogus": 1}']
)
def test_bad_trace_exits_2_with_the_line_number(tmp_path, line: str) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"id": "ok", "arrival_s": 0, "prompt": [1], "output": [2]}\n' + line)
    code, payload = _run(["simulate", str(trace), "qwen3-0.6b", "--json"])
    assert code == 2
    assert payload["error"]["type"] == "TraceError"
    assert payload["error"]["message"].startswith("line 2:")


def test_unknown_workload_kind_exits_2(tmp_path) -> None:
    code, payload = _run(["trace-gen", "poetry", str(tmp_path / "x.jsonl"), "--json"])
    assert code == 2 and "unknown workload kind" in payload["error"]["message"]
