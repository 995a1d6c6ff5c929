"""Qwen3.5 / Qwen3-Next hybrids (Gated DeltaNet + gated attention) match transformers.

State slots start out NaN in the harness, so a fresh prefill that read its slot instead
of starting from zeros would produce garbage tokens.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exactness_harness import engine_greedy, hf_greedy, prompts_for, save_tiny  # noqa: E402

from hybridkv.engine.models import load_model  # noqa: E402

NUM_NEW = 32
CASES = [(1, 4), (3, 16), (None, 4)]
HYBRID_LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    config = transformers.Qwen3_5TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        layer_types=HYBRID_LAYERS,
    )
    folder = tmp_path_factory.mktemp("qwen3_5")
    hf = save_tiny(transformers.Qwen3_5ForCausalLM, config, folder)
    prompts = prompts_for(config.vocab_size)
    return load_model(folder), prompts, hf_greedy(hf, prompts, NUM_NEW)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    config = transformers.Qwen3NextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        layer_types=HYBRID_LAYERS,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=2,
    )
    folder = tmp_path_factory.mktemp("qwen3_next")
    # Small shards: also exercises loading through model.safetensors.index.json.
    hf = save_tiny(transformers.Qwen3NextForCausalLM, config, folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").exists()
    prompts = prompts_for(config.vocab_size)
    return load_model(folder), prompts, hf_greedy(hf, prompts, NUM_NEW)


@pytest.mark.parametrize(("chunk_size", "block_size"), CASES)
def test_qwen3_5_greedy_matches_transformers(qwen3_5, chunk_size, block_size):
    model, prompts, expected = qwen3_5
    got = engine_greedy(model, prompts, NUM_NEW, chunk_size=chunk_size, block_size=block_size)
    assert got == expected


@pytest.mark.parametrize(("chunk_size", "block_size"), CASES)
def test_qwen3_next_greedy_matches_transformers(qwen3_next, chunk_size, block_size):
    model, prompts, expected = qwen3_next
    got = engine_greedy(model, prompts, NUM_NEW, chunk_size=chunk_size, block_size=block_size)
    assert got == expected
