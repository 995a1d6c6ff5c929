"""Drafting with a head fed the main model's hidden states (MTP, EAGLE).

The head's attention layers are draft layers of the plan, so its K/V live in pages of
the same `CacheManager` request as the main model's. Its KV at position p needs the
token at p + 1 (it is fed ``(token[p + 1], h[p])``), so it lags the main model by one
position and is written in two ways:

    observe  after the main pass of every step, for each position p the step made
             computed (verified prompt tokens, accepted drafts): one batched head pass
             with (token[p + 1], h[p]); the last row's output and logits are kept
             (``pending``) for the request's next decode step.
    run      at a decode step (c computed, L drafts reserved): d1 = pick(pending
             logits at c - 1); then L - 1 chained single-token passes at c .. c + L - 2,
             each fed (d_j, the previous head output), batched across requests.

Example, c = 20, L = 3, then 2 accepted (+ bonus b)::

    run       pending @19 -> d1;  pass @20 (d1, out19) -> d2;  pass @21 (d2, out20) -> d3
    main      verifies T[-1] d1 d2 d3 at 20..23 -> accepts d1 d2, emits b at 23
    observe   head @20 (d1, h20), @21 (d2, h21), @22 (b, h22) -> pending @22

Observation runs before the step commits, so a block is never cached before the head's
KV for its positions is written; the KV a chained pass wrote beyond the accepted
positions lies in uncommitted positions and is overwritten before it is read. A
prefix hit of k blocks reuses the head's KV at k*B - 1, which was computed with the
token at k*B: the manager runs in EAGLE mode (a hit needs block k + 1 to match too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from hybridkv.engine.forward.runner import ModelRunner, StepInput
from hybridkv.engine.models.common import HiddenStates, LayerDesc
from hybridkv.engine.ops.context import ForwardBatch, LayerCache
from hybridkv.engine.speculative.drafting import Drafts, pick_draft
from hybridkv.errors import EngineError
from hybridkv.sched import ScheduledChunk


class DraftHead(Protocol):
    """A hidden-state-fed drafter head (`hybridkv.engine.models.mtp`, `.eagle`)."""

    name: str
    capture: tuple[int, ...]  # main decoder layers whose outputs it reads

    @property
    def layers(self) -> list[LayerDesc]: ...

    @property
    def device(self) -> torch.device: ...

    def features(self, hidden: HiddenStates) -> torch.Tensor: ...

    def forward(
        self,
        batch: ForwardBatch,
        caches: Mapping[int, LayerCache],
        features: torch.Tensor,
        *,
        chained: bool = False,
    ) -> torch.Tensor: ...

    def logits(self, out: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Observation:
    """Positions ``num_computed .. num_computed + len(next_token_ids) - 1`` of one
    request became computed this step; ``next_token_ids[i]`` is the token after
    position ``num_computed + i`` and ``features[i]`` the main model's row there.
    ``keep``: the request decodes next (keep the last head output for its drafts)."""

    req_id: str
    num_computed: int
    next_token_ids: list[int]
    features: torch.Tensor
    keep: bool


@dataclass(frozen=True)
class Pending:
    position: int  # the head output is at this position; its logits predict position + 2
    out: torch.Tensor  # [hidden]
    logits: torch.Tensor  # [vocab]


class HeadDrafter:
    """Runs a `DraftHead` on the plan's draft groups, aligned with the main model."""

    def __init__(self, runner: ModelRunner, head: DraftHead) -> None:
        self.runner = runner
        self.head = head
        self.pending: dict[str, Pending] = {}
        self.capture: tuple[int, ...] | None = head.capture

    def forget(self, req_id: str) -> None:
        self.pending.pop(req_id, None)

    def features(self, hidden: HiddenStates) -> torch.Tensor:
        return self.head.features(hidden)

    def max_drafts(self, req_id: str, num_computed: int, limit: int) -> int:
        """``limit`` when the head has caught up to the decode step's position, else 0:
        a request whose prompt ends in a 1-token step (a 1-token prompt, a hit that left
        one token) has no head output yet and decodes that step without drafts."""
        pend = self.pending.get(req_id)
        return limit if pend is not None and pend.position == num_computed - 1 else 0

    def _pass(
        self, steps: Sequence[StepInput], features: torch.Tensor, chained: bool
    ) -> torch.Tensor:
        batch = self.runner.build_batch(steps)
        batch.check()
        return self.head.forward(batch, self.runner.caches, features, chained=chained)

    # ------------------------------------------------------------------ after main
    def observe(self, observations: Sequence[Observation]) -> None:
        """One head pass over every request's newly computed positions (module doc)."""
        items = [o for o in observations if o.next_token_ids]
        if not items:
            return
        steps = [StepInput(o.req_id, o.next_token_ids, o.num_computed) for o in items]
        out = self._pass(steps, torch.cat([o.features for o in items]), chained=False)
        end = 0
        for o in items:
            end += len(o.next_token_ids)
            if o.keep:
                last = out[end - 1]
                position = o.num_computed + len(o.next_token_ids) - 1
                self.pending[o.req_id] = Pending(position, last, self.head.logits(last[None])[0])
            else:
                self.pending.pop(o.req_id, None)

    # ------------------------------------------------------------------ before main
    def run(
        self,
        chunks: Sequence[ScheduledChunk],
        temperature: Mapping[str, float],
        generators: Mapping[str, torch.Generator],
    ) -> dict[str, Drafts]:
        """Drafts (and, for sampled drafts, their proposal distributions) per request
        id, for the decode chunks with lookahead."""
        wanted = {c.request.req_id: c for c in chunks if c.num_lookahead}
        tokens: dict[str, list[int]] = {}
        probs: dict[str, list[torch.Tensor]] = {}
        outs: dict[str, torch.Tensor] = {}
        for req_id, chunk in wanted.items():
            pend = self.pending.get(req_id)
            if pend is None or pend.position != chunk.num_computed - 1:
                where = "none" if pend is None else f"position {pend.position}"
                raise EngineError(
                    f"request {req_id!r}: the {self.head.name} head has {where} pending, but "
                    f"its decode step starts at {chunk.num_computed} (needs position "
                    f"{chunk.num_computed - 1})"
                )
            tokens[req_id], probs[req_id] = [], []
            pick_draft(req_id, pend.logits, temperature, generators, tokens, probs)
            outs[req_id] = pend.out
        longest = max((c.num_lookahead for c in wanted.values()), default=0)
        for j in range(2, longest + 1):
            live = [r for r, c in wanted.items() if c.num_lookahead >= j]
            steps = [StepInput(r, [tokens[r][-1]], wanted[r].num_computed + j - 2) for r in live]
            out = self._pass(steps, torch.stack([outs[r] for r in live]), chained=True)
            logits = self.head.logits(out)
            for i, r in enumerate(live):
                outs[r] = out[i]
                pick_draft(r, logits[i], temperature, generators, tokens, probs)
        return {r: Drafts(tokens[r], torch.stack(probs[r]) if probs[r] else None) for r in wanted}
