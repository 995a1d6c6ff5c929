"""LFM2 (``lfm2``: gated short-conv state layers + q/k-normed GQA attention) matches
transformers, through the harness's hand-made paged cache and through `LLM` on the
planned cache (conv-only state groups: an empty ssm part)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exactness_harness import engine_greedy, hf_greedy, prompts_for, save_tiny  # noqa: E402
from llm_support import NUM_NEW, _perturb  # noqa: E402

from hybridkv.engine.models import load_model  # noqa: E402

CASE = "lfm2"


def test_lfm2_layers_match_the_planner(llm_case):
    from hybridkv.engine.models.loader import read_config
    from hybridkv.models.registry import decoder_layer_indices, from_hf_config

    case = llm_case(CASE)
    model = load_model(case.folder)
    assert [(d.index, d.kind, d.family) for d in model.layers] == [
        (0, "state", "short_conv"),
        (1, "full_attention", "attention"),
        (2, "state", "short_conv"),
        (3, "state", "short_conv"),
        (4, "full_attention", "attention"),
    ]
    assert model.layers[0].shapes == {"conv": (64, 2), "ssm": ()}
    assert model.layers[1].shapes == {"key": (2, 16), "value": (2, 16)}
    config = read_config(case.folder)
    assert decoder_layer_indices(config) == (0, 1, 2, 3, 4)
    specs = from_hf_config(config).layers
    assert [s.family for s in specs] == [d.family for d in model.layers]
    assert specs[0].conv_shape() == model.layers[0].shapes["conv"]
    assert tuple(specs[0].ssm_shape()) == model.layers[0].shapes["ssm"]


@pytest.mark.parametrize(("chunk_size", "block_size"), [(1, 4), (3, 16), (None, 4)])
def test_lfm2_harness(llm_case, chunk_size, block_size):
    case = llm_case(CASE)
    model = load_model(case.folder)
    got = engine_greedy(model, case.prompts, NUM_NEW, chunk_size=chunk_size, block_size=block_size)
    assert got == case.expected


@pytest.fixture(scope="module")
def lfm2_idxs_tied(tmp_path_factory):
    """``full_attn_idxs`` layout, tied head, conv bias, L_cache 4, no ff-size adjust."""
    config = transformers.Lfm2Config(
        vocab_size=128,
        hidden_size=48,
        intermediate_size=40,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        full_attn_idxs=[2],
        conv_L_cache=4,
        conv_bias=True,
        block_auto_adjust_ff_dim=False,
        tie_word_embeddings=True,
        initializer_range=0.1,
    )
    folder = tmp_path_factory.mktemp("lfm2_idxs")
    hf = save_tiny(transformers.Lfm2ForCausalLM, config, folder)
    _perturb(hf, ("norm", "conv.bias"), scale=0.3)
    hf.save_pretrained(folder)
    prompts = prompts_for(config.vocab_size)
    return load_model(folder), prompts, hf_greedy(hf, prompts, NUM_NEW)


@pytest.mark.parametrize(("chunk_size", "block_size"), [(1, 4), (None, 16)])
def test_lfm2_idxs_tied_harness(lfm2_idxs_tied, chunk_size, block_size):
    model, prompts, expected = lfm2_idxs_tied
    assert [d.kind for d in model.layers] == ["state", "state", "full_attention", "state"]
    got = engine_greedy(model, prompts, NUM_NEW, chunk_size=chunk_size, block_size=block_size)
    assert got == expected


# LLM-level tests (planned cache) for this case: tests/exactness/test_llm_more_archs.py
