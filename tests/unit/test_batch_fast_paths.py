"""The batch calls' inline fast paths and their fallbacks (`CacheManager.allocate_batch`,
`commit_batch`): a batch with one bad value falls back to per-request checks that name
the culprit, and everything before it in the batch is done exactly as one call at a
time would do it."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cache import NO_CHANGE, CacheManager
from hybridkv.cache.block import NULL_BLOCK
from hybridkv.cache.toy import ToyGroup, toy_plan
from hybridkv.cache.validate import all_counts, all_valid_token_lists
from hybridkv.errors import CacheError

FULL4 = ToyGroup("full", 4)


def _running(num: int, prompt_tokens: int = 6) -> CacheManager:
    cm = CacheManager(toy_plan([FULL4], num_blocks=64))
    for i in range(num):
        req = f"r{i}"
        cm.add_request(req, [100 * i + t + 1 for t in range(prompt_tokens)])
        cm.lookup(req)
        cm.allocate(req, prompt_tokens)
        cm.commit(req, 0, [7])
    return cm


def test_batch_validators_accept_plain_ints_only() -> None:
    assert all_counts([0, 1, 5]) and all_counts([])
    assert not all_counts([1, True]) and not all_counts([1, -1]) and not all_counts([1.0])
    assert not all_counts([1 << 63]) and all_counts([(1 << 63) - 1])
    assert not all_counts([np.int64(1)])  # valid, but judged one by one (`check_count`)
    assert all_valid_token_lists([[1, 2], (3,), []])
    assert not all_valid_token_lists([[1], [-1]])
    assert not all_valid_token_lists([[1], [1 << 63]])
    assert not all_valid_token_lists([[1], [2.0]])
    assert not all_valid_token_lists([[1], "ab"])
    assert not all_valid_token_lists([[1], np.array([2])])


def test_commit_batch_with_one_bad_token_commits_those_before_it() -> None:
    cm = _running(3)
    cm.allocate_batch(["r0", "r1", "r2"], [1, 1, 1], [0, 0, 0])
    with pytest.raises(CacheError, match=r"'r1'.*new_token_ids\[0\] = -5"):
        cm.commit_batch(["r0", "r1", "r2"], [0, 0, 0], [[8], [-5], [8]])
    assert [cm.num_computed_tokens(r) for r in ("r0", "r1", "r2")] == [7, 6, 6]
    assert cm.token_ids("r1")[-1] == 7  # the refused id was not appended
    cm.commit_batch(["r1", "r2"], [0, 0], [[8], [8]])  # still pending: commit now
    assert [cm.num_computed_tokens(r) for r in ("r1", "r2")] == [7, 7]
    cm.check_invariants()


def test_allocate_batch_with_a_bool_count_allocates_those_before_it() -> None:
    cm = _running(3)
    with pytest.raises(CacheError, match=r"'r1': num_new_tokens must be a non-negative int"):
        cm.allocate_batch(["r0", "r1", "r2"], [1, True, 1], [0, 0, 0])
    cm.commit("r0", 0, [8])  # r0's step was allocated; r1's and r2's were not
    with pytest.raises(CacheError, match="without an allocated step"):
        cm.commit("r2", 0, [8])
    cm.check_invariants()


def test_numpy_counts_take_the_checked_path_with_the_same_result() -> None:
    plain, numpy_counts = _running(2), _running(2)
    a = plain.allocate_batch(["r0", "r1"], [1, 1], [2, 3])
    b = numpy_counts.allocate_batch(["r0", "r1"], [np.int64(1)] * 2, [np.int64(2), np.int64(3)])
    assert a == b
    assert [d.new_block_ids() for d in a] == [{0: [5]}, {0: [6]}]  # r0 holds 1, 2; r1 holds 3, 4
    for cm in (plain, numpy_counts):
        cm.commit_batch(["r0", "r1"], [np.int64(2), 1], [[8, 9, 10], [8, 9]])
        assert [cm.num_computed_tokens(r) for r in ("r0", "r1")] == [9, 8]
        cm.check_invariants()


def test_a_released_position_forces_the_next_delta_even_when_no_block_is_needed() -> None:
    """Sliding window 5, block 4: the commit that reaches c = 8 releases block 0 while
    the table already holds block 2 (taken for drafts); the next step needs no block but
    must still hand out the nulled position (the fast path is closed until then)."""
    cm = CacheManager(toy_plan([ToyGroup("sliding", 4, 5)], num_blocks=16))
    cm.add_request("a", [1, 2, 3, 4, 5, 6, 7])
    cm.lookup("a")
    cm.allocate("a", 7)  # positions 0..6: blocks 1, 2
    cm.commit("a", 0, [8])  # c = 7
    grown = cm.allocate("a", 1, 3)  # position 7 + drafts 8..10: block 3
    assert grown.groups[0] == (2, (3,), None)
    cm.commit("a", 0, [9])  # c = 8: the next token reads 4..8, block 0 leaves
    cm.check_invariants()
    step = cm.allocate("a", 1)  # position 8 sits in block 3, already held
    assert step is not NO_CHANGE and step.taken == {}
    assert step.groups[0] == (3, (), (0, 1))
    assert cm.block_table("a", 0) == [NULL_BLOCK, 2, 3]
    cm.commit("a", 0, [10])
    assert cm.allocate("a", 1) is NO_CHANGE  # nothing owed any more: the fast path
    cm.check_invariants()
