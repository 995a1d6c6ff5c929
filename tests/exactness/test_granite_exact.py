"""Granite-4.0-H (``granitemoehybrid``: Mamba2 + attention layers, MoE + shared expert,
embedding / residual / attention / logits multipliers) matches transformers, through
the harness's hand-made paged cache and through `LLM` on the planned cache."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exactness_harness import engine_greedy, hf_greedy, prompts_for, save_tiny  # noqa: E402
from llm_support import NUM_NEW, _perturb  # noqa: E402

from hybridkv.engine.models import load_model  # noqa: E402

CASE = "granite"


def test_granite_layers_match_the_planner(llm_case):
    from hybridkv.engine.models.loader import read_config
    from hybridkv.models.registry import decoder_layer_indices, from_hf_config

    case = llm_case(CASE)
    model = load_model(case.folder)
    assert [(d.index, d.kind, d.family) for d in model.layers] == [
        (0, "state", "mamba2"),
        (1, "full_attention", "attention"),
        (2, "state", "mamba2"),
        (3, "full_attention", "attention"),
    ]
    assert model.layers[0].shapes == {"conv": (192, 3), "ssm": (8, 16, 16)}
    config = read_config(case.folder)
    assert decoder_layer_indices(config) == (0, 1, 2, 3)
    assert len(from_hf_config(config).layers) == 4


@pytest.mark.parametrize(("chunk_size", "block_size"), [(1, 4), (3, 16), (None, 4)])
def test_granite_moe_nope_harness(llm_case, chunk_size, block_size):
    case = llm_case(CASE)
    model = load_model(case.folder)
    got = engine_greedy(model, case.prompts, NUM_NEW, chunk_size=chunk_size, block_size=block_size)
    assert got == case.expected


@pytest.fixture(scope="module")
def granite_dense_rope(tmp_path_factory):
    """No experts (shared MLP only), rope attention, perturbed norms."""
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["attention", "mamba", "attention"],
        position_embedding_type="rope",
        mamba_n_heads=4,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_chunk_size=16,
        num_local_experts=0,
        shared_intermediate_size=40,
        embedding_multiplier=4.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=2.0,
        initializer_range=0.1,
    )
    folder = tmp_path_factory.mktemp("granite_dense")
    hf = save_tiny(transformers.GraniteMoeHybridForCausalLM, config, folder)
    _perturb(hf, ("norm",), scale=0.3)
    hf.save_pretrained(folder)
    prompts = prompts_for(config.vocab_size)
    return load_model(folder), prompts, hf_greedy(hf, prompts, NUM_NEW)


@pytest.mark.parametrize(("chunk_size", "block_size"), [(1, 4), (None, 16)])
def test_granite_dense_rope_harness(granite_dense_rope, chunk_size, block_size):
    model, prompts, expected = granite_dense_rope
    got = engine_greedy(model, prompts, NUM_NEW, chunk_size=chunk_size, block_size=block_size)
    assert got == expected


# LLM-level tests (planned cache) for this case: tests/exactness/test_llm_more_archs.py
