"""Sticky state spares: a state group's spec slots grow once, to S, with exact block ids.

Toy plan: group 0 full attention (block 16), group 1 a state group (checkpoint interval
16, align mode), S = 3 speculative states, one shared pool handing out fresh blocks in
ascending order (1, 2, ...). Budget of the state group: 2 + S = 5 blocks.
"""

from __future__ import annotations

from hybridkv.cache import NO_CHANGE, CacheManager
from hybridkv.cache.toy import ToyGroup, toy_plan


def _manager(num_spec: int = 3, mode: str = "align") -> CacheManager:
    groups = [ToyGroup("full", 16), ToyGroup("state", 16)]
    return CacheManager(toy_plan(groups, num_spec_tokens=num_spec, state_mode=mode))


def test_first_drafting_step_takes_all_spec_slots_once() -> None:
    cm = _manager()
    cm.add_request("r", [1, 2, 3, 4, 5])
    assert cm.lookup("r") == 0
    # prefill without drafts: no spare is taken (full: block 1; state write block: 2)
    delta = cm.allocate("r", 5)
    assert delta is not None and delta.taken == {0: (1,), 1: (2,)}
    cm.commit("r", 0, [6])
    assert cm.block_table("r", 1) == [2]
    # one draft: the state group takes S = 3 slots at once, not 1
    assert cm.blocks_needed("r", 1, 1) == [3]
    delta = cm.allocate("r", 1, 1)
    assert delta is not None and delta.taken == {1: (3, 4, 5)}
    assert cm.state_slots("r", 1).spec_blocks == (3,)
    assert cm.block_table("r", 1) == [2, 3, 4, 5]
    cm.commit("r", 0, [7])
    cm.check_invariants()
    # three drafts later: the slots are held, the step takes nothing (fast path)
    assert cm.blocks_needed("r", 1, 3) == [0]
    assert cm.allocate("r", 1, 3) is NO_CHANGE
    assert cm.state_slots("r", 1).spec_blocks == (3, 4, 5)
    cm.commit("r", 2, [8, 9, 10])  # running: the slot after draft 2 (block 4)
    assert cm.block_table("r", 1) == [4, 3, 2, 5]
    cm.check_invariants()
    cm.free("r")
    assert cm.num_free_blocks() == cm.plan.pools[0].num_pages - 1
    cm.check_invariants()


def test_spares_stay_within_the_budget_when_the_step_writes_a_new_block() -> None:
    # A hit at a cached checkpoint (c = 16) reads a read-only block: the step needs a
    # write block too, so the budget 2 + S leaves room for S = 3 slots, no more.
    cm = _manager()
    prompt = list(range(1, 21))
    cm.add_request("a", prompt)
    cm.lookup("a")
    assert cm.allocate("a", 16) is not None
    cm.commit("a", 0, [])  # the state after 16 tokens is cached (checkpoint)
    cm.add_request("b", prompt)
    assert cm.lookup("b") == 16
    delta = cm.allocate("b", 1, 2)
    assert delta is not None
    held = cm.block_table("b", 1)
    running, write = held[0], held[1]
    assert running == cm.block_table("a", 1)[0]  # the shared cached checkpoint
    assert len(held) == 1 + 1 + 3  # running, write and S slots: exactly the budget 5
    assert cm.state_slots("b", 1).write_block == write != running
    cm.check_invariants()


def test_no_spec_states_no_sticky_growth() -> None:
    cm = _manager(num_spec=0)
    cm.add_request("r", [1, 2, 3])
    cm.lookup("r")
    assert cm.allocate("r", 3) is not None
    cm.commit("r", 0, [4])
    # lookahead with S = 0: the state group keeps no spec slot
    assert cm.blocks_needed("r", 1, 2) == [0]
    assert cm.allocate("r", 1, 2) is not None
    assert cm.block_table("r", 1) == [2]  # full: block 1; state: running block 2 only
    cm.commit("r", 0, [5])
    cm.check_invariants()


def test_state_slots_many_equals_one_call_per_request() -> None:
    """The batch read an engine makes per state group: the same `StepSlots` as one
    `state_slots` call per request, in order, and the same typed errors."""
    import pytest

    from hybridkv.errors import CacheError

    cm = _manager()
    for name, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6, 7, 8]), ("c", [9])):
        cm.add_request(name, prompt)
        cm.lookup(name)
        assert cm.allocate(name, len(prompt)) is not None
    cm.commit("a", 0, [11])
    cm.commit("b", 0, [12])
    cm.commit("c", 0, [13])
    assert cm.allocate("b", 1, 2) is not None and cm.allocate("a", 1) is not None
    assert cm.state_slots_many(["b", "a"], 1) == [cm.state_slots("b", 1), cm.state_slots("a", 1)]
    assert cm.state_slots_many([], 1) == []
    with pytest.raises(CacheError, match="not a state group"):
        cm.state_slots_many(["a"], 0)
    with pytest.raises(CacheError, match="out of range"):
        cm.state_slots_many(["a"], 7)
    with pytest.raises(CacheError, match="no step allocated"):
        cm.state_slots_many(["a", "c"], 1)
    with pytest.raises(CacheError, match="unknown request"):
        cm.state_slots_many(["zz"], 1)
