"""`VllmKVCacheManager` driven the way vLLM's scheduler drives its manager, checked by a
fake worker that reads the rows exactly as vLLM's worker does (`hybridkv.vllm.rows`).

No vLLM needed: requests are stand-ins with the fields the facade reads. The worker
keeps, per block, what it holds: attention slots hold token ids, a state block holds the
token sequence the state has consumed. Before every step it checks that the request's
computed tokens are exactly what it reads (attention: every slot below ``c``; state:
the state it starts from), so a wrong row, column, copy or commit fails the test.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.errors import HybridKVError, InvariantError
from hybridkv.vllm.kv_manager import VllmKVCacheManager, checkpoint_rules_from_env
from hybridkv.vllm.kv_plan import UnsupportedVllmSetup, VllmGroup, vllm_groups
from hybridkv.vllm.rows import split_prefill_chunk


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    max_new: int
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    lora_request: Any = None
    cache_salt: str | None = None
    skip_reading_prefix_cache: bool = False
    spec: int = 0  # drafts scheduled in the step in flight
    drafts: list[int] = field(default_factory=list)
    produced: int = 0
    num_output_placeholders: int = 0  # async scheduling: tokens sampled by steps in flight
    epoch: int = 0  # preemptions so far: an output from an earlier epoch is stale

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class Blocks:
    """vLLM's ``KVCacheBlocks`` as far as the facade builds it."""

    def __init__(self, blocks: tuple) -> None:
        self.blocks = blocks

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in g] for g in self.blocks)


@dataclass
class FakeWorker:
    """vLLM's worker as far as the rows go. A state block holds what its state has
    consumed, in two parts as vLLM keeps it: the ssm state, and the conv window, which a
    speculative step leaves at one offset per draft (``conv[block][i]``: after the
    step's first ``i + 1`` tokens). ``acc``: the worker's ``num_accepted_tokens``."""

    groups: list[VllmGroup]
    align: bool
    num_spec: int = 0
    # a draft model's attention groups write its KV up to ``lookahead`` slots past the
    # step (vLLM's drafter runs K positions ahead); every attention group's row must
    # cover them (vLLM's scheduler reserves ``num_lookahead_tokens`` in each)
    draft_groups: frozenset[int] = frozenset()
    lookahead: int = 0
    # an MTP / EAGLE head's groups: a slot holds (token p, token p + 1), the head's KV at
    # p being a function of both (vLLM's drafter runs on the next token's embedding); a
    # position whose next token the step has not sampled yet holds (token p, None)
    head_groups: frozenset[int] = frozenset()
    rows: dict[str, list[list[int]]] = field(default_factory=dict)
    cols: dict[str, dict[int, int]] = field(default_factory=dict)
    acc: dict[str, int] = field(default_factory=dict)
    slots: dict[tuple[int, int], int] = field(default_factory=dict)  # (block, slot) -> token
    ssm: dict[int, tuple[int, ...]] = field(default_factory=dict)  # block -> consumed
    conv: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)

    def drop(self, req_id: str) -> None:
        self.rows.pop(req_id, None)
        self.cols.pop(req_id, None)
        self.acc.pop(req_id, None)

    def copy(self, copies: list[tuple[int, int]]) -> None:
        """The step's block copies, before the step runs (every layer: state and slots)."""
        for src, dst in copies:
            self.ssm[dst] = self.ssm.get(src, ())
            self.conv[dst] = list(self.conv.get(src, [()]))
            for g in self.groups:
                for s in range(g.block_size):
                    if (src, s) in self.slots:
                        self.slots[(dst, s)] = self.slots[(src, s)]

    def _move(self, src_col: int, bias: int, dst_col: int, row: list[int]) -> None:
        """vLLM's state copy: ssm from column ``src + bias``, conv window at offset
        ``bias`` of column ``src``, joined into column ``dst`` (offset 0)."""
        self.ssm[row[dst_col]] = self.ssm.get(row[src_col + bias], ())
        self.conv[row[dst_col]] = [self.conv.get(row[src_col], [()])[bias]]

    def run(self, req: FakeRequest, n: int, drafts: int = 0) -> None:
        """One step of ``n`` scheduled tokens incl. ``drafts`` from
        ``req.num_computed_tokens - n`` (vLLM advanced the count already)."""
        c = req.num_computed_tokens - n
        tokens = req.all_token_ids
        rows = self.rows[req.request_id]
        spec_row = self.num_spec > 0 and n - drafts == 1 and c >= req.num_prompt_tokens - 1
        for g in self.groups:
            row = rows[g.group_id]
            B = g.block_size
            if g.kind == "state":
                cols = self.cols.setdefault(req.request_id, {})
                acc = self.acc.get(req.request_id, 1)
                cur = -(-(c + n) // B) - 1 if self.align else 0
                prev = cols.get(g.group_id, (c - 1) // B if self.align else 0)
                if self.align and prev not in (-1, cur):
                    self._move(prev, acc - 1, cur, row)
                    acc = 1
                if c:
                    got = (self.ssm.get(row[cur + acc - 1]), self.conv[row[cur]][acc - 1])
                    assert got == (tuple(tokens[:c]),) * 2, (req.request_id, c, acc)
                if spec_row:
                    for t in range(drafts + 1):
                        self.ssm[row[cur + t]] = tuple(tokens[: c + 1 + t])
                    self.conv[row[cur]] = [tuple(tokens[: c + 1 + t]) for t in range(drafts + 1)]
                else:
                    self.ssm[row[cur]] = tuple(tokens[: c + n])
                    self.conv[row[cur]] = [tuple(tokens[: c + n])]
                    acc = 1
                cols[g.group_id] = cur
                self.acc[req.request_id] = acc
                continue
            lo = max(0, c - g.span_tokens + 1) if g.kind == "sliding" else 0
            head = g.group_id in self.head_groups
            for p in range(lo, c):
                want = (tokens[p], tokens[p + 1]) if head else tokens[p]
                assert self.slots.get((row[p // B], p % B)) == want, (req.request_id, p)
            real = len(tokens) - drafts  # the step's drafts sit past the request's tokens
            for p in range(c, c + n):
                token = tokens[p] if p < len(tokens) else -1
                if head:
                    self.slots[(row[p // B], p % B)] = (
                        token,
                        tokens[p + 1] if p + 1 < real else None,
                    )
                else:
                    self.slots[(row[p // B], p % B)] = token
            if self.lookahead and g.kind == "full":
                assert len(row) * B >= c + n + self.lookahead, (req.request_id, g.group_id)
            if g.group_id in self.draft_groups:
                for p in range(c + n, c + n + self.lookahead):  # the drafter's own KV
                    self.slots[(row[p // B], p % B)] = -2

    def sampled(self, req: FakeRequest, c: int, num_verified: int) -> None:
        """The head's KV of the step's verified positions, now that the token after the
        last of them is sampled (vLLM's drafter runs after sampling, in the same step)."""
        tokens = req.all_token_ids
        for gid in self.head_groups:
            row = self.rows[req.request_id][gid]
            B = next(g.block_size for g in self.groups if g.group_id == gid)
            for p in range(c, min(c + num_verified, len(tokens) - 1)):
                self.slots[(row[p // B], p % B)] = (tokens[p], tokens[p + 1])

    def accepted(self, req: FakeRequest, c: int, n: int, drafts: int, accepted: int) -> None:
        """After sampling a step from ``c`` (``n`` tokens incl. ``drafts``): the worker's
        ``num_accepted_tokens`` and, in align mode with drafts, the post-copy of a
        boundary the accepted tokens reached into that boundary's column."""
        if not self.num_spec or n - drafts != 1 or req.request_id not in self.rows:
            return
        self.acc[req.request_id] = accepted + 1
        if not self.align:
            return
        for g in self.groups:
            if g.kind != "state":
                continue
            B = g.block_size
            row = self.rows[req.request_id][g.group_id]
            cur = self.cols[req.request_id][g.group_id]
            running, new = c + 1, c + 1 + accepted
            boundary = new // B * B
            if boundary >= running:
                dest = boundary // B - 1
                self._move(cur, boundary - running, dest, row)
                if dest == cur:
                    self.acc[req.request_id] = 1


def _manager(
    groups: list[VllmGroup],
    num_blocks: int,
    *,
    caching: bool = True,
    spec: int = 0,
    lookahead: int = 0,
    async_steps: bool = False,
):
    return VllmKVCacheManager(
        groups,
        num_blocks=num_blocks,
        enable_caching=caching,
        state_mode="align" if caching else "none",
        num_spec_tokens=spec,
        blocks_cls=Blocks,
        num_lookahead_tokens=lookahead,
        async_steps=async_steps,
    )


def _drive(
    groups: list[VllmGroup],
    num_blocks: int,
    sessions: int,
    turns: int,
    seed: int,
    *,
    spec: int = 0,
    budget: int = 96,
    caching: bool = True,
    shared: int = 0,
    draft_groups: frozenset[int] = frozenset(),
    head_groups: frozenset[int] = frozenset(),
    trim_at_stop: bool = False,
) -> VllmKVCacheManager:
    """A scheduler loop in vLLM's shape: FCFS admission with a token budget, chunked
    prefill split where hybridkv checkpoints, preemption of the newest on failure,
    multi-turn sessions (the next prompt extends the previous context). With
    ``draft_groups`` (a draft model's attention groups) every allocation carries vLLM's
    lookahead of K tokens, as vLLM's scheduler passes it for draft models. ``head_groups``:
    an MTP head's groups (its KV at p depends on token p + 1; the head drafts, so vLLM
    passes the lookahead too). ``trim_at_stop``: vLLM 0.33's count at a stop inside a
    step (the tokens past the stop leave the computed count, the last kept one too)
    instead of vLLM 0.32's (the count keeps them)."""
    rng = random.Random(seed)
    lookahead = spec if draft_groups or head_groups else 0
    kv = _manager(groups, num_blocks, caching=caching, spec=spec, lookahead=lookahead)
    worker = FakeWorker(
        groups,
        align=caching,
        num_spec=spec,
        draft_groups=draft_groups | head_groups,
        lookahead=lookahead,
        head_groups=head_groups,
    )
    B = min((g.block_size for g in groups if g.kind == "state"), default=0)
    system = [rng.randrange(1, 50) for _ in range(shared)]  # a prompt every session shares
    contexts = [
        system + [rng.randrange(1, 50) for _ in range(rng.randrange(5, 40))]
        for _ in range(sessions)
    ]
    for turn in range(turns):
        waiting = [
            FakeRequest(f"s{i}t{turn}", list(ctx), len(ctx), rng.randrange(1, 12))
            for i, ctx in enumerate(contexts)
        ]
        running: list[FakeRequest] = []
        finished: list[FakeRequest] = []
        steps = 0
        while waiting or running:
            steps += 1
            assert steps < 2000
            kv.settle({r.request_id: r for r in running + waiting})
            kv.new_step_starts()
            scheduled: list[tuple[FakeRequest, int]] = []
            appended: dict[str, Any] = {}
            left = budget
            for req in list(running):
                if req not in running:  # preempted for an earlier one this step
                    continue
                drafts = 0
                if spec and req.num_computed_tokens == req.num_tokens - 1:  # decoding
                    drafts = rng.randrange(0, spec + 1)  # the draft count varies per step
                n = req.num_tokens - req.num_computed_tokens + drafts
                n = min(n, left)
                if B and caching:
                    n = split_prefill_chunk(
                        req.num_computed_tokens, n, req.num_prompt_tokens, B, kv.junction_point(req)
                    )
                if n <= 0:
                    continue
                while (blocks := kv.allocate_slots(req, n, num_lookahead_tokens=lookahead)) is None:
                    victim = running.pop()
                    kv.free(victim)
                    worker.drop(victim.request_id)
                    victim.num_computed_tokens = 0
                    victim.num_preemptions += 1
                    waiting.insert(0, victim)
                    scheduled = [(r, m) for r, m in scheduled if r is not victim]
                    if victim is req:
                        break
                else:
                    req.spec = max(0, req.num_computed_tokens + n - req.num_tokens)
                    scheduled.append((req, n))
                    appended[req.request_id] = blocks
                    left -= n
            while waiting and left > 0:
                req = waiting[0]
                _, hit, _ = kv.get_computed_blocks(req)
                assert hit < req.num_tokens
                n = min(req.num_tokens - hit, left)
                if B and caching:
                    n = split_prefill_chunk(
                        hit, n, req.num_prompt_tokens, B, kv.junction_point(req)
                    )
                if (
                    kv.allocate_slots(
                        req, n, num_new_computed_tokens=hit, num_lookahead_tokens=lookahead
                    )
                    is None
                ):
                    break
                waiting.pop(0)
                req.num_computed_tokens = hit
                req.spec = 0
                running.append(req)
                scheduled.append((req, n))
                left -= n
            worker.copy(kv.take_kv_cache_block_copies()[0])
            for req, n in scheduled:
                blocks = appended.get(req.request_id)
                if blocks is None:  # admitted this step: vLLM sends the whole row
                    worker.rows[req.request_id] = [
                        list(r) for r in kv.get_block_ids(req.request_id)
                    ]
                else:  # running: vLLM sends what the allocation appended
                    for row, new in zip(
                        worker.rows[req.request_id], blocks.get_block_ids(), strict=True
                    ):
                        row.extend(new)
                req.num_computed_tokens += n
                # drafts in flight: the tokens the drafter proposed
                req.drafts = [rng.randrange(1, 50) for _ in range(req.spec)]
                req.all_token_ids.extend(req.drafts)
                worker.run(req, n, req.spec)
                del req.all_token_ids[len(req.all_token_ids) - len(req.drafts) :]
            kv.mark_executed()
            for req, n in scheduled:
                if req.num_computed_tokens < req.num_tokens:
                    worker.sampled(req, req.num_computed_tokens - n, n)  # a prefill chunk
                    continue
                accepted = rng.randrange(0, req.spec + 1) if req.spec else 0
                worker.accepted(req, req.num_computed_tokens - n, n, req.spec, accepted)
                req.num_computed_tokens -= req.spec - accepted
                new = [*req.drafts[:accepted], rng.randrange(1, 50)]
                # vLLM keeps only the tokens up to max_tokens; 0.32's computed count does
                # not shrink with them, 0.33's does
                kept = new[: req.max_new - req.produced]
                if trim_at_stop:
                    req.num_computed_tokens -= len(new) - len(kept)
                sampled, new = new, kept
                req.all_token_ids.extend(new)
                verified = n - req.spec + accepted
                worker.sampled(req, req.num_computed_tokens - verified, verified)
                req.produced += len(new)
                if req.produced >= req.max_new:
                    running.remove(req)
                    # what the worker sampled (vLLM's ModelRunnerOutput)
                    kv.outputs_arriving({req.request_id: 0}, [sampled])
                    kv.free(req)
                    worker.drop(req.request_id)
                    finished.append(req)
            kv.check_invariants()
        for req in finished:
            i = int(req.request_id[1:].split("t")[0])
            contexts[i] = req.all_token_ids + [rng.randrange(1, 50) for _ in range(5)]
    kv.check_invariants()
    assert kv.usage == 0.0
    assert kv.cache.num_free_blocks(0) == num_blocks - 1
    return kv


@dataclass
class Entry:
    """One request's step in a schedule, as the worker receives it."""

    req: FakeRequest
    epoch: int
    num_scheduled: int  # tokens incl. drafts
    computed: int  # the scheduler's computed tokens before it (all earlier drafts accepted)
    drafts: int  # drafts scheduled (their ids are the worker's own)
    row: Any  # the whole row for an admission, else the blocks appended per group
    start: list[int] | None  # an admission: the tokens the worker starts from


@dataclass
class Flight:
    """One schedule's output on its way to the worker, applied when the worker runs it
    (vLLM's worker applies a scheduler output at the start of its step)."""

    drops: list[str]  # requests finished, aborted or preempted since the last output
    copies: list[tuple[int, int]]
    entries: list[Entry]


def _drive_async(
    groups: list[VllmGroup],
    num_blocks: int,
    sessions: int,
    turns: int,
    seed: int,
    *,
    budget: int = 96,
    caching: bool = True,
    shared: int = 0,
    abort_rate: float = 0.05,
    spec: int = 0,
    draft_groups: frozenset[int] = frozenset(),
    head_groups: frozenset[int] = frozenset(),
) -> VllmKVCacheManager:
    """vLLM's async scheduling as its engine core runs it (a batch queue of 2): schedule
    ``k + 1`` before step ``k`` ran and before its output reaches the scheduler, so a
    decode step starts from a token the scheduler has not seen (vLLM's output
    placeholder). The worker keeps its own copy of each request's tokens (it samples
    them) and runs step ``k`` only after schedule ``k + 1`` (blocks freed there may be
    reused by ``k + 1``, which runs after ``k``). Preemption resets a request (its
    output in flight is stale and dropped), aborts free a request with a step in
    flight, a request reaching ``max_new`` is freed while the next step computes its
    last token. The worker checks every read as in `_drive`.

    With ``spec`` (K) drafts, as vLLM 0.33's AsyncScheduler and V1 worker in align mode
    run them: a decode step carries 0..K draft placeholders whose ids only the worker
    knows; the scheduler counts every draft as accepted when it schedules the next step
    (``k + 1`` starts after all of ``k``'s drafts) and rolls back the rejected ones
    when ``k``'s output arrives; the worker runs ``k + 1`` from the real start (it
    applies ``k``'s acceptance before laying out the state columns). ``draft_groups`` /
    ``head_groups`` as in `_drive` (vLLM passes the lookahead K with every allocation)."""
    rng = random.Random(seed)
    lookahead = spec if draft_groups or head_groups else 0
    kv = _manager(
        groups, num_blocks, caching=caching, spec=spec, lookahead=lookahead, async_steps=True
    )
    worker = FakeWorker(
        groups,
        align=caching,
        num_spec=spec,
        draft_groups=draft_groups | head_groups,
        lookahead=lookahead,
        head_groups=head_groups,
    )
    wtokens: dict[str, list[int]] = {}  # the worker's tokens per request
    wcomputed: dict[str, int] = {}
    B = min((g.block_size for g in groups if g.kind == "state"), default=0)
    system = [rng.randrange(1, 50) for _ in range(shared)]
    contexts = [
        system + [rng.randrange(1, 50) for _ in range(rng.randrange(5, 40))]
        for _ in range(sessions)
    ]
    spec_len: dict[str, int] = {}  # draft placeholders a request's next step carries

    def run_on_worker(flight: Flight) -> dict[str, tuple[int, list[int]]]:
        """The worker's step: drops, copies, rows, then every request's tokens; returns
        per request that samples: (drafts accepted, tokens sampled)."""
        for req_id in flight.drops:
            worker.drop(req_id)
            wtokens.pop(req_id, None)
            wcomputed.pop(req_id, None)
        worker.copy(flight.copies)
        out: dict[str, tuple[int, list[int]]] = {}
        for e in flight.entries:
            rid = e.req.request_id
            if e.start is not None:
                worker.rows[rid] = e.row
                wtokens[rid], wcomputed[rid] = e.start, e.computed
            else:
                for old, new in zip(worker.rows[rid], e.row, strict=True):
                    old.extend(new)
            c, n, d = wcomputed[rid], e.num_scheduled, e.drafts
            # the scheduler started it after every draft of the step before
            assert 0 <= e.computed - c <= spec, (rid, e.computed, c)
            drafted = [rng.randrange(1, 50) for _ in range(d)]
            view = FakeRequest(rid, wtokens[rid] + drafted, e.req.num_prompt_tokens, e.req.max_new)
            view.num_computed_tokens = c + n
            worker.run(view, n, d)
            if c + n - d < len(wtokens[rid]):  # a prefill chunk: nothing sampled
                wcomputed[rid] = c + n
                del view.all_token_ids[len(wtokens[rid]) :]
                worker.sampled(view, c, n)
                continue
            accepted = rng.randrange(0, d + 1)
            worker.accepted(view, c, n, d, accepted)
            new = [*drafted[:accepted], rng.randrange(1, 50)]
            wtokens[rid].extend(new)
            wcomputed[rid] = c + n - d + accepted
            view.all_token_ids = wtokens[rid]
            worker.sampled(view, c, n - d + accepted)
            out[rid] = (accepted, new)
        return out

    for turn in range(turns):
        waiting = [
            FakeRequest(f"s{i}t{turn}", list(ctx), len(ctx), rng.randrange(1, 12))
            for i, ctx in enumerate(contexts)
        ]
        running: list[FakeRequest] = []
        done: list[FakeRequest] = []
        drops: list[str] = []
        in_flight: Flight | None = None
        steps = 0
        while waiting or running or in_flight is not None:
            steps += 1
            assert steps < 3000
            kv.settle({r.request_id: r for r in running + waiting})
            kv.new_step_starts()
            entries: list[Entry] = []
            preempted = False
            left = budget
            for req in list(running):
                if req not in running:
                    continue
                P = req.num_output_placeholders
                if P and req.num_computed_tokens + 2 - P >= req.num_prompt_tokens + req.max_new:
                    continue  # vLLM's skip: the step in flight reaches max_tokens
                if rng.random() < 0.1:
                    # left out of this schedule (budget, batch size, a grammar wait): its
                    # output arrives after its last step was committed
                    continue
                rid = req.request_id
                n = req.num_tokens + spec_len.get(rid, 0) + P - req.num_computed_tokens
                n = min(n, left)
                if B and caching:
                    n = split_prefill_chunk(
                        req.num_computed_tokens, n, req.num_prompt_tokens, B, kv.junction_point(req)
                    )
                if n <= 0:
                    continue
                while (blocks := kv.allocate_slots(req, n, num_lookahead_tokens=lookahead)) is None:
                    # the newest, or (as vLLM's priority policy may) any request, one
                    # scheduled in this very schedule included: its step never runs
                    victim = running.pop(rng.randrange(len(running)) if rng.random() < 0.3 else -1)
                    kv.free(victim)
                    drops.append(victim.request_id)
                    victim.num_computed_tokens = victim.num_output_placeholders = 0
                    spec_len.pop(victim.request_id, None)
                    victim.num_preemptions += 1
                    victim.epoch += 1
                    waiting.insert(0, victim)
                    entries = [e for e in entries if e.req is not victim]
                    preempted = True
                    if victim is req:
                        break
                else:
                    d = max(0, n + req.num_computed_tokens - req.num_tokens - P)
                    entries.append(
                        Entry(
                            req,
                            req.epoch,
                            n,
                            req.num_computed_tokens,
                            d,
                            blocks.get_block_ids(),
                            None,
                        )
                    )
                    left -= n
            while waiting and left > 0 and not preempted:
                req = waiting[0]
                _, hit, _ = kv.get_computed_blocks(req)
                assert hit < req.num_tokens
                n = min(req.num_tokens - hit, left)
                if B and caching:
                    n = split_prefill_chunk(
                        hit, n, req.num_prompt_tokens, B, kv.junction_point(req)
                    )
                if (
                    kv.allocate_slots(
                        req, n, num_new_computed_tokens=hit, num_lookahead_tokens=lookahead
                    )
                    is None
                ):
                    break
                waiting.pop(0)
                req.num_computed_tokens = hit
                running.append(req)
                row = [list(r) for r in kv.get_block_ids(req.request_id)]
                entries.append(Entry(req, req.epoch, n, hit, 0, row, list(req.all_token_ids)))
                left -= n
            kv.schedule_done()
            for e in entries:  # AsyncScheduler's _update_after_schedule
                req = e.req
                req.num_computed_tokens += e.num_scheduled
                spec_len.pop(req.request_id, None)
                if req.num_computed_tokens >= req.num_tokens:
                    req.num_output_placeholders += 1 + e.drafts
                    # the drafter proposes 0..K tokens for the next step
                    spec_len[req.request_id] = rng.randrange(0, spec + 1) if spec else 0
            flight = Flight(drops, kv.take_kv_cache_block_copies()[0], entries)
            drops = []
            if running and rng.random() < abort_rate:  # an abort while a step is in flight
                victim = rng.choice(running)
                running.remove(victim)
                kv.free(victim)
                drops.append(victim.request_id)
            # the worker runs the step scheduled before (after this schedule), then its
            # output reaches the scheduler (vLLM's update_from_output)
            if in_flight is not None:
                sampled = run_on_worker(in_flight)
                order = list(sampled)
                kv.outputs_arriving(
                    {r: i for i, r in enumerate(order)}, [sampled[r][1] for r in order]
                )
                for e in in_flight.entries:
                    req, rid = e.req, e.req.request_id
                    if req not in running or e.epoch != req.epoch or rid not in sampled:
                        continue  # aborted, stale (preempted since), or a prefill chunk
                    accepted, new = sampled[rid]
                    rejected = e.drafts - accepted
                    req.num_computed_tokens -= rejected
                    req.num_output_placeholders -= rejected
                    kept = new[: req.max_new - req.produced]
                    req.all_token_ids.extend(kept)
                    req.produced += len(kept)
                    req.num_computed_tokens -= len(new) - len(kept)  # trimmed at the stop
                    req.num_output_placeholders -= len(new)
                    if req.produced >= req.max_new:
                        running.remove(req)
                        kv.free(req)
                        spec_len.pop(rid, None)
                        drops.append(rid)
                        done.append(req)
                kv.outputs_processed(
                    {r.request_id: r for r in running},
                    [e.req.request_id for e in in_flight.entries],
                )
            kv.check_invariants()
            in_flight = flight if flight.entries or flight.drops else None
            if in_flight is not None and not (waiting or running):
                run_on_worker(in_flight)  # the last step: nothing left to schedule
                in_flight = None
        for req in done:
            i = int(req.request_id[1:].split("t")[0])
            contexts[i] = req.all_token_ids + [rng.randrange(1, 50) for _ in range(5)]
    kv.check_invariants()
    assert kv.usage == 0.0
    assert kv.cache.num_free_blocks(0) == num_blocks - 1
    return kv


HYBRID = [VllmGroup(0, "full", 8), VllmGroup(1, "state", 8)]


def test_multi_turn_hybrid_reads_exactly_its_tokens() -> None:
    kv = _drive(HYBRID, 200, sessions=4, turns=3, seed=1)
    assert kv.cache.stats().num_hit_tokens > 0


def test_shared_system_prompt_junctions() -> None:
    """Sessions share a 29-token system prompt: junction checkpoints (state at the
    boundary below where prompts part, attention's partial block copied) let later
    sessions hit past the align boundaries; every read stays exact."""
    kv = _drive(HYBRID, 200, sessions=5, turns=2, seed=5, shared=29, budget=40)
    assert kv.cache.stats().num_hit_tokens > 0


def test_turn_end_hits_reach_the_previous_context() -> None:
    """Turn 2 of one session resumes at the end of turn 1's computed tokens."""
    kv = _manager(HYBRID, 100)
    worker = FakeWorker(HYBRID, align=True)
    req = FakeRequest("a", list(range(1, 21)), 20, 3)
    assert kv.get_computed_blocks(req)[1] == 0
    kv.new_step_starts()
    assert kv.allocate_slots(req, 16) is not None  # split: the chunk ends at 16
    worker.rows["a"] = [list(r) for r in kv.get_block_ids("a")]
    req.num_computed_tokens = 16
    worker.run(req, 16)
    kv.mark_executed()
    kv.settle({"a": req})
    kv.new_step_starts()
    kv.allocate_slots(req, 4)
    req.num_computed_tokens = 20
    worker.rows["a"] = [list(r) for r in kv.get_block_ids("a")]
    worker.run(req, 4)
    kv.mark_executed()
    req.all_token_ids.append(99)
    kv.free(req)
    nxt = FakeRequest("b", [*range(1, 21), 99, 5, 6], 23, 1)
    assert kv.get_computed_blocks(nxt)[1] == 20  # the turn end (every computed token)
    kv.check_invariants()


def test_sliding_window_with_varying_drafts() -> None:
    """Attention-only (sliding + full), drafts 0..3 per step (the #39271 shape: the draft
    count shrinks and grows): nothing raises, every read is right, all blocks return."""
    groups = [VllmGroup(0, "full", 4), VllmGroup(1, "sliding", 4, 8)]
    _drive(groups, 300, sessions=4, turns=2, seed=2, spec=3)


def test_hybrid_with_varying_drafts_reads_exactly_its_tokens() -> None:
    """Drafts 0..3 per step on a hybrid (the #39271 shape: the count shrinks to 0 and
    grows again): the worker's state rows with draft columns, pre-copies and boundary
    post-copies always give each step exactly the state of its computed tokens, and
    multi-turn chat still hits."""
    kv = _drive(HYBRID, 300, sessions=4, turns=3, seed=11, spec=3)
    assert kv.state_layout == "columns"
    assert kv.cache.stats().num_hit_tokens > 0


def test_hybrid_drafts_without_prefix_caching() -> None:
    """none mode with drafts: a fixed row of 1 + K state blocks, read at the accepted
    draft's column, no copies."""
    kv = _drive(HYBRID, 200, sessions=3, turns=2, seed=12, spec=3, caching=False)
    assert kv.cache.stats().num_hit_tokens == 0


def test_hybrid_drafts_under_pressure() -> None:
    _drive(HYBRID, 40, sessions=5, turns=2, seed=13, spec=3, budget=40)


# the seed pair's shape: main attention, Gated DeltaNet state, a draft model's attention
# group (its own block size, as vLLM's grouping may give it)
DRAFT_MODEL = [VllmGroup(0, "state", 8), VllmGroup(1, "full", 8), VllmGroup(2, "full", 16)]


def test_draft_model_lookahead_in_attention_groups_only() -> None:
    """A draft model (vLLM passes ``num_lookahead_tokens`` = K with every allocation):
    both attention groups, main and draft, hold K slots past the step, where the
    drafter writes its own KV; the state group's running column follows the drafts
    alone, so every read (state columns, pre-copies, post-copies) is right."""
    kv = _drive(DRAFT_MODEL, 300, sessions=4, turns=3, seed=21, spec=3, draft_groups=frozenset({2}))
    assert kv.cache.stats().num_hit_tokens > 0


def test_draft_model_hits_cover_main_and_draft_groups() -> None:
    """A prefix hit is one length for every group: a second turn starts with the main
    model's and the draft's KV below the hit both in place (the worker reads both)."""
    kv = _drive(
        DRAFT_MODEL,
        300,
        sessions=3,
        turns=2,
        seed=22,
        spec=3,
        shared=20,
        draft_groups=frozenset({2}),
    )
    assert kv.cache.stats().num_hit_tokens > 0


def test_draft_model_under_pressure() -> None:
    _drive(
        DRAFT_MODEL,
        40,
        sessions=5,
        turns=2,
        seed=23,
        spec=3,
        budget=40,
        draft_groups=frozenset({2}),
    )


# an MTP head: its layer joins the main attention group (vLLM's grouping), which vLLM
# flags ``is_eagle_group``; hybridkv keys that group's blocks one token ahead
MTP = [VllmGroup(0, "state", 8), VllmGroup(1, "full", 8, draft_head=True)]


def test_mtp_head_reads_kv_of_its_next_tokens() -> None:
    """Sessions share a 16-token system prompt (two blocks) and diverge right after it:
    a block's head KV at its last slot was written with the next token of whoever
    computed it, so a block is hit only where that token matches too; multi-turn hits
    and turn ends still land (every read checked against (token p, token p + 1))."""
    kv = _drive(
        MTP, 300, sessions=4, turns=3, seed=31, spec=3, shared=16, head_groups=frozenset({1})
    )
    assert kv.cache.stats().num_hit_tokens > 0


def test_mtp_head_keyed_like_the_main_model_reads_stale_kv() -> None:
    """The check above can fail: the same group keyed by its own tokens only (vLLM 0.32
    with ``disable_eagle_block_drop``) hands a session the head KV another session
    wrote with a different next token."""
    plain = [VllmGroup(0, "state", 8), VllmGroup(1, "full", 8)]
    with pytest.raises(AssertionError, match=r"\('s\dt\d', \d+\)"):
        _drive(
            plain, 300, sessions=4, turns=3, seed=31, spec=3, shared=16, head_groups=frozenset({1})
        )


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(40, 120),
    budget=st.integers(9, 64),
    shared=st.sampled_from([0, 8, 13, 16]),
    spec=st.integers(1, 3),
)
def test_random_lives_mtp_head(
    seed: int, num_blocks: int, budget: int, shared: int, spec: int
) -> None:
    _drive(
        MTP,
        num_blocks,
        sessions=3,
        turns=2,
        seed=seed,
        budget=budget,
        shared=shared,
        spec=spec,
        head_groups=frozenset({1}),
    )


def test_pressure_preempts_and_recovers() -> None:
    _drive(HYBRID, 24, sessions=6, turns=2, seed=3, budget=40)


def test_prefix_caching_off_uses_one_state_block() -> None:
    kv = _drive(HYBRID, 120, sessions=3, turns=2, seed=4, caching=False)
    assert kv.cache.stats().num_hit_tokens == 0


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(48, 120),  # one request's largest need fits (~100 tokens)
    block=st.sampled_from([4, 8]),
    budget=st.integers(9, 64),
    shared=st.sampled_from([0, 13, 20]),
)
def test_random_lives_hybrid(
    seed: int, num_blocks: int, block: int, budget: int, shared: int
) -> None:
    groups = [VllmGroup(0, "full", block), VllmGroup(1, "state", block)]
    _drive(groups, num_blocks, sessions=3, turns=2, seed=seed, budget=budget, shared=shared)


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(48, 120),
    block=st.sampled_from([4, 8]),
    budget=st.integers(9, 64),
    shared=st.sampled_from([0, 13, 20]),
    spec=st.integers(1, 3),
    caching=st.booleans(),
    trim_at_stop=st.booleans(),
)
def test_random_lives_hybrid_with_drafts(
    seed: int,
    num_blocks: int,
    block: int,
    budget: int,
    shared: int,
    spec: int,
    caching: bool,
    trim_at_stop: bool,
) -> None:
    """Random lives with drafts on a hybrid (vLLM 0.32's or 0.33's count at a stop):
    every state read is exactly the request's computed tokens, invariants hold after
    every step, every block comes back."""
    groups = [VllmGroup(0, "full", block), VllmGroup(1, "state", block)]
    _drive(
        groups,
        num_blocks,
        sessions=3,
        turns=2,
        seed=seed,
        budget=budget,
        shared=shared,
        spec=min(spec, block - 1),
        caching=caching,
        trim_at_stop=trim_at_stop,
    )


def test_stop_inside_a_step_with_vllm_033_counts() -> None:
    """vLLM 0.33 takes the tokens past a stop out of the computed count, the last kept
    one too, while its worker may have accepted drafts past it (and moved a boundary's
    state into the running column): where vLLM dropped tokens at a stop, a freed
    request counts every kept token computed, so the cache sees no token after them and
    no turn end claims a state the worker moved on from."""
    for seed in range(12):
        _drive(HYBRID, 300, sessions=4, turns=3, seed=seed, spec=3, shared=16, trim_at_stop=True)


def test_mtp_turn_end_after_a_stop_at_the_bonus_token() -> None:
    """A turn that stops at its step's last token (vLLM dropped nothing): the turn end
    covers every computed token, the MTP head's group (keyed one token ahead) too, which
    needs the token after its last position."""
    kv = _manager(MTP, 100, spec=3, lookahead=3)
    req = FakeRequest("a", list(range(1, 21)), 20, 2)
    kv.get_computed_blocks(req)
    kv.new_step_starts()
    assert kv.allocate_slots(req, 20, num_lookahead_tokens=3) is not None
    kv.mark_executed()
    req.num_computed_tokens = 20
    req.all_token_ids.append(70)
    kv.settle({"a": req})
    kv.new_step_starts()
    assert kv.allocate_slots(req, 4, num_lookahead_tokens=3) is not None  # 70 + 3 drafts
    kv.mark_executed()
    req.num_computed_tokens = 21  # no draft accepted
    req.all_token_ids.append(71)  # the token after them: max tokens reached
    kv.outputs_arriving({"a": 0}, [[71]])
    kv.free(req)
    nxt = FakeRequest("b", [*req.all_token_ids, 5, 6], 24, 1)
    assert kv.get_computed_blocks(nxt)[1] == 21
    kv.check_invariants()


def test_stop_inside_a_step_counted_as_vllm_033_does_reads_a_moved_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check above can fail: committed with vLLM 0.33's count, a request that
    stopped inside a step stores a turn end whose state the worker's post-copy moved on."""
    commit = VllmKVCacheManager._commit

    def vllm_count(
        self: VllmKVCacheManager, request: Any, go_ahead: bool = True, last: bool = False
    ):
        return commit(self, request, go_ahead, False)

    monkeypatch.setattr(VllmKVCacheManager, "_commit", vllm_count)
    with pytest.raises(AssertionError, match=r"\('s\dt\d', \d+, \d\)"):
        for seed in range(12):
            _drive(
                HYBRID, 300, sessions=4, turns=3, seed=seed, spec=3, shared=16, trim_at_stop=True
            )


def test_split_prefill_chunk() -> None:
    assert split_prefill_chunk(0, 300, 300, 256) == 256
    assert split_prefill_chunk(256, 44, 300, 256) == 44
    assert split_prefill_chunk(0, 1000, 1000, 256) == 768
    assert split_prefill_chunk(300, 250, 600, 256) == 212  # a turn-end start mid-block
    assert split_prefill_chunk(300, 1, 300, 256) == 1  # decode: unchanged
    assert split_prefill_chunk(0, 100, 100, 0) == 100  # no state group
    assert split_prefill_chunk(0, 1000, 1000, 256, junction=512) == 512  # junction first
    assert split_prefill_chunk(300, 600, 900, 256, junction=768) == 468


def test_group_translation_and_refusals() -> None:
    class Spec:
        def __init__(self, **kw: Any) -> None:
            self.__dict__.update(kw)

    class FullAttentionSpec(Spec): ...

    class SlidingWindowSpec(FullAttentionSpec): ...

    class MambaSpec(Spec): ...

    class CrossAttentionSpec(FullAttentionSpec): ...

    class Group:
        def __init__(self, spec: Any) -> None:
            self.kv_cache_spec = spec
            self.layer_names = ["model.layers.0.attn"]

    class Config:
        def __init__(self, *specs: Any) -> None:
            self.kv_cache_groups = [Group(s) for s in specs]

    got = vllm_groups(
        Config(
            FullAttentionSpec(block_size=16),
            SlidingWindowSpec(block_size=16, sliding_window=512),
            MambaSpec(block_size=256),
        )
    )
    assert got == [
        VllmGroup(0, "full", 16),
        VllmGroup(1, "sliding", 16, 512),
        VllmGroup(2, "state", 256),
    ]
    # an MTP head: vLLM flags the group its layer joined (is_eagle_group); hybridkv keys
    # that group one token ahead, and every attention group where vLLM flagged none
    specs = (MambaSpec(block_size=16), FullAttentionSpec(block_size=16))
    flagged = Config(*specs)
    flagged.kv_cache_groups[1].is_eagle_group = True  # type: ignore[attr-defined]
    assert [g.draft_head for g in vllm_groups(flagged, draft_head=True)] == [False, True]
    assert [g.draft_head for g in vllm_groups(flagged)] == [False, False]
    unflagged = Config(*specs, FullAttentionSpec(block_size=16))
    assert [g.draft_head for g in vllm_groups(unflagged, draft_head=True)] == [False, True, True]
    with pytest.raises(UnsupportedVllmSetup, match="CrossAttentionSpec"):
        vllm_groups(Config(CrossAttentionSpec(block_size=16)))
    with pytest.raises(UnsupportedVllmSetup, match="needs >= 2"):
        _manager(HYBRID, 1)


def test_rules_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDKV_VLLM_CHECKPOINT_RULES", raising=False)
    assert checkpoint_rules_from_env() == ("junction", "turn_end")
    monkeypatch.setenv("HYBRIDKV_VLLM_CHECKPOINT_RULES", "")
    assert checkpoint_rules_from_env() == ()
    monkeypatch.setenv("HYBRIDKV_VLLM_CHECKPOINT_RULES", "turn_end,every_block")
    with pytest.raises(HybridKVError, match="every_block"):
        checkpoint_rules_from_env()


def test_a_moved_block_is_refused() -> None:
    """A row column the worker already holds cannot change: the translation refuses."""
    from hybridkv.cache.delta import GroupDelta, StepDelta
    from hybridkv.vllm.rows import WorkerRows

    rows = WorkerRows([None], align=True)
    rows.step("r", StepDelta(groups={0: GroupDelta(0, (5, 6))}, admitted=True), {}, 8)
    with pytest.raises(InvariantError, match="only grow"):
        rows.step("r", StepDelta(groups={0: GroupDelta(1, (7,))}), {}, 1)


def test_identical_prompt_in_one_schedule_waits_and_hits() -> None:
    """Two requests with one prompt admitted in the same schedule: the second would
    recompute every block the first computes; it waits one step and hits them."""
    kv = _manager(HYBRID, 100)
    prompt = list(range(1, 34))
    a, b = (FakeRequest(name, list(prompt), 33, 2) for name in "ab")
    kv.new_step_starts()
    assert kv.get_computed_blocks(a)[1] == 0
    assert kv.allocate_slots(a, 32) is not None  # the chunk ends on the boundary at 32
    assert kv.get_computed_blocks(b)[1] == 0
    assert kv.allocate_slots(b, 32) is None  # deferred: vLLM stops admitting this step
    assert kv.num_deferred == 1
    a.num_computed_tokens = 32
    kv.mark_executed()
    kv.settle({"a": a, "b": b})
    kv.new_step_starts()
    assert kv.get_computed_blocks(b)[1] == 32
    assert kv.allocate_slots(b, 1, num_new_computed_tokens=32) is not None
    kv.check_invariants()


def test_turn_end_after_accepted_drafts_hits_every_group() -> None:
    """A turn whose last step accepted drafts: vLLM's worker then holds the state after
    the step's first token whole in its running column (the state after the accepted
    drafts is split over two columns), so every group keeps its turn end there, and the
    next turn hits it (not the block boundary) and reads exactly its tokens."""
    kv = _manager(HYBRID, 100, spec=3)
    worker = FakeWorker(HYBRID, align=True, num_spec=3)
    req = FakeRequest("a", list(range(1, 13)), 12, 3)
    steps = [(8, 0, 0), (4, 0, 0), (4, 3, 2)]  # (scheduled tokens, drafts, accepted)
    for i, (n, drafts, accepted) in enumerate(steps):
        kv.settle({"a": req})
        kv.new_step_starts()
        if i == 0:
            kv.get_computed_blocks(req)
        assert kv.allocate_slots(req, n) is not None
        worker.rows["a"] = [list(r) for r in kv.get_block_ids("a")]
        c = req.num_computed_tokens
        req.num_computed_tokens += n
        req.all_token_ids += [90 + d for d in range(drafts)]
        worker.run(req, n, drafts)
        del req.all_token_ids[len(req.all_token_ids) - drafts :]
        kv.mark_executed()
        if c + n - drafts >= req.num_prompt_tokens:
            worker.accepted(req, c, n, drafts, accepted)
            req.num_computed_tokens -= drafts - accepted
            req.all_token_ids += [90 + d for d in range(accepted)] + [77]
    kv.settle({"a": req})
    assert kv.cache.num_computed_tokens("a") == 15  # 12 + 1 + 2 accepted
    kv.free(req)
    worker.drop("a")
    nxt = FakeRequest("b", [*req.all_token_ids, 5, 6, 7], len(req.all_token_ids) + 3, 1)
    hit = kv.get_computed_blocks(nxt)[1]
    assert hit == 13  # the running column's whole state: after the step's first token
    kv.new_step_starts()
    assert kv.allocate_slots(nxt, nxt.num_tokens - hit, num_new_computed_tokens=hit) is not None
    worker.copy(kv.take_kv_cache_block_copies()[0])
    worker.rows["b"] = [list(r) for r in kv.get_block_ids("b")]
    nxt.num_computed_tokens = nxt.num_tokens
    worker.run(nxt, nxt.num_tokens - hit)  # reads exactly tokens[:13] in every group
    kv.check_invariants()


# ---------------------------------------------------------------------- async scheduling
def test_async_multi_turn_hybrid_reads_exactly_its_tokens() -> None:
    """Async scheduling (one step in flight, its sampled token unknown when the next
    step is allocated): every read is exactly the request's tokens, and multi-turn chat
    hits as it does synchronously."""
    kv = _drive_async(HYBRID, 200, sessions=4, turns=3, seed=1, abort_rate=0.0)
    assert kv.cache.stats().num_hit_tokens > 0


def test_async_shared_system_prompt_junctions() -> None:
    kv = _drive_async(HYBRID, 200, sessions=5, turns=2, seed=5, shared=29, budget=40)
    assert kv.cache.stats().num_hit_tokens > 0


def test_async_pressure_preempts_with_steps_in_flight() -> None:
    """A 24-block pool: requests are preempted while their previous step is in flight
    (its output arrives stale and is dropped); blocks they free are reused by the next
    step, which the worker runs after the one in flight."""
    _drive_async(HYBRID, 24, sessions=6, turns=2, seed=3, budget=40)


def test_async_sliding_window() -> None:
    groups = [VllmGroup(0, "full", 4), VllmGroup(1, "sliding", 4, 8)]
    _drive_async(groups, 300, sessions=4, turns=2, seed=2)


def test_async_prefix_caching_off() -> None:
    kv = _drive_async(HYBRID, 120, sessions=3, turns=2, seed=4, caching=False)
    assert kv.cache.stats().num_hit_tokens == 0


def test_async_turn_end_covers_the_token_in_flight() -> None:
    """A request that stops while the next step is in flight: that step computes the
    last sampled token, its tokens are known when the request is freed, so the turn
    end stored covers every token (one more than a synchronous run stores)."""
    kv = _manager(HYBRID, 100, async_steps=True)
    req = FakeRequest("a", list(range(1, 13)), 12, 2)
    kv.get_computed_blocks(req)
    kv.new_step_starts()
    assert kv.allocate_slots(req, 12) is not None  # the prompt; samples token 12
    kv.schedule_done()
    req.num_computed_tokens, req.num_output_placeholders = 12, 1
    kv.settle({"a": req})
    kv.new_step_starts()
    assert kv.allocate_slots(req, 1) is not None  # computes token 12, not known yet
    kv.schedule_done()
    assert kv.cache.num_computed_tokens("a") == 12  # the prompt step committed
    req.num_computed_tokens, req.num_output_placeholders = 13, 2
    req.all_token_ids.append(70)  # output of the prompt step
    req.all_token_ids.append(71)  # output of the step in flight: max_new reached
    kv.free(req)
    nxt = FakeRequest("b", [*req.all_token_ids, 5, 6], 16, 1)
    assert kv.get_computed_blocks(nxt)[1] == 13
    kv.check_invariants()


def test_async_refuses_a_second_step_in_flight() -> None:
    """hybridkv keeps one step in flight per request (vLLM's batch queue of 2): a third
    schedule before any output is refused with the counts, nothing half-done."""
    kv = _manager(HYBRID, 100, async_steps=True)
    req = FakeRequest("a", list(range(1, 13)), 12, 5)
    kv.get_computed_blocks(req)
    for n in (12, 1):
        kv.new_step_starts()
        assert kv.allocate_slots(req, n) is not None
        kv.schedule_done()
        req.num_computed_tokens += n
        req.num_output_placeholders += 1  # AsyncScheduler's _update_after_schedule
    kv.new_step_starts()
    with pytest.raises(InvariantError, match="one step in flight"):
        kv.allocate_slots(req, 1)
    kv.check_invariants()


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(48, 120),
    block=st.sampled_from([4, 8]),
    budget=st.integers(9, 64),
    shared=st.sampled_from([0, 13, 20]),
    caching=st.booleans(),
    abort_rate=st.sampled_from([0.0, 0.1]),
)
def test_random_lives_hybrid_async(
    seed: int,
    num_blocks: int,
    block: int,
    budget: int,
    shared: int,
    caching: bool,
    abort_rate: float,
) -> None:
    """Random lives under async scheduling: chunked prefill, preemption and aborts with
    a step in flight, multi-turn hits; every read exact, invariants after every step,
    every block back."""
    groups = [VllmGroup(0, "full", block), VllmGroup(1, "state", block)]
    _drive_async(
        groups,
        num_blocks,
        sessions=3,
        turns=2,
        seed=seed,
        budget=budget,
        shared=shared,
        caching=caching,
        abort_rate=abort_rate,
    )


@pytest.mark.parametrize("schedule_returned", [False, True])
def test_async_free_commits_only_steps_the_worker_runs(schedule_returned: bool) -> None:
    """A request freed with a step whose tokens are all known: preempted inside the
    schedule that allocated the step (vLLM takes it out of that schedule's output, the
    worker never runs it), the step is dropped and nothing of it is cached; aborted
    after the schedule returned (the worker runs it), it is committed and its blocks
    are hit."""
    kv = _manager(HYBRID, 100, async_steps=True)
    prompt = list(range(1, 18))
    a = FakeRequest("a", list(prompt), 17, 3)
    kv.get_computed_blocks(a)
    kv.new_step_starts()
    assert kv.allocate_slots(a, 16) is not None  # the chunk ends on the boundary at 16
    if schedule_returned:
        kv.schedule_done()
        a.num_computed_tokens = 16
    kv.free(a)
    b = FakeRequest("b", [*prompt, 40], 18, 1)
    assert kv.get_computed_blocks(b)[1] == (16 if schedule_returned else 0)
    kv.check_invariants()


# ------------------------------------------------- async scheduling with speculative decoding
def test_async_drafts_hybrid_reads_exactly_its_tokens() -> None:
    """Drafts 0..3 per step under async scheduling: every decode step is scheduled
    before the step before it reports its accepted count, so the worker may start it
    anywhere in that step's drafts; hybridkv holds the blocks of the latest start and
    lays the step out at its real one once the output arrives. Every read (attention
    slots, state columns, pre- and post-copies) is exact, multi-turn chat hits."""
    kv = _drive_async(HYBRID, 300, sessions=4, turns=3, seed=41, spec=3, abort_rate=0.0)
    assert kv.state_layout == "columns"
    assert kv.cache.stats().num_hit_tokens > 0


def test_async_drafts_shared_system_prompt() -> None:
    kv = _drive_async(HYBRID, 300, sessions=5, turns=2, seed=42, spec=3, shared=29, budget=40)
    assert kv.cache.stats().num_hit_tokens > 0


def test_async_drafts_under_pressure_with_aborts() -> None:
    """A pool small enough to preempt with a step ahead in flight, and aborts."""
    _drive_async(HYBRID, 40, sessions=6, turns=2, seed=43, spec=3, budget=40, abort_rate=0.1)


def test_async_drafts_prefix_caching_off() -> None:
    kv = _drive_async(HYBRID, 200, sessions=3, turns=2, seed=44, spec=3, caching=False)
    assert kv.cache.stats().num_hit_tokens == 0


def test_async_drafts_sliding_window() -> None:
    groups = [VllmGroup(0, "full", 4), VllmGroup(1, "sliding", 4, 8)]
    _drive_async(groups, 300, sessions=4, turns=2, seed=45, spec=3)


def test_async_draft_model() -> None:
    kv = _drive_async(
        DRAFT_MODEL, 300, sessions=4, turns=3, seed=46, spec=3, draft_groups=frozenset({2})
    )
    assert kv.cache.stats().num_hit_tokens > 0


def test_async_mtp_head() -> None:
    kv = _drive_async(
        MTP, 300, sessions=4, turns=3, seed=47, spec=3, shared=16, head_groups=frozenset({1})
    )
    assert kv.cache.stats().num_hit_tokens > 0


def test_async_step_ahead_freed_without_becoming_pending_reads_a_stale_turn_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checks above can fail: a request freed while its step ahead is in flight
    keeps a turn end over the running state that step then updates in place, unless the
    step becomes the pending one first (no turn end over a step in flight)."""
    commit = VllmKVCacheManager._commit

    def drop_ahead(
        self: VllmKVCacheManager, request: Any, go_ahead: bool = True, last: bool = False
    ):
        return commit(self, request, go_ahead and not last, last)

    monkeypatch.setattr(VllmKVCacheManager, "_commit", drop_ahead)
    with pytest.raises(AssertionError, match=r"\('s\dt\d', \d+, \d\)"):
        for seed in range(6):
            _drive_async(HYBRID, 300, sessions=4, turns=3, seed=seed, spec=3, shared=16)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(40, 140),
    block=st.sampled_from([4, 8]),
    budget=st.integers(9, 64),
    shared=st.sampled_from([0, 8, 13, 20]),
    caching=st.booleans(),
    spec=st.integers(1, 3),
    abort_rate=st.sampled_from([0.0, 0.1]),
    layout=st.sampled_from(["hybrid", "draft_model", "mtp"]),
)
def test_random_lives_async_drafts(
    seed: int,
    num_blocks: int,
    block: int,
    budget: int,
    shared: int,
    caching: bool,
    spec: int,
    abort_rate: float,
    layout: str,
) -> None:
    """Random lives with drafts under async scheduling: chunked prefill, 0..K drafts a
    step, preemption and aborts with a step ahead in flight, multi-turn hits, a draft
    model's or an MTP head's groups; every read exact, invariants after every step,
    every block back."""
    spec = min(spec, block - 1)
    state = VllmGroup(0, "state", block)
    groups = {
        "hybrid": [VllmGroup(0, "full", block), VllmGroup(1, "state", block)],
        "draft_model": [state, VllmGroup(1, "full", block), VllmGroup(2, "full", 2 * block)],
        "mtp": [state, VllmGroup(1, "full", block, draft_head=True)],
    }[layout]
    _drive_async(
        groups,
        num_blocks,
        sessions=3,
        turns=2,
        seed=seed,
        budget=budget,
        shared=shared,
        caching=caching,
        abort_rate=abort_rate,
        spec=spec,
        draft_groups=frozenset({2}) if layout == "draft_model" else frozenset(),
        head_groups=frozenset({1}) if layout == "mtp" else frozenset(),
    )


def test_reset_prefix_cache_with_waiting_requests() -> None:
    """vLLM's ``reset_prefix_cache(reset_running_requests=True)`` preempts every running
    request, then resets: requests still waiting were looked up but hold no block, so
    the reset succeeds and they are looked up again in the new cache; a request that
    holds blocks refuses it."""
    kv = _manager(HYBRID, 100)
    first = FakeRequest("a", list(range(1, 30)), 29, 4)
    kv.get_computed_blocks(first)
    kv.new_step_starts()
    assert kv.allocate_slots(first, 16) is not None
    kv.schedule_done()
    waiting = FakeRequest("b", list(range(1, 30)), 29, 4)
    kv.get_computed_blocks(waiting)
    assert not kv.reset_prefix_cache()  # "a" holds blocks
    kv.free(first)
    assert kv.reset_prefix_cache()
    kv.check_invariants()
    assert kv.get_computed_blocks(waiting)[1] == 0  # nothing cached survives the reset
    kv.new_step_starts()
    assert kv.allocate_slots(waiting, 16) is not None
    kv.check_invariants()
