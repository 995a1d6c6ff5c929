"""The one scheduler (`hybridkv.sched`) on toy plans: exact decisions for the token
budget, chunking and checkpoint alignment, draft lookahead, preemption, max_model_len,
cancellation, priority and cache-aware admission (in-batch prefix dedupe)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from hybridkv.cache import CacheManager
from hybridkv.cache.toy import ToyGroup, toy_plan
from hybridkv.errors import SchedulerError
from hybridkv.sched import (
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    Status,
    StepReport,
    StepResult,
)

FULL4 = [ToyGroup("full", 4)]


def make(groups=FULL4, num_blocks=400, num_spec_tokens=0, rules=None, **config):
    plan = toy_plan(groups, num_blocks=num_blocks, num_spec_tokens=num_spec_tokens)
    manager = CacheManager(plan, checkpoint_rules=rules)
    config.setdefault("max_num_batched_tokens", 8192)
    return Scheduler(manager, SchedulerConfig(**config)), manager


def req(name, prompt, max_new=8, **kw):
    return Request(name, list(prompt), max_new, **kw)


def step(
    s: Scheduler,
    offered: Mapping[str, int] | None = None,
    accept: Mapping[str, int] | None = None,
) -> tuple[SchedulerOutput, StepReport]:
    """Schedule, then answer every sampling chunk: token 1000 + position, and
    ``accept[req]`` drafts accepted (capped to what was reserved)."""
    out = s.schedule(offered or {})
    results = {}
    for c in out.chunks:
        if c.samples:
            a = min((accept or {}).get(c.request.req_id, 0), c.num_lookahead)
            first = c.request.num_tokens
            results[c.request.req_id] = StepResult(a, [1000 + first + i for i in range(a + 1)])
    report = s.update(out, results)
    s.check_invariants()
    s.manager.check_invariants()
    return out, report


def decisions(out: SchedulerOutput) -> list[tuple[str, int, int, int]]:
    return [
        (c.request.req_id, c.num_computed, c.num_new_tokens, c.num_lookahead) for c in out.chunks
    ]


def test_token_budget_running_first_then_admission_in_arrival_order():
    s, _ = make(max_num_batched_tokens=8, cache_aware=False)
    for name, base in (("a", 0), ("b", 100), ("c", 200)):
        s.add(req(name, range(base, base + 10)))
    assert decisions(step(s)[0]) == [("a", 0, 8, 0)]
    assert decisions(step(s)[0]) == [("a", 8, 2, 0), ("b", 0, 6, 0)]
    # a decodes (1), b finishes its prompt (4), c gets the last 3 tokens of the budget
    assert decisions(step(s)[0]) == [("a", 10, 1, 0), ("b", 6, 4, 0), ("c", 0, 3, 0)]


def test_chunk_size_and_checkpoint_alignment():
    s, _ = make(max_num_batched_tokens=40, chunk_align_tokens=16)
    s.add(req("a", range(1, 101)))
    sizes = [step(s)[0].chunks[0].num_new_tokens for _ in range(4)]
    assert sizes == [32, 32, 32, 4]  # 0-32 | 32-64 | 64-96 | 96-100
    s, _ = make(max_num_batched_tokens=40, chunk_size=7)
    s.add(req("a", range(1, 20)))
    assert [step(s)[0].chunks[0].num_new_tokens for _ in range(3)] == [7, 7, 5]


def test_lookahead_is_capped_by_k_budget_and_limits():
    s, _ = make(max_spec_tokens=3, max_num_batched_tokens=64)
    s.add(req("a", range(1, 5), max_new=6))
    step(s)  # prefill: emits 1
    out, report = step(s, offered={"a": 5}, accept={"a": 3})
    assert decisions(out) == [("a", 4, 1, 3)] and out.chunks[0].num_proposed == 5
    assert report.accepted == {"a": 3} and len(s.get("a").output) == 5
    out, _ = step(s, offered={"a": 5}, accept={"a": 5})  # 1 token left: no drafts
    assert decisions(out) == [("a", 8, 1, 0)]
    assert s.get("a") is None
    # budget: 1 decode token + at most budget - 1 drafts
    s, _ = make(max_num_batched_tokens=3)
    s.add(req("b", range(1, 3), max_new=20))
    step(s)
    assert decisions(step(s, offered={"b": 9})[0]) == [("b", 2, 1, 2)]


def test_drafts_are_dropped_before_anyone_is_preempted():
    """5 usable blocks of 4: a and b hold one each. a reserves 3 drafts (+1 block); b's
    8 drafts would need 3 more blocks, only 2 are free: b drops them and nobody is
    preempted."""
    s, _ = make(num_blocks=6, num_spec_tokens=8)
    s.add(req("a", [1, 2, 3, 4], max_new=20))
    s.add(req("b", [5, 6, 7, 8], max_new=20))
    step(s)
    out, _ = step(s, offered={"a": 3, "b": 8})
    assert decisions(out) == [("a", 4, 1, 3), ("b", 4, 1, 0)]
    assert out.preempted == () and s.num_preemptions == 0


def test_preemption_takes_the_newest_first_and_requeues_by_arrival():
    s, _ = make(num_blocks=6, num_spec_tokens=8)
    for name, base in (("a", 0), ("b", 10), ("c", 20)):
        s.add(req(name, range(base, base + 4), max_new=20))
    step(s)
    # 2 free blocks: a's 7 drafts would take both (12 positions). Drafts go first: a
    # drops them, but a, b and c still need a block each, so c goes
    out, _ = step(s, offered={"a": 7})
    assert decisions(out) == [("a", 4, 1, 0), ("b", 4, 1, 0)]
    assert out.dropped_drafts == ("a",)
    assert [(p.request.req_id, p.num_computed) for p in out.preempted] == [("c", 4)]
    c = s.waiting[0]
    assert c.req_id == "c" and c.status is Status.WAITING and c.num_computed == 0
    assert c.num_preemptions == 1
    # the newest running request preempts itself when it cannot grow
    s2, _ = make(num_blocks=5)  # 4 usable blocks
    s2.add(req("x", range(0, 5), max_new=30))
    s2.add(req("y", range(10, 18), max_new=30))
    step(s2)  # 2 blocks each, 0 free
    out, _ = step(s2)  # x fits its block; y needs a third block: it yields itself
    assert [p.request.req_id for p in out.preempted] == ["y"]
    assert decisions(out) == [("x", 5, 1, 0)]


def test_max_model_len_refuses_long_prompts_and_stops_at_the_limit():
    s, m = make(max_model_len=10, max_spec_tokens=8, num_spec_tokens=8)
    long = req("long", range(10))
    assert s.add(long) is False
    assert long.status is Status.REFUSED and long.finish_reason == "refused"
    assert "max_model_len=10" in long.refusal and not m.has_request("long")
    edge = req("edge", range(20, 29), max_new=50)
    assert s.add(edge)
    short = req("short", range(40, 46), max_new=50)
    s.add(short)
    step(s)
    assert edge.finish_reason == "length" and edge.output == [1009]
    out, _ = step(s, offered={"short": 8}, accept={"short": 8})
    assert decisions(out) == [("short", 6, 1, 2)]  # 7 tokens: 2 drafts + bonus reach 10
    assert short.finish_reason == "length" and short.num_tokens == 10


def test_cancel_releases_blocks_waiting_or_running():
    s, m = make(max_num_seqs=1, cache_aware=False)
    a, b = req("a", range(0, 9)), req("b", range(20, 29))
    s.add(a)
    s.add(b)
    step(s)
    assert a.status is Status.RUNNING and b.status is Status.WAITING
    s.cancel(b)
    s.cancel(a)
    assert (a.status, b.status) == (Status.CANCELLED, Status.CANCELLED)
    assert not s.has_work and m.usage() == 0.0 and not m.has_request("a")
    s.check_invariants()
    s.add(req("c", range(5)))
    out = s.schedule({})
    with pytest.raises(SchedulerError, match="in flight"):
        s.cancel(out.chunks[0].request)


def test_priority_then_arrival():
    s, _ = make(max_num_seqs=1)
    for name, priority in (("p2", 2), ("p0", 0), ("p1", 1), ("p0b", 0)):
        s.add(req(name, [len(name), priority, 9], max_new=1, priority=priority))
    order = [step(s)[0].chunks[0].request.req_id for _ in range(4)]
    assert order == ["p0", "p0b", "p1", "p2"]


def test_longest_cached_prefix_first_among_equal_priority():
    s, _ = make(max_num_seqs=1)
    shared = list(range(100, 116))
    s.add(req("warm", [*shared, 1], max_new=1))
    step(s)  # warm's 16 prompt tokens are cached now
    s.add(req("cold", range(200, 217), max_new=1))  # arrived first, nothing cached
    s.add(req("hit", [*shared, 2], max_new=1))
    out, _ = step(s)
    assert decisions(out) == [("hit", 16, 1, 0)]
    assert decisions(step(s)[0]) == [("cold", 0, 17, 0)]


def shared_prefix_requests(n, prefix_len=224, suffix_len=16):
    prefix = list(range(1, prefix_len + 1))
    return [
        req(f"r{i}", [*prefix, *range(1000 + suffix_len * i, 1000 + suffix_len * (i + 1))])
        for i in range(n)
    ]


@pytest.mark.parametrize("cache_aware", [True, False])
def test_in_batch_dedupe_one_request_computes_a_shared_prefix(cache_aware):
    """32 requests sharing an uncached 224-token prefix: one computes it, the other 31
    wait one step and hit all 224 tokens on admission."""
    s, m = make(
        groups=[ToyGroup("full", 16)], num_blocks=1000, max_num_seqs=64, cache_aware=cache_aware
    )
    for r in shared_prefix_requests(32):
        s.add(r)
    out, _ = step(s)
    if not cache_aware:
        assert len(out.chunks) == 32 and all(c.prefix_hit == 0 for c in out.chunks)
        return
    assert decisions(out) == [("r0", 0, 240, 0)]
    assert len(out.deferred) == 31 and s.num_deferrals == 31
    out, _ = step(s)
    admitted = [c for c in out.chunks if c.prefix_hit is not None]
    assert [(c.prefix_hit, c.num_new_tokens) for c in admitted] == [(224, 16)] * 31
    assert m.stats().num_hit_tokens >= 31 * 224


def test_deferred_requests_follow_a_chunked_blocker_and_never_starve():
    """The blocker computes the prefix in 64-token chunks; the others wait while their
    next uncached block is being computed, and are admitted (hitting everything the
    blocker committed) once it passes; cancelling the blocker frees them at once."""
    s, _ = make(groups=[ToyGroup("full", 16)], chunk_size=64, max_num_seqs=8)
    reqs = shared_prefix_requests(3, prefix_len=160)
    for r in reqs:
        s.add(r)
    hits = []
    for _ in range(4):
        out, _ = step(s)
        hits += [(c.request.req_id, c.prefix_hit) for c in out.chunks if c.prefix_hit]
    assert hits == [("r1", 160), ("r2", 160)]  # after r0's chunks 0-64, 64-128, 128-176

    s, _ = make(groups=[ToyGroup("full", 16)], chunk_size=64, max_num_seqs=8)
    reqs = shared_prefix_requests(3, prefix_len=160)
    for r in reqs:
        s.add(r)
    step(s)
    assert s.running == [reqs[0]]
    s.cancel(reqs[0])
    out, _ = step(s)
    # r1 hits r0's committed first chunk and computes the rest; r2 now waits for r1
    assert decisions(out) == [("r1", 64, 64, 0)] and out.deferred == ("r2",)


def test_a_request_that_cannot_fit_alone_is_a_typed_error():
    s, _ = make(num_blocks=4)  # 3 usable blocks: 12 tokens
    s.add(req("big", range(20)))
    out, _ = step(s)  # alone, the first chunk halves to fit: 10 tokens in 3 blocks
    assert decisions(out) == [("big", 0, 10, 0)]
    with pytest.raises(SchedulerError, match="'big' cannot take its next step alone"):
        for _ in range(3):  # 10 -> 12 (halved twice), then 13 tokens need a 4th block
            step(s)


def test_results_that_contradict_the_step_are_refused():
    s, _ = make(num_spec_tokens=4, max_spec_tokens=4)
    s.add(req("a", range(4)))
    out = s.schedule({})
    with pytest.raises(SchedulerError, match="no result"):
        s.update(out, {})
    s.update(out, {"a": StepResult(0, [7])})
    out = s.schedule({"a": 2})
    with pytest.raises(SchedulerError, match="accepted"):
        s.update(out, {"a": StepResult(3, [1, 2, 3, 4])})
    with pytest.raises(SchedulerError, match="awaits update"):
        s.schedule({})


@pytest.mark.parametrize(("rules", "hit"), [(("turn_end",), 192), (None, 224)])
def test_waiters_are_not_serialised_when_hits_come_in_larger_granules(rules, hit):
    """Hash unit 16, hit granule 64 (state checkpoints): after the blocker, the hit is
    192 for everyone (224 shared) without the junction rule; with it (the default) the
    blocker checkpoints its state at 224, where it stops sharing with the requests held
    back for it, and they hit all 224 (a junction copy of its block 208-224). The
    granule 192-256 is only partly shared, so nobody waits for anyone else's suffix and
    all three are admitted in the same step."""
    s, _ = make(
        groups=[ToyGroup("state", 64), ToyGroup("full", 16)],
        num_blocks=400,
        chunk_align_tokens=64,
        rules=rules,
    )
    assert s.manager.hash_unit_tokens == 16 and s.manager.plan.hit_granularity_tokens == 64
    for r in shared_prefix_requests(4, suffix_len=32):
        s.add(r)
    out, _ = step(s)
    assert decisions(out) == [("r0", 0, 256, 0)] and len(out.deferred) == 3
    out, _ = step(s)
    admitted = [(c.request.req_id, c.prefix_hit) for c in out.chunks if c.prefix_hit is not None]
    assert admitted == [("r1", hit), ("r2", hit), ("r3", hit)] and out.deferred == ()
