"""Greedy sampling for a whole step at once equals per-request argmax and verification."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine.sampling.sampler import greedy_ids, sample  # noqa: E402
from hybridkv.engine.speculative.verify import accept_greedy, verify_greedy  # noqa: E402


@pytest.mark.parametrize("seed", range(5))
def test_greedy_ids_match_per_request_verification(seed):
    gen = torch.Generator().manual_seed(seed)
    rows = [1, 3, 1, 5, 2]
    logits = [torch.randn(n, 11, generator=gen) for n in rows]
    logits[0][0, 4] = logits[0][0, 7] = 99.0  # a tie: the first index wins, as argmax
    best = greedy_ids(logits)
    assert [len(b) for b in best] == rows
    assert best[0] == [4]
    for per_req, ids in zip(logits, best, strict=True):
        assert ids[-1] == sample(per_req[-1], 0.0, None)
        drafts = [int(t) for t in torch.randint(0, 11, (per_req.shape[0] - 1,), generator=gen)]
        drafts[: len(drafts) // 2] = ids[: len(drafts) // 2]  # some accepted prefix
        assert accept_greedy(ids, drafts) == verify_greedy(per_req, drafts)
    assert greedy_ids([]) == []
