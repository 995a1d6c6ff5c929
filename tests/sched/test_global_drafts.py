"""Drafts are dropped globally, before anyone is preempted (`sched.running`): the step
is planned with the manager's exact needs, and while it does not fit, the newest request
still carrying drafts drops them. Exact decisions on toy plans, each compared with the
old rule (a request that does not fit drops only its own drafts; drafts reserved before
it stay), which a manager without `blocks_needed` still gets."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from hybridkv.cache import CacheManager
from hybridkv.cache.toy import ToyGroup, toy_plan
from hybridkv.errors import CacheError
from hybridkv.sched import Request, Scheduler, SchedulerConfig, SchedulerOutput, StepResult


class NoPlanning:
    """A manager without `blocks_needed`: the scheduler can only learn a miss by trying."""

    def __init__(self, manager: CacheManager) -> None:
        self._manager = manager
        self.caching = manager.caching
        self.hash_unit_tokens = manager.hash_unit_tokens

    def __getattr__(self, name: str) -> Any:
        if name == "blocks_needed":
            raise AttributeError(name)
        return getattr(self._manager, name)


def make(num_blocks: int, planning: bool = True, groups=None) -> tuple[Scheduler, CacheManager]:
    plan = toy_plan(groups or [ToyGroup("full", 4)], num_blocks=num_blocks, num_spec_tokens=4)
    manager = CacheManager(plan)
    front: Any = manager if planning else NoPlanning(manager)
    return Scheduler(front, SchedulerConfig(max_spec_tokens=4)), manager


def step(s: Scheduler, offered: Mapping[str, int] | None = None) -> SchedulerOutput:
    """Schedule and answer: every sampling chunk emits one token, no draft accepted."""
    out = s.schedule(offered or {})
    results = {
        c.request.req_id: StepResult(0, [900 + c.request.num_tokens])
        for c in out.chunks
        if c.samples
    }
    s.update(out, results)
    s.check_invariants()
    s.manager.check_invariants()
    return out


def decisions(out: SchedulerOutput) -> list[tuple[str, int, int, int]]:
    return [
        (c.request.req_id, c.num_computed, c.num_new_tokens, c.num_lookahead) for c in out.chunks
    ]


def three_decoding(planning: bool) -> tuple[Scheduler, CacheManager]:
    """a and b: 6 prompt tokens (2 blocks each), c: 4 (1 block); 7 usable blocks, so 2
    are free once all three decode (the `sched.running` module example)."""
    s, manager = make(num_blocks=8, planning=planning)
    s.add(Request("a", [1, 2, 3, 4, 5, 6], 20))
    s.add(Request("b", [11, 12, 13, 14, 15, 16], 20))
    s.add(Request("c", [21, 22, 23, 24], 20))
    step(s)  # prefill all three; each samples its first token
    assert manager.num_free_blocks() == 2
    return s, manager


OFFERED = {"a": 3, "b": 3, "c": 4}


def test_dropping_drafts_of_others_avoids_a_preemption():
    """a 1+3 (1 block), b 1+3 (1), c 1+4 (2): 4 > 2 free. c drops (3 > 2), then b (2):
    everyone runs, a keeps its drafts, nobody is preempted."""
    s, manager = three_decoding(planning=True)
    out = step(s, OFFERED)
    assert decisions(out) == [("a", 6, 1, 3), ("b", 6, 1, 0), ("c", 4, 1, 0)]
    assert out.dropped_drafts == ("c", "b")
    assert out.preempted == () and s.num_preemptions == 0
    assert out.avoided_preemption  # the rule without planning preempts c (next test)
    assert manager.num_free_blocks() == 0
    assert s.planner.num_dropped == 2 and s.planner.num_preemptions_avoided == 1


def test_the_old_rule_preempts_in_the_same_situation():
    """Allocating in order, a and b take both free blocks with their drafts; c needs a
    block even without drafts and preempts itself."""
    s, _ = three_decoding(planning=False)
    out = step(s, OFFERED)
    assert decisions(out) == [("a", 6, 1, 3), ("b", 6, 1, 3)]
    assert [p.request.req_id for p in out.preempted] == ["c"]
    assert out.dropped_drafts == ("c",)


def test_no_drafts_are_dropped_when_the_step_fits():
    s, _ = three_decoding(planning=True)
    out = step(s, {"a": 3, "c": 3})  # a: 1 block, c: positions 4..7, inside its block 1
    assert decisions(out) == [("a", 6, 1, 3), ("b", 6, 1, 0), ("c", 4, 1, 3)]
    assert out.dropped_drafts == () and out.preempted == () and not out.avoided_preemption


def test_drafts_go_first_even_when_a_preemption_remains():
    """d is admitted and takes the last free blocks. Next step d needs a block even
    without drafts and none is free: every draft goes first (newest first), then d, the
    newest, preempts itself; a, b and c run without drafts."""
    s, manager = three_decoding(planning=True)
    s.add(Request("d", [31, 32, 33, 34], 20))
    out = step(s)  # a, b decode inside their blocks, c takes 1 block, d's prefill 1
    assert decisions(out)[-1] == ("d", 0, 4, 0) and manager.num_free_blocks() == 0
    out = step(s, {**OFFERED, "d": 4})
    assert decisions(out) == [("a", 7, 1, 0), ("b", 7, 1, 0), ("c", 5, 1, 0)]
    assert out.dropped_drafts == ("d", "c", "b", "a")
    assert [(p.request.req_id, p.num_computed) for p in out.preempted] == [("d", 4)]
    assert not out.avoided_preemption


def test_a_drop_does_not_grow_the_chunks_after_it():
    """Budget 6, 4 usable blocks, all held: a's 4 drafts need a block, so they go. b keeps
    the one prefill token it was planned with (inside its block); handing it a's freed
    budget (5 tokens, up to position 9) would need a block and preempt b."""
    plan = toy_plan([ToyGroup("full", 4)], num_blocks=5, num_spec_tokens=4)
    manager = CacheManager(plan)
    s = Scheduler(manager, SchedulerConfig(max_spec_tokens=4, max_num_batched_tokens=6))
    s.add(Request("a", [1, 2, 3, 4], 20))
    step(s)  # a: 1 block, 4 computed, decodes at position 4
    s.add(Request("b", list(range(40, 52)), 20))
    out = step(s)  # a decodes (1 token, a second block); b: 5 tokens, 2 blocks
    assert decisions(out) == [("a", 4, 1, 0), ("b", 0, 5, 0)]
    assert manager.num_free_blocks() == 0
    out = step(s, {"a": 4})  # a + 4 drafts: positions 5..9 need block 3
    assert out.dropped_drafts == ("a",)
    assert decisions(out) == [("a", 5, 1, 0), ("b", 5, 1, 0)]
    assert out.preempted == ()
    assert not out.avoided_preemption  # a dropping its own drafts was enough here


def test_blocks_needed_batch_is_the_sum():
    _, manager = three_decoding(planning=True)
    ids, ns = ["a", "b", "c"], [1, 1, 1]
    for lookaheads in ([3, 3, 4], [0, 0, 0], [3, 0, 4], [0, 3, 0]):
        each = [manager.blocks_needed(r, 1, la) for r, la in zip(ids, lookaheads, strict=True)]
        assert manager.blocks_needed_batch(ids, ns, lookaheads) == [sum(n[0] for n in each)]
    assert manager.blocks_needed_batch(ids, ns, [3, 3, 4]) == [4]  # the module example
    with pytest.raises(CacheError, match="blocks_needed_batch"):
        manager.blocks_needed_batch(ids, ns, [0])


def test_blocks_needed_matches_what_allocate_takes():
    """Per pool, `blocks_needed` equals the blocks the next `allocate` takes (full,
    sliding window and state groups in one pool), and refuses requests between states."""
    groups = [ToyGroup("full", 4), ToyGroup("sliding", 4, 6), ToyGroup("state", 8)]
    manager = CacheManager(toy_plan(groups, num_blocks=200, num_spec_tokens=4))
    manager.add_request("r", list(range(1, 12)))
    with pytest.raises(CacheError, match="not admitted"):
        manager.blocks_needed("r", 1)
    manager.lookup("r")
    manager.allocate("r", 11)
    with pytest.raises(CacheError, match="not committed"):
        manager.blocks_needed("r", 1)
    manager.commit("r", 0, [50])
    tokens = 12
    for lookahead, accepted in [(4, 2), (0, 0), (3, 3), (1, 0), (4, 4), (2, 1), (0, 0)]:
        need = manager.blocks_needed("r", 1, lookahead)
        delta = manager.allocate("r", 1, lookahead)
        assert delta is not None
        taken = sum(len(blocks) for blocks in delta.taken.values())
        assert need == [taken], (lookahead, accepted)
        manager.commit("r", accepted, list(range(tokens, tokens + accepted + 1)))
        tokens += accepted + 1
    with pytest.raises(CacheError, match="exceed"):
        manager.blocks_needed("r", 5)
    with pytest.raises(CacheError, match="num_lookahead_tokens"):
        manager.blocks_needed("r", 1, -2)
    with pytest.raises(CacheError, match="num_new_tokens"):
        manager.blocks_needed("r", 1.0)  # type: ignore[arg-type]
    manager.check_invariants()
