"""A scripted tree drafter for the tree tests: it knows transformers' greedy tokens and
hides the right continuation at a random branch of every tree (or nowhere), so steps
accept paths through second-choice nodes, stop early, or accept nothing -- every case
the compaction and commit must handle."""

from __future__ import annotations

import random

import torch

from hybridkv.engine.speculative.drafting import Drafts
from hybridkv.plan.tree import TokenTree

TREE = TokenTree.from_paths([[0], [1], [2], [0, 0], [1, 0], [1, 1], [0, 0, 0], [1, 0, 0]])


class ScriptedTreeDrafter:
    """A `Drafter` proposing ``tree`` per decode step; the right tokens (from
    ``expected``) sit on a random root-to-node path, wrong ones elsewhere."""

    capture = None

    def __init__(self, prompts, expected, vocab: int, tree: TokenTree = TREE, seed: int = 0):
        self.want = {tuple(p): list(e) for p, e in zip(prompts, expected, strict=True)}
        self.vocab = vocab
        self.tree = tree
        self.rng = random.Random(seed)
        self.seen: list[tuple[list[int], Drafts]] = []  # (verified tokens, drafts)

    def max_drafts(self, req_id, num_computed, limit):
        return limit

    def features(self, hidden):
        raise AssertionError("reads no hidden states")

    def observe(self, observations):
        return None

    def forget(self, req_id):
        return None

    def run(self, chunks, temperature, generators):
        out = {}
        for c in chunks:
            if not c.num_lookahead:
                continue
            req = c.request
            verified = list(req.tokens[: c.num_computed + 1])
            done = len(verified) - len(req.prompt)
            future = self.want[tuple(req.prompt)][done:]
            tree = self.tree.prefix(min(c.num_lookahead, self.tree.num_nodes))
            out[req.req_id] = Drafts(self._tokens(tree, future), None, tree.parents)
            self.seen.append((verified, out[req.req_id]))
        return out

    def _tokens(self, tree: TokenTree, future: list[int]) -> list[int]:
        # The node that carries the right token at each depth, chosen among the children
        # of the previous right node (or none: the path stops there).
        right: dict[int, int] = {}
        node = -1
        for depth in range(1, tree.max_depth + 1):
            kids = tree.children(node)
            if not kids or depth > len(future) or self.rng.random() < 0.15:
                break
            node = self.rng.choice(kids)
            right[node] = future[depth - 1]
        tokens = []
        for i, depth in enumerate(tree.depths):
            if i in right:
                tokens.append(right[i])
                continue
            truth = future[depth - 1] if depth <= len(future) else 0
            tokens.append((truth + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab)
        # siblings must differ: resample clashes (never onto the right token)
        for parent in {-1, *range(tree.num_nodes)}:
            kids = tree.children(parent)
            used: set[int] = set()
            for i in sorted(kids, key=lambda k: k not in right):
                while tokens[i] in used:
                    tokens[i] = (tokens[i] + 1) % self.vocab
                used.add(tokens[i])
        return tokens


def node_logits_oracle(hf, verified: list[int], drafts: Drafts) -> torch.Tensor:
    """transformers' next-token logits after each tree node, each computed on the plain
    sequence verified + the node's path (no tree, no cache): ``[N, vocab]``."""
    parents = drafts.parents
    assert parents is not None
    rows = []
    for i in range(len(drafts.token_ids)):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        seq = verified + [drafts.token_ids[j] for j in reversed(path)]
        with torch.no_grad():
            logits = hf(torch.tensor([seq]), attention_mask=torch.ones(1, len(seq))).logits
        rows.append(logits[0, -1].float())
    return torch.stack(rows)
