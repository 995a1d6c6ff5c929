"""`CacheManager.reserve_next`: the blocks of a step scheduled before the pending step's
accepted count is known (vLLM's async scheduling with drafts), with exact block ids."""

from __future__ import annotations

import pytest

from hybridkv.cache import CacheManager
from hybridkv.errors import CacheError
from hybridkv.vllm.kv_plan import VllmGroup, plan_for_vllm

B = 4  # block size of both groups
K = 2  # speculative tokens


def _cache(state_layout: str = "columns") -> CacheManager:
    plan = plan_for_vllm(
        [VllmGroup(0, "full", B), VllmGroup(1, "state", B)],
        num_blocks=40,
        num_spec_tokens=K,
        prefix_caching=True,
        state_mode="align",
    )
    return CacheManager(
        plan, checkpoints_inside_steps=False, state_layout=state_layout, checkpoint_rules=()
    )


def _decoding(cache: CacheManager) -> None:
    """Request "a": a 7-token prompt computed, one token sampled (c = 7 of 8 tokens)."""
    cache.add_request("a", list(range(1, 8)))
    cache.lookup("a")
    cache.allocate("a", 7)
    cache.commit("a", 0, [50])


@pytest.mark.parametrize("accepted", [0, 1, 2])
def test_step_ahead_holds_the_latest_start(accepted: int) -> None:
    cache = _cache()
    _decoding(cache)
    assert cache.block_table("a", 0) == [1, 2]
    # step k: token 7 and 2 drafts (positions 8, 9): the worker's running column moves
    # from 1 to 2 (ceil(10 / 4) - 1), K scratch columns after it; column 0 is null
    step = cache.allocate("a", 1, K)
    assert step is not None and step.taken == {0: (6,), 1: (7,)}
    assert cache.state_slots("a", 1).columns == (0, 3, 4, 5, 7)
    # step k + 1 before k's output: it starts at 9 + a for a in 0..2, 1 token + 2 drafts,
    # so it may end at 13 (attention: 4 blocks) and run in column 3 (+ K scratch)
    ahead = cache.reserve_next("a", 1, K)
    assert ahead is not None and ahead.taken == {0: (8,), 1: (9,)}
    assert cache.block_table("a", 0) == [1, 2, 6, 8]
    assert cache.state_slots("a", 1).columns == (0, 3, 4, 5, 7, 9)
    assert cache.num_computed_tokens("a") == 7  # nothing committed
    cache.check_invariants()
    # k's output: a accepted, the sample after them; k + 1 at its real start takes
    # nothing the worker was not given with it
    cache.commit("a", accepted, [60 + i for i in range(accepted + 1)])
    assert cache.num_computed_tokens("a") == 8 + accepted
    step = cache.allocate("a", 1, K)
    assert step is not None and not step.taken and not step.copies
    assert cache.block_table("a", 0) == [1, 2, 6, 8]
    assert cache.state_slots("a", 1).columns == (0, 3, 4, 5, 7, 9)
    cache.check_invariants()
    cache.free("a")
    cache.check_invariants()
    assert cache.usage() == 0.0


def test_reserve_next_needs_a_pending_step() -> None:
    cache = _cache()
    _decoding(cache)
    with pytest.raises(CacheError, match="no step is pending"):
        cache.reserve_next("a", 1, K)


def test_slots_layout_holds_no_step_ahead() -> None:
    """hybridkv's own engine (state slots) never schedules a step ahead: refused."""
    cache = _cache("slots")
    _decoding(cache)
    cache.allocate("a", 1, K)
    with pytest.raises(CacheError, match="cannot hold blocks for a step ahead"):
        cache.reserve_next("a", 1, K)


def test_reserve_next_that_does_not_fit_changes_nothing() -> None:
    cache = _cache()
    _decoding(cache)
    cache.allocate("a", 1, K)
    cache.add_request("b", list(range(100, 100 + 4 * 30)))
    cache.lookup("b")
    free = cache.num_free_blocks(0)
    assert cache.allocate("b", 4 * (free - 3)) is not None  # leaves one block
    assert cache.num_free_blocks(0) < 2
    before = cache.block_table("a", 0), cache.state_slots("a", 1).columns
    assert cache.reserve_next("a", 1, K) is None
    assert (cache.block_table("a", 0), cache.state_slots("a", 1).columns) == before
    cache.check_invariants()
