"""`LLM` on the PLANNED cache (one byte buffer per pool, views per layer) and the real
`CacheManager` produces transformers' greedy tokens, in float32, for a batch of 8
prompts with shared prefixes and 32 new tokens: any chunk size, prefix caching on or
off, a second round served from the prefix cache (attention and state groups both
hit), and a memory budget so small that requests are preempted and recomputed dozens
of times."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llm_support import BUILDERS, NUM_NEW  # noqa: E402

from hybridkv.engine import LLM  # noqa: E402

MODELS = sorted(BUILDERS)
# Tight budgets (bytes) at max_model_len 128, measured to thrash with 8 requests.
TIGHT_MEMORY = {"qwen3": 120 << 10, "qwen3_5": 98 << 10, "gemma3": 98 << 10, "nemotron_h": 98 << 10}
LONG_NEW = 64  # preemption runs generate longer so requests keep growing


def tokens(llm, prompts, num_new=NUM_NEW):
    return [r.token_ids for r in llm.generate(prompts, num_new)]


@pytest.mark.parametrize("chunk_size", [1, 7, None])
@pytest.mark.parametrize("name", MODELS)
def test_llm_greedy_matches_transformers_any_chunk_size(llm_case, name, chunk_size):
    case = llm_case(name)
    llm = LLM(case.folder, chunk_size=chunk_size, max_num_batched_tokens=64)
    assert tokens(llm, case.prompts) == case.expected


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [2, 3, 5, 16, 17, 33, 61])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("name", MODELS)
def test_llm_greedy_chunk_size_sweep(llm_case, name, chunk_size, prefix_caching):
    case = llm_case(name)
    llm = LLM(case.folder, chunk_size=chunk_size, prefix_caching=prefix_caching)
    assert tokens(llm, case.prompts) == case.expected


@pytest.mark.parametrize("name", MODELS)
def test_llm_without_prefix_caching_matches_transformers(llm_case, name):
    case = llm_case(name)
    llm = LLM(case.folder, prefix_caching=False, chunk_size=5)
    assert tokens(llm, case.prompts) == case.expected
    assert llm.stats().prefix_hit_tokens == {"attention": 0, "state": 0}


@pytest.mark.parametrize("name", MODELS)
def test_llm_second_round_hits_prefix_cache_with_same_tokens(llm_case, name):
    case = llm_case(name)
    llm = LLM(case.folder, chunk_size=6)
    assert tokens(llm, case.prompts) == case.expected
    before = llm.stats().prefix_hit_tokens
    warm = llm.generate(case.prompts, NUM_NEW)
    assert [r.token_ids for r in warm] == case.expected
    hits = llm.stats().prefix_hit_tokens
    assert hits["attention"] > before["attention"]
    assert sum(r.stats.prefix_hit_tokens for r in warm) > 0
    if case.hybrid:  # every state group restored a checkpoint at the hit
        assert hits["state"] > before["state"]
        assert llm.stats().num_checkpoints_used > 0
    else:
        assert hits["state"] == 0


@pytest.mark.parametrize("name", MODELS)
def test_llm_many_preemptions_give_the_same_tokens(llm_case, name):
    """Recompute after preemption starts from a clean or restored state: tokens equal
    an unconstrained run (and transformers' for the first 32)."""
    case = llm_case(name)
    free = LLM(case.folder, max_model_len=128)
    expected = tokens(free, case.prompts, LONG_NEW)
    assert [t[:NUM_NEW] for t in expected] == case.expected
    assert free.stats().num_preemptions == 0
    tight = LLM(case.folder, memory_bytes=TIGHT_MEMORY[name], chunk_size=3, max_model_len=128)
    assert tokens(tight, case.prompts, LONG_NEW) == expected  # cold cache
    assert tokens(tight, case.prompts, LONG_NEW) == expected  # warm cache
    # Chunks end on state checkpoints (align mode), so recomputes restore more state and
    # the pool preempts less than with free chunking: nemotron_h goes from 80 to 30.
    assert tight.stats().num_preemptions >= 25
    tight.manager.check_invariants()


def test_llm_cancel_releases_blocks_and_others_continue(llm_case):
    case = llm_case("qwen3_5")
    llm = LLM(case.folder, chunk_size=4)
    from hybridkv.engine.sampling.sampler import SamplingParams

    reqs = [llm.add_request(p, SamplingParams(NUM_NEW), i) for i, p in enumerate(case.prompts)]
    for _ in range(5):
        llm.step()
    llm.cancel(reqs[1])
    llm.cancel(reqs[6])
    while llm.scheduler.has_work:
        llm.step()
    results = [llm.result(r) for r in reqs]
    assert [r.cancelled for r in results] == [i in (1, 6) for i in range(8)]
    for i, r in enumerate(results):
        if i not in (1, 6):
            assert r.token_ids == case.expected[i]
    assert llm.manager.usage() == 0.0  # cached blocks are free (evictable)
    llm.manager.check_invariants()


def test_llm_temperature_sampling_is_seeded_per_request(llm_case):
    case = llm_case("qwen3")
    a = LLM(case.folder).generate(case.prompts, 8, temperature=1.0, seed=7)
    b = LLM(case.folder, chunk_size=3, max_num_seqs=2).generate(
        case.prompts, 8, temperature=1.0, seed=7
    )
    c = LLM(case.folder).generate(case.prompts, 8, temperature=1.0, seed=8)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]
