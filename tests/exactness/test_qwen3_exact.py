"""Qwen3 (dense) through paged attention produces transformers' greedy tokens."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exactness_harness import engine_greedy, hf_greedy, prompts_for, save_tiny  # noqa: E402

from hybridkv.engine.models import load_model  # noqa: E402

NUM_NEW = 32


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    config = transformers.Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    folder = tmp_path_factory.mktemp("qwen3")
    hf = save_tiny(transformers.Qwen3ForCausalLM, config, folder)
    prompts = prompts_for(config.vocab_size)
    return load_model(folder), prompts, hf_greedy(hf, prompts, NUM_NEW)


@pytest.mark.parametrize(("chunk_size", "block_size"), [(1, 4), (3, 16), (None, 4)])
def test_qwen3_greedy_matches_transformers(qwen3, chunk_size, block_size):
    model, prompts, expected = qwen3
    got = engine_greedy(model, prompts, NUM_NEW, chunk_size=chunk_size, block_size=block_size)
    assert got == expected
