"""gpt-oss (alternating sliding-window / full attention with learned softmax sinks,
YaRN rope, clamped-SwiGLU experts) matches transformers, through the harness's paged
cache (blocks that left the 8-token window are NaN null blocks) and through `LLM`."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exactness_harness import engine_greedy  # noqa: E402
from llm_support import NUM_NEW  # noqa: E402

from hybridkv.engine.models import load_model  # noqa: E402

CASE = "gpt_oss"


def test_gpt_oss_layers_match_the_planner(llm_case):
    from hybridkv.engine.models.loader import read_config
    from hybridkv.models.registry import from_hf_config

    case = llm_case(CASE)
    model = load_model(case.folder)
    assert [(d.kind, d.sliding_window) for d in model.layers] == [
        ("sliding_attention", 8),
        ("full_attention", None),
        ("sliding_attention", 8),
        ("full_attention", None),
    ]
    assert read_config(case.folder)["rope_parameters"]["rope_type"] == "yarn"
    assert model.blocks[0].mixer.rope.attention_scaling > 1.0  # YaRN's mscale
    assert len(from_hf_config(read_config(case.folder)).layers) == 4


def test_gpt_oss_sinks_matter(llm_case):
    """Dropping the sinks changes the tokens, so the exactness tests see them."""
    case = llm_case(CASE)
    model = load_model(case.folder)
    for block in model.blocks:
        block.mixer.sinks = None
    got = engine_greedy(model, case.prompts, NUM_NEW, chunk_size=None, block_size=16)
    assert got != case.expected


@pytest.mark.parametrize(("chunk_size", "block_size"), [(1, 4), (3, 16), (None, 4), (5, 4)])
def test_gpt_oss_harness(llm_case, chunk_size, block_size):
    case = llm_case(CASE)
    model = load_model(case.folder)
    got = engine_greedy(model, case.prompts, NUM_NEW, chunk_size=chunk_size, block_size=block_size)
    assert got == case.expected


# LLM-level tests (planned cache) for this case: tests/exactness/test_llm_more_archs.py
