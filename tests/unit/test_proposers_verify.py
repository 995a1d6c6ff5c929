"""Proposers (n-gram, suffix) and verification (greedy, speculative sampling)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine.speculative.proposers import NgramProposer, SuffixProposer  # noqa: E402
from hybridkv.engine.speculative.verify import verify_greedy, verify_sampling  # noqa: E402


def test_ngram_copies_what_followed_the_latest_match() -> None:
    tokens = [1, 2, 3, 4, 9, 9, 1, 2, 3]
    assert NgramProposer(max_n=3).propose("r", tokens, 2) == [4, 9]
    assert NgramProposer(max_n=3).propose("r", [5, 6, 7], 2) == []
    # the latest occurrence wins
    assert NgramProposer(min_n=1, max_n=1).propose("r", [7, 1, 7, 2, 7], 1) == [2]


def test_suffix_draft_count_follows_match_length() -> None:
    proposer = SuffixProposer(min_match=2)
    assert proposer.propose("r", [1, 2, 3, 4, 5, 1, 2], 8) == [3]  # 2-token match: 1 draft
    assert proposer.propose("r", [1, 2, 3, 4, 5, 6, 1, 2, 3, 4], 8) == [5, 6, 1]
    assert proposer.propose("r", [1, 2, 3, 4, 5, 6, 1, 2, 3, 4], 2) == [5, 6]  # capped at K
    assert proposer.propose("r", [1, 2, 3], 8) == []  # no match: zero drafts


def test_greedy_accepts_longest_matching_prefix_plus_bonus() -> None:
    logits = torch.full((4, 10), -5.0)
    for pos, best in enumerate([3, 7, 2, 8]):
        logits[pos, best] = 5.0
    assert verify_greedy(logits, [3, 7, 2]).token_ids == [3, 7, 2, 8]
    v = verify_greedy(logits, [3, 1, 2])
    assert (v.num_accepted, v.token_ids) == (1, [3, 7])
    assert verify_greedy(logits[:1], []).token_ids == [3]


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_speculative_sampling_matches_main_distribution(with_draft_probs: bool) -> None:
    """The first emitted token is distributed as p0, and the second (when the first
    draft was accepted) as p1: speculative sampling does not change the output law."""
    gen = torch.Generator().manual_seed(0)
    vocab, trials = 5, 8000
    logits = torch.tensor(
        [[1.0, 0.2, -0.5, 0.7, 0.0], [0.1, 1.2, 0.3, -1.0, 0.4], [0.0, 0.0, 0.0, 0.0, 0.0]]
    )
    p = torch.softmax(logits.double(), dim=-1)
    q = torch.softmax(
        torch.tensor([[0.0, 1.0, 0.5, -0.3, 0.2], [0.9, 0.0, -0.2, 0.3, 0.1]], dtype=torch.float64),
        dim=-1,
    )
    first = torch.zeros(vocab, dtype=torch.float64)
    second = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(trials):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        verdict = verify_sampling(logits, drafts, 1.0, gen, q if with_draft_probs else None)
        first[verdict.token_ids[0]] += 1
        if len(verdict.token_ids) >= 2:
            second[verdict.token_ids[1]] += 1
    assert (first / trials - p[0]).abs().max() < 0.025
    assert (second / second.sum() - p[1]).abs().max() < 0.03


def test_suffix_in_a_loop_copies_from_a_period_back_not_the_overlapping_match():
    """In a loop the latest occurrence of the suffix overlaps the end (2 tokens follow
    it); the proposer takes an earlier one with enough continuation for every draft
    the match earned (before: 2 drafts, however long the loop)."""
    loop = [7, 8] * 12
    drafts = SuffixProposer(min_match=2, max_match=8).propose("r", loop, 6)
    # longest suffix tried: 8 tokens -> earns 7 drafts, K = 6; an occurrence followed by
    # >= 6 tokens exists (start 10), so all 6 are proposed and continue the loop
    assert drafts == [7, 8, 7, 8, 7, 8]
