"""Tree verification pieces on their own: greedy acceptance along the tree, the step's
parent layout, the path rows the head observes, and the per-request tree layout
(positions, ancestry, root-to-leaf paths) the layers read."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine.ops.tree_batch import TreeLayout, ancestors, root_paths  # noqa: E402
from hybridkv.engine.speculative.tree import accept_tree, path_first_rows, step_parents  # noqa: E402
from hybridkv.errors import EngineError  # noqa: E402

# nodes: 0=(0,) 1=(1,) 2=(0,0) 3=(1,0) 4=(0,0,0)
PARENTS = (-1, -1, 0, 1, 2)
TOKENS = [10, 11, 20, 21, 30]


@pytest.mark.parametrize(
    ("best", "accepted", "emitted", "path"),
    [
        ([11, 5, 21, 6, 7, 8], 2, [11, 21, 7], (1, 3)),  # second choice, then its child
        ([10, 20, 5, 30, 5, 9], 3, [10, 20, 30, 9], (0, 2, 4)),  # the chain, plus bonus
        ([12, 0, 0, 0, 0, 0], 0, [12], ()),  # nothing matches: the correction
        ([10, 21, 0, 0, 0, 0], 1, [10, 21], (0,)),  # 21 is not a child of node 0
    ],
)
def test_accept_tree_follows_the_argmax_child(best, accepted, emitted, path):
    verdict = accept_tree(best, TOKENS, PARENTS)
    assert verdict.verdict.num_accepted == accepted
    assert verdict.verdict.token_ids == emitted
    assert verdict.path == path


def test_accept_tree_checks_its_sizes():
    with pytest.raises(EngineError, match="N \\+ 1"):
        accept_tree([1, 2], TOKENS, PARENTS)


def test_step_parents_puts_the_nodes_after_the_verified_tokens():
    assert step_parents(1, PARENTS) == (-1, 0, 0, 1, 2, 3)
    assert step_parents(3, (-1, 0)) == (-1, 0, 1, 2, 3)


def test_path_first_rows_orders_accepted_nodes_first():
    # request 0: 1 verified + 5 nodes, path nodes 1, 3; request 1: 4 plain rows
    order = path_first_rows([6, 4], [(1, 5, (1, 3)), None]).tolist()
    assert order == [0, 2, 4, 1, 3, 5, 6, 7, 8, 9]


def test_tree_layout_positions_are_depths():
    layout = TreeLayout.build([(-1, 0, 0, 1, 2, 3), None], [(7, 6), (3, 2)], torch.device("cpu"))
    assert layout.positions.tolist() == [7, 8, 8, 9, 9, 10, 3, 4]
    with pytest.raises(EngineError, match="before its child"):
        TreeLayout.build([(-1, 2, 0)], [(0, 3)], torch.device("cpu"))
    with pytest.raises(EngineError, match="3 parents for 2"):
        TreeLayout.build([(-1, 0, 0)], [(0, 2)], torch.device("cpu"))


def test_ancestry_and_paths():
    parents = step_parents(1, PARENTS)  # (-1, 0, 0, 1, 2, 3)
    seen = ancestors(parents)
    assert seen[5].nonzero().flatten().tolist() == [0, 1, 3, 5]
    assert seen[4].nonzero().flatten().tolist() == [0, 2, 4]
    assert not seen[1, 2] and not seen[2, 1]  # siblings never see each other
    assert root_paths(parents) == [[0, 2, 4], [0, 1, 3, 5]]
    assert root_paths((-1, -1, 0)) == [[1], [0, 2]]  # several roots (a head's level pass)
