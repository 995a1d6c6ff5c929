"""`hybridkv plan` / `hybridkv models` from the command line (issue 2 acceptance)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app

runner = CliRunner()

ACCEPTANCE = [
    "plan",
    "qwen3-coder-next-80b-a3b",
    "--draft",
    "qwen3-4b",
    "--spec-method",
    "draft",
    "--num-spec",
    "3",
    "--kv-dtype",
    "fp8_e4m3",
    "--memory",
    "60GiB",
]


def run_json(args: list[str]) -> dict:
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_acceptance_pair_padding_and_blocks_vs_vllm() -> None:
    out = run_json(ACCEPTANCE)
    for key in (
        "layout",
        "groups",
        "pools",
        "memory_bytes",
        "waste_bytes",
        "capacity",
        "alternatives",
        "warnings",
    ):
        assert key in out
    assert out["waste_bytes"] <= 0.02 * out["memory_bytes"]
    vllm = run_json([*ACCEPTANCE, "--layout", "vllm"])
    for model in ("main", "draft"):
        ours = max(
            g["block_size"] for g in out["groups"] if g["model"] == model and g["kind"] != "state"
        )
        theirs = max(
            g["block_size"] for g in vllm["groups"] if g["model"] == model and g["kind"] != "state"
        )
        assert ours <= theirs
    # vLLM's rule pads each DeltaNet page to the draft's page: 50%
    state = next(g for g in vllm["groups"] if g["kind"] == "state")
    assert state["padded_page_bytes"] == 2 * state["page_bytes"]
    group_keys = {
        "kind",
        "model",
        "layers",
        "block_size",
        "page_bytes",
        "padded_page_bytes",
        "pool",
    }
    assert group_keys <= set(out["groups"][0])
    assert {"max_concurrency", "tokens_per_group", "state_slots"} <= set(out["capacity"])


def test_vllm_layout_qwen35_9b_528_tokens() -> None:
    out = run_json(
        [
            "plan",
            "qwen3.5-9b",
            "--layout",
            "vllm",
            "--kv-dtype",
            "bfloat16",
            "--ssm-dtype",
            "float32",
        ]
    )
    attn = [g for g in out["groups"] if g["kind"] == "full_attention"]
    state = next(g for g in out["groups"] if g["kind"] == "state")
    assert {g["block_size"] for g in attn} == {528}
    pad = 1 - state["page_bytes"] / state["padded_page_bytes"]
    assert f"{pad:.2%}" == "0.76%"


def test_vllm_flag_names_carry_over() -> None:
    ours = run_json(ACCEPTANCE)
    theirs = run_json(
        [
            "plan",
            "qwen3-coder-next-80b-a3b",
            "--kv-cache-dtype",
            "fp8_e4m3",
            "--speculative-config",
            '{"method": "draft_model", "model": "qwen3-4b", "num_speculative_tokens": 3}',
            "--gpu-memory",
            "60GiB",
            "--gpu-memory-utilization",
            "1.0",
            "--enable-prefix-caching",
            "--tensor-parallel-size",
            "1",
        ]
    )
    assert ours["capacity"] == theirs["capacity"]
    assert ours["groups"] == theirs["groups"]


def test_mtp_head_from_main_model() -> None:
    out = run_json(
        [
            "plan",
            "qwen3.5-9b",
            "--spec-method",
            "mtp",
            "--num-spec",
            "2",
            "--memory",
            "40GiB",
            "--max-model-len",
            "32768",
        ]
    )
    # the head's layer is planned: in its own group, or (vLLM's rule) merged into the
    # main attention type as "main+draft"
    assert any("draft" in g["model"] for g in out["groups"])
    assert sum(len(g["layers"]) for g in out["groups"]) == 32 + 1


@pytest.mark.parametrize(
    "args, needle",
    [
        (["plan", "no-such-model"], "presets:"),
        (["plan", "qwen3.5-9b", "--block-size", "16", "--layout", "shared"], ">= 528"),
        (["plan", "qwen3.5-9b", "--memory", "lots"], "not a size"),
        (["plan", "qwen3.5-9b", "--kv-dtype", "fp4"], "fp4"),
        (["plan", "qwen3.5-9b", "--memory", "1GiB"], "cannot hold one request"),
        (["plan", "qwen3.5-9b", "--speculative-config", "{bad"], "not JSON"),
        (["plan", "qwen3.5-9b", "--tp", "3"], "tp=3"),
    ],
)
def test_errors_exit_2_with_message_and_json(args: list[str], needle: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert needle in " ".join(result.output.split())
    assert "Traceback" not in result.output
    as_json = runner.invoke(app, [*args, "--json"])
    assert as_json.exit_code == 2
    payload = json.loads(as_json.stdout)
    assert needle in payload["error"]["message"] and payload["error"]["type"]


def test_models_lists_presets() -> None:
    result = runner.invoke(app, ["models", "--json"])
    assert result.exit_code == 0
    names = {m["name"] for m in json.loads(result.stdout)}
    assert {"qwen3-coder-next-80b-a3b", "qwen3-4b", "qwen3.5-9b"} <= names


def test_plan_table_output_renders() -> None:
    result = runner.invoke(app, ACCEPTANCE)
    assert result.exit_code == 0
    assert "max concurrency" in result.output and "vllm" in result.output


def test_state_mode_all_and_vllms_mamba_cache_mode_alias() -> None:
    """--state-mode align|all|none is accepted, and so is vLLM's --mamba-cache-mode;
    `all` needs prefix caching like `align`."""
    ours = run_json(["plan", "qwen3.5-9b", "--state-mode", "all", "--memory", "40GiB"])
    alias = run_json(["plan", "qwen3.5-9b", "--mamba-cache-mode", "all", "--memory", "40GiB"])
    assert ours == alias
    assert ours["hit_granularity_tokens"] > 0
    result = runner.invoke(
        app,
        ["plan", "qwen3.5-9b", "--state-mode", "all", "--no-prefix-caching", "--json"],
    )
    assert result.exit_code == 2 and "state_mode='all'" in result.stdout
