"""Tree drafts from a hidden-state head (MTP, EAGLE): the head run level by level.

The chain drafter (`proposers.head.HeadDrafter`) picks d1 from the head's pending
output at c - 1 and then runs one chained pass per draft. For a tree
(`plan.tree.TokenTree`, N nodes, breadth-first) of a decode step at c::

    depth 1   the tree's ranks among the pending logits' top choices (rank 0 = argmax)
    pass d    (d = 1 .. depth - 1) every node of depth <= d, fed (its token, its
              parent's head output; the pending output for depth 1) at head position
              c + depth - 1, with the tree mask (each node sees the head's committed
              KV and its own ancestors); the depth-d outputs give their children

Sampled requests (temperature > 0) get a chain of their L drafts from the inner head
drafter: tree verification is greedy (multi-branch speculative sampling is not built),
a chain is verified by exact speculative sampling.

Pass d recomputes the shallower nodes so that their K/V sit in the head's slots for the
depth-d nodes to attend to (a tree of depth D costs D - 1 head passes over at most N
tokens; the head is one layer). The K/V written past c are overwritten by the
observation after the main pass (`HeadDrafter.observe`), as for a chain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hybridkv.engine.forward.runner import StepInput
from hybridkv.engine.models.common import HiddenStates
from hybridkv.engine.speculative.drafting import Drafts
from hybridkv.engine.speculative.proposers.head import HeadDrafter
from hybridkv.errors import EngineError
from hybridkv.plan.tree import TokenTree
from hybridkv.sched import ScheduledChunk


class TreeHeadDrafter:
    """A `Drafter` that drafts ``tree`` (or its first L nodes) per decode step."""

    def __init__(self, inner: HeadDrafter, tree: TokenTree) -> None:
        self.inner = inner
        self.tree = tree
        self.capture: tuple[int, ...] | None = inner.capture

    def forget(self, req_id: str) -> None:
        self.inner.forget(req_id)

    def check_invariants(self) -> None:
        """The tree is well formed and fits the head's speculative capacity."""
        self.tree.check_invariants()
        if self.capture != self.inner.capture:
            raise EngineError("tree drafter: capture layers differ from its head drafter's")

    def features(self, hidden: HiddenStates) -> torch.Tensor:
        return self.inner.features(hidden)

    def max_drafts(self, req_id: str, num_computed: int, limit: int) -> int:
        return self.inner.max_drafts(req_id, num_computed, limit)

    def observe(self, observations: Sequence[Any]) -> None:
        self.inner.observe(observations)

    def run(
        self,
        chunks: Sequence[ScheduledChunk],
        temperature: Mapping[str, float],
        generators: Mapping[str, torch.Generator],
    ) -> dict[str, Drafts]:
        """The tree's nodes (tokens and parents) per request id with lookahead. Sampled
        requests (temperature > 0) draft a chain of their L drafts instead: trees are
        verified greedily, a chain by exact speculative sampling."""
        sampled = [c for c in chunks if temperature.get(c.request.req_id, 0.0) > 0]
        drafts = self.inner.run(sampled, temperature, generators) if sampled else {}
        wanted = {
            c.request.req_id: c
            for c in chunks
            if c.num_lookahead and temperature.get(c.request.req_id, 0.0) <= 0
        }
        trees: dict[str, TokenTree] = {}
        tokens: dict[str, list[int]] = {}
        outs: dict[str, list[torch.Tensor | None]] = {}
        for req_id, chunk in wanted.items():
            pend = self.inner.pending.get(req_id)
            if pend is None or pend.position != chunk.num_computed - 1:
                raise EngineError(
                    f"request {req_id!r}: the head has no output at position "
                    f"{chunk.num_computed - 1} for its tree drafts"
                )
            tree = self.tree.prefix(min(chunk.num_lookahead, self.tree.num_nodes))
            trees[req_id] = tree
            tokens[req_id] = [-1] * tree.num_nodes
            outs[req_id] = [None] * tree.num_nodes
            _fill_children(tree, -1, pend.logits, tokens[req_id])
        depth = 1
        while True:
            live = [r for r, t in trees.items() if t.max_depth > depth]
            if not live:
                break
            steps, features, counts = [], [], []
            for r in live:
                tree = trees[r]
                m = sum(1 for d in tree.depths if d <= depth)
                pend_out = self.inner.pending[r].out
                for i in range(m):
                    parent = tree.parents[i]
                    feature = pend_out if parent < 0 else outs[r][parent]
                    assert feature is not None  # parents come first (breadth-first)
                    features.append(feature)
                steps.append(
                    StepInput(r, tokens[r][:m], wanted[r].num_computed, parents=tree.parents[:m])
                )
                counts.append(m)
            out = self.inner._pass(steps, torch.stack(features), chained=True)
            for r, rows in zip(live, torch.split(out, counts), strict=True):
                tree = trees[r]
                for i, row in enumerate(rows):
                    if tree.depths[i] == depth:
                        outs[r][i] = row
                parents_here = [i for i in range(len(rows)) if tree.depths[i] == depth]
                needing = [i for i in parents_here if tree.children(i)]
                if needing:
                    logits = self.inner.head.logits(torch.stack([rows[i] for i in needing]))
                    for i, row_logits in zip(needing, logits, strict=True):
                        _fill_children(tree, i, row_logits, tokens[r])
            depth += 1
        drafts.update({r: Drafts(tokens[r], None, trees[r].parents) for r in wanted})
        return drafts


def _fill_children(tree: TokenTree, node: int, logits: torch.Tensor, tokens: list[int]) -> None:
    """The tokens of ``node``'s children: their ranks among ``logits``' top choices."""
    kids = tree.children(node)
    if not kids:
        return
    ranks = [tree.ranks[i] for i in kids]
    top = torch.topk(logits, max(ranks) + 1).indices.tolist()
    for i, rank in zip(kids, ranks, strict=True):
        tokens[i] = int(top[rank])
