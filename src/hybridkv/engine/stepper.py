"""One engine step, end to end: schedule, draft, run the main model, verify, emit, commit.

    schedule   Scheduler.schedule -> chunks (prefill pieces, decode steps with L drafts)
    draft      draft model passes (`DraftModelDrafter`), or the proposer's drafts that
               were reserved at scheduling time (`lookahead`)
    main       ModelRunner.execute -> logits [1 + L, vocab] per sampling request
    verify     greedy / speculative sampling -> a accepted drafts + 1 token
    emit       cut at max_new_tokens and after the first stop id: a' <= a
    observe    a hidden-state head (MTP, EAGLE) writes its KV at the positions the step
               made computed, from the main pass's hidden states (`proposers.head`)
    commit     CacheManager.commit(r, a', tokens): state after c + 1 + a' tokens runs on

Cutting after a stop id is a smaller verdict of the same shape: emitting the stop token
``d_j`` (draft j, or the bonus) is "j drafts accepted, then d_j", so the cache commits
exactly the positions before it and the request finishes.

Worked example, c = 20 computed, drafts d0 d1 d2, all accepted + bonus b, d1 = EOS::

    verdict    a = 3, tokens d0 d1 d2 b      -> emit d0 d1 (a' = 1): d1 plays the bonus
    commit     1 accepted: the running state is the one after 20 + 1 + 1 tokens

Greedy argmax runs on the model's device; sampled tokens are drawn on the host from the
request's CPU generator (logits rows are tiny), so a seed gives the same stream anywhere.
"""

from __future__ import annotations

import torch

from hybridkv.cache import CacheManager
from hybridkv.engine.models.common import HiddenStates
from hybridkv.engine.proposers import Proposer
from hybridkv.engine.proposers.head import Observation
from hybridkv.engine.runner import ModelRunner, StepInput
from hybridkv.engine.sampler import make_generator, sample
from hybridkv.engine.scheduler import Request, ScheduledChunk, Scheduler
from hybridkv.engine.speculative import Drafter, Drafts, SpecCounters
from hybridkv.engine.verify import Verdict, verify_greedy, verify_sampling
from hybridkv.errors import EngineError
from hybridkv.plan.types import CachePlan
from hybridkv.spec.layers import STATE


def emitted(verdict: Verdict, req: Request) -> Verdict:
    """``verdict`` cut to what ``req`` emits (max_new_tokens, first stop id)."""
    n = req.num_to_emit(verdict.token_ids)
    if n == len(verdict.token_ids):
        return verdict
    assert n >= 1, f"request {req.req_id!r} sampled while already finished"
    return Verdict(n - 1, verdict.token_ids[:n])


class Stepper:
    """The per-step loop of `LLM` and the per-request state it needs between steps
    (random generators, drafts proposed at scheduling time, acceptance counters)."""

    def __init__(
        self,
        plan: CachePlan,
        manager: CacheManager,
        runner: ModelRunner,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunk_size: int | None,
        spec_method: str | None,
        num_spec_tokens: int,
        drafter: Drafter | None,
        proposer: Proposer | None,
    ) -> None:
        self.plan = plan
        self.manager = manager
        self.runner = runner
        self.spec_method = spec_method
        self.num_spec_tokens = num_spec_tokens
        self.drafter = drafter
        self.proposer = proposer
        self.scheduler = Scheduler(
            manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            chunk_size=chunk_size,
            lookahead=self.lookahead if spec_method is not None else None,
        )
        self.generators: dict[str, torch.Generator] = {}
        self.drafts: dict[str, Drafts] = {}
        self.spec = SpecCounters()
        self.req_spec: dict[str, SpecCounters] = {}
        self.num_steps = self.num_tokens = self.num_output = 0
        self.hits = {"attention": 0, "state": 0}
        self._has_attention = any(g.kind != STATE for g in plan.groups)
        self._state_groups = [g.group_id for g in plan.groups if g.kind == STATE]

    # ------------------------------------------------------------------ requests
    def add(self, req: Request) -> None:
        if req.params.temperature > 0:
            self.generators[req.req_id] = make_generator(req.params.seed, req.index)
        self.scheduler.add(req)

    def cancel(self, req: Request) -> None:
        self.scheduler.cancel(req)
        self.forget(req)

    def forget(self, req: Request) -> None:
        self.generators.pop(req.req_id, None)
        self.drafts.pop(req.req_id, None)
        if self.drafter is not None:
            self.drafter.forget(req.req_id)
        if self.proposer is not None:
            self.proposer.forget(req.req_id)

    def lookahead(self, req: Request, budget: int) -> int:
        """Drafts to reserve for ``req``'s decode step (called by the scheduler)."""
        left = req.params.max_new_tokens - len(req.output) - 1  # the bonus token is extra
        limit = max(0, min(self.num_spec_tokens, left, budget))
        if self.proposer is None:  # draft model / head: it drafts after the allocation
            return (
                self.drafter.max_drafts(req.req_id, req.num_computed, limit)
                if self.drafter
                else limit
            )
        drafts = self.proposer.propose(req.req_id, req.tokens, limit)[:limit] if limit else []
        self.drafts[req.req_id] = Drafts([int(t) for t in drafts])
        return len(drafts)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[Request]:
        """Run one scheduler step; returns the requests that finished in it."""
        chunks = self.scheduler.schedule()
        drafts: dict[str, Drafts] = {}
        if self.drafter is not None:
            temps = {c.request.req_id: c.request.params.temperature for c in chunks}
            drafts = self.drafter.run(chunks, temps, self.generators)
        else:
            for c in chunks:
                if c.num_lookahead:
                    drafts[c.request.req_id] = self.drafts.pop(c.request.req_id)
        steps = [self._step_input(c, drafts) for c in chunks]
        capture = None if self.drafter is None else self.drafter.capture
        hidden = None
        if capture is None:
            logits = self.runner.execute(steps)
        else:
            logits, hidden = self.runner.execute_with_hidden(steps, capture)
        self.num_steps += 1
        verdicts: list[Verdict | None] = []
        for chunk, rows in zip(chunks, logits, strict=True):
            req = chunk.request
            req.num_steps += 1
            self.num_tokens += chunk.num_new_tokens + chunk.num_lookahead
            if not chunk.samples:
                req.num_computed = chunk.num_computed + chunk.num_new_tokens
                verdicts.append(None)
                continue
            verdict = emitted(self._verify(req, rows, drafts.get(req.req_id)), req)
            req.num_computed = chunk.num_computed + chunk.num_new_tokens + verdict.num_accepted
            req.emit(verdict.token_ids)
            self.num_output += len(verdict.token_ids)
            verdicts.append(verdict)
        if hidden is not None and self.drafter is not None:
            self.drafter.observe(self._observations(chunks, steps, verdicts, hidden))
        finished = []
        for chunk, outcome in zip(chunks, verdicts, strict=True):
            req = chunk.request
            if outcome is None:
                self.manager.commit(req.req_id)
                continue
            self.manager.commit(req.req_id, outcome.num_accepted, outcome.token_ids)
            if self.spec_method is not None:
                self.spec.add(chunk.num_lookahead, outcome.num_accepted)
                self.req_spec.setdefault(req.req_id, SpecCounters()).add(
                    chunk.num_lookahead, outcome.num_accepted
                )
            if req.done:
                self.scheduler.finish(req)
                self.forget(req)
                finished.append(req)
        return finished

    def _observations(
        self,
        chunks: list[ScheduledChunk],
        steps: list[StepInput],
        verdicts: list[Verdict | None],
        hidden: HiddenStates,
    ) -> list[Observation]:
        """Per chunk, the positions this step made computed, the token after each and
        the drafter head's feature rows there (rows follow the steps' tokens in order)."""
        assert self.drafter is not None
        features = self.drafter.features(hidden)
        out = []
        start = 0
        for chunk, step, verdict in zip(chunks, steps, verdicts, strict=True):
            req = chunk.request
            num = req.num_computed - chunk.num_computed
            next_ids = req.tokens[chunk.num_computed + 1 : req.num_computed + 1]
            if len(next_ids) != num:
                raise EngineError(
                    f"request {req.req_id!r}: {num} positions computed this step but only "
                    f"{len(next_ids)} tokens follow them"
                )
            keep = verdict is not None and not req.done  # it sampled: it decodes next
            rows = features[start : start + num]
            out.append(Observation(req.req_id, chunk.num_computed, list(next_ids), rows, keep))
            start += len(step.token_ids)
        return out

    def _verify(self, req: Request, logits: torch.Tensor, drafts: Drafts | None) -> Verdict:
        """Accepted drafts + one sampled token from the main model's ``[1 + L, vocab]``."""
        temperature = req.params.temperature
        generator = self.generators.get(req.req_id)
        if temperature > 0:
            logits = logits.cpu()  # drawn with the request's CPU generator
        if drafts is None or not drafts.token_ids:
            return Verdict(0, [sample(logits[-1], temperature, generator)])
        if temperature <= 0:
            return verify_greedy(logits, drafts.token_ids)
        assert generator is not None
        return verify_sampling(logits, drafts.token_ids, temperature, generator, drafts.probs)

    def _step_input(self, chunk: ScheduledChunk, drafts: dict[str, Drafts]) -> StepInput:
        req = chunk.request
        start = chunk.num_computed
        if chunk.prefix_hit:
            self._count_hit(req, chunk.prefix_hit)
        tokens = req.tokens[start : start + chunk.num_new_tokens]
        if not chunk.num_lookahead:
            return StepInput(req.req_id, tokens, start)
        draft_ids = drafts[req.req_id].token_ids
        if len(draft_ids) != chunk.num_lookahead:
            raise EngineError(
                f"request {req.req_id!r}: {len(draft_ids)} drafts for {chunk.num_lookahead} "
                "reserved positions"
            )
        return StepInput(req.req_id, [*tokens, *draft_ids], start, len(draft_ids))

    def _count_hit(self, req: Request, hit: int) -> None:
        if self._has_attention:
            self.hits["attention"] += hit
        if self._state_groups and all(
            self.manager.state_slots(req.req_id, g).read_block is not None
            for g in self._state_groups
        ):
            self.hits["state"] += hit
