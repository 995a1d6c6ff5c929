"""The chain policy's eviction bookkeeping (issue 25, eleventh session): the ghost index
keeps the order of a plain dict trimmed from its oldest entry, and bulk evictions
(`BlockPool.take_many`) take the same victims, in the same order, with the same side
effects as one `take` per block."""

from __future__ import annotations

import random

import pytest

from hybridkv.cache.block_pool import BlockPool
from hybridkv.cache.events import BLOCK_REMOVED, CacheEvent
from hybridkv.cache.rules import CacheRules
from hybridkv.plan.types import PoolPlan


def _fill_and_release(pool: BlockPool, rng: random.Random, num: int, salt: int) -> list[int]:
    """Take ``num`` blocks, cache each under a fresh hash, release them (one burst)."""
    blocks = pool.take_many(num)
    for i, block in enumerate(blocks):
        pool.cache(block, 0, f"{salt}-{i}-{rng.random()}".encode(), 16)
    if rng.random() < 0.3:  # a hit on some of them before the release: protected tier
        pool.touch_many(blocks[: len(blocks) // 2])
        pool.release_many(blocks[: len(blocks) // 2])
    pool.release_many(blocks)
    return blocks


def test_ghosts_keep_plain_dict_order() -> None:
    """Reference: a plain dict, trimmed with ``del d[next(iter(d))]``, fed the same
    evictions (from the pool's events) and lookups."""
    rng = random.Random(3)
    plan_ = PoolPlan(pool_id=0, page_bytes=1, num_pages=9, num_tensors=1, group_ids=(0,))
    events: list[CacheEvent] = []
    pool = BlockPool(plan_, events, CacheRules(eviction_policy="chain"))
    assert pool.ghosts is not None
    ref: dict[bytes, bool] = {}
    seen = 0
    evicted_keys: list[bytes] = []
    for salt in range(200):
        _fill_and_release(pool, rng, rng.randint(1, 6), salt)
        for event in events[seen:]:
            if event.kind == BLOCK_REMOVED:
                key = pool.ghost_key(event.group_id, event.block_hash)
                ref[key] = True
                if len(ref) > pool.num_blocks:
                    del ref[next(iter(ref))]
                evicted_keys.append(event.block_hash)
        seen = len(events)
        if evicted_keys and rng.random() < 0.4:  # a lookup that misses an evicted key
            key_hash = rng.choice(evicted_keys)
            assert pool.lookup(0, key_hash) is None
            ref.pop(pool.ghost_key(0, key_hash), None)
        assert list(pool.ghosts) == list(ref)
    assert pool.num_evictions > 3 * pool.num_blocks  # the bound was hit many times


@pytest.mark.parametrize("seed", range(6))
def test_bulk_chain_evictions_match_single_takes(seed: int) -> None:
    """`take_many` on two pools, one per block on a third: same blocks, events,
    ghosts and free-queue state."""
    plan_ = PoolPlan(pool_id=0, page_bytes=1, num_pages=24, num_tensors=1, group_ids=(0,))
    events: list[list[CacheEvent]] = [[], []]
    pools = [BlockPool(plan_, events[i], CacheRules(eviction_policy="chain")) for i in range(2)]
    rngs = [random.Random(seed), random.Random(seed)]
    for salt in range(60):
        n = rngs[0].randint(1, 12)
        rngs[1].randint(1, 12)
        # pool 0 takes in bulk; pool 1 one block at a time
        bulk = pools[0].take_many(n)
        single = [pools[1].take() for _ in range(n)]
        assert bulk == single
        for pool, rng, blocks in ((pools[0], rngs[0], bulk), (pools[1], rngs[1], single)):
            for i, block in enumerate(blocks):
                pool.cache(block, 0, f"{salt}-{i}-{rng.random()}".encode(), 16)
            if rng.random() < 0.3:
                pool.touch_many(blocks[: len(blocks) // 2])
                pool.release_many(blocks[: len(blocks) // 2])
            pool.release_many(blocks)
        assert events[0] == events[1]
        assert pools[0].ghosts == pools[1].ghosts
        assert list(pools[0].ghosts or ()) == list(pools[1].ghosts or ())
        assert pools[0].free.fresh_ids() == pools[1].free.fresh_ids()
    assert pools[0].num_evictions == pools[1].num_evictions > 0
