"""The ``turn_end`` checkpoint rule (`hybridkv.cache.turn_end`): a released request keeps
its partial last block and its state at its last computed token; the next turn of the
session resumes there, taking the partial block over."""

from __future__ import annotations

import pytest

from hybridkv.cache import CacheManager
from hybridkv.cache.toy import ToyGroup, toy_plan
from hybridkv.errors import CacheError

F4, S8 = ToyGroup("full", 4), ToyGroup("state", 8)
PROMPT = list(range(100, 110))  # 10 tokens
OUTPUT = [7, 8, 9, 6]  # 4 tokens: the request ends with 14 tokens, 13 computed


def _manager(rules=("turn_end",), groups=(F4, S8), eagle=False, **plan_kwargs) -> CacheManager:
    plan = toy_plan(list(groups), num_blocks=plan_kwargs.pop("num_blocks", 40), **plan_kwargs)
    return CacheManager(plan, checkpoint_rules=rules, eagle=eagle)


def _run_turn(cm: CacheManager, req: str, prompt: list[int], output: list[int]) -> int:
    """Admit ``req``, prefill in one chunk, decode ``output`` one token a step, free.
    Returns the prefix hit."""
    cm.add_request(req, prompt)
    hit = cm.lookup(req)
    assert cm.allocate(req, len(prompt) - hit) is not None
    cm.commit(req, 0, [output[0]])
    for token in output[1:]:
        assert cm.allocate(req, 1) is not None
        cm.commit(req, 0, [token])
    cm.check_invariants()
    cm.free(req)
    cm.check_invariants()
    return hit


def test_next_turn_resumes_at_the_last_computed_token_and_takes_the_block_over():
    """Turn 1 computes 13 of its 14 tokens (the last sampled token never is). Turn 2's
    prompt extends all 14: it hits 13 (block-granular: 8, the state checkpoint), its
    table's 4th block is turn 1's partial block, no longer cached, written from 13."""
    for rules, expected in ((("turn_end",), 13), ((), 8)):
        cm = _manager(rules)
        _run_turn(cm, "t1", PROMPT, OUTPUT)
        turn2 = PROMPT + OUTPUT + [1, 2, 3]
        cm.add_request("t2", turn2)
        assert cm.lookup("t2") == expected
        if rules:
            partial = [i for i in range(1, 40) if cm.block_info(0, i).block_hash is not None]
            entry = [b for b in partial if cm.coordinator.pools[0].hash_end[b] == 13]
            assert len(entry) == 2  # the attention block and the state at 13
        assert cm.allocate("t2", len(turn2) - expected) is not None
        table = cm.block_table("t2", 0)
        assert len(table) == 5  # 17 tokens in blocks of 4
        if rules:
            block = table[3]  # positions 12..15: turn 1's partial block, taken over
            info = cm.block_info(0, block)
            assert info.ref_count == 1 and info.block_hash is None
            slots = cm.state_slots("t2", 1)
            assert slots.num_computed_tokens == 13 and slots.read_block is not None
            assert cm.coordinator.pools[0].num_takeovers == 1
        cm.commit("t2", 0, [5])
        cm.check_invariants()


def test_a_partial_hit_needs_an_exact_token_match_inside_the_block():
    """Same chain up to the anchor (12), a different token inside the partial block:
    no turn-end hit (the block hit stops at the state checkpoint at 8)."""
    cm = _manager()
    _run_turn(cm, "t1", PROMPT, OUTPUT)
    other = PROMPT + OUTPUT[:2] + [999, 1, 2]  # token 12 differs
    cm.add_request("o", other)
    assert cm.lookup("o") == 8
    shorter = PROMPT + OUTPUT[:2] + [1]  # a prefix of the entry's tokens only (12 < 13)
    cm.add_request("s", shorter)
    assert cm.lookup("s") == 8  # entries end at 13 > the 12 tokens a hit may take


def test_two_requests_racing_for_one_partial_block():
    """Both look the entry up; the first admission takes the block over; the second
    allocate sees the takeover, fails without changing anything, and its next lookup
    stops at the block boundary."""
    cm = _manager()
    _run_turn(cm, "t1", PROMPT, OUTPUT)
    nxt = PROMPT + OUTPUT + [1, 2]
    for req in ("a", "b"):
        cm.add_request(req, nxt)
        assert cm.lookup(req) == 13
    assert cm.allocate("a", len(nxt) - 13) is not None
    free_before = cm.num_free_blocks()
    assert cm.allocate("b", len(nxt) - 13) is None
    assert cm.num_free_blocks() == free_before
    cm.check_invariants()
    assert cm.lookup("b") == 8
    assert cm.allocate("b", len(nxt) - 8) is not None
    cm.check_invariants()


def test_entries_are_evicted_like_blocks_and_leave_the_anchor_table():
    cm = _manager(num_blocks=16)  # 15 usable
    _run_turn(cm, "t1", PROMPT, OUTPUT)
    pool = cm.coordinator.pools[0]
    assert pool.partial is not None and len(pool.partial) == 2
    big = list(range(500, 553))  # 52 computed: 13 attention blocks + 2 states: all 15
    cm.add_request("big", big)
    cm.lookup("big")
    assert cm.allocate("big", 52) is not None
    cm.check_invariants()
    assert len(pool.partial) == 0 and not any(pool.partial.only.values())
    assert not any(pool.partial.many.values())
    cm.add_request("t2", PROMPT + OUTPUT + [1])
    assert cm.lookup("t2") == 0


def test_not_kept_when_released_mid_step_or_on_a_boundary():
    """A request freed with a step in flight (its running state may be half written)
    keeps nothing; one that ends on a block boundary needs no entry."""
    cm = _manager()
    cm.add_request("x", PROMPT)
    cm.lookup("x")
    assert cm.allocate("x", 10) is not None
    cm.free("x")  # pending step
    assert len(cm.coordinator.pools[0].partial) == 0
    cm.add_request("y", list(range(300, 308)))  # computes 8 tokens, then frees
    cm.lookup("y")
    cm.allocate("y", 8)
    cm.commit("y", 0, [1])
    cm.free("y")
    assert len(cm.coordinator.pools[0].partial) == 0
    cm.check_invariants()


def test_preempted_request_resumes_from_its_own_turn_end():
    cm = _manager()
    cm.add_request("p", PROMPT)
    cm.lookup("p")
    cm.allocate("p", 10)
    cm.commit("p", 0, [1])
    cm.allocate("p", 1)
    cm.commit("p", 0, [2])  # 11 computed, 12 tokens
    cm.preempt("p")
    assert cm.lookup("p") == 11
    assert cm.allocate("p", 1) is not None
    cm.check_invariants()


def test_groups_keyed_ahead_match_the_next_token_too():
    """EAGLE / MTP head groups key a block with the token after it; a turn-end entry
    too: the same 13 tokens followed by another token miss the head group's entry."""
    groups = (F4, S8, ToyGroup("full", 4, model="draft"))
    cm = _manager(groups=groups, eagle=True, num_spec_tokens=2)
    _run_turn(cm, "t1", PROMPT, OUTPUT)
    same = PROMPT + OUTPUT + [1]
    cm.add_request("same", same)
    assert cm.lookup("same") == 13
    other = PROMPT + OUTPUT[:3] + [OUTPUT[3] + 1, 1]  # same 13 tokens, another 14th
    cm.add_request("other", other)
    assert cm.lookup("other") == 8  # the head group's entry misses: the state's 8
    cm.check_invariants()


def test_rule_name_and_unknown_rules():
    plan = toy_plan([F4, S8])
    assert CacheManager(plan, checkpoint_rules=("junction", "turn_end")).checkpoint_rules == (
        "junction",
        "turn_end",
    )
    with pytest.raises(CacheError, match=r"\['turn-end'\] are unknown.*turn_end"):
        CacheManager(plan, checkpoint_rules=("turn-end",))


def test_junction_with_turn_end_checkpoints_at_the_attention_match_inside_an_interval():
    """split: attention blocks of 4, state interval 8. A computed 14 tokens; B shares
    its first 12 then diverges: attention matches 12, the state only 8. With turn_end
    the junction checkpoint goes at 12 itself (without: at 8), so C hits 12."""
    shared = list(range(200, 212))
    for rules, expected in ((("junction", "turn_end"), 12), (("junction",), 8)):
        cm = _manager(rules, layout="split")
        _run_turn(cm, "a", [*shared, 1, 2], [3])
        b = [*shared, 50, 51, 52, 53, 54]
        _run_turn(cm, "b", b, [4])
        cm.add_request("c", [*shared, 60, 61])
        assert cm.lookup("c") == expected
        assert cm.allocate("c", 2 + 12 - expected) is not None
        cm.check_invariants()
