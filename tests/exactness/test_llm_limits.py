"""`LLM` limits through the one scheduler: max_model_len (default and refusal, prompts
refused with a reason, a request stopped at the limit with its drafts capped), and
per-request cache salts and priorities."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine import LLM  # noqa: E402
from hybridkv.engine.sampling.sampler import SamplingParams  # noqa: E402
from hybridkv.errors import EngineError  # noqa: E402
from hybridkv.sched import Status  # noqa: E402


def test_max_model_len_defaults_to_the_checkpoint_and_refuses_more(llm_case):
    case = llm_case("qwen3")
    positions = json.loads((case.folder / "config.json").read_text())["max_position_embeddings"]
    assert LLM(case.folder).max_model_len == min(positions, 4096)
    with pytest.raises(EngineError, match=f"max_position_embeddings {positions}"):
        LLM(case.folder, max_model_len=positions + 1)


def test_long_prompt_is_refused_and_a_request_stops_at_the_limit(llm_case):
    case = llm_case("qwen3_5")
    prompt = max(case.prompts, key=len)
    limit = len(prompt) + 5
    llm = LLM(case.folder, max_model_len=limit, spec_method="ngram", num_spec_tokens=4)
    refused = llm.add_request(list(range(limit)), SamplingParams(4))
    assert refused.status is Status.REFUSED and refused.finish_reason == "refused"
    assert f"max_model_len={limit}" in refused.refusal
    assert not llm.manager.has_request(refused.req_id)
    with pytest.raises(EngineError, match=f"max_model_len={limit}"):
        llm.generate([prompt, list(range(limit))], 4)
    (result,) = llm.generate([prompt], 50, ignore_eos=True)
    assert result.finish_reason == "length" and len(result.token_ids) == 5
    free = LLM(case.folder).generate([prompt], 5, ignore_eos=True)[0].token_ids
    assert result.token_ids == free  # the limit cuts; it does not change tokens


def test_cache_salt_isolates_prefix_hits(llm_case):
    case = llm_case("qwen3")
    llm = LLM(case.folder)
    prompt = case.prompts[0]
    params = SamplingParams(2)

    def hit(salt):
        req = llm.add_request(prompt, params, cache_salt=salt)
        while llm.scheduler.has_work:
            llm.step()
        return req.prefix_hit_tokens, req.output

    first = hit("tenant-a")
    same = hit("tenant-a")
    other = hit("tenant-b")
    assert first[0] == 0 and same[0] > 0 and other[0] == 0
    assert first[1] == same[1] == other[1]


def test_priority_orders_admission(llm_case):
    case = llm_case("qwen3")
    llm = LLM(case.folder, max_num_seqs=1)
    params = SamplingParams(1)
    late = llm.add_request(case.prompts[1], params, priority=1)
    urgent = llm.add_request(case.prompts[2], params, priority=0)
    finished = []
    while llm.scheduler.has_work:
        finished += llm.step()
    assert finished == [urgent, late]


def test_idle_step_runs_no_forward(llm_case):
    """`step()` with nothing waiting or running (before any request, after the last one
    finished) returns no finished requests; it must not run the model on an empty batch."""
    case = llm_case("qwen3_5")
    llm = LLM(case.folder)
    assert llm.step() == [] and llm.stepper.num_steps == 1
    req = llm.add_request(case.prompts[0], SamplingParams(2))
    finished = []
    while llm.scheduler.has_work:
        finished += llm.step()
    assert finished == [req]
    scheduled = llm.stats().num_scheduled_tokens
    assert llm.step() == [] and llm.step() == []
    assert llm.stats().num_scheduled_tokens == scheduled and llm.stats().num_output_tokens == 2
