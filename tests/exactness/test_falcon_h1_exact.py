"""Falcon-H1 (attention and Mamba2 side by side in every layer, muP multipliers)
matches transformers, through the harness's paged cache and through `LLM` on the
planned cache (each decoder layer is two plan layers: attention, then Mamba2)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exactness_harness import engine_greedy, hf_greedy, prompts_for, save_tiny  # noqa: E402
from llm_support import NUM_NEW, _perturb  # noqa: E402

from hybridkv.engine.models import load_model  # noqa: E402

CASE = "falcon_h1"


def test_falcon_h1_layers_match_the_planner(llm_case):
    from hybridkv.engine.models.loader import read_config
    from hybridkv.models.registry import decoder_layer_indices, from_hf_config

    case = llm_case(CASE)
    model = load_model(case.folder)
    assert [(d.index, d.kind, d.family) for d in model.layers] == [
        (0, "full_attention", "attention"),
        (1, "state", "mamba2"),
        (2, "full_attention", "attention"),
        (3, "state", "mamba2"),
        (4, "full_attention", "attention"),
        (5, "state", "mamba2"),
    ]
    # mamba_d_ssm 96 = 8 heads x 12; conv over 96 + 2 groups x 2 x 16 state.
    assert model.layers[1].shapes == {"conv": (160, 3), "ssm": (8, 12, 16)}
    config = read_config(case.folder)
    assert decoder_layer_indices(config) == (0, 0, 1, 1, 2, 2)
    assert len(from_hf_config(config).layers) == 6


@pytest.mark.parametrize(("chunk_size", "block_size"), [(1, 4), (None, 4)])
def test_falcon_h1_harness(llm_case, chunk_size, block_size):
    case = llm_case(CASE)
    model = load_model(case.folder)
    got = engine_greedy(model, case.prompts, NUM_NEW, chunk_size=chunk_size, block_size=block_size)
    assert got == case.expected


@pytest.fixture(scope="module", params=[True, False], ids=["norm_before_gate", "gate_first"])
def falcon_h1_rms_norm(request, tmp_path_factory):
    """The optional Mamba2 output norm (both orders), biases everywhere, and
    ``mamba_d_ssm`` null (intermediate = expand x hidden)."""
    config = transformers.FalconH1Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_d_ssm=None,
        mamba_n_heads=8,
        mamba_d_state=8,
        mamba_n_groups=2,
        mamba_chunk_size=16,
        mamba_rms_norm=True,
        mamba_norm_before_gate=request.param,
        mamba_proj_bias=True,
        projectors_bias=True,
        attention_bias=True,
        mlp_bias=True,
        key_multiplier=1.5,
        ssm_multipliers=[1.2, 0.9, 1.1, 0.8, 1.3],
        initializer_range=0.1,
    )
    folder = tmp_path_factory.mktemp("falcon_h1_norm")
    hf = save_tiny(transformers.FalconH1ForCausalLM, config, folder)
    _perturb(hf, ("norm", "bias"), scale=0.3)
    hf.save_pretrained(folder)
    prompts = prompts_for(config.vocab_size)
    return load_model(folder), prompts, hf_greedy(hf, prompts, NUM_NEW)


@pytest.mark.parametrize(("chunk_size", "block_size"), [(1, 4), (None, 16)])
def test_falcon_h1_mamba_norm_harness(falcon_h1_rms_norm, chunk_size, block_size):
    model, prompts, expected = falcon_h1_rms_norm
    got = engine_greedy(model, prompts, NUM_NEW, chunk_size=chunk_size, block_size=block_size)
    assert got == expected


# LLM-level tests (planned cache) for this case: tests/exactness/test_llm_more_archs.py
