"""Speculative decoding in the engine: the draft-model drafter, proposer selection and
acceptance counters.

One decode step of request r (verified tokens T, c = len(T) - 1 computed, L drafts)::

    scheduler   allocate(r, 1, L)                 (L from the proposer, or K for a model)
    drafter     draft model: L + 1 single-token passes at c .. c+L (`draft_pass_points`)
                n-gram / suffix: drafts were proposed at scheduling time
    main        one pass over T[-1], d1..dL at c .. c+L, logits at all L + 1 positions
    verify      greedy or speculative sampling -> a accepted, a + 1 new tokens
    commit      commit(r, a, d1..da + bonus): the state after c + 1 + a tokens (for the
                main AND the draft model's state groups) becomes the running state

Both models write the same positions with the same tokens, so one `CacheManager`
request (the plan holds main and draft groups) covers both; a rejected position's KV is
simply overwritten by the next step, and its state slot is never cached.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hybridkv.engine.forward.runner import ModelRunner, StepInput
from hybridkv.engine.models.common import HiddenStates
from hybridkv.engine.speculative.proposers import NgramProposer, Proposer, SuffixProposer
from hybridkv.engine.speculative.verify import token_probs
from hybridkv.errors import EngineError
from hybridkv.sched import ScheduledChunk

PROPOSER_METHODS = ("ngram", "suffix")


def make_proposer(method: str) -> Proposer:
    """The built-in copy proposer for ``method`` ("ngram" or "suffix")."""
    if method == "ngram":
        return NgramProposer()
    if method == "suffix":
        return SuffixProposer()
    raise EngineError(
        f"spec method {method!r} has no engine proposer; use draft (with a draft model), "
        f"{' or '.join(PROPOSER_METHODS)}"
    )


@dataclass(frozen=True)
class Drafts:
    """One request's drafts in a step and, for sampled drafts, their proposal
    distributions ``[len(token_ids), vocab]`` (None: deterministic, one-hot).
    ``parents``: a token tree (`hybridkv.engine.speculative.tree`): draft i follows draft
    ``parents[i]`` (-1: the verified token); None: a chain."""

    token_ids: list[int]
    probs: torch.Tensor | None = None
    parents: tuple[int, ...] | None = None


@dataclass
class SpecCounters:
    """Acceptance counters (one request, or the whole engine).

    ``num_verify_steps`` counts main-model steps that emitted tokens for the request
    (zero-draft decode steps included); each emits accepted + 1 tokens, so
    ``mean_accepted_length = (num_accepted + num_verify_steps) / num_verify_steps``.
    """

    num_proposed: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0
    num_draft_steps: int = 0  # verify steps that carried >= 1 draft

    def add(self, num_proposed: int, num_accepted: int) -> None:
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        self.num_verify_steps += 1
        self.num_draft_steps += num_proposed > 0

    @property
    def mean_accepted_length(self) -> float:
        steps = self.num_verify_steps
        return (self.num_accepted + steps) / steps if steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0


class Drafter(Protocol):
    """What the stepper drives: drafts before the main pass, and a look at what the
    main pass computed (hidden-state heads catch their KV up there)."""

    capture: tuple[int, ...] | None  # None: needs no main hidden states

    def run(
        self,
        chunks: Sequence[ScheduledChunk],
        temperature: Mapping[str, float],
        generators: Mapping[str, torch.Generator],
    ) -> dict[str, Drafts]: ...

    def max_drafts(self, req_id: str, num_computed: int, limit: int) -> int:
        """Drafts it can make for a decode step at ``num_computed`` (<= ``limit``)."""
        ...

    def features(self, hidden: HiddenStates) -> torch.Tensor: ...

    def observe(self, observations: Sequence[Any]) -> None: ...

    def forget(self, req_id: str) -> None: ...


class DraftModelDrafter:
    """Runs a draft model on its own plan groups, aligned with the main model.

    Every scheduled chunk goes through the draft model too (prefill chunks: same tokens,
    same positions, so the draft's cache holds the prompt); a decode chunk with L
    reserved drafts gets L + 1 single-token passes, batched across requests pass by pass.
    """

    capture: tuple[int, ...] | None = None

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def run(
        self,
        chunks: Sequence[ScheduledChunk],
        temperature: Mapping[str, float],
        generators: Mapping[str, torch.Generator],
    ) -> dict[str, Drafts]:
        """Draft tokens per request id (decode chunks with lookahead only)."""
        if not chunks:
            return {}
        first = [
            StepInput(
                c.request.req_id,
                c.request.tokens[c.num_computed : c.num_computed + c.num_new_tokens],
                c.num_computed,
                0,
                1 if c.num_lookahead else 0,
            )
            for c in chunks
        ]
        logits = self.runner.execute(first)
        tokens: dict[str, list[int]] = {}
        probs: dict[str, list[torch.Tensor]] = {}
        wanted = {c.request.req_id: c.num_lookahead for c in chunks if c.num_lookahead}
        starts = {c.request.req_id: c.num_computed for c in chunks}
        for step, row in zip(first, logits, strict=True):
            if step.req_id in wanted:
                tokens[step.req_id], probs[step.req_id] = [], []
                pick_draft(step.req_id, row[-1], temperature, generators, tokens, probs)
        max_pass = 1 + max(wanted.values(), default=0)
        for j in range(2, max_pass + 1):
            steps = [
                StepInput(r, [tokens[r][-1]], starts[r] + j - 1, 0, j)
                for r, la in wanted.items()
                if la >= j - 1
            ]
            logits = self.runner.execute(steps)
            for step, row in zip(steps, logits, strict=True):
                if wanted[step.req_id] >= j:
                    pick_draft(step.req_id, row[-1], temperature, generators, tokens, probs)
        return {r: Drafts(tokens[r], torch.stack(probs[r]) if probs[r] else None) for r in wanted}

    def max_drafts(self, req_id: str, num_computed: int, limit: int) -> int:
        return limit  # it runs the step's tokens itself, then drafts

    def features(self, hidden: HiddenStates) -> torch.Tensor:
        raise EngineError("a draft model reads no hidden states of the main model")

    def observe(self, observations: Sequence[Any]) -> None:
        """A draft model ran the step's chunks already (`run`); nothing to catch up."""
        return None

    def forget(self, req_id: str) -> None:
        return None


def pick_draft(
    req_id: str,
    logits: torch.Tensor,
    temperature: Mapping[str, float],
    generators: Mapping[str, torch.Generator],
    tokens: dict[str, list[int]],
    probs: dict[str, list[torch.Tensor]],
) -> None:
    """Append one draft for ``req_id``: greedy argmax, or a draw from the request's CPU
    generator (its proposal distribution kept for speculative sampling)."""
    temp = temperature.get(req_id, 0.0)
    if temp <= 0:
        tokens[req_id].append(int(logits.argmax()))
        return
    q = token_probs(logits.cpu(), temp)  # drawn with the request's CPU generator
    tokens[req_id].append(int(torch.multinomial(q, 1, generator=generators[req_id])))
    probs[req_id].append(q)
