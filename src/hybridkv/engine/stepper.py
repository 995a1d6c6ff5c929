"""The model executor of the one scheduler (`hybridkv.sched`): propose drafts, run the
main model, verify. The scheduler decides the step and settles it (cut, commit, emit).

    propose    n-gram / suffix: the proposal for each decode-ready request (its length
               is offered); draft model: K offered, it drafts after the allocation
    schedule   `Scheduler.schedule` -> chunks (prefill pieces, decode steps with L drafts)
    tables     the output's block-table changes (released rows, then the manager's
               deltas) go to the device tables every runner reads, once per step
    draft      draft model passes (`DraftModelDrafter`), or the first L proposed drafts
    main       ModelRunner.execute -> logits [1 + L, vocab] per sampling request
    verify     greedy / speculative sampling -> a accepted drafts + 1 token (`StepResult`);
               a token tree: greedy along the tree, the accepted path moved into the
               chain's slots before the commit (`engine.speculative.tree.TreeSettler`)
    observe    a hidden-state head (MTP, EAGLE) writes its KV at the positions the step
               computed, from the main pass's hidden states (`proposers.head`); before
               the update commits, so no block is cached without the head's KV
    update     `Scheduler.update`: cut at max_new_tokens / max_model_len and after the
               first stop id (a' <= a), CacheManager.commit(r, a', tokens), emit

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

import os
from collections.abc import Callable, Sequence

import torch

from hybridkv.cache import CacheManager
from hybridkv.engine.forward.block_copy import run_copies, step_copies
from hybridkv.engine.forward.runner import ModelRunner, StepInput
from hybridkv.engine.models.common import HiddenStates
from hybridkv.engine.sampling.logits_process import process_rows
from hybridkv.engine.sampling.logprobs import LogprobRecorder
from hybridkv.engine.sampling.sampler import SamplingParams, greedy_ids, make_generator, sample
from hybridkv.engine.speculative.drafting import Drafter, Drafts, SpecCounters
from hybridkv.engine.speculative.proposers import Proposer
from hybridkv.engine.speculative.proposers.head import Observation
from hybridkv.engine.speculative.proposers.tree import TreeHeadDrafter
from hybridkv.engine.speculative.tree import TreeSettler, step_parents
from hybridkv.engine.speculative.verify import Verdict, accept_greedy, verify_sampling
from hybridkv.errors import EngineError
from hybridkv.plan.types import CachePlan
from hybridkv.sched import (
    Request,
    ScheduledChunk,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StepReport,
    StepResult,
    run_step,
)

StepHook = Callable[[SchedulerOutput, StepReport], None]


class Stepper:
    """The `Executor` of `LLM` and the per-request executor data it needs between steps
    (sampling params, random generators, proposals, acceptance counters). Progress
    (computed tokens, output, status) lives in the `Request` record only."""

    def __init__(
        self,
        plan: CachePlan,
        manager: CacheManager,
        runner: ModelRunner,
        *,
        config: SchedulerConfig,
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
        self.scheduler = Scheduler(manager, config)
        self.params: dict[str, SamplingParams] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.proposals: dict[str, list[int]] = {}
        self.spec = SpecCounters()
        self.req_spec: dict[str, SpecCounters] = {}
        self.logprobs = LogprobRecorder()  # requests that asked for logprobs only
        self.num_steps = self.num_tokens = self.num_output = 0
        self.hits = {"attention": 0, "state": 0}
        self.num_copied = 0  # junction copy slots run (`engine.forward.block_copy`)
        self.hooks: list[StepHook] = []  # called after every step (traces, servers)
        self.tables = runner.tables  # shared with the drafter's runner
        # debug: compare every scheduled row with the manager's after applying deltas
        self.check_tables = os.environ.get("HYBRIDKV_CHECK_TABLES", "") not in ("", "0")
        self._has_attention = any(not g.is_state for g in plan.groups)
        self._state_groups = [g.group_id for g in plan.groups if g.is_state]

    # ------------------------------------------------------------------ requests
    def add(self, req: Request, params: SamplingParams, index: int = 0) -> bool:
        """Queue ``req``; False when the scheduler refused it (see `Request.refusal`)."""
        if (params.penalized or params.filtered) and isinstance(self.drafter, TreeHeadDrafter):
            raise EngineError(
                "penalties, min_tokens and top_k / top_p / min_p are not supported with "
                "token-tree drafts (spec_topk / spec_tree); use chain drafts or drop them"
            )
        if not self.scheduler.add(req):
            return False
        self.params[req.req_id] = params
        self.logprobs.add(req.req_id, params.logprobs, params.prompt_logprobs)
        if params.temperature > 0:
            self.generators[req.req_id] = make_generator(params.seed, index)
        return True

    def cancel(self, req: Request) -> None:
        self.scheduler.cancel(req)
        self.forget(req)
        self.logprobs.pop(req.req_id)

    def forget(self, req: Request) -> None:
        self.generators.pop(req.req_id, None)
        self.proposals.pop(req.req_id, None)
        if self.drafter is not None:
            self.drafter.forget(req.req_id)
        if self.proposer is not None:
            self.proposer.forget(req.req_id)

    # ------------------------------------------------------------------ executor
    def propose(self, ready: Sequence[Request]) -> dict[str, int]:
        """Drafts offered per decode-ready request (before scheduling)."""
        offered: dict[str, int] = {}
        self.proposals.clear()
        if self.spec_method is None:
            return offered
        for req in ready:
            limit = min(self.num_spec_tokens, req.num_tokens_left - 1)
            if limit <= 0:
                continue
            if self.drafter is not None:  # draft model / head: drafts after the allocation
                offered[req.req_id] = self.drafter.max_drafts(req.req_id, req.num_computed, limit)
                continue
            if self.proposer is None:
                offered[req.req_id] = limit
                continue
            drafts = [int(t) for t in self.proposer.propose(req.req_id, req.tokens, limit)]
            self.proposals[req.req_id] = drafts[:limit]
            offered[req.req_id] = len(self.proposals[req.req_id])
        return offered

    def execute(self, output: SchedulerOutput) -> dict[str, StepResult]:
        """Draft (draft model), run the main model over every chunk, verify."""
        chunks = output.chunks
        self.tables.apply_step(output.released, output.deltas)
        # junction copies before any layer reads the new blocks (`engine.forward.block_copy`)
        self.num_copied += run_copies(self.runner.tensors, step_copies(output.deltas))
        if self.check_tables:
            self.tables.check_against(self.manager, [c.request.req_id for c in chunks])
        if not chunks:  # an idle step (nothing waiting or running): no forward to run
            return {}
        drafts: dict[str, Drafts] = {}
        if self.drafter is not None:
            temps = {c.request.req_id: self.params[c.request.req_id].temperature for c in chunks}
            drafts = self.drafter.run(chunks, temps, self.generators)
        else:
            for c in chunks:
                if c.num_lookahead:
                    drafts[c.request.req_id] = Drafts(
                        self.proposals[c.request.req_id][: c.num_lookahead]
                    )
        steps = [self._step_input(c, drafts) for c in chunks]
        capture = None if self.drafter is None else self.drafter.capture
        hidden = None
        if capture is None:
            logits = self.runner.execute(steps)
        else:
            logits, hidden = self.runner.execute_with_hidden(steps, capture)
        results: dict[str, StepResult] = {}
        best = greedy_ids(logits)  # every row's argmax at once (greedy requests use it)
        trees = TreeSettler(self.runner, self.manager)
        for chunk, step, rows, argmax in zip(chunks, steps, logits, best, strict=True):
            self.num_tokens += chunk.num_scheduled_tokens
            if step.all_logits:  # prompt logprobs: every row, then the usual tail
                req = chunk.request
                self.logprobs.record_prompt(req.req_id, req.prompt, chunk.num_computed, rows)
                tail = 1 + chunk.num_lookahead
                rows, argmax = rows[rows.shape[0] - tail :], argmax[len(argmax) - tail :]
            if chunk.samples:
                req = chunk.request
                draft = drafts.get(req.req_id)
                if draft is not None and draft.parents is not None:  # a token tree
                    verdict = trees.settle(chunk, argmax, draft)
                    scored = [0, *(1 + node for node in trees.paths[req.req_id][2])]
                else:
                    verdict = self._verify(req, rows, argmax, draft)
                    scored = list(range(len(verdict.token_ids)))
                if self.logprobs.wants_output(req.req_id):
                    self.logprobs.stage(req.req_id, rows[scored], verdict.token_ids)
                results[req.req_id] = StepResult(verdict.num_accepted, verdict.token_ids)
        if hidden is not None and trees.paths:
            hidden = trees.reorder(hidden, steps)
        if hidden is not None and self.drafter is not None:
            self.drafter.observe(self._observations(chunks, steps, results, hidden))
        return results

    def _observations(
        self,
        chunks: Sequence[ScheduledChunk],
        steps: Sequence[StepInput],
        results: dict[str, StepResult],
        hidden: HiddenStates,
    ) -> list[Observation]:
        """Per chunk, the positions this step computes (verified tokens and accepted
        drafts), the token after each and the head's feature rows there (rows follow
        the steps' tokens in order). The verdicts are the uncut ones: a cut (stop id,
        length) finishes the request, and its first positions are the same either way."""
        assert self.drafter is not None
        features = self.drafter.features(hidden)
        out = []
        start = 0
        for chunk, step in zip(chunks, steps, strict=True):
            req = chunk.request
            c, n = chunk.num_computed, chunk.num_new_tokens
            result = results.get(req.req_id)
            if result is None:  # a prefill piece: the next prompt token is known
                next_ids = list(req.tokens[c + 1 : c + n + 1])
            else:
                next_ids = [*req.tokens[c + 1 : c + n], *result.token_ids]
            if len(next_ids) < n:
                raise EngineError(
                    f"request {req.req_id!r}: {n} positions computed from {c} but only "
                    f"{len(next_ids)} tokens follow them"
                )
            rows = features[start : start + len(next_ids)]
            out.append(Observation(req.req_id, c, next_ids, rows, result is not None))
            start += len(step.token_ids)
        return out

    # ------------------------------------------------------------------ one step
    def step(self) -> list[Request]:
        """Run one scheduler step; returns the requests that finished in it."""
        output, report = run_step(self.scheduler, self)
        self.num_steps += 1
        for chunk in output.chunks:
            req_id = chunk.request.req_id
            if req_id not in report.emitted:
                continue
            self.num_output += len(report.emitted[req_id])
            self.logprobs.commit(req_id, len(report.emitted[req_id]))
            if self.spec_method is not None:
                accepted = report.accepted[req_id]
                self.spec.add(chunk.num_lookahead, accepted)
                self.req_spec.setdefault(req_id, SpecCounters()).add(chunk.num_lookahead, accepted)
        for req in report.finished:
            self.forget(req)
        for hook in self.hooks:
            hook(output, report)
        return report.finished

    def _verify(
        self, req: Request, logits: torch.Tensor, argmax: list[int], drafts: Drafts | None
    ) -> Verdict:
        """Accepted drafts + one sampled token from the main model's ``[1 + L, vocab]``
        (``argmax``: its rows' argmax ids, for greedy requests)."""
        params = self.params[req.req_id]
        temperature = params.temperature
        if params.penalized or params.filtered:  # `engine.sampling.logits_process`
            draft_ids = [] if drafts is None else drafts.token_ids
            stops = req.stop_token_ids
            logits = process_rows(logits, params, req.prompt, req.output, draft_ids, stops)
            if temperature <= 0:
                argmax = logits.argmax(dim=-1).tolist()
        if temperature <= 0:
            draft_ids = [] if drafts is None else drafts.token_ids
            return accept_greedy(argmax[len(argmax) - 1 - len(draft_ids) :], draft_ids)
        generator = self.generators.get(req.req_id)
        logits = logits.cpu()  # drawn with the request's CPU generator
        if drafts is None or not drafts.token_ids:
            return Verdict(0, [sample(logits[-1], temperature, generator)])
        if generator is None:
            raise EngineError(f"request {req.req_id!r} samples but has no generator")
        return verify_sampling(logits, drafts.token_ids, temperature, generator, drafts.probs)

    def _step_input(self, chunk: ScheduledChunk, drafts: dict[str, Drafts]) -> StepInput:
        req = chunk.request
        start = chunk.num_computed
        if chunk.prefix_hit:
            self._count_hit(req, chunk.prefix_hit)
        tokens = req.tokens[start : start + chunk.num_new_tokens]
        if not chunk.num_lookahead:
            every = self.logprobs.wants_prompt_rows(req.req_id, start, len(req.prompt))
            return StepInput(req.req_id, tokens, start, all_logits=every)
        draft_ids = drafts[req.req_id].token_ids
        if len(draft_ids) != chunk.num_lookahead:
            raise EngineError(
                f"request {req.req_id!r}: {len(draft_ids)} drafts for {chunk.num_lookahead} "
                "reserved positions"
            )
        parents = drafts[req.req_id].parents
        tree = None if parents is None else step_parents(len(tokens), parents)
        return StepInput(req.req_id, [*tokens, *draft_ids], start, len(draft_ids), parents=tree)

    def _count_hit(self, req: Request, hit: int) -> None:
        if self._has_attention:
            self.hits["attention"] += hit
        if self._state_groups and all(
            self.manager.state_slots(req.req_id, g).read_block is not None
            for g in self._state_groups
        ):
            self.hits["state"] += hit
