"""Steps that touch several groups of one pool at once (`Coordinator`): every group's
new blocks in one `BlockPool.take_many`, every group's blocks released in one
`BlockPool.release_many` at `free` (lru), and the other multi-group fast paths, give
exactly what one pool call per group gives: the same block ids, deltas, tables and
free queue order. The reference is the per-pool path of the same coordinator
(``_one_pool`` off), which takes and releases group by group."""

from __future__ import annotations

import random

import pytest

from hybridkv.cache import CacheManager
from hybridkv.cache.block import NULL_BLOCK
from hybridkv.cache.block_pool import BlockPool
from hybridkv.cache.managers import UNBOUNDED, FastLimits
from hybridkv.cache.toy import ToyGroup, toy_plan
from hybridkv.plan.types import PoolPlan

GROUPS = [
    ToyGroup("full", 4),
    ToyGroup("sliding", 4, span_tokens=6),
    ToyGroup("state", 4),
    ToyGroup("full", 4, model="draft"),
    ToyGroup("state", 4),
]


def _manager(policy: str, one_pool: bool, num_blocks: int = 72) -> CacheManager:
    cm = CacheManager(
        toy_plan(GROUPS, num_blocks=num_blocks, num_spec_tokens=3),
        record_events=True,
        eviction_policy=policy,
        checkpoint_rules=(),
    )
    if not one_pool:
        cm.coordinator._one_pool = False  # the per-group reference path
    return cm


def _replay(cm: CacheManager, seed: int) -> list[object]:
    """A seeded workload (shared prefixes, chunked prefill, drafts, frees) through the
    public API; returns everything observable, step by step."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    seen: list[object] = []
    running: dict[str, int] = {}  # request -> decode steps left
    num = 0
    for _ in range(120):
        if len(running) < 4 and rng.random() < 0.5:
            req = f"r{num}"
            num += 1
            prompt = rng.choice(prefixes) + [
                rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))
            ]
            cm.add_request(req, prompt)
            hit = cm.lookup(req)
            delta = cm.allocate(req, len(prompt) - hit)
            seen.append(("admit", req, hit, delta))
            if delta is None:
                cm.free(req)
                continue
            cm.commit(req, 0, [rng.randrange(1, 50)])
            running[req] = rng.randrange(2, 12)
            continue
        if not running:
            continue
        reqs = sorted(running)
        drafts = [rng.randrange(0, 4) for _ in reqs]
        deltas = cm.allocate_batch(reqs, [1] * len(reqs), drafts)
        seen.append(("allocate", reqs, deltas))
        ok = [r for r, d in zip(reqs, deltas, strict=True) if d is not None]
        accepted = [rng.randrange(0, d + 1) for r, d in zip(reqs, drafts, strict=True) if r in ok]
        cm.commit_batch(ok, accepted, [[rng.randrange(1, 50)] * (a + 1) for a in accepted])
        seen.append(("tables", [cm.block_tables(r) for r in reqs]))
        for req in reqs:
            running[req] -= 1
            if running[req] <= 0 or req not in ok:
                cm.free(req)
                del running[req]
        cm.check_invariants()
    pool = cm.coordinator.pools[0]
    seen.append(("free", pool.free.fresh_ids(), pool.free.cached_ids(), cm.stats()))
    seen.append(("events", cm.take_events()))
    return seen


@pytest.mark.parametrize("policy", ["lru", "chain"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_pool_call_per_step_equals_one_per_group(policy: str, seed: int) -> None:
    bulk = _replay(_manager(policy, one_pool=True), seed)
    per_group = _replay(_manager(policy, one_pool=False), seed)
    assert bulk == per_group
    assert any(kind == "free" for kind, *_ in bulk)


def test_a_tight_pool_evicts_the_same_blocks_either_way() -> None:
    bulk = _manager("lru", one_pool=True, num_blocks=40)
    per_group = _manager("lru", one_pool=False, num_blocks=40)
    assert _replay(bulk, 5) == _replay(per_group, 5)
    assert bulk.stats().num_evictions > 0


def test_fast_bounds_are_fast_limits_with_unbounded_for_none() -> None:
    """Full attention B 4 holding 3 blocks, 2 cached (c = 10): the table ends at 12 and
    the third block fills at 12; no bound on verified tokens or drafts. The state group
    (interval 4, 3 spec states) after the same steps: its boundary at 12 bounds verified
    tokens and, written in place, the commit; it holds all 3 spec slots (sticky spares),
    so drafts are not bounded."""
    cm = CacheManager(toy_plan([ToyGroup("full", 4), ToyGroup("state", 4)], num_spec_tokens=3))
    cm.add_request("a", list(range(1, 10)))
    cm.lookup("a")
    cm.allocate("a", 9)
    cm.commit("a", 0, [10])
    cm.allocate("a", 1, 1)
    cm.commit("a", 0, [11])  # c = 10
    r = cm._requests["a"]
    full, state = cm._managers
    assert full.fast_limits(r.states[0], 10) == FastLimits(12, None, None, 12)
    assert full.fast_bounds(r.states[0], 10) == (12, UNBOUNDED, UNBOUNDED, 12)
    limits = state.fast_limits(r.states[1], 10)
    assert limits == FastLimits(None, 12, None, 12)
    assert state.fast_bounds(r.states[1], 10) == tuple(
        UNBOUNDED if x is None else x for x in limits
    )
    assert (r.fast_end, r.fast_verified, r.commit_below) == (12, 12, 12)
    cm.check_invariants()


@pytest.mark.parametrize("case", ["fresh", "one_cached", "null", "key_taken", "one_block"])
def test_cache_table_in_one_update_equals_the_loop(case: str) -> None:
    """`BlockPool.cache_table` without events stores a prefill chunk's blocks with one
    dict update per index; with events (or a null, cached or duplicate entry in the
    range, or a short range) it takes the per-block loop. Both leave the pool exactly
    alike: blocks 2..9 of table [1..10] (B 4, unit 2) under the chain hashes at their
    ends (block j + 1 of the table ends at 4(j + 1), key hashes[2(j + 1) - 1])."""
    plan_ = PoolPlan(pool_id=0, page_bytes=1, num_pages=16, num_tensors=1, group_ids=(0,))
    hashes = [bytes([i]) for i in range(24)]
    pools = [BlockPool(plan_, None), BlockPool(plan_, [])]  # bulk, loop (events on)
    first, last = (1, 2) if case == "one_block" else (1, 9)
    for pool in pools:
        table = [pool.take() for _ in range(10)]  # [1..10]
        if case == "one_cached":
            pool.cache(table[9], 0, b"other", 40)
            pool.cache(table[2], 0, b"another", 12)
        if case == "null":
            table[1] = NULL_BLOCK
        if case == "key_taken":
            pool.cache(table[9], 0, hashes[5], 40)  # the key of table[2] (end 12)
        pool.cache_table(0, table, first, last, hashes, 2, 4)
    bulk, loop = pools
    assert bulk.index == loop.index and bulk.hashes == loop.hashes
    assert list(bulk.hash_group) == list(loop.hash_group)
    assert list(bulk.hash_end) == list(loop.hash_end)
    assert bulk.num_stored == loop.num_stored
    if case == "fresh":
        assert bulk.index[0] == {hashes[2 * (j + 1) - 1]: j + 1 for j in range(1, 9)}
        assert [bulk.hash_end[b] for b in range(2, 10)] == [8, 12, 16, 20, 24, 28, 32, 36]
