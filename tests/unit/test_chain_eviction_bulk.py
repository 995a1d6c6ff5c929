"""The chain policy's eviction bookkeeping (issue 25, eleventh session): the ghost index
keeps the order of a plain dict trimmed from its oldest entry, and bulk evictions
(`BlockPool.take_many`) take the same victims, in the same order, with the same side
effects as one `take` per block."""

from __future__ import annotations

import random

import pytest

from hybridkv.cache.block_pool import BlockPool
from hybridkv.cache.events import BLOCK_REMOVED, CacheEvent
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
    pool = BlockPool(plan_, events, eviction_policy="chain")
    assert pool.ghosts is not None
    ref: dict[tuple[int, bytes], bool] = {}
    seen = 0
    evicted_keys: list[bytes] = []
    for salt in range(200):
        _fill_and_release(pool, rng, rng.randint(1, 6), salt)
        for event in events[seen:]:
            if event.kind == BLOCK_REMOVED:
                key = (event.group_id, event.block_hash)
                ref[key] = True
                if len(ref) > pool.num_blocks:
                    del ref[next(iter(ref))]
                evicted_keys.append(event.block_hash)
        seen = len(events)
        if evicted_keys and rng.random() < 0.4:  # a lookup that misses an evicted key
            key_hash = rng.choice(evicted_keys)
            assert pool.lookup(0, key_hash) is None
            ref.pop((0, key_hash), None)
        assert list(pool.ghosts) == list(ref)
    assert pool.num_evictions > 3 * pool.num_blocks  # the bound was hit many times


@pytest.mark.parametrize("seed", range(6))
def test_bulk_chain_evictions_match_single_takes(seed: int) -> None:
    """`take_many` on two pools, one per block on a third: same blocks, events,
    ghosts and free-queue state."""
    plan_ = PoolPlan(pool_id=0, page_bytes=1, num_pages=24, num_tensors=1, group_ids=(0,))
    events: list[list[CacheEvent]] = [[], []]
    pools = [BlockPool(plan_, events[i], eviction_policy="chain") for i in range(2)]
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


def _queue_state(pool: BlockPool) -> tuple:
    free = pool.free
    return (
        free.fresh_ids(),
        [free.tier_ids(tier) for tier in range(3)],
        free.loops.clock,
        list(free.loops.freed),
        [free.tier_of(b) for b in range(pool.num_blocks)],
        list(pool.ref_counts),
    )


@pytest.mark.parametrize("seed", range(6))
def test_release_groups_match_one_release_many_per_group(seed: int) -> None:
    """A request's groups released in one `release_groups` call: the same free queue
    (order, tiers, release times, loop clock) as one `release_many` per group; empty
    segments and segments that free nothing tick no clock in either."""
    rng = random.Random(seed)
    plan_ = PoolPlan(pool_id=0, page_bytes=1, num_pages=40, num_tensors=1, group_ids=(0, 1, 2))
    pools = [BlockPool(plan_, None, eviction_policy="chain") for _ in range(2)]
    for salt in range(30):
        segments: list[list[int]] = []
        for group in range(3):
            n = rng.randint(0, 4)
            blocks = [pools[0].take_many(n), pools[1].take_many(n)]
            assert blocks[0] == blocks[1]
            for i, block in enumerate(blocks[0]):
                if rng.random() < 0.6:
                    key = f"{salt}-{group}-{i}".encode()
                    for pool in pools:
                        pool.cache(block, group, key, 16)
            if blocks[0] and rng.random() < 0.3:  # a second reference: frees nothing
                for pool in pools:
                    pool.touch_many(blocks[0][:1])  # type: ignore[arg-type]
            segments.append(blocks[0] + [0] * rng.randint(0, 1))  # null blocks skipped
        pools[0].releasing_hot = pools[1].releasing_hot = rng.random() < 0.3
        pools[0].release_groups(segments)
        for segment in segments:
            pools[1].release_many(segment)
        pools[0].releasing_hot = pools[1].releasing_hot = False
        assert _queue_state(pools[0]) == _queue_state(pools[1])

    # the touched blocks still hold a reference: release them the same way
    held = [b for b in range(1, 40) if pools[0].ref_counts[b]]
    pools[0].release_groups([held[:3], held[3:]])
    pools[1].release_many(held[:3])
    pools[1].release_many(held[3:])
    assert _queue_state(pools[0]) == _queue_state(pools[1])
