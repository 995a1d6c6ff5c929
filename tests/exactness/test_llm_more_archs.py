"""`LLM` on the planned cache for the architectures beyond the core four: any chunk size,
a warm second round with prefix hits, and preemptions (float32, tokens vs transformers).

Each architecture's own file tests its harness runs and planner agreement.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from llm_support import NUM_NEW

from hybridkv.engine import LLM

LONG_NEW = 64
# case -> (has state layers, bytes at max_model_len 128 that force dozens of preemptions)
CASES = {
    "granite": (True, 140 << 10),
    "falcon_h1": (True, 170 << 10),
    "gpt_oss": (False, 98 << 10),
    "jamba": (True, 140 << 10),
    "lfm2": (True, 100 << 10),
}


def _llm_tokens(llm, prompts, num_new=NUM_NEW):
    return [r.token_ids for r in llm.generate(prompts, num_new)]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("chunk_size", [1, 7, None])
def test_llm_any_chunk_size(llm_case, name, chunk_size):
    case = llm_case(name)
    llm = LLM(case.folder, chunk_size=chunk_size, max_num_batched_tokens=64)
    assert _llm_tokens(llm, case.prompts) == case.expected


@pytest.mark.parametrize("name", CASES)
def test_llm_second_round_hits_prefix_cache(llm_case, name):
    case = llm_case(name)
    llm = LLM(case.folder, chunk_size=6)
    assert _llm_tokens(llm, case.prompts) == case.expected
    before = llm.stats().prefix_hit_tokens
    assert _llm_tokens(llm, case.prompts) == case.expected
    hits = llm.stats().prefix_hit_tokens
    assert hits["attention"] > before["attention"]
    if CASES[name][0]:
        assert hits["state"] > before["state"]
        assert llm.stats().num_checkpoints_used > 0
    else:
        assert hits["state"] == 0


@pytest.mark.parametrize("name", CASES)
def test_llm_preemptions_give_the_same_tokens(llm_case, name):
    case = llm_case(name)
    free = LLM(case.folder, max_model_len=128, prefix_caching=False, chunk_size=5)
    expected = _llm_tokens(free, case.prompts, LONG_NEW)
    assert [t[:NUM_NEW] for t in expected] == case.expected
    tight = LLM(case.folder, memory_bytes=CASES[name][1], chunk_size=3, max_model_len=128)
    assert _llm_tokens(tight, case.prompts, LONG_NEW) == expected  # cold cache
    assert _llm_tokens(tight, case.prompts, LONG_NEW) == expected  # warm cache
    assert tight.stats().num_preemptions >= 20
    tight.manager.check_invariants()
