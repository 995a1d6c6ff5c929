"""`hybridkv generate`: JSON token ids per prompt and stats; errors exit 2."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from typer.testing import CliRunner  # noqa: E402

import hybridkv.cli.engine  # noqa: E402,F401  (registers the command)
from hybridkv.cli import app  # noqa: E402


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    folder = tmp_path_factory.mktemp("cli_qwen3")
    transformers.Qwen3ForCausalLM(config).float().save_pretrained(folder)
    return folder


def test_generate_json_holds_token_ids_per_prompt(tiny_qwen3):
    result = CliRunner().invoke(
        app,
        [
            "generate",
            str(tiny_qwen3),
            "--prompt-ids",
            "1,2,3",
            "--prompt-ids",
            "4,5",
            "--max-new-tokens",
            "4",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [o["prompt_token_ids"] for o in payload["outputs"]] == [[1, 2, 3], [4, 5]]
    assert all(len(o["token_ids"]) == 4 for o in payload["outputs"])
    assert payload["stats"]["num_steps"] >= 4


def test_generate_errors_exit_2(tiny_qwen3):
    runner = CliRunner()
    bad_ids = runner.invoke(app, ["generate", str(tiny_qwen3), "--prompt-ids", "1,x"])
    assert bad_ids.exit_code == 2
    no_tokenizer = runner.invoke(app, ["generate", str(tiny_qwen3), "--prompt", "hi", "--json"])
    assert no_tokenizer.exit_code == 2
    assert "tokenizer" in json.loads(no_tokenizer.stdout)["error"]["message"]


def test_generate_stop_token_ids_device_and_finish_reason(tiny_qwen3):
    runner = CliRunner()
    args = ["generate", str(tiny_qwen3), "--prompt-ids", "1,2,3", "--max-new-tokens", "6"]
    full = json.loads(runner.invoke(app, [*args, "--device", "cpu", "--json"]).stdout)
    out = full["outputs"][0]
    assert full["device"] == "cpu" and full["eos_token_ids"] == []
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 6
    stop = out["token_ids"][2]
    cut = out["token_ids"][: out["token_ids"].index(stop) + 1]
    result = runner.invoke(app, [*args, "--stop-token-ids", str(stop), "--ignore-eos", "--json"])
    assert result.exit_code == 0, result.output
    stopped = json.loads(result.stdout)["outputs"][0]
    assert stopped["token_ids"] == cut and stopped["finish_reason"] == "stop"
    bad = runner.invoke(app, [*args, "--stop-token-ids", "x", "--json"])
    assert bad.exit_code == 2
    assert "--stop-token-ids" in json.loads(bad.stdout)["error"]["message"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_generate_on_cuda_without_cuda_exits_2(tiny_qwen3):
    result = CliRunner().invoke(
        app, ["generate", str(tiny_qwen3), "--prompt-ids", "1", "--device", "cuda", "--json"]
    )
    assert result.exit_code == 2
    assert "CUDA" in json.loads(result.stdout)["error"]["message"]


@pytest.mark.parametrize("flag", ["--kv-dtype", "--kv-cache-dtype"])
def test_generate_fp8_kv_matches_the_python_api(tiny_qwen3, flag):
    from hybridkv.engine import LLM

    args = ["generate", str(tiny_qwen3), "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "6"]
    result = CliRunner().invoke(app, [*args, flag, "fp8_e5m2", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["kv_dtype"] == "fp8_e5m2"
    want = LLM(tiny_qwen3, kv_dtype="fp8_e5m2").generate([[1, 2, 3, 4, 5]], 6)[0].token_ids
    assert payload["outputs"][0]["token_ids"] == want
    bad = CliRunner().invoke(app, [*args, flag, "fp9", "--json"])
    assert bad.exit_code == 2
    assert "fp9" in json.loads(bad.stdout)["error"]["message"]


@pytest.mark.parametrize("compile_flag", ["--torch-compile", "--no-torch-compile"])
def test_generate_and_serve_take_the_benchmarks_engine_settings(tiny_qwen3, compile_flag):
    """bench/engine_vs_vllm.py measures `LLM(torch_compile=True)` with a thread per core,
    which `generate` and `serve` could not run; both flags now reach the engine, and
    `generate --json` says which settings its tokens ran under."""
    import hybridkv.cli.serve  # noqa: F401  (registers serve)
    from hybridkv.engine.ops import compiled

    was_compiled, was_threads = compiled.enabled(), torch.get_num_threads()
    args = ["generate", str(tiny_qwen3), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]
    try:
        result = CliRunner().invoke(app, [*args, compile_flag, "--threads", "1", "--json"])
        assert result.exit_code == 0, result.output
        payload = json.loads(result.stdout)
        assert payload["torch_compile"] is (compile_flag == "--torch-compile")
        assert payload["threads"] == 1
        if compile_flag == "--torch-compile":
            assert compiled.enabled()  # process-wide, as LLM(torch_compile=True) sets it
    finally:
        compiled.enable(was_compiled)
        torch.set_num_threads(was_threads)
    serve_help = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200).output
    assert "--torch-compile / --no-torch-compile" in serve_help and "--threads" in serve_help
