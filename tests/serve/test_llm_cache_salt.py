"""`LLM.add_request` / `LLM.generate` take a per-request ``cache_salt``: a prompt only
hits blocks computed under the same salt (None is a salt of its own); the output does
not depend on the salt."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv.cli.engine import load_llm  # noqa: E402
from hybridkv.demo import HEADER  # noqa: E402
from hybridkv.errors import EngineError  # noqa: E402

pytestmark = pytest.mark.engine


@pytest.fixture()
def llm():
    torch.set_num_threads(1)
    return load_llm("demo")


def hit(llm, prompt, salt):
    result = llm.generate([prompt], 4, temperature=0.0, cache_salt=salt)[0]
    return result.stats.prefix_hit_tokens, result.token_ids


def test_same_salt_hits_other_salt_misses_and_tokens_agree(llm):
    prompt = HEADER + "def main("
    first_hit, tokens = hit(llm, prompt, "a")
    assert first_hit == 0
    assert hit(llm, prompt, "b") == (0, tokens)
    assert hit(llm, prompt, None) == (0, tokens)
    again, again_tokens = hit(llm, prompt, "a")
    assert again > 0 and again_tokens == tokens
    llm.manager.check_invariants()


def test_one_salt_per_prompt(llm):
    prompt = HEADER + "class Config:\n"
    llm.generate([prompt], 2, cache_salt="x")
    results = llm.generate([prompt, prompt], 2, cache_salt=["y", "x"])
    assert results[0].stats.prefix_hit_tokens == 0
    assert results[1].stats.prefix_hit_tokens > 0


@pytest.mark.parametrize("salt", [["a"], ["a", "b", "c"], 5, ["a", 5]])
def test_bad_salts_are_refused_before_any_request_is_added(llm, salt):
    with pytest.raises(EngineError, match="cache_salt"):
        llm.generate(["ab", "cd"], 2, cache_salt=salt)
    assert llm.num_requests() == (0, 0)
