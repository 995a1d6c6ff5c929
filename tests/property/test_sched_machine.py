"""Hypothesis state machine over the one scheduler and a real `CacheManager`: random
add / cancel / step sequences (shared prefixes, salts, priorities, drafts offered and
accepted, a pool small enough to preempt) keep both sides' `check_invariants()`, never
emit past a request's limits, and always drain: every request finishes or is cancelled,
nothing is left referenced, no deferred request starves."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hybridkv.cache import CacheManager
from hybridkv.cache.toy import ToyGroup, toy_plan
from hybridkv.sched import Request, Scheduler, SchedulerConfig, Status, StepResult

PREFIXES = (list(range(1, 33)), list(range(100, 120)), [7] * 24)
K = 3
MAX_DRAIN_STEPS = 2000


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        budget=st.integers(8, 64),
        chunk=st.one_of(st.none(), st.integers(3, 20)),
        align=st.booleans(),
        max_model_len=st.one_of(st.none(), st.integers(30, 60)),
    )
    def setup(self, budget, chunk, align, max_model_len) -> None:
        groups = [ToyGroup("sliding", 4, 12), ToyGroup("full", 4), ToyGroup("state", 8)]
        self.plan = toy_plan(groups, num_blocks=70, num_spec_tokens=K)
        self.manager = CacheManager(self.plan)
        self.config = SchedulerConfig(
            max_num_seqs=6,
            max_num_batched_tokens=budget,
            chunk_size=chunk,
            chunk_align_tokens=8 if align else 0,
            max_model_len=max_model_len,
            max_spec_tokens=K,
            reorder_window=4,
        )
        self.s = Scheduler(self.manager, self.config)
        self.requests: list[Request] = []
        self.count = 0

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        prefix_len=st.integers(1, 32),
        suffix=st.lists(st.integers(200, 260), max_size=8),
        max_new=st.integers(1, 10),
        priority=st.integers(0, 2),
        salt=st.sampled_from([None, None, "t1"]),
    )
    def add(self, prefix, prefix_len, suffix, max_new, priority, salt) -> None:
        prompt = PREFIXES[prefix][:prefix_len] + suffix
        req = Request(f"r{self.count}", prompt, max_new, priority=priority, cache_salt=salt)
        self.count += 1
        admitted = self.s.add(req)
        limit = self.config.max_model_len
        assert admitted == (limit is None or len(prompt) < limit)
        self.requests.append(req)

    @rule(index=st.integers(0, 50))
    def cancel(self, index) -> None:
        live = [r for r in self.requests if r.status in (Status.WAITING, Status.RUNNING)]
        if live:
            self.s.cancel(live[index % len(live)])

    @rule(data=st.data())
    def step(self, data) -> None:
        if not self.s.has_work:
            return
        self._step(data.draw(st.randoms(use_true_random=False)))

    def _step(self, rng) -> None:
        offered = {r.req_id: rng.randint(0, K + 2) for r in self.s.decode_ready()}
        out = self.s.schedule(offered)
        assert out.num_scheduled_tokens <= self.config.max_num_batched_tokens
        results = {}
        for c in out.chunks:
            assert c.num_lookahead <= min(K, offered.get(c.request.req_id, 0))
            if c.samples:
                a = rng.randint(0, c.num_lookahead)
                results[c.request.req_id] = StepResult(
                    a, [rng.randint(0, 50) for _ in range(a + 1)]
                )
        self.s.update(out, results)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "s"):
            return
        self.s.check_invariants()
        self.manager.check_invariants()
        for r in self.requests:
            assert len(r.output) <= r.max_new_tokens
            if r.max_total_tokens is not None and r.status is not Status.REFUSED:
                assert r.num_tokens <= r.max_total_tokens
            if r.status in (Status.FINISHED, Status.CANCELLED, Status.REFUSED):
                assert not self.manager.has_request(r.req_id)

    def teardown(self) -> None:
        if not hasattr(self, "s"):
            return
        import random

        rng = random.Random(0)
        for _ in range(MAX_DRAIN_STEPS):
            if not self.s.has_work:
                break
            self._step(rng)
            self.s.check_invariants()
        assert not self.s.has_work, "requests starved: the scheduler did not drain"
        for r in self.requests:
            assert r.status in (Status.FINISHED, Status.CANCELLED, Status.REFUSED)
            if r.status is Status.FINISHED:
                assert r.finish_reason == "length"
        assert self.manager.usage() == 0.0
        self.manager.check_invariants()


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
