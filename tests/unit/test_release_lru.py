"""`BlockPool.release_many` under lru: one fused pass (`FreeQueue.release_lru`)."""

from __future__ import annotations

import pytest

from hybridkv.cache.block_pool import BlockPool
from hybridkv.cache.rules import CacheRules
from hybridkv.errors import InvariantError
from hybridkv.ids import BlockId
from hybridkv.plan.types import PoolPlan

PLAN = PoolPlan(pool_id=0, page_bytes=1, num_pages=10, num_tensors=1, group_ids=(0,))


def _pool() -> BlockPool:
    pool = BlockPool(PLAN, None, CacheRules(eviction_policy="lru"))
    assert [pool.take() for _ in range(5)] == [1, 2, 3, 4, 5]
    for b in (1, 2, 4):
        pool.cache(BlockId(b), 0, bytes([b]), 4)
    return pool


def test_cached_blocks_join_the_newest_end_in_order_fresh_ones_the_stack() -> None:
    pool = _pool()
    pool.ref_counts[2] += 1  # shared: stays referenced
    pool.release_many([4, 0, 2, 5, 1, 3])
    assert pool.free.tier_ids(1) == [4, 1]  # probation, oldest first
    assert pool.ref_counts[2] == 1
    assert pool.free.fresh_ids() == [9, 8, 7, 6, 5, 3]  # a stack: 3 is taken next
    assert len(pool.free) == 10 - 1 - 5 + 4  # 4 untaken + 4 released (2 still held)


def test_a_block_released_while_free_raises_and_leaves_the_queue_linked() -> None:
    pool = _pool()
    pool.release_many([4])
    with pytest.raises(InvariantError, match="block 4 released while free"):
        pool.release_many([1, 4, 2])
    # block 1 was released before the bad one: linked, counted; 2 untouched
    assert pool.free.tier_ids(1) == [4, 1]
    assert pool.ref_counts[2] == 1
    pool.free.check_invariants()
