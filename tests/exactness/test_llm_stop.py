"""`LLM` stops where transformers' `generate` stops: after the checkpoint's EOS id from
``generation_config.json`` (``config.json`` without one), with the EOS token in the
output; speculative decoding drops drafts accepted after it; ``ignore_eos`` and
``stop_token_ids`` behave as documented; and the cache stays consistent."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llm_support import NUM_NEW  # noqa: E402

from hybridkv.engine import LLM  # noqa: E402

K = 4


def pick_eos(expected: list[list[int]]) -> int:
    """A token that first appears mid-output in the most prompts (not at position 0)."""
    counts: Counter[int] = Counter()
    for out in expected:
        first = {}
        for i, t in enumerate(out):
            first.setdefault(t, i)
        counts.update(t for t, i in first.items() if 1 <= i < NUM_NEW - 2)
    return min(counts, key=lambda t: (-counts[t], t))


def hf_generate_from_folder(folder, prompts):
    """transformers' greedy tokens with the folder's own generation config (its EOS)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.long)
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW, do_sample=False
            )
        outs.append(out[0, ids.shape[1] :].tolist())
    return outs


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def eos_case(request, llm_case, tmp_path_factory):
    """(folder with generation_config.json eos_token_id = E, prompts, HF tokens, E, the
    no-EOS tokens)."""
    case = llm_case(request.param)
    eos = pick_eos(case.expected)
    folder = tmp_path_factory.mktemp(f"eos_{request.param}")
    for item in case.folder.iterdir():
        shutil.copy(item, folder / item.name)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [eos]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    expected = hf_generate_from_folder(folder, case.prompts)
    assert any(len(e) < NUM_NEW for e in expected), "the chosen EOS never stops transformers"
    return folder, case.prompts, expected, eos, case.expected


def check_stops(results, expected, eos):
    assert [r.token_ids for r in results] == expected
    for r in results:
        stopped = r.token_ids[-1] == eos and eos not in r.token_ids[:-1]
        assert r.finish_reason == ("stop" if stopped else "length")


def test_greedy_stops_at_eos_like_transformers(eos_case):
    folder, prompts, expected, eos, _ = eos_case
    llm = LLM(folder, chunk_size=7)
    assert llm.eos_token_ids == (eos,)
    check_stops(llm.generate(prompts, NUM_NEW), expected, eos)
    # a second, prefix-cached round stops the same way
    check_stops(llm.generate(prompts, NUM_NEW), expected, eos)
    llm.manager.check_invariants()


@pytest.mark.parametrize("how", ["self_draft", "ngram", "suffix"])
def test_speculative_drops_drafts_accepted_after_eos(eos_case, how):
    """Self-drafting accepts every draft, so EOS often sits mid-verdict: the tokens
    after it must not be emitted, counted or committed."""
    folder, prompts, expected, eos, _ = eos_case
    if how == "self_draft":
        llm = LLM(folder, draft=folder, num_spec_tokens=K, chunk_size=5)
    else:
        llm = LLM(folder, spec_method=how, num_spec_tokens=K, chunk_size=6)
    results = llm.generate(prompts, NUM_NEW)
    check_stops(results, expected, eos)
    s = llm.stats()
    assert s.num_output_tokens == sum(len(e) for e in expected)
    for r in results:
        emitted = r.stats.num_accepted_tokens + r.stats.num_verify_steps
        assert emitted == len(r.token_ids)
    check_stops(llm.generate(prompts, NUM_NEW), expected, eos)
    llm.manager.check_invariants()


def test_ignore_eos_and_stop_token_ids(eos_case):
    folder, prompts, _, _, no_eos = eos_case
    llm = LLM(folder, spec_method="ngram", num_spec_tokens=K)
    ignored = llm.generate(prompts, NUM_NEW, ignore_eos=True)
    assert [r.token_ids for r in ignored] == no_eos
    assert all(r.finish_reason == "length" for r in ignored)
    # a stop id still stops with ignore_eos; the stop token is the last output token
    stop = no_eos[0][3]
    stopped = llm.generate(prompts, NUM_NEW, ignore_eos=True, stop_token_ids=[stop])
    for r, full in zip(stopped, no_eos, strict=True):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert r.token_ids == full[:cut]
    assert stopped[0].finish_reason == "stop"
    llm.manager.check_invariants()
