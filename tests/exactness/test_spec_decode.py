"""Speculative decoding through `LLM` keeps greedy output token-for-token equal to
transformers (and to the engine without it), for every proposer: a separate draft model
(dense on a Gated DeltaNet main, or the main's own checkpoint so drafts are accepted),
n-gram and suffix lookup, and a scripted oracle that forces any draft pattern. Also:
rejected drafts never reach the prefix cache, preemption mid-speculation, and a warm
prefix cache under suffix decoding."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llm_support import BUILDERS, NUM_NEW  # noqa: E402

from hybridkv.cache.events import BLOCK_STORED  # noqa: E402
from hybridkv.engine import LLM  # noqa: E402
from hybridkv.engine.sampling.sampler import SamplingParams  # noqa: E402

MODELS = sorted(BUILDERS)
K = 4


def tokens(llm, prompts, num_new=NUM_NEW):
    return [r.token_ids for r in llm.generate(prompts, num_new)]


class OracleProposer:
    """Proposes the main model's own greedy continuation (known in advance), following
    a script of ``(num_drafts, num_correct)`` per call: ``num_correct`` true tokens, then
    wrong ones (the true token + 1) up to ``num_drafts``. Counts cycle per request."""

    name = "oracle"

    def __init__(self, prompts, expected, script: Sequence[tuple[int, int]], vocab: int):
        self.full = [list(p) + list(e) for p, e in zip(prompts, expected, strict=True)]
        self.script = list(script)
        self.vocab = vocab
        self.calls: dict[str, int] = {}
        self.proposed: list[int] = []

    def propose(self, request_id, token_ids, max_num_tokens):
        i = self.calls.get(request_id, 0)
        self.calls[request_id] = i + 1
        num, correct = self.script[i % len(self.script)]
        num = min(num, max_num_tokens)
        full = next(f for f in self.full if f[: len(token_ids)] == list(token_ids))
        truth = full[len(token_ids) : len(token_ids) + num]
        drafts = [t if j < correct else (t + 1) % self.vocab for j, t in enumerate(truth)]
        self.proposed.append(len(drafts))
        return drafts

    def forget(self, request_id):
        return None


# K drafts all right -> 0 drafts; falling K..1 and back, some with rejections.
SCRIPT = [
    (K, K),
    (0, 0),
    (K, K),
    (3, 3),
    (2, 2),
    (1, 1),
    (0, 0),
    (1, 1),
    (K, 2),
    (K, K),
    (2, 0),
    (K, K),
    (0, 0),
]


@pytest.fixture(scope="module")
def qwen3_draft(llm_case):
    """A dense Qwen3 checkpoint with the tiny models' vocabulary (a real, disagreeing draft)."""
    return llm_case("qwen3").folder


def test_dense_draft_on_gated_deltanet_main_matches_transformers(llm_case, qwen3_draft):
    case = llm_case("qwen3_5")
    llm = LLM(
        case.folder, draft=qwen3_draft, num_spec_tokens=K, chunk_size=7, max_num_batched_tokens=64
    )
    assert {g.model for g in llm.plan.groups} == {"main", "draft"}
    assert tokens(llm, case.prompts) == case.expected
    s = llm.stats()
    assert s.spec_method == "draft" and s.num_proposed_tokens > 0
    assert s.num_verify_steps > 0 and s.mean_accepted_length >= 1.0
    # a second round is served from the prefix cache (both models' groups hit)
    warm = llm.generate(case.prompts, NUM_NEW)
    assert [r.token_ids for r in warm] == case.expected
    assert sum(r.stats.prefix_hit_tokens for r in warm) > 0
    llm.manager.check_invariants()


@pytest.mark.parametrize("name", MODELS)
def test_self_draft_accepts_drafts_and_matches_transformers(llm_case, name):
    """The draft IS the main checkpoint: greedy drafts are all accepted, so the draft's
    own groups (state groups too, for hybrids) must follow the accepted positions."""
    case = llm_case(name)
    llm = LLM(case.folder, draft=case.folder, num_spec_tokens=K, chunk_size=5)
    assert tokens(llm, case.prompts) == case.expected
    s = llm.stats()
    assert s.num_accepted_tokens == s.num_proposed_tokens > 0
    assert s.mean_accepted_length > 3.0
    assert s.tokens_per_step > 2.0
    llm.manager.check_invariants()


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("name", MODELS)
def test_copy_proposers_match_transformers(llm_case, name, method):
    case = llm_case(name)
    llm = LLM(case.folder, spec_method=method, num_spec_tokens=K, chunk_size=6)
    assert tokens(llm, case.prompts) == case.expected
    assert (
        llm.stats().num_verify_steps
        == len(case.prompts) * NUM_NEW - llm.stats().num_accepted_tokens
    )


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_suffix_with_warm_prefix_cache_in_align_mode(llm_case, name):
    case = llm_case(name)
    llm = LLM(
        case.folder, spec_method="suffix", num_spec_tokens=K, chunk_size=8, state_mode="align"
    )
    assert all(g.state_mode == "align" for g in llm.plan.groups if g.kind == "state")
    assert tokens(llm, case.prompts) == case.expected
    before = llm.stats()
    assert tokens(llm, case.prompts) == case.expected
    after = llm.stats()
    assert after.prefix_hit_tokens["state"] > before.prefix_hit_tokens["state"]
    assert after.num_checkpoints_used > before.num_checkpoints_used


@pytest.mark.parametrize("name", MODELS)
def test_scripted_draft_counts_zero_after_full_accept_and_k_to_1(llm_case, name):
    """Zero-draft steps right after fully accepted steps read the accepted state, and
    draft counts falling K -> 1 -> K across small blocks change nothing."""
    case = llm_case(name)
    oracle = OracleProposer(case.prompts, case.expected, SCRIPT, 128)
    block = {} if case.hybrid else {"block_size": 4}
    llm = LLM(case.folder, proposer=oracle, num_spec_tokens=K, chunk_size=5, **block)
    assert tokens(llm, case.prompts) == case.expected
    s = llm.stats()
    assert 0 in oracle.proposed and K in oracle.proposed and 1 in oracle.proposed
    assert 0 < s.num_accepted_tokens < s.num_proposed_tokens  # some rejected
    llm.manager.check_invariants()


@pytest.mark.parametrize("name", MODELS)
def test_rejected_drafts_never_enter_the_prefix_cache(llm_case, name):
    """Every block / state checkpoint stored during runs with many rejected drafts
    covers only computed, verified tokens of the one running request; a warm round
    served from that cache is exact."""
    case = llm_case(name)
    wrong = [(K, 0), (K, 1), (3, 2), (K, K)]
    oracle = OracleProposer(case.prompts, case.expected, wrong, 128)
    block = {} if case.hybrid else {"block_size": 4}
    llm = LLM(case.folder, proposer=oracle, num_spec_tokens=K, chunk_size=4, **block)
    num_stored = 0
    for _round in range(2):
        for i in (0, 1, 5):  # one request at a time: each event is that request's
            req = llm.add_request(case.prompts[i], SamplingParams(NUM_NEW), i)
            while llm.scheduler.has_work:
                llm.step()
                for event in llm.manager.take_events():
                    if event.kind == BLOCK_STORED:
                        num_stored += 1
                        assert event.num_tokens <= req.num_computed <= req.num_tokens
            assert req.output == case.expected[i]
    assert num_stored > 0
    assert llm.stats().num_accepted_tokens < llm.stats().num_proposed_tokens
    assert llm.stats().prefix_hit_tokens["attention"] > 0
    llm.manager.check_invariants()


# Budgets (bytes) at max_model_len 128 with K = 4 spec states, measured to preempt.
TIGHT = {"qwen3": 130 << 10, "qwen3_5": 150 << 10, "gemma3": 90 << 10, "nemotron_h": 150 << 10}


@pytest.mark.parametrize("name", MODELS)
def test_preemption_mid_speculation_gives_the_same_tokens(llm_case, name):
    case = llm_case(name)
    oracle = OracleProposer(case.prompts, case.expected, SCRIPT, 128)
    tight = LLM(
        case.folder,
        proposer=oracle,
        num_spec_tokens=K,
        memory_bytes=TIGHT[name],
        chunk_size=3,
        max_model_len=128,
    )
    assert tokens(tight, case.prompts) == case.expected
    assert tight.stats().num_preemptions >= 5
    assert tight.stats().num_accepted_tokens > 0
    tight.manager.check_invariants()


def test_preemption_with_a_draft_model(llm_case):
    case = llm_case("qwen3_5")
    tight = LLM(
        case.folder,
        draft=case.folder,
        num_spec_tokens=K,
        memory_bytes=290 << 10,
        chunk_size=3,
        max_model_len=128,
    )
    assert tokens(tight, case.prompts) == case.expected
    assert tight.stats().num_preemptions >= 1
    tight.manager.check_invariants()


def test_rejection_sampling_through_the_engine_keeps_the_main_distribution(tmp_path):
    """Temperature 1 on a vocabulary of 6 with a disagreeing draft model (sampled drafts,
    q kept) and with a one-hot proposer: the first two emitted tokens are distributed
    like the main model's own sampling (exact probabilities from transformers)."""
    from exactness_harness import save_tiny

    def tiny(seed, folder):
        config = transformers.Qwen3Config(
            vocab_size=6,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
        return save_tiny(transformers.Qwen3ForCausalLM, config, folder, seed=seed)

    main = tiny(0, tmp_path / "main")
    tiny(1, tmp_path / "draft")
    prompt = [1, 2, 3, 1, 2]  # n-gram lookup proposes "3 1"

    def probs(tokens):
        with torch.no_grad():
            return torch.softmax(main(torch.tensor([tokens])).logits[0, -1].double(), -1)

    # The first token comes from the prefill; tokens 2 and 3 from speculative steps.
    p1 = probs(prompt)
    p2 = torch.stack([probs([*prompt, a]) for a in range(6)])  # [t1, t2]
    p3 = torch.stack(
        [torch.stack([probs([*prompt, a, b]) for b in range(6)]) for a in range(6)]
    )  # [t1, t2, t3]
    joint12 = p1[:, None] * p2
    want = {1: joint12.sum(0), 2: (joint12[:, :, None] * p3).sum((0, 1))}
    n = 1500
    for spec in ({"draft": tmp_path / "draft"}, {"spec_method": "ngram"}):
        llm = LLM(
            tmp_path / "main",
            num_spec_tokens=2,
            max_num_seqs=256,
            max_num_batched_tokens=2048,
            **spec,
        )
        out = llm.generate([prompt] * n, 3, temperature=1.0, seed=5)
        assert llm.stats().num_proposed_tokens > 0
        assert 0 < llm.stats().num_accepted_tokens < llm.stats().num_proposed_tokens
        for pos, dist in want.items():
            seen = torch.bincount(torch.tensor([r.token_ids[pos] for r in out]), minlength=6)
            # total variation distance; the sampling error at n = 1500 is about 0.03
            assert 0.5 * float((seen.double() / n - dist).abs().sum()) < 0.06
