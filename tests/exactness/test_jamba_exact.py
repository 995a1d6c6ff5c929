"""Jamba (``jamba``: Mamba1 state layers + NoPE attention, MoE every other layer) matches
transformers, through the harness's hand-made paged cache and through `LLM` on the
planned cache."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exactness_harness import engine_greedy, hf_greedy, prompts_for, save_tiny  # noqa: E402
from llm_support import NUM_NEW, _perturb  # noqa: E402

from hybridkv.engine.models import load_model  # noqa: E402

CASE = "jamba"


def test_jamba_layers_match_the_planner(llm_case):
    from hybridkv.engine.models.loader import read_config
    from hybridkv.models.registry import decoder_layer_indices, from_hf_config

    case = llm_case(CASE)
    model = load_model(case.folder)
    assert [(d.index, d.kind, d.family) for d in model.layers] == [
        (0, "state", "mamba1"),
        (1, "full_attention", "attention"),
        (2, "state", "mamba1"),
        (3, "full_attention", "attention"),
    ]
    assert model.layers[0].shapes == {"conv": (128, 3), "ssm": (128, 8)}
    config = read_config(case.folder)
    assert decoder_layer_indices(config) == (0, 1, 2, 3)
    specs = from_hf_config(config).layers
    assert [s.family for s in specs] == [d.family for d in model.layers]
    assert specs[0].conv_shape() == model.layers[0].shapes["conv"]
    assert tuple(specs[0].ssm_shape()) == model.layers[0].shapes["ssm"]


@pytest.mark.parametrize(("chunk_size", "block_size"), [(1, 4), (3, 16), (None, 4)])
def test_jamba_harness(llm_case, chunk_size, block_size):
    case = llm_case(CASE)
    model = load_model(case.folder)
    got = engine_greedy(model, case.prompts, NUM_NEW, chunk_size=chunk_size, block_size=block_size)
    assert got == case.expected


@pytest.fixture(scope="module")
def jamba_dense_bias(tmp_path_factory):
    """No experts, in/out projection biases, no conv bias, explicit dt rank, attention
    first (offset 0 of period 3), perturbed norms and D."""
    config = transformers.JambaConfig(
        vocab_size=128,
        hidden_size=48,
        intermediate_size=40,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        attn_layer_period=3,
        attn_layer_offset=0,
        num_experts=1,
        mamba_d_state=4,
        mamba_d_conv=3,
        mamba_expand=1,
        mamba_dt_rank=6,
        mamba_conv_bias=False,
        mamba_proj_bias=True,
        initializer_range=0.1,
    )
    folder = tmp_path_factory.mktemp("jamba_dense")
    hf = save_tiny(transformers.JambaForCausalLM, config, folder)
    _perturb(hf, ("norm", ".D", "proj.bias"), scale=0.3)
    hf.save_pretrained(folder)
    prompts = prompts_for(config.vocab_size)
    return load_model(folder), prompts, hf_greedy(hf, prompts, NUM_NEW)


@pytest.mark.parametrize(("chunk_size", "block_size"), [(1, 4), (None, 16)])
def test_jamba_dense_bias_harness(jamba_dense_bias, chunk_size, block_size):
    model, prompts, expected = jamba_dense_bias
    assert [d.kind for d in model.layers] == ["full_attention", "state", "state", "full_attention"]
    got = engine_greedy(model, prompts, NUM_NEW, chunk_size=chunk_size, block_size=block_size)
    assert got == expected


# LLM-level tests (planned cache) for this case: tests/exactness/test_llm_more_archs.py
