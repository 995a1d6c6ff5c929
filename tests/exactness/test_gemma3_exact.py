"""Gemma 3 (sliding-window + global layers) matches transformers.

The window (8 tokens) is much shorter than prompt + output, and the harness swaps blocks
that left the window for the NaN-filled null block, so reading outside the window shows.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exactness_harness import engine_greedy, hf_greedy, prompts_for, save_tiny  # noqa: E402

from hybridkv.engine.models import load_model  # noqa: E402

NUM_NEW = 32


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    config = transformers.Gemma3TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        final_logit_softcapping=30.0,
    )
    folder = tmp_path_factory.mktemp("gemma3")
    hf = save_tiny(transformers.Gemma3ForCausalLM, config, folder)
    prompts = prompts_for(config.vocab_size)
    return load_model(folder), prompts, hf_greedy(hf, prompts, NUM_NEW)


def test_gemma3_layers_describe_sliding_and_full(gemma3):
    model, _, _ = gemma3
    kinds = [(d.kind, d.sliding_window) for d in model.layers]
    assert kinds == [
        ("sliding_attention", 8),
        ("sliding_attention", 8),
        ("full_attention", None),
        ("sliding_attention", 8),
    ]


@pytest.mark.parametrize(("chunk_size", "block_size"), [(1, 4), (3, 16), (None, 4), (5, 4)])
def test_gemma3_greedy_matches_transformers(gemma3, chunk_size, block_size):
    model, prompts, expected = gemma3
    got = engine_greedy(model, prompts, NUM_NEW, chunk_size=chunk_size, block_size=block_size)
    assert got == expected
