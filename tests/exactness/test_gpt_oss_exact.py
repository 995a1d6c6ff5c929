"""gpt-oss (alternating sliding-window / full attention with learned softmax sinks,
YaRN rope, clamped-SwiGLU experts) matches transformers, through the harness's paged
cache (blocks that left the 8-token window are NaN null blocks) and through `LLM`."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exactness_harness import engine_greedy  # noqa: E402
from llm_support import NUM_NEW  # noqa: E402

from hybridkv.engine import LLM  # noqa: E402
from hybridkv.engine.models import load_model  # noqa: E402

CASE = "gpt_oss"
HYBRID = False
TIGHT_MEMORY = 98 << 10  # bytes at max_model_len 128: dozens of preemptions
LONG_NEW = 64


def test_gpt_oss_layers_match_the_planner(llm_case):
    from hybridkv.engine.loader import read_config
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


# ----------------------------------------------------------------------------- LLM (planned cache)


def _llm_tokens(llm, prompts, num_new=NUM_NEW):
    return [r.token_ids for r in llm.generate(prompts, num_new)]


@pytest.mark.parametrize("chunk_size", [1, 7, None])
def test_llm_any_chunk_size(llm_case, chunk_size):
    case = llm_case(CASE)
    llm = LLM(case.folder, chunk_size=chunk_size, max_num_batched_tokens=64)
    assert _llm_tokens(llm, case.prompts) == case.expected


def test_llm_second_round_hits_prefix_cache(llm_case):
    case = llm_case(CASE)
    llm = LLM(case.folder, chunk_size=6)
    assert _llm_tokens(llm, case.prompts) == case.expected
    before = llm.stats().prefix_hit_tokens
    assert _llm_tokens(llm, case.prompts) == case.expected
    hits = llm.stats().prefix_hit_tokens
    assert hits["attention"] > before["attention"]
    if HYBRID:
        assert hits["state"] > before["state"]
        assert llm.stats().num_checkpoints_used > 0
    else:
        assert hits["state"] == 0


def test_llm_preemptions_give_the_same_tokens(llm_case):
    case = llm_case(CASE)
    free = LLM(case.folder, max_model_len=128, prefix_caching=False, chunk_size=5)
    expected = _llm_tokens(free, case.prompts, LONG_NEW)
    assert [t[:NUM_NEW] for t in expected] == case.expected
    tight = LLM(case.folder, memory_bytes=TIGHT_MEMORY, chunk_size=3, max_model_len=128)
    assert _llm_tokens(tight, case.prompts, LONG_NEW) == expected  # cold cache
    assert _llm_tokens(tight, case.prompts, LONG_NEW) == expected  # warm cache
    assert tight.stats().num_preemptions >= 20
    tight.manager.check_invariants()
