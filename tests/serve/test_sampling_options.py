"""The engine side of the API's sampling options: logits processing (penalties,
min_tokens, top_k / top_p / min_p) against the formulas written out here, parameter
checks, and prompt / output logprobs through `LLM` with chunked prefill and preemption
against transformers' log-softmax (float32, the demo's hybrid main model)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine.sampling.logits_process import process_rows  # noqa: E402
from hybridkv.engine.sampling.logprobs import token_logprobs  # noqa: E402
from hybridkv.engine.sampling.sampler import SamplingParams  # noqa: E402
from hybridkv.errors import EngineError  # noqa: E402

VOCAB = 12


def rows(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_penalties_follow_openai_and_ctrl_formulas_row_by_row():
    """Row j's history is the output plus the first j drafts."""
    logits = rows(3)
    params = SamplingParams(8, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5)
    prompt, output, drafts = [1, 2], [3, 3, 4], [5, 3]
    out = process_rows(logits, params, prompt, output, drafts, frozenset())
    for j in range(3):
        history = output + drafts[:j]
        for t in range(VOCAB):
            x = float(logits[j, t])
            if t in prompt or t in history:
                x = x / 1.5 if x > 0 else x * 1.5
            count = history.count(t)
            x -= 0.25 * count + 0.5 * (count > 0)
            assert float(out[j, t]) == pytest.approx(x, abs=1e-5), (j, t)


def test_min_tokens_masks_stop_ids_until_enough_were_emitted():
    logits = rows(3)
    params = SamplingParams(8, min_tokens=3)
    out = process_rows(logits, params, [1], [7, 8], [9, 10], frozenset({0, 11}))
    # row 0: 2 emitted < 3 -> masked; rows 1, 2: 3 and 4 -> free
    assert torch.isinf(out[0, [0, 11]]).all() and torch.isfinite(out[0, 1:11]).all()
    assert torch.equal(out[1:], logits[1:])


@pytest.mark.parametrize(
    "option",
    [{"top_k": 3}, {"top_p": 0.6}, {"min_p": 0.2}, {"top_k": 5, "top_p": 0.5, "min_p": 0.05}],
)
def test_filters_keep_the_documented_set(option):
    logits = rows(1, seed=4)
    params = SamplingParams(4, temperature=0.7, **option)
    out = process_rows(logits, params, [0], [], [], frozenset())
    probs = torch.softmax(logits[0] / 0.7, dim=-1).tolist()
    order = sorted(range(VOCAB), key=lambda t: -probs[t])
    keep = [t for t in order if probs[t] >= option.get("min_p", 0.0) * probs[order[0]]]
    keep = keep[: option.get("top_k", VOCAB)]
    mass = sum(probs[t] for t in keep)
    nucleus, total = [], 0.0
    for t in keep:
        if total < option.get("top_p", 1.0) * mass or not nucleus:
            nucleus.append(t)
        total += probs[t]
    kept = [t for t in range(VOCAB) if math.isfinite(float(out[0, t]))]
    assert sorted(kept) == sorted(nucleus)
    assert torch.equal(out[0, kept], logits[0, kept])  # unscaled: the sampler divides by T


def test_greedy_rows_are_not_filtered_and_defaults_change_nothing():
    logits = rows(2)
    greedy = SamplingParams(4, top_k=1, top_p=0.1)
    assert not greedy.filtered and not greedy.penalized
    assert torch.equal(process_rows(logits, greedy, [0], [], [1], frozenset({0})), logits)


@pytest.mark.parametrize(
    "bad",
    [
        {"top_p": 0.0},
        {"top_k": -1},
        {"min_p": 1.5},
        {"min_tokens": 9},
        {"presence_penalty": 2.5},
        {"repetition_penalty": 0.0},
        {"logprobs": -1},
    ],
)
def test_bad_sampling_params_name_the_field(bad):
    with pytest.raises(EngineError, match=next(iter(bad))):
        SamplingParams(8, **bad)


def test_token_logprobs_rank_and_top_k():
    logits = rows(2)
    items = token_logprobs(logits, [3, 5], 2)
    lp = torch.log_softmax(logits, dim=-1)
    for item, row, token in zip(items, lp, [3, 5], strict=True):
        assert item.logprob == pytest.approx(float(row[token]))
        assert item.rank == 1 + int((row > row[token]).sum())
        assert [t for t, _ in item.top] == row.topk(2).indices.tolist()


@pytest.fixture(scope="module")
def demo_main():
    pytest.importorskip("transformers")
    from hybridkv.cli.engine import load_llm

    torch.set_num_threads(1)
    # 16-token chunks: the prompt's logprobs come from several prefill steps
    return load_llm("demo", chunk_size=16, max_num_seqs=4)


def test_prompt_logprobs_across_chunks_and_a_preemption_equal_transformers(demo_main):
    import transformers

    from hybridkv.demo import HEADER

    llm = demo_main
    prompt = llm.encode(HEADER[:150])
    params = SamplingParams(6, logprobs=2, prompt_logprobs=3)
    req = llm.add_request(prompt, params)
    steps = 0
    while not req.done:
        llm.step()
        steps += 1
        if steps == 3:  # mid-prefill: drop its blocks, recompute from scratch (between
            llm.scheduler._preempt(req)  # steps, as the scheduler does when blocks run out)
    result = llm.result(req, release=True)
    assert result.stats.num_preemptions == 1 and result.stats.prefix_hit_tokens == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(llm.model_path, dtype=torch.float32)
    ids = prompt + result.token_ids
    with torch.no_grad():
        lp = torch.log_softmax(hf.eval()(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert result.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        item = result.prompt_logprobs[i]
        assert item.token_id == prompt[i]
        assert item.logprob == pytest.approx(float(lp[i - 1, prompt[i]]), abs=1e-4)
        assert [t for t, _ in item.top] == lp[i - 1].topk(3).indices.tolist()
    assert result.token_ids == lp[len(prompt) - 1 : -1].argmax(-1).tolist()  # greedy
    for k, item in enumerate(result.logprobs):
        row = lp[len(prompt) - 1 + k]
        assert item.logprob == pytest.approx(float(row[item.token_id]), abs=1e-4)
    assert llm.stepper.logprobs.get(req.req_id, len(prompt)) == (None, None)  # released
