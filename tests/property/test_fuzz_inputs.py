"""Fuzz: hostile configs, CLI flags and traces never cause an internal error (issue 10).

Hypothesis draws (1) HF-style config dicts for every supported ``model_type`` with
fields of every JSON type and absurd sizes, then plans them; (2) `hybridkv plan` command
lines from every option with odd values; (3) JSONL trace lines and whole traces run
through `hybridkv simulate`. The rule everywhere: success, or a typed `HybridKVError`
(exit status 2 with a message on the command line); never another exception, never
"internal error", never a traceback. The default run is bounded for CI (the profile in
``tests/conftest.py``); ``-m slow`` runs many more examples.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import hybridkv.cli.sim  # noqa: F401  (registers simulate / trace-gen)
from hybridkv.cli import app
from hybridkv.errors import HybridKVError
from hybridkv.models import from_hf_config
from hybridkv.models.registry import supported_model_types
from hybridkv.plan import PlanOptions, plan
from hybridkv.sim.trace import parse_trace

runner = CliRunner()
SLOW = settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))

# ---------------------------------------------------------------------- values

small_ints = st.integers(-2, 300)
absurd_ints = st.sampled_from([0, -1, 2**31, 2**63, 2**64 + 1, 10**7, 10**30])
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    small_ints,
    absurd_ints,
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)

# Fields the adapters read (any family); each draws a sane value most of the time.
CONFIG_FIELDS = {
    "num_hidden_layers": st.one_of(st.integers(1, 12), absurd_ints, json_values),
    "hidden_size": st.one_of(st.sampled_from([64, 128, 256, 2048]), absurd_ints, json_values),
    "num_attention_heads": st.one_of(st.sampled_from([1, 2, 4, 8]), json_values),
    "num_key_value_heads": st.one_of(st.sampled_from([1, 2, 4]), json_values),
    "head_dim": st.one_of(st.sampled_from([16, 64, 128]), json_values),
    "sliding_window": st.one_of(st.sampled_from([128, 4096]), json_values),
    "max_position_embeddings": st.one_of(st.sampled_from([4096, 40960]), json_values),
    "layer_types": json_values,
    "dtype": st.one_of(st.sampled_from(["bfloat16", "float32", "int8", "fp8"]), json_values),
    "full_attention_interval": st.one_of(st.integers(1, 4), json_values),
    "linear_num_key_heads": st.one_of(st.integers(1, 8), json_values),
    "linear_num_value_heads": st.one_of(st.integers(1, 8), json_values),
    "linear_key_head_dim": st.one_of(st.sampled_from([32, 128]), json_values),
    "linear_value_head_dim": st.one_of(st.sampled_from([32, 128]), json_values),
    "linear_conv_kernel_dim": st.one_of(st.integers(1, 4), json_values),
    "mamba_d_state": st.one_of(st.sampled_from([16, 128]), json_values),
    "mamba_n_heads": st.one_of(st.integers(1, 8), json_values),
    "mamba_expand": st.one_of(st.integers(1, 2), json_values),
    "hybrid_override_pattern": st.one_of(st.text("M*-E", max_size=12), json_values),
    "kv_lora_rank": st.one_of(st.sampled_from([64, 512]), json_values),
    "qk_rope_head_dim": st.one_of(st.sampled_from([32, 64]), json_values),
    "mtp_num_hidden_layers": st.one_of(st.integers(0, 2), absurd_ints, json_values),
    "text_config": json_values,
}


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    model_type: Any = draw(
        st.one_of(st.sampled_from(supported_model_types()), json_values)
        if draw(st.integers(0, 9)) == 0
        else st.sampled_from(supported_model_types())
    )
    keys = draw(st.sets(st.sampled_from(sorted(CONFIG_FIELDS)), max_size=len(CONFIG_FIELDS)))
    config: dict[str, Any] = {"model_type": model_type}
    for key in sorted(keys):
        config[key] = draw(CONFIG_FIELDS[key])
    return config


def _config_then_plan(config: dict[str, Any]) -> None:
    with contextlib.suppress(HybridKVError):  # refused with a typed error: fine
        spec = from_hf_config(config)
        plan(spec, None, PlanOptions(memory_bytes=1 << 30, max_model_len=4096))


@given(configs())
def test_fuzz_configs_are_planned_or_refused(config: dict[str, Any]) -> None:
    _config_then_plan(config)


@pytest.mark.slow
@SLOW
@given(configs())
def test_fuzz_configs_are_planned_or_refused_long(config: dict[str, Any]) -> None:
    _config_then_plan(config)


# ------------------------------------------------------------------- CLI flags

MODELS = ["qwen3-0.6b", "qwen3.5-0.8b", "gpt-oss-20b", "lfm2-1.2b", "qwen3-4", "Qwen/Qwen3-4B"]
ODD_TEXT = st.sampled_from(["", "-1", "0", "1e400", "nan", "x", "2" * 30, "[]", "{}", "null"])
FLAG_VALUES: dict[str, st.SearchStrategy[str]] = {
    "--draft": st.sampled_from(["qwen3-0.6b", "qwen3-4b", "nope", "demo"]),
    "--spec-method": st.sampled_from(
        ["draft", "eagle", "mtp", "ngram", "suffix", "tree", "Eagle3"]
    ),
    "--num-spec": st.one_of(st.integers(-2, 12).map(str), ODD_TEXT),
    "--speculative-config": st.one_of(
        st.builds(
            json.dumps,
            st.dictionaries(
                st.sampled_from(
                    ["method", "model", "num_speculative_tokens", "topk", "speculative_token_tree"]
                ),
                json_values,
                max_size=3,
            ),
        ),
        ODD_TEXT,
    ),
    "--kv-dtype": st.sampled_from(["auto", "fp8", "fp8_e4m3", "bfloat16", "int4", ""]),
    "--ssm-dtype": st.sampled_from(["auto", "float32", "fp8_e5m2", "x"]),
    "--memory": st.one_of(
        st.sampled_from(["1GiB", "60G", "60GB", "512MiB", "1048576", "60", "1e400GiB", "2PiB"]),
        ODD_TEXT,
    ),
    "--gpu-memory": st.sampled_from(["80GiB", "0", "x"]),
    "--gpu-memory-utilization": st.sampled_from(["0.9", "0", "1.5", "nan", "-1"]),
    "--tp": st.one_of(st.sampled_from(["1", "2", "3", "8", "0"]), ODD_TEXT),
    "--max-model-len": st.one_of(st.sampled_from(["1", "4096", "100000", "0"]), ODD_TEXT),
    "--max-num-seqs": st.one_of(st.sampled_from(["1", "8", "256", "0"]), ODD_TEXT),
    "--max-num-batched-tokens": st.sampled_from(["1", "16", "8192", "0", str(10**12)]),
    "--state-mode": st.sampled_from(["align", "none", "all"]),
    "--layout": st.sampled_from(["auto", "shared", "split", "vllm", "best"]),
    "--block-size": st.one_of(st.sampled_from(["1", "16", "17", "4096", "0"]), ODD_TEXT),
    "--max-block-size": st.sampled_from(["16", "64", "1", "0"]),
    "--target-len": st.sampled_from(["1", "8192", "0"]),
    "--typical-len": st.sampled_from(["1", "8192", "0"]),
}
SWITCHES = ["--no-prefix-caching", "--prefix-caching", "--json"]


@st.composite
def plan_command_lines(draw: st.DrawFn) -> list[str]:
    args = ["plan", draw(st.sampled_from(MODELS))]
    for flag in draw(st.lists(st.sampled_from(sorted(FLAG_VALUES)), max_size=5, unique=True)):
        args += [flag, draw(FLAG_VALUES[flag])]
    args += draw(st.lists(st.sampled_from(SWITCHES), max_size=2, unique=True))
    return args


def _check_cli(args: list[str]) -> None:
    result = runner.invoke(app, args)
    text = result.output
    assert result.exit_code in (0, 2), (args, result.exit_code, text)
    assert "internal error" not in text.lower(), (args, text)
    assert "Traceback" not in text, (args, text)
    if result.exit_code == 2:
        assert text.strip(), args  # a refusal says why


@given(plan_command_lines())
def test_fuzz_plan_flags_exit_0_or_2_with_a_message(args: list[str]) -> None:
    _check_cli(args)


@pytest.mark.slow
@SLOW
@given(plan_command_lines())
def test_fuzz_plan_flags_exit_0_or_2_with_a_message_long(args: list[str]) -> None:
    _check_cli(args)


# ------------------------------------------------------------------------ traces

token_lists = st.one_of(
    st.lists(st.integers(0, 500), min_size=1, max_size=40),
    st.lists(st.one_of(st.integers(-3, 2**64), json_scalars), max_size=4),
)
trace_values = {
    "id": st.one_of(st.text(min_size=1, max_size=6), json_scalars),
    "arrival_s": st.one_of(
        st.floats(0, 100),
        st.floats(allow_nan=True, allow_infinity=True),
        absurd_ints,
        json_scalars,
    ),
    "prompt": token_lists,
    "output": token_lists,
    "spec": st.one_of(
        st.lists(st.lists(st.integers(-1, 6), min_size=2, max_size=2), max_size=6), json_values
    ),
    "cache_salt": st.one_of(st.text(max_size=4), json_scalars),
    "extra": json_values,
}


@st.composite
def trace_lines(draw: st.DrawFn) -> str:
    if draw(st.integers(0, 19)) == 0:  # raw junk now and then
        return draw(st.sampled_from(["{", "[]", "null", '{"id": 1' + "0" * 5000 + "}", "\t"]))
    keys = draw(st.sets(st.sampled_from(sorted(trace_values)), max_size=len(trace_values)))
    keys |= draw(st.sets(st.sampled_from(["id", "arrival_s", "prompt", "output"]), min_size=3))
    line = {key: draw(trace_values[key]) for key in sorted(keys)}
    return json.dumps(line)


@given(st.lists(trace_lines(), max_size=6))
def test_fuzz_trace_lines_parse_or_raise_trace_error(lines: list[str]) -> None:
    with contextlib.suppress(HybridKVError):  # refused with a typed error: fine
        parse_trace(lines)


def _simulate(tmp_path: Path, lines: list[str], flags: list[str]) -> None:
    path = tmp_path / "fuzz.jsonl"
    path.write_text("\n".join(lines) + "\n")
    _check_cli(["simulate", str(path), "qwen3.5-0.8b", "--memory", "1GiB", *flags, "--json"])


simulate_flags = st.lists(
    st.sampled_from(
        [
            ["--max-model-len", "64"],
            ["--spec-method", "ngram", "--num-spec", "3"],
            ["--no-prefix-caching"],
            ["--layout", "split"],
            ["--max-num-seqs", "2"],
            ["--max-num-batched-tokens", "16"],
        ]
    ),
    max_size=3,
).map(lambda groups: [flag for group in groups for flag in group])


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(trace_lines(), max_size=5), simulate_flags)
def test_fuzz_simulate_exits_0_or_2(tmp_path_factory, lines: list[str], flags: list[str]) -> None:
    _simulate(tmp_path_factory.mktemp("fuzz"), lines, flags)


@pytest.mark.slow
@SLOW
@given(st.lists(trace_lines(), max_size=8), simulate_flags)
def test_fuzz_simulate_exits_0_or_2_long(
    tmp_path_factory, lines: list[str], flags: list[str]
) -> None:
    _simulate(tmp_path_factory.mktemp("fuzz"), lines, flags)


# --------------------------------------------------------------------- trace-gen

RANGES = st.sampled_from(["1:8", "8:64", "64:8", "0:4", "5", "1:100000000", "x", "3:"])
TRACE_GEN_FLAGS: dict[str, st.SearchStrategy[str]] = {
    "--num-requests": st.sampled_from(["0", "1", "20", "-1", str(10**9)]),
    "--seed": st.sampled_from(["0", "7", "-1", str(2**70)]),
    "--max-drafts": st.sampled_from(["0", "4", "-2", "100000"]),
    "--rate": st.sampled_from(["0", "8", "-1", "nan", "inf", "1e300"]),
    "--prefix-len": RANGES,
    "--suffix-len": RANGES,
    "--output-len": RANGES,
    "--num-prefixes": st.sampled_from(["1", "3", "0", "1000000"]),
    "--max-turns": st.sampled_from(["1", "4", "0", "100000"]),
}


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.sampled_from(["chat", "agentic", "suffix", "documents", "poetry"]),
    st.lists(st.sampled_from(sorted(TRACE_GEN_FLAGS)), max_size=5, unique=True),
    st.data(),
)
def test_fuzz_trace_gen_exits_0_or_2(tmp_path_factory, kind: str, flags: list, data) -> None:
    out = tmp_path_factory.mktemp("gen") / "t.jsonl"
    args = ["trace-gen", kind, str(out), "--num-requests", "20", "--prefix-len", "1:64"]
    for flag in flags:
        args += [flag, data.draw(TRACE_GEN_FLAGS[flag])]
    _check_cli(args)
