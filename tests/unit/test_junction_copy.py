"""Junction copies (`hybridkv.cache.junction`): mid-block prefix hits served by a copy
of a cached block's first slots, with exact block ids.

Plan: full attention B 4 + a state group (interval 4), one pool, LRU. The shared
prefix S is 10 tokens: it ends inside block 2 (tokens 8..11)."""

from __future__ import annotations

from hybridkv.cache import CacheManager
from hybridkv.cache.junction import MAX_CHILDREN_PER_PARENT, CopyOrder
from hybridkv.cache.toy import ToyGroup, toy_plan

S = list(range(100, 110))
A = [*S, 1, 2, 3, 4, 5, 6]  # 16 tokens
B = [*S, 11, 12, 13, 14, 15]  # 15 tokens
C = [*S, 21, 22, 23, 24, 25, 26, 27]  # 17 tokens


def _manager(num_blocks: int = 40, rules=("junction", "turn_end")) -> CacheManager:
    plan = toy_plan([ToyGroup("full", 4), ToyGroup("state", 4)], num_blocks=num_blocks)
    return CacheManager(plan, eviction_policy="lru", checkpoint_rules=rules)


def _admit(m: CacheManager, rid: str, prompt: list[int], salt: str | None = None):
    m.add_request(rid, prompt, cache_salt=salt)
    hit = m.lookup(rid)
    delta = m.allocate(rid, len(prompt) - hit)
    assert delta is not None
    return hit, delta


def _finish(m: CacheManager, rid: str) -> None:
    m.commit(rid, 0, [7])
    m.free(rid)
    m.check_invariants()


def _a_then_b(m: CacheManager, junction: bool = True) -> None:
    # A computes everything (blocks 1-4, states 5-6); B leaves the cache at 10: it hits
    # nothing (no state at 8 or 10) and stores its state at 10 (block 13), the junction
    assert _admit(m, "A", A)[0] == 0
    _finish(m, "A")
    hit, _ = _admit(m, "B", B)
    assert hit == 0
    expected = ((10, 13), (12, 12)) if junction else ((12, 12),)
    assert m.state_slots("B", 1).checkpoints == expected
    _finish(m, "B")


def test_third_prompt_hits_mid_block_with_one_copy_order_and_a_pinned_source():
    m = _manager()
    _a_then_b(m)
    pool = m.coordinator.pools[0]
    hit, delta = _admit(m, "C", C)
    assert hit == 10
    # blocks 0, 1 hit (1, 2); position 2 is fresh block 7, filled by copying A's
    # cached block 2 (block 3) slots 0..1; positions 3, 4 fresh
    assert m.block_table("C", 0) == [1, 2, 7, 8, 14]
    assert delta.copies == (CopyOrder(group_id=0, src_block=3, dst_block=7, num_tokens=2),)
    assert m.state_slots("C", 1).read_block == 13  # B's junction state
    assert pool.ref_counts[3] == 1 and pool.is_cached(3)  # pinned until the copy ran
    m.check_invariants()
    m.commit("C", 0, [7])
    assert pool.ref_counts[3] == 0 and pool.is_cached(3)  # released, still cached
    m.check_invariants()
    m.free("C")
    m.check_invariants()


def test_freed_before_commit_releases_the_pinned_source():
    m = _manager()
    _a_then_b(m)
    _admit(m, "C", C)
    pool = m.coordinator.pools[0]
    m.preempt("C")
    assert pool.ref_counts[3] == 0
    m.check_invariants()
    # looked up again after the preemption: the same copy, another fresh block
    hit = m.lookup("C")
    assert hit == 10
    delta = m.allocate("C", len(C) - hit)
    assert delta is not None and [o.src_block for o in delta.copies] == [3]
    m.free("C")
    m.check_invariants()


def test_cache_salt_isolates_junction_children():
    m = _manager()
    _a_then_b(m)
    hit, delta = _admit(m, "D", C, salt="other tenant")
    assert hit == 0 and delta.copies == ()
    m.check_invariants()


def test_without_the_junction_rule_nothing_is_copied():
    m = _manager(rules=("turn_end",))
    _a_then_b(m, junction=False)
    hit, delta = _admit(m, "C", C)
    assert hit == 0 and delta.copies == ()  # no junction state at 10, no copy
    assert m.coordinator.pools[0].children is None


def test_eviction_of_the_source_drops_it_from_the_child_index():
    # 19 usable blocks: after A and B a request of 15 blocks evicts every cached block
    m = _manager(num_blocks=20)
    _a_then_b(m)
    pool = m.coordinator.pools[0]
    assert pool.children.parent_of[3] is not None
    big = list(range(500, 556))  # 14 attention blocks + 1 state block
    _admit(m, "Z", big)
    assert pool.children.parent_of[3] is None and not pool.is_cached(3)
    m.check_invariants()
    m.free("Z")
    hit, delta = _admit(m, "C", C)
    assert hit == 0 and delta.copies == ()
    m.check_invariants()


def test_child_index_keeps_at_most_the_bound_per_parent():
    m = _manager(num_blocks=200)
    _admit(m, "A", A)
    _finish(m, "A")
    for i in range(MAX_CHILDREN_PER_PARENT + 3):
        _admit(m, f"r{i}", S[:8] + [200 + i] * 5)
        _finish(m, f"r{i}")
    children = m.coordinator.pools[0].children
    assert max(len(kids) for _, _, kids in children.by_parent()) == MAX_CHILDREN_PER_PARENT
    m.check_invariants()
