"""Verifying a token tree in one main pass, and committing the accepted path.

One decode step of request r with a tree of N draft nodes (`plan.tree.TokenTree`, c
computed tokens, the verified token T at c)::

    drafter   N nodes in breadth-first order, parent of each (-1: T)
              (`proposers.tree.TreeHeadDrafter`)
    main      one pass over T, node 1 .. node N in slots c .. c + N: RoPE at c + depth,
              tree attention mask, one recurrent state per node from its parent's
              (`tree_batch`); logits at all 1 + N tokens
    accept    greedy: from T, follow the child whose token is the main model's argmax
              at its parent; a accepted nodes, then the argmax at the last one (bonus)
    compact   the accepted node at depth d moves to slot c + d: its K/V (every main
              attention layer) and its state (spec slot d - 1 of every state layer)
    commit    the scheduler commits a drafts as for a chain; the manager keeps the
              path's blocks and checkpoints and frees the rest (no tree knowledge needed)

Example, N = 4 nodes ``(0,) (1,) (0,0) (1,0)`` at slots c+1 .. c+4. The main model's
argmax after T is the token of (1,), after (1,) the token of (1,0), after that none
of the nodes: a = 2, path (1,) (1,0) = nodes 2 and 4 (1-based); node 2 moves from c+2
to c+1, node 4 from c+4 to c+2; the bonus is the argmax at node 4.

Moving in depth order is safe: the node at depth d sits at slot >= c + d, and each later
source sits after every earlier destination. Only greedy verification runs with trees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridkv.cache import CacheManager
from hybridkv.engine.forward.runner import ModelRunner, StepInput
from hybridkv.engine.forward.tensors import group_key
from hybridkv.engine.models.common import HiddenStates
from hybridkv.engine.ops.context import KVCache, StateCache
from hybridkv.engine.speculative.drafting import Drafts
from hybridkv.engine.speculative.verify import Verdict
from hybridkv.errors import EngineError
from hybridkv.sched import ScheduledChunk


@dataclass(frozen=True)
class TreeVerdict:
    """The greedy verdict and the accepted nodes (0-based node indices, depth order)."""

    verdict: Verdict
    path: tuple[int, ...]


def accept_tree(
    best: Sequence[int], node_tokens: Sequence[int], parents: Sequence[int]
) -> TreeVerdict:
    """``best``: the main model's argmax at [T, node 0 .. node N-1]; ``parents[i]``: the
    parent node of node i (-1: T). Siblings carry distinct tokens, so at most one child
    matches at each step."""
    if len(best) != len(node_tokens) + 1 or len(parents) != len(node_tokens):
        raise EngineError(
            f"tree verification: {len(best)} scored tokens, {len(node_tokens)} nodes and "
            f"{len(parents)} parents (needs N + 1, N, N)"
        )
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    node, path = -1, []
    while True:
        want = best[node + 1]
        match = next((i for i in children.get(node, ()) if node_tokens[i] == want), None)
        if match is None:
            break
        path.append(match)
        node = match
    tokens = [int(node_tokens[i]) for i in path]
    return TreeVerdict(Verdict(len(path), [*tokens, int(best[node + 1])]), tuple(path))


def compact_path(
    runner: ModelRunner,
    manager: CacheManager,
    req_id: str,
    first_node_pos: int,
    path: Sequence[int],
) -> None:
    """Move the accepted nodes' K/V and states into the chain's places (module doc).
    ``first_node_pos``: the slot position of node 0 (c + number of verified tokens)."""
    moves = [(i, d) for d, i in enumerate(path) if i != d]
    if not moves:
        return
    src = [i for i, _ in moves]
    dst = [d for _, d in moves]
    for group in runner.attention_groups:
        key = group_key(group.group_id)
        table = manager.block_table(req_id, group.group_id)
        size, device = group.block_size, runner.device
        src_at = _page_index(table, size, [first_node_pos + i for i in src], device)
        dst_at = _page_index(table, size, [first_node_pos + d for d in dst], device)
        for cache in runner.caches.values():
            if isinstance(cache, KVCache) and cache.group == key:
                cache.key[dst_at] = cache.key[src_at]
                cache.value[dst_at] = cache.value[src_at]
    for group in runner.state_groups:
        key = group_key(group.group_id)
        spec = manager.state_slots(req_id, group.group_id).spec_blocks
        if max(src) >= len(spec):
            raise EngineError(
                f"request {req_id!r}, state group {group.group_id}: node {max(src)} has no "
                f"speculative state slot ({len(spec)} held); plan num_spec_tokens = the "
                "tree's node count"
            )
        device = runner.device
        from_slots = torch.tensor([int(spec[i]) for i in src], dtype=torch.long, device=device)
        to_slots = torch.tensor([int(spec[d]) for d in dst], dtype=torch.long, device=device)
        for cache in runner.caches.values():
            if isinstance(cache, StateCache) and cache.group == key:
                cache.conv[to_slots] = cache.conv[from_slots]
                cache.ssm[to_slots] = cache.ssm[from_slots]


def _page_index(
    table: Sequence[int], block_size: int, positions: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    last = max(positions)
    if last // block_size >= len(table):
        raise EngineError(
            f"tree commit: position {last} needs logical block {last // block_size} but the "
            f"request holds {len(table)} blocks"
        )
    blocks = [int(table[p // block_size]) for p in positions]
    offsets = [p % block_size for p in positions]
    return (
        torch.tensor(blocks, dtype=torch.long, device=device),
        torch.tensor(offsets, dtype=torch.long, device=device),
    )


def step_parents(num_verified: int, node_parents: Sequence[int]) -> tuple[int, ...]:
    """Parents over a verify step's tokens: the verified tokens as a chain, then the
    nodes (node parent -1 -> the last verified token)."""
    chain = tuple(range(-1, num_verified - 1))
    return (*chain, *(num_verified - 1 if p < 0 else num_verified + p for p in node_parents))


def path_first_rows(
    row_counts: Sequence[int], paths: Sequence[tuple[int, int, Sequence[int]] | None]
) -> torch.Tensor:
    """Batch row order that puts, per request, its verified tokens and then its accepted
    nodes first (the head's observation reads the first n + a rows of each request).
    ``paths[r]``: (row offset of node 0 within the request, N, path) or None."""
    order: list[int] = []
    start = 0
    for count, entry in zip(row_counts, paths, strict=True):
        rows = list(range(start, start + count))
        if entry is not None:
            offset, num_nodes, path = entry
            nodes = rows[offset : offset + num_nodes]
            picked = [nodes[i] for i in path]
            rest = [row for i, row in enumerate(nodes) if i not in set(path)]
            rows = rows[:offset] + picked + rest
        order.extend(rows)
        start += count
    return torch.tensor(order, dtype=torch.long)


def reorder_hidden(hidden: HiddenStates, order: torch.Tensor) -> HiddenStates:
    index = order.to(hidden.final.device)
    return HiddenStates(
        final=hidden.final[index], layers={k: v[index] for k, v in hidden.layers.items()}
    )


class TreeSettler:
    """One step's tree verdicts: accept, compact, and remember the paths so that the
    head's observation reads the accepted nodes' hidden states in path order."""

    def __init__(self, runner: ModelRunner, manager: CacheManager) -> None:
        self.runner = runner
        self.manager = manager
        self.paths: dict[str, tuple[int, int, tuple[int, ...]]] = {}

    def settle(self, chunk: ScheduledChunk, argmax: Sequence[int], drafts: Drafts) -> Verdict:
        req_id = chunk.request.req_id
        parents = drafts.parents
        if parents is None:
            raise EngineError(f"request {req_id!r}: tree verification of a chain")
        num_nodes = len(drafts.token_ids)
        tv = accept_tree(argmax[len(argmax) - 1 - num_nodes :], drafts.token_ids, parents)
        n = chunk.num_new_tokens
        compact_path(self.runner, self.manager, req_id, chunk.num_computed + n, tv.path)
        self.paths[req_id] = (n, num_nodes, tv.path)
        return tv.verdict

    def check_invariants(self) -> None:
        """Every accepted path is a chain of distinct nodes within its tree."""
        for req_id, (_n, num_nodes, path) in self.paths.items():
            if len(set(path)) != len(path) or any(not 0 <= i < num_nodes for i in path):
                raise EngineError(f"request {req_id!r}: accepted path {path} of {num_nodes}")

    def reorder(self, hidden: HiddenStates, steps: Sequence[StepInput]) -> HiddenStates:
        counts = [len(s.token_ids) for s in steps]
        entries = [self.paths.get(s.req_id) for s in steps]
        return reorder_hidden(hidden, path_first_rows(counts, entries))
