"""The numpy paths for whole tables (`block_pool.BULK_MIN_BLOCKS`: lru release of a
table, caching a prefill chunk's blocks) leave the pool exactly as the per-block loops
do: same tables, free order, indexes, reference counts and statistics, on a workload
that shares prefixes, evicts, preempts and frees."""

from __future__ import annotations

import random
from array import array

import pytest

from hybridkv.cache import CacheManager, block_pool
from hybridkv.cache.toy import ToyGroup, toy_plan


def _snapshot(cm: CacheManager, live: list[str]) -> tuple:
    pool = cm.coordinator.pools[0]
    return (
        {req: cm.block_table(req, 0) for req in live},
        pool.free.fresh_ids(),
        pool.free.cached_ids(),
        dict(pool.hashes),
        {g: dict(index) for g, index in pool.index.items()},
        array("q", pool.ref_counts),
        array("q", pool.hash_group),
        array("q", pool.hash_end),
        cm.stats(),
    )


def _replay(policy: str, groups: list[ToyGroup], num_blocks: int, seed: int) -> list[tuple]:
    rng = random.Random(seed)
    cm = CacheManager(
        toy_plan(groups, num_blocks=num_blocks),
        record_events=False,
        eviction_policy=policy,
        checkpoint_rules=(),
    )
    prefixes = [[rng.randrange(1, 500) for _ in range(rng.randrange(40, 120))] for _ in range(3)]
    live: list[str] = []
    snapshots = []
    for i in range(60):
        if live and (len(live) > 3 or rng.random() < 0.3):
            req = live.pop(rng.randrange(len(live)))
            (cm.preempt if rng.random() < 0.2 else cm.free)(req)
            if cm.has_request(req):
                cm.free(req)
        req = f"r{i}"
        prompt = rng.choice(prefixes) + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 60))]
        cm.add_request(req, prompt)
        hit = cm.lookup(req)
        if cm.allocate(req, len(prompt) - hit) is None:
            cm.free(req)
            continue
        cm.commit(req, 0, [rng.randrange(1, 500)])
        live.append(req)
        for _ in range(rng.randrange(0, 12)):  # a few decode steps of everyone
            deltas = cm.allocate_batch(live, [1] * len(live), [2] * len(live))
            ok = [req for req, delta in zip(live, deltas, strict=True) if delta is not None]
            cm.commit_batch(ok, [1] * len(ok), [[7, 8]] * len(ok))
            for req in set(live) - set(ok):  # did not fit: out of the batch
                cm.free(req)
            live = ok
        cm.check_invariants()
        snapshots.append(_snapshot(cm, live))
    return snapshots


@pytest.mark.parametrize("policy", ["lru", "chain"])
@pytest.mark.parametrize(("block_size", "num_blocks"), [(4, 160), (1, 600)])
def test_bulk_and_loop_paths_leave_the_same_pool(
    monkeypatch: pytest.MonkeyPatch, policy: str, block_size: int, num_blocks: int
) -> None:
    groups = [ToyGroup("full", block_size)]
    monkeypatch.setattr(block_pool, "BULK_MIN_BLOCKS", 10**9)
    loop = _replay(policy, groups, num_blocks, seed=3)
    monkeypatch.setattr(block_pool, "BULK_MIN_BLOCKS", 1)
    bulk = _replay(policy, groups, num_blocks, seed=3)
    assert len(loop) == len(bulk) > 40
    for step, (a, b) in enumerate(zip(loop, bulk, strict=True)):
        assert a == b, f"step {step}: the bulk path left another pool"
    assert sum(s[-1].num_evictions > 0 for s in loop) > 5  # the workload evicts
