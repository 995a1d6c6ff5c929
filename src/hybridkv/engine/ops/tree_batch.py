"""A step's token trees as the layers see them (`ForwardBatch.tree`).

Request ``r``'s new tokens sit in consecutive cache slots ``c .. c + n - 1`` as usual;
with a tree, ``parents[r][i]`` names the new token that token ``i`` follows (-1: it
follows the committed context directly). A chain is ``[-1, 0, 1, ...]``; one verified
token then a tree of drafts ``d1 d2 d3`` with d2 a sibling of d1 and d3 d1's child::

    token      T   d1  d2  d3        parents  [-1, 0, 0, 1]
    slot       c   c+1 c+2 c+3       depth    [ 0, 1, 1, 2]   position = c + depth

What each layer kind does with it:

    attention  RoPE at the position (``positions``); token i sees the committed keys
               (< c, and its sliding window counted from its position) and, among the
               new tokens, itself and its ancestors only (`apply_tree_mask`)
    state      one padded row per root-to-leaf path, every row starting from the
               request's read state; a token's output and its state write points come
               from the first path that holds it (`state_batched.tree_state_parts`), so each node's
               state is computed from its parent's, along its own path (conv window too)

Write point ``(k, slot)`` of a tree request means "the state after new token k - 1,
along its path" (for a chain: after the first k tokens, as everywhere else).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hybridkv.errors import EngineError, InvariantError

if TYPE_CHECKING:
    from hybridkv.engine.ops.context import ForwardBatch


@dataclass(frozen=True)
class TreeLayout:
    """Parents per request (None: a plain causal chunk); see the module docstring."""

    parents: tuple[tuple[int, ...] | None, ...]
    positions: torch.Tensor  # [T]: num_computed + depth, for RoPE
    depths: tuple[tuple[int, ...] | None, ...] = field(repr=False)

    @classmethod
    def build(
        cls,
        parents: Sequence[Sequence[int] | None],
        starts: Sequence[tuple[int, int]],
        device: torch.device,
    ) -> TreeLayout:
        """``parents`` per request; ``starts``: (num_computed, num_new) per request."""
        if len(parents) != len(starts):
            raise EngineError(f"{len(parents)} parent lists for {len(starts)} requests")
        positions: list[int] = []
        depths: list[tuple[int, ...] | None] = []
        kept: list[tuple[int, ...] | None] = []
        for r, (tree, (c, n)) in enumerate(zip(parents, starts, strict=True)):
            if tree is None:
                positions.extend(range(c, c + n))
                depths.append(None)
                kept.append(None)
                continue
            if len(tree) != n:
                raise EngineError(f"request {r}: {len(tree)} parents for {n} new tokens")
            depth: list[int] = []
            for i, p in enumerate(tree):
                if not -1 <= p < i:
                    raise EngineError(
                        f"request {r}: token {i} has parent {p}; a parent must come "
                        "before its child (-1: the committed context)"
                    )
                depth.append(0 if p < 0 else depth[p] + 1)
            positions.extend(c + d for d in depth)
            depths.append(tuple(depth))
            kept.append(tuple(int(p) for p in tree))
        return cls(
            parents=tuple(kept),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            depths=tuple(depths),
        )

    def check_invariants(self) -> None:
        for tree, depth in zip(self.parents, self.depths, strict=True):
            if (tree is None) != (depth is None) or (tree and len(tree) != len(depth or ())):
                raise InvariantError("tree layout: parents and depths disagree on a request")


def rope_positions(batch: ForwardBatch) -> torch.Tensor:
    """Positions for RoPE: the slot positions, or the tree depths' positions."""
    tree: TreeLayout | None = batch.tree
    return batch.positions if tree is None else tree.positions


def ancestors(parents: Sequence[int]) -> torch.Tensor:
    """``[n, n]`` bool: token i may see token j (j is i or an ancestor of i)."""
    n = len(parents)
    seen = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            seen[i] |= seen[p]
    return seen


def apply_tree_mask(index: Any, batch: ForwardBatch, window: int | None) -> None:
    """Rewrite the masks of ``index`` (an `attention.AttentionIndex`) for tree requests:
    committed keys by position (window from the token's own position), new keys by
    ancestry (and window by depth). Plain requests keep the causal mask."""
    tree: TreeLayout = batch.tree
    computed, lengths = batch.host_computed, batch.host_lengths
    for part in index.parts:
        device = part.mask.device
        num_keys = int(part.mask.shape[-1])
        for row, r in enumerate(part.layout.reqs):
            parents, depths = tree.parents[r], tree.depths[r]
            if parents is None or depths is None:
                continue
            c, n = computed[r], lengths[r]
            first = 0 if window is None else max(0, c - window + 1)
            key_pos = first + torch.arange(num_keys)
            real = key_pos < c + n
            old = key_pos < c
            depth = torch.tensor(depths, dtype=torch.long)
            new = (key_pos - c).clamp(0, n - 1)
            mask = old[None, :] | ancestors(parents)[:, new]
            mask &= real[None, :]
            if window is not None:
                reach = torch.where(old, key_pos, c + depth[new])
                mask &= reach[None, :] > (c + depth)[:, None] - window
            part.mask[row, 0, :n, :] = mask.to(device)


def root_paths(parents: Sequence[int]) -> list[list[int]]:
    """Every root-to-leaf path of token indices (roots: parent -1), leaves in order."""
    has_child = {p for p in parents if p >= 0}
    paths = []
    for leaf in range(len(parents)):
        if leaf in has_child:
            continue
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths
