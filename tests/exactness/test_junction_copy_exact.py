"""Junction copies (copy-on-write of the partial attention block) give transformers'
tokens: three prompts share a prefix that ends inside an attention block; the first
computes it, the second stores its state at the junction, the third hits the whole
shared prefix (a copy of the first's block slots + the state at the junction)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exactness_harness import hf_greedy  # noqa: E402
from llm_support import BUILDERS, VOCAB  # noqa: E402

from hybridkv.engine import LLM  # noqa: E402

NUM_NEW = 8


def _hf(name: str, folder):
    model_cls, _ = BUILDERS[name]()
    return model_cls.from_pretrained(folder, torch_dtype=torch.float32).eval()


def _prompts(shared_len: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    shared = draw(shared_len)
    out = []
    for tail in (23, 9, 14):
        own = draw(tail)
        while own[0] in {p[shared_len] for p in out}:  # diverge exactly at shared_len
            own = draw(tail)
        out.append(shared + own)
    return out


def _run(llm: LLM, hf, prompts: list[list[int]]) -> list[int]:
    """Each prompt alone, in order; returns the hits and checks every token."""
    hits = []
    for prompt in prompts:
        (result,) = llm.generate([prompt], NUM_NEW)
        assert result.token_ids == hf_greedy(hf, [prompt], NUM_NEW)[0]
        hits.append(result.stats.prefix_hit_tokens)
        llm.manager.check_invariants()
    return hits


@pytest.mark.slow
@pytest.mark.parametrize("spec", [None, "ngram", "draft"])
@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_mid_block_divergence_hits_by_copy_and_is_token_exact(llm_case, name, spec):
    case = llm_case(name)
    hf = _hf(name, case.folder)
    kwargs: dict = {}
    if spec == "ngram":
        kwargs = dict(spec_method="ngram", num_spec_tokens=3)
    elif spec == "draft":
        kwargs = dict(draft=llm_case("qwen3").folder, num_spec_tokens=3)
    llm = LLM(case.folder, chunk_size=16, state_mode="align", **kwargs)
    assert set(llm.manager.checkpoint_rules) == {"junction", "turn_end"}  # the defaults
    g = llm.plan.hit_granularity_tokens
    shared_len = 2 * g + g // 2 + 1  # inside the third block, past a state interval
    hits = _run(llm, hf, _prompts(shared_len))
    # first: nothing cached; second: the block boundary below (no state at the
    # junction yet: it stores one); third: the whole shared prefix, by a copy
    assert hits == [0, 2 * g, shared_len], hits
    assert llm.stepper.num_copied > 0


def test_copy_off_keeps_the_block_boundary(llm_case):
    """Control: without the junction rule the third prompt stops at the boundary."""
    case = llm_case("qwen3_5")
    hf = _hf("qwen3_5", case.folder)
    llm = LLM(case.folder, chunk_size=16, state_mode="align", checkpoint_rules=("turn_end",))
    g = llm.plan.hit_granularity_tokens
    shared_len = 2 * g + g // 2 + 1
    assert _run(llm, hf, _prompts(shared_len)) == [0, 2 * g, 2 * g]
    assert llm.stepper.num_copied == 0
