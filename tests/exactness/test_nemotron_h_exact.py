"""Nemotron-H (Mamba2 + NoPE attention + relu^2 MLP blocks) matches transformers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exactness_harness import engine_greedy, hf_greedy, prompts_for, save_tiny  # noqa: E402

from hybridkv.engine.models import load_model  # noqa: E402

NUM_NEW = 32


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory):
    config = transformers.NemotronHConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=5,
        layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=8,
        ssm_state_size=16,
        n_groups=2,
        chunk_size=16,
    )
    folder = tmp_path_factory.mktemp("nemotron_h")
    hf = save_tiny(transformers.NemotronHForCausalLM, config, folder)
    prompts = prompts_for(config.vocab_size)
    return load_model(folder), prompts, hf_greedy(hf, prompts, NUM_NEW)


def test_nemotron_h_describes_only_cached_layers(nemotron_h):
    model, _, _ = nemotron_h
    assert [(d.index, d.kind, d.family) for d in model.layers] == [
        (0, "state", "mamba2"),
        (2, "full_attention", "attention"),
        (3, "state", "mamba2"),
    ]
    assert model.layers[0].shapes == {"conv": (128, 3), "ssm": (8, 8, 16)}


@pytest.mark.parametrize(("chunk_size", "block_size"), [(1, 4), (3, 16), (None, 4)])
def test_nemotron_h_greedy_matches_transformers(nemotron_h, chunk_size, block_size):
    model, prompts, expected = nemotron_h
    got = engine_greedy(model, prompts, NUM_NEW, chunk_size=chunk_size, block_size=block_size)
    assert got == expected
