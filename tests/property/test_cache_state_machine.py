"""Hypothesis state machines over `CacheManager` for hybrid plans, against a simple model.

The model knows each request's verified tokens, computed count and pending step, and
every prefix any request has computed. After every rule: `check_invariants()`, a hit
never exceeds what was really computed with that prefix (and salt), a shared block is a
cached block, a failed allocate changed nothing, full-attention tables hold exactly the
blocks the largest reservation needs, and an engine-style persistent table kept only
from `allocate`'s deltas equals `block_table`. Misuse (floats, negative or huge
counts and token ids, mismatched batch lengths) raises a `HybridKVError` and changes
nothing (snapshot before, compare after).
"""

from __future__ import annotations

from typing import ClassVar

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from hybridkv.cache import NULL_BLOCK, CacheManager
from hybridkv.cache.toy import ToyGroup, toy_plan
from hybridkv.errors import HybridKVError
from hybridkv.ids import cdiv

DOCS = (list(range(1, 25)), [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9, 9], [7] * 30)
MAX_TOKENS = 56


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):  # noqa: B905
        if x != y:
            break
        n += 1
    return n


class CacheMachine(RuleBasedStateMachine):
    plan_kwargs: ClassVar[dict] = {}
    groups: ClassVar[list[ToyGroup]] = []
    eagle = False
    eviction = "lru"
    checkpoint_rules: tuple[str, ...] = ()

    requests = Bundle("requests")

    @initialize()
    def setup(self) -> None:
        self.plan = toy_plan(self.groups, **self.plan_kwargs)
        self.k = self.plan_kwargs.get("num_spec_tokens", 0)
        self.cm = CacheManager(
            self.plan,
            eagle=self.eagle,
            eviction_policy=self.eviction,
            checkpoint_rules=self.checkpoint_rules,
        )
        self.rows: dict[tuple[str, int], list[int]] = {}  # tables kept from deltas only
        self.tokens: dict[str, list[int]] = {}
        self.salt: dict[str, str | None] = {}
        self.computed: dict[str, int] = {}
        self.max_total: dict[str, int] = {}
        self.computed_prefixes: list[tuple[str | None, list[int]]] = []
        self.next_id = 0

    # ----------------------------------------------------------------- rules
    @rule(
        target=requests,
        doc=st.integers(0, len(DOCS) - 1),
        cut=st.integers(1, 30),
        suffix=st.lists(st.integers(1, 3), max_size=6),
        salted=st.booleans(),
        look=st.booleans(),
    )
    def add(self, doc, cut, suffix, salted, look):
        req = f"r{self.next_id}"
        self.next_id += 1
        prompt = DOCS[doc][:cut] + suffix
        salt = "tenant" if salted else None
        self.cm.add_request(req, prompt, cache_salt=salt)
        self.tokens[req], self.salt[req] = list(prompt), salt
        self.computed[req] = 0
        self.max_total[req] = 0
        if look:
            self.lookup(req)
        return req

    @rule(req=requests)
    def lookup(self, req):
        if not self.cm.has_request(req) or self._started(req):
            return
        hit = self.cm.lookup(req)
        toks = self.tokens[req]
        assert 0 <= hit <= len(toks) - 1
        best = max(
            (_common_prefix(toks, p) for s, p in self.computed_prefixes if s == self.salt[req]),
            default=0,
        )
        assert hit <= best, f"hit {hit} but only {best} tokens were ever computed"
        event("hit > 0" if hit else "hit == 0")
        if hit % 4:
            event("hit inside a block (turn end)")
        if 0 < hit < max(g.block_size for g in self.plan.groups):
            event("hit inside a first block or interval (root anchor)")

    @rule(req=requests, data=st.data())
    def step(self, req, data):
        if not self.cm.has_request(req):
            return
        toks, c = self.tokens[req], self.cm.num_computed_tokens(req)
        if len(toks) >= MAX_TOKENS:
            return
        c_before = c
        started = self._started(req)
        if not started:
            c = 0  # allocate will start from the looked-up hit (if any)
        remaining = len(toks) - max(c, self._pending_hit(req))
        if remaining <= 0:
            return
        n = data.draw(st.integers(1, remaining), label="n")
        at_end = max(c, self._pending_hit(req)) + n == len(toks)
        lookahead = data.draw(st.integers(0, self.k + 1), label="L") if at_end else 0
        snapshot = self._snapshot()
        blocks = self.cm.allocate(req, n, lookahead)
        if blocks is None:
            event("allocate failed")
            assert self._snapshot() == snapshot, "a failed allocate changed something"
            assert self.cm.num_computed_tokens(req) == c_before
            return
        self._apply_delta(req, blocks)
        self.cm.check_invariants()
        c = self.cm.num_computed_tokens(req)
        self.max_total[req] = max(self.max_total[req], c + n + lookahead)
        self._check_tables(req)
        max_accept = min(lookahead, self.k)
        accepted = data.draw(st.integers(0, max_accept), label="a") if at_end else 0
        new = []
        if at_end:
            new = data.draw(
                st.lists(st.integers(1, 3), min_size=accepted + 1, max_size=accepted + 1),
                label="new",
            )
        if accepted:
            event("drafts accepted")
        self.cm.commit(req, accepted, new)
        toks.extend(new)
        c2 = c + n + accepted
        assert self.cm.num_computed_tokens(req) == c2
        self.computed_prefixes.append((self.salt[req], list(toks[:c2])))

    @rule(
        reqs=st.lists(requests, min_size=1, max_size=4, unique=True),
        lookahead=st.integers(0, 3),
        accept_all=st.booleans(),
    )
    def batch_decode(self, reqs, lookahead, accept_all):
        ready = [
            r
            for r in reqs
            if self.cm.has_request(r)
            and self._started(r)
            and self.cm.num_computed_tokens(r) == len(self.tokens[r]) - 1
            and len(self.tokens[r]) < MAX_TOKENS
        ]
        if not ready:
            return
        lookahead = min(lookahead, self.k)
        results = self.cm.allocate_batch(ready, [1] * len(ready), [lookahead] * len(ready))
        ok = [r for r, res in zip(ready, results) if res is not None]  # noqa: B905
        for r, res in zip(ready, results):  # noqa: B905
            if res is not None:
                self._apply_delta(r, res)
        a = lookahead if accept_all else 0
        news = [[2] * (a + 1) for _ in ok]
        for r in ok:
            self.max_total[r] = max(
                self.max_total[r], self.cm.num_computed_tokens(r) + 1 + lookahead
            )
        self.cm.commit_batch(ok, [a] * len(ok), news)
        for r, new in zip(ok, news):  # noqa: B905
            self.tokens[r].extend(new)
            c2 = self.cm.num_computed_tokens(r)
            assert c2 == len(self.tokens[r]) - 1
            self.computed_prefixes.append((self.salt[r], list(self.tokens[r][:c2])))

    @rule(req=requests, kind=st.integers(0, 9), bad=st.sampled_from([1.5, -1, 2**63, True]))
    def misuse(self, req, kind, bad):
        """A refused call raises a typed error and changes nothing."""
        if not self.cm.has_request(req):
            return
        pending = self.cm._requests[req].pending
        calls = {
            0: lambda: self.cm.allocate(req, bad),
            1: lambda: self.cm.allocate(req, 1, bad),
            2: lambda: self.cm.allocate_batch([req], [1, 1], [0]),
            3: lambda: self.cm.add_request(f"bad{self.next_id}", [1, bad, 2]),
            4: lambda: self.cm.commit_batch([req], [0], []),
        }
        if pending:
            calls.update(
                {
                    5: lambda: self.cm.commit(req, bad, [1] * 9),
                    6: lambda: self.cm.commit(req, 0, [1, bad]),
                    7: lambda: self.cm.commit(req, float(0), [1]),
                    8: lambda: self.cm.commit(req, 0, "ab"),
                }
            )
        call = calls.get(kind)
        if call is None or (kind in (0, 1) and pending) or (kind in (3, 6) and bad is True):
            return  # a bool token id is an int (0 / 1); a bool count is refused
        before = self._full_snapshot()
        with pytest.raises(HybridKVError):
            call()
        assert self._full_snapshot() == before, f"refused call {kind} ({bad!r}) changed state"
        event(f"misuse {kind}")

    @rule(req=requests)
    def preempt(self, req):
        if self.cm.has_request(req):
            self.cm.preempt(req)
            assert self.cm.num_computed_tokens(req) == 0
            self.max_total[req] = 0

    @rule(req=consumes(requests))
    def finish(self, req):
        if self.cm.has_request(req):
            self.cm.free(req)

    @precondition(lambda self: self.cm.usage() > 0.7)
    @rule(req=requests)
    def relieve_pressure(self, req):
        if self.cm.has_request(req) and self._started(req):
            self.cm.preempt(req)
            self.max_total[req] = 0

    # ----------------------------------------------------------------- checks
    @invariant()
    def invariants(self):
        if not hasattr(self, "cm"):
            return
        self.cm.check_invariants()
        owners: dict[tuple[int, int], int] = {}
        for req in self.tokens:
            if not self.cm.has_request(req):
                continue
            for gid, table in self.cm.block_tables(req).items():
                pool = self.plan.group(gid).pool_id
                for b in set(table) - {NULL_BLOCK}:
                    owners[(pool, b)] = owners.get((pool, b), 0) + 1
        for (pool, b), count in owners.items():
            info = self.cm.block_info(pool, b)
            assert info.ref_count == count
            if count > 1:
                assert info.block_hash is not None, f"block {b} shared but not cached"

    def _check_tables(self, req):
        for group in self.plan.groups:
            table = self.cm.block_table(req, group.group_id)
            if group.kind == "full_attention":
                assert len(table) == cdiv(self.max_total[req], group.block_size)
                assert len(table) <= group.blocks_needed(self.max_total[req])

    def _apply_delta(self, req, delta):
        """Keep per-group rows from deltas alone, as an engine would, and compare."""
        if delta.admitted:
            for key in [k for k in self.rows if k[0] == req]:
                del self.rows[key]
        for gid, gd in delta.groups.items():
            gd.apply(self.rows.setdefault((req, gid), []), NULL_BLOCK)
        for order in delta.copies:  # junction copies: admission only, into the hit's block
            assert delta.admitted
            group = self.plan.group(order.group_id)
            c = self.cm.num_computed_tokens(req)
            assert not group.is_state and order.num_tokens == c % group.block_size > 0
            row = self.rows[(req, order.group_id)]
            assert row[c // group.block_size] == order.dst_block != order.src_block
            assert self.cm.coordinator.pools[group.pool_id].is_cached(order.src_block)
            event("junction copy (mid-block hit)")
        for group in self.plan.groups:
            if group.is_state:
                assert group.group_id not in delta.groups
                continue
            row = self.rows.get((req, group.group_id), [])
            assert row == self.cm.block_table(req, group.group_id), "delta rows drifted"

    def _full_snapshot(self):
        reqs = {
            r: (
                self.cm.token_ids(r),
                self.cm.num_computed_tokens(r),
                self.cm._requests[r].pending,
                self.cm.block_tables(r),
            )
            for r in self.tokens
            if self.cm.has_request(r)
        }
        free = [self.cm.num_free_blocks(p.pool_id) for p in self.plan.pools]
        return reqs, free, self.cm.stats(), self.cm.has_request(f"bad{self.next_id}")

    def _started(self, req) -> bool:
        return self.cm._requests[req].started

    def _pending_hit(self, req) -> int:
        return self.cm._requests[req].pending_hit or 0 if not self._started(req) else 0

    def _snapshot(self):
        tables = {r: self.cm.block_tables(r) for r in self.tokens if self.cm.has_request(r)}
        free = [self.cm.num_free_blocks(p.pool_id) for p in self.plan.pools]
        return tables, free, self.cm.stats().num_evictions


def _machine(name, groups, eagle=False, eviction="lru", rules=(), **plan_kwargs):
    cls = type(
        name,
        (CacheMachine,),
        {
            "groups": groups,
            "plan_kwargs": plan_kwargs,
            "eagle": eagle,
            "eviction": eviction,
            "checkpoint_rules": rules,
        },
    )
    cls.TestCase.settings = settings(
        max_examples=50,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    return cls


F4, S8 = ToyGroup("full", 4), ToyGroup("state", 8)
SW = ToyGroup("sliding", 4, 6)
MACHINES = [
    _machine("FullStateAlignShared", [F4, S8], num_spec_tokens=3, num_blocks=30),
    _machine(
        "FullStateNoneSplit",
        [F4, S8],
        num_spec_tokens=2,
        state_mode="none",
        layout="split",
        num_blocks=20,
    ),
    _machine("FullSlidingShared", [F4, SW], num_spec_tokens=2, num_blocks=24),
    _machine(
        "FullSlidingStateSplit",
        [F4, ToyGroup("sliding", 2, 5), S8],
        num_spec_tokens=4,
        layout="split",
        num_blocks=24,
    ),
    _machine(
        "MainDenseDraft",
        [F4, S8, ToyGroup("full", 4, model="draft")],
        num_spec_tokens=3,
        num_blocks=36,
    ),
    _machine(
        "MainHybridDraft",
        [F4, S8, ToyGroup("full", 4, model="draft"), ToyGroup("state", 4, model="draft")],
        num_spec_tokens=2,
        num_blocks=40,
    ),
    _machine(
        "ChunkedMlaState",
        [ToyGroup("chunked", 4, 8), ToyGroup("mla", 4), ToyGroup("state", 12)],
        num_spec_tokens=2,
        num_blocks=30,
    ),
    _machine(
        "EagleFullSlidingState",
        [F4, SW, S8, ToyGroup("full", 4, model="draft")],
        eagle=True,
        num_spec_tokens=3,
        num_blocks=40,
    ),
    # chain eviction (dead sliding blocks, probation MRU bursts, protected LRU) under a
    # pool small enough that most allocations evict
    _machine(
        "ChainEvictionSlidingStateShared",
        [F4, SW, S8],
        eviction="chain",
        num_spec_tokens=2,
        num_blocks=26,
    ),
    _machine(
        "ChainEvictionEagleSplit",
        [F4, SW, ToyGroup("full", 4, model="draft")],
        eagle=True,
        eviction="chain",
        num_spec_tokens=2,
        layout="split",
        num_blocks=14,
    ),
    # every boundary checkpointed, several checkpoints per step, plus junction ones
    _machine(
        "AllModeJunctionShared",
        [F4, SW, S8],
        state_mode="all",
        rules=("junction",),
        num_spec_tokens=2,
        num_blocks=40,
    ),
    _machine(
        "AlignJunctionChainSplit",
        [F4, ToyGroup("state", 4)],
        rules=("junction",),
        eviction="chain",
        num_spec_tokens=3,
        layout="split",
        num_blocks=16,
    ),
    # turn-end entries: partial last blocks taken over by the next hit, state at the end
    _machine(
        "TurnEndJunctionSlidingStateShared",
        [F4, SW, S8],
        rules=("junction", "turn_end"),
        num_spec_tokens=2,
        num_blocks=30,
    ),
    # split: the attention match (blocks of 4) falls inside state intervals of 8, where
    # junction checkpoints go under turn-end keys
    _machine(
        "TurnEndJunctionInsideIntervalSplit",
        [F4, S8],
        rules=("junction", "turn_end"),
        eviction="chain",
        num_spec_tokens=1,
        layout="split",
        num_blocks=16,
    ),
    _machine(
        "TurnEndAllChainEagleSplit",
        [F4, SW, S8, ToyGroup("full", 4, model="draft")],
        eagle=True,
        eviction="chain",
        state_mode="all",
        rules=("turn_end",),
        num_spec_tokens=3,
        layout="split",
        num_blocks=18,
    ),
    # junction copies: the full-block match extended by a copy of a cached block's head
    _machine(
        "JunctionCopyFullStateShared",
        [F4, ToyGroup("state", 4)],
        rules=("junction", "turn_end"),
        num_blocks=40,
    ),
    _machine(
        "TurnEndChunkedMlaStateDraft",
        [ToyGroup("chunked", 4, 8), ToyGroup("mla", 4), ToyGroup("state", 12)],
        rules=("turn_end",),
        num_spec_tokens=2,
        num_blocks=30,
    ),
    _machine(
        "FullSlidingStateNoneShared",
        [F4, SW, S8],
        num_spec_tokens=1,
        state_mode="none",
        num_blocks=30,
    ),
]

for _cls in MACHINES:
    globals()[f"Test{_cls.__name__}"] = _cls.TestCase


@pytest.mark.slow
@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.__name__)
def test_soak(machine):
    from hypothesis.stateful import run_state_machine_as_test

    # long runs: Hypothesis' speed and data-size health checks are not what this tests
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=400,
            stateful_step_count=80,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
