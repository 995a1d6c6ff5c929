"""``chain`` eviction in loop mode (`hybridkv.cache.loop_detect`): sessions served round
robin come back at one regular distance, counted in request releases; the newest release
of either tier then goes first, its chain's tail first."""

from __future__ import annotations

import pytest

from hybridkv.cache import CacheManager
from hybridkv.cache.chain_queue import ChainQueue
from hybridkv.cache.free_queue import PROBATION, PROTECTED
from hybridkv.cache.loop_detect import LOOP_MIN_HITS, LoopDetector
from hybridkv.cache.toy import ToyGroup, toy_plan
from hybridkv.errors import InvariantError
from hybridkv.ids import BlockId


def _serve(q: ChainQueue, session: int, tier: int, *, hit: bool) -> None:
    """Session ``s`` owns the chain 2s+1 -> 2s+2: hit it (when cached), then release
    it tail first in one request's release (`push_chain_many`), into ``tier``."""
    head, tail = 2 * session + 1, 2 * session + 2
    if hit:
        for block in (head, tail):
            q.note_hit(BlockId(block))
            q.remove_cached(BlockId(block))
    q.push_chain_many([tail, head], [tier, tier])


def test_round_robin_turns_loop_mode_on_and_evicts_the_newest_release_across_tiers() -> None:
    q = ChainQueue(16, [])
    for s in range(4):  # first turn: nothing to hit
        _serve(q, s, PROBATION, hit=False)
    rounds = 0
    while not q.loops.loop:
        for s in range(4):
            _serve(q, s, PROTECTED, hit=True)
        rounds += 1
        q.check_invariants()
    # one sample per request (a chain's two blocks share one distance): 3 other releases
    assert q.loops.hits == LOOP_MIN_HITS and rounds == LOOP_MIN_HITS // 4
    assert q.loops.mean == 3.0 and q.loops.variance() == 0.0
    # one more round, session 2 released into probation (as a session that missed is)
    for s in range(4):
        _serve(q, s, PROBATION if s == 2 else PROTECTED, hit=True)
    q.check_invariants()
    popped = [q.pop()[0] for _ in range(8)]
    # newest release first whatever its tier (session 3 is protected, yet goes before
    # session 2 in probation), tail before head
    assert popped == [8, 7, 6, 5, 4, 3, 2, 1]
    assert q.last_victim_newest


def test_without_loop_mode_probation_goes_first() -> None:
    """The same queue before loop mode: the tier order holds (probation first)."""
    q = ChainQueue(16, [])
    for s in range(4):
        _serve(q, s, PROBATION if s == 2 else PROTECTED, hit=False)
    assert not q.loops.loop
    assert [q.pop()[0] for _ in range(2)] == [6, 5]  # session 2's probation chain first


def test_irregular_reuse_distances_keep_loop_mode_off() -> None:
    """Chat-like traffic: every other session comes back twice in a row (distances 0
    and 9 mixed), so the distances vary far more than LOOP_CV allows."""
    q = ChainQueue(64, [])
    for s in range(10):
        _serve(q, s, PROBATION, hit=False)
    order = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    for r in range(3 * LOOP_MIN_HITS):
        s = order[r % 10]
        _serve(q, s, PROTECTED, hit=True)
        if r % 2:  # the same session again right away: distance 0 next
            _serve(q, s, PROTECTED, hit=True)
    assert q.loops.hits >= LOOP_MIN_HITS
    assert q.loops.variance() > (0.25 * q.loops.mean) ** 2
    assert not q.loops.loop
    q.check_invariants()


def test_one_sample_per_release_and_hit_pair() -> None:
    d = LoopDetector(8)
    d.freed[1] = d.freed[2] = 0
    d.clock = 5
    d.hit(1)
    d.hit(2)  # same release, same hit time: the same sample
    assert d.hits == 1 and d.mean == 5.0
    d.clock = 7
    d.hit(1)
    assert d.hits == 2 and d.mean == pytest.approx(5.1)  # weight 0.05 toward 7


def test_loop_invariants_catch_a_corrupt_state() -> None:
    q = ChainQueue(8, [])
    q.push_chain_many([3], [PROBATION])
    q.check_invariants()
    q.loops.loop = True  # on before LOOP_MIN_HITS samples
    with pytest.raises(InvariantError, match="loop mode on after 0 samples"):
        q.check_invariants()
    q.loops.loop = False
    q.loops.freed[3] = q.loops.clock + 1
    with pytest.raises(InvariantError, match="block 3 released at clock 2, after the clock 1"):
        q.check_invariants()


def test_pools_with_a_sliding_window_keep_loop_mode_off() -> None:
    """The coordinator marks pools holding a group that releases out-of-window blocks."""
    shared = CacheManager(toy_plan([ToyGroup("full", 4), ToyGroup("sliding", 4, 8)]))
    dense = CacheManager(toy_plan([ToyGroup("full", 4)]))
    assert [p.free.windowed for p in shared.coordinator.pools] == [True]
    assert [p.free.windowed for p in dense.coordinator.pools] == [False]
