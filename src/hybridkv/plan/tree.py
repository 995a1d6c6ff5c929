"""Tree drafts: the shape of a token tree, and which configurations run one.

A *token tree* of N draft nodes is verified in one main-model pass (the engine side is
`hybridkv.engine.speculative.tree`). Each node is named by its path of child ranks from the root:
``(0,)`` is the drafter's most likely next token, ``(1,)`` its second choice,
``(0, 1)`` the second choice after ``(0,)``, and so on. Example, N = 4::

    root (the last verified token, position c)
    |-- (0,)      depth 1, position c + 1
    |   |-- (0, 0)   depth 2, position c + 2
    |   `-- (0, 1)   depth 2
    `-- (1,)      depth 1

Nodes are kept in breadth-first order (depth, then path), so every prefix of the node
list is itself a tree (a step with fewer reserved positions drafts a prefix) and a
parent always comes before its children (`TokenTree.parents[i] < i`).

What a tree costs the cache: the main pass carries N draft tokens, so the planner
reserves N lookahead slots and keeps S = N speculative state slots per state group
(one per node: a chain of K drafts needs K, a tree of N nodes needs N). Plan a tree by
passing ``num_spec_tokens = N``; nothing else in the plan changes. After verification
the accepted path (at most the tree's depth) is compacted into the first slots, so the
cache manager commits it exactly like an accepted chain prefix.

Which configurations run trees (`check_tree_drafts`): drafts from a hidden-state head
(``mtp``, ``eagle``) with greedy verification. A draft model, n-gram and suffix
proposers propose one chain per step, and sampling with a tree would need multi-branch
speculative sampling; both are refused by name.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridkv.errors import InvariantError, PlanError

TREE_KEYS = ("topk", "speculative_token_tree")  # --speculative-config keys that ask for trees
TREE_METHODS = ("mtp", "eagle")  # drafters that can branch (a head, run level by level)
# A path of the tree, with the verified token before it, is one row of the recurrent
# state kernels' short part (`state_batched.SHORT_MAX_TOKENS` = 8).
MAX_TREE_DEPTH = 7
MAX_TREE_NODES = 64
# Per-rank acceptance estimates used to shape a ``topk`` tree: the chance that the r-th
# choice of the head is the main model's token. From the demo MTP head (bench/
# tree_drafts.py prints them: rank 0 0.754, rank 1 0.087 at depth 1), made decreasing;
# any decreasing sequence gives a valid tree.
DEFAULT_RANK_RATES = (0.75, 0.09, 0.03, 0.02, 0.01, 0.01, 0.01, 0.01)
# Deeper nodes are drafted from the head's own outputs: each extra level is damped (the
# demo head's second draft is accepted about half as often as its first, given the first).
DEFAULT_DEPTH_DECAY = 0.5

Path = tuple[int, ...]


@dataclass(frozen=True)
class TokenTree:
    """A token tree in breadth-first order (module docstring). Build with `from_paths`
    or `from_topk`; the constructor checks nothing else than `check_invariants`."""

    paths: tuple[Path, ...]
    parents: tuple[int, ...] = field(init=False)  # parent node index, -1 for depth 1
    depths: tuple[int, ...] = field(init=False)  # 1 for children of the root

    def __post_init__(self) -> None:
        index = {path: i for i, path in enumerate(self.paths)}
        parents = tuple(-1 if len(p) == 1 else index.get(p[:-1], -2) for p in self.paths)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "depths", tuple(len(p) for p in self.paths))
        self.check_invariants()

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Each node's rank among its parent's choices (0: the most likely token)."""
        return tuple(p[-1] for p in self.paths)

    @property
    def is_chain(self) -> bool:
        return all(rank == 0 for rank in self.ranks)

    def children(self, node: int) -> list[int]:
        """Child node indices of ``node`` (-1: the root), in order."""
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def prefix(self, num_nodes: int) -> TokenTree:
        """The first ``num_nodes`` nodes (a tree again: breadth-first order)."""
        if not 0 <= num_nodes <= self.num_nodes:
            raise PlanError(f"tree prefix of {num_nodes} nodes: the tree has {self.num_nodes}")
        return self if num_nodes == self.num_nodes else TokenTree(self.paths[:num_nodes])

    def check_invariants(self) -> None:
        if len(set(self.paths)) != len(self.paths):
            raise InvariantError(f"token tree has repeated paths: {list(self.paths)}")
        if list(self.paths) != sorted(self.paths, key=_bfs_key):
            raise InvariantError(f"token tree paths are not breadth-first: {list(self.paths)}")
        for path, parent in zip(self.paths, self.parents, strict=True):
            if not path or any(r < 0 for r in path) or parent == -2:
                raise InvariantError(f"token tree path {path}: empty, negative or orphaned")

    @classmethod
    def from_paths(cls, paths: object) -> TokenTree:
        """A tree from a list of rank paths (lists or tuples of ints, any order);
        `PlanError` naming the first bad entry."""
        if not isinstance(paths, Sequence) or isinstance(paths, str) or not paths:
            raise PlanError(
                f"speculative_token_tree must be a non-empty list of paths such as "
                f"[[0], [1], [0, 0]], got {paths!r}"
            )
        seen: set[Path] = set()
        for raw in paths:
            if (
                not isinstance(raw, Sequence)
                or isinstance(raw, str)
                or not raw
                or not all(isinstance(r, int) and not isinstance(r, bool) for r in raw)
                or min(raw) < 0
            ):
                raise PlanError(
                    f"speculative_token_tree entry {raw!r}: a path is a non-empty list of "
                    "child ranks >= 0, e.g. [0, 1]"
                )
            path = tuple(int(r) for r in raw)
            if path in seen:
                raise PlanError(f"speculative_token_tree lists the path {list(path)} twice")
            seen.add(path)
        for path in seen:
            if len(path) > 1 and path[:-1] not in seen:
                raise PlanError(
                    f"speculative_token_tree path {list(path)} has no parent "
                    f"{list(path[:-1])} in the tree; list every ancestor"
                )
        tree = cls(tuple(sorted(seen, key=_bfs_key)))
        _check_size(tree.num_nodes, tree.max_depth)
        return tree

    @classmethod
    def from_topk(
        cls,
        topk: int,
        num_nodes: int,
        rank_rates: Sequence[float] = DEFAULT_RANK_RATES,
        depth_decay: float = DEFAULT_DEPTH_DECAY,
    ) -> TokenTree:
        """The ``num_nodes`` paths (ranks < ``topk``) most likely to be accepted when the
        r-th choice is right with probability ``rank_rates[r]`` and each level deeper
        is damped by ``depth_decay``: best-first, so ancestors always come in first.
        ``topk`` 1 gives a chain."""
        _check_topk(topk)
        _check_size(num_nodes, None)
        if len(rank_rates) < topk or not all(0 < r <= 1 for r in rank_rates[:topk]):
            raise PlanError(
                f"topk={topk} needs {topk} acceptance rates in (0, 1], got {list(rank_rates)}"
            )
        heap: list[tuple[float, Path]] = [(-rank_rates[r], (r,)) for r in range(topk)]
        heapq.heapify(heap)
        chosen: list[Path] = []
        while heap and len(chosen) < num_nodes:
            neg, path = heapq.heappop(heap)
            chosen.append(path)
            if len(path) < MAX_TREE_DEPTH:
                for r in range(topk):
                    heapq.heappush(heap, (neg * rank_rates[r] * depth_decay, (*path, r)))
        return cls(tuple(sorted(chosen, key=_bfs_key)))


def _bfs_key(path: Path) -> tuple[int, Path]:
    return len(path), path


def _check_topk(topk: object) -> None:
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
        raise PlanError(f"topk={topk!r}: must be a positive integer (1: a chain of drafts)")


def _check_size(num_nodes: int, depth: int | None) -> None:
    if not 1 <= num_nodes <= MAX_TREE_NODES:
        raise PlanError(
            f"a token tree of {num_nodes} nodes: use 1 to {MAX_TREE_NODES} "
            "(num_speculative_tokens is the node count of a tree)"
        )
    if depth is not None and depth > MAX_TREE_DEPTH:
        raise PlanError(
            f"token tree depth {depth} > {MAX_TREE_DEPTH}: a path and the verified token "
            f"must fit the state kernels' short rows ({MAX_TREE_DEPTH + 1} tokens)"
        )


def check_tree_drafts(
    topk: object = 1,
    token_tree: object = None,
    *,
    num_spec_tokens: int = 0,
    method: str | None = None,
) -> TokenTree | None:
    """The tree asked for (None: a chain), or `PlanError` naming what does not run.

    ``topk`` k > 1 shapes a tree of ``num_spec_tokens`` nodes (`TokenTree.from_topk`);
    ``token_tree`` is an explicit list of rank paths (``num_spec_tokens`` 0 or its node
    count). Trees run with the hidden-state heads (``TREE_METHODS``) only."""
    _check_topk(topk)
    if topk == 1 and not token_tree:
        return None
    if token_tree:
        if topk != 1:
            raise PlanError(f"give topk={topk} or speculative_token_tree, not both")
        tree = TokenTree.from_paths(token_tree)
        if num_spec_tokens not in (0, tree.num_nodes):
            raise PlanError(
                f"num_speculative_tokens={num_spec_tokens} but the token tree has "
                f"{tree.num_nodes} nodes; drop it or make it {tree.num_nodes}"
            )
        asked = f"a token tree of {tree.num_nodes} nodes"
    else:
        assert isinstance(topk, int)
        if num_spec_tokens < 1:
            raise PlanError(f"topk={topk} needs num_speculative_tokens >= 1 (the node count)")
        tree = TokenTree.from_topk(topk, num_spec_tokens)
        asked = f"topk={topk}"
    if method not in TREE_METHODS:
        raise PlanError(
            f"tree drafts ({asked}) run with a hidden-state head ({', '.join(TREE_METHODS)}), "
            f"not spec method {method!r}: a draft model, ngram and suffix propose one chain "
            "per step (a draft model would need tree attention in its own passes). Use "
            "topk=1 for a chain."
        )
    return tree


def check_chain_drafts(topk: object = 1, token_tree: object = None, **_: object) -> None:
    """`PlanError` unless the drafts form one chain (older entry points that plan chains
    only; `check_tree_drafts` is the one that accepts trees)."""
    _check_topk(topk)
    if topk != 1 or token_tree:
        asked = f"topk={topk}" if topk != 1 else "a token tree"
        raise PlanError(
            f"tree drafts ({asked}) are not supported here: this entry point plans a chain; "
            f"trees run in the engine with spec method {' or '.join(TREE_METHODS)}"
        )
