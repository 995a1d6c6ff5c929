"""Token tree shapes (`hybridkv.plan.tree`) and the configurations that refuse trees by
name: proposers that draft one chain (draft model, ngram, suffix), malformed trees,
trees too deep for the state kernels' short rows. The plan CLI plans a tree of N nodes
as N speculative tokens."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app
from hybridkv.errors import InvariantError, PlanError
from hybridkv.plan.tree import MAX_TREE_DEPTH, TokenTree, check_chain_drafts, check_tree_drafts


def test_chains_are_not_trees():
    assert check_tree_drafts(1, None, num_spec_tokens=3, method="ngram") is None
    assert check_tree_drafts(1, [], method="draft") is None
    check_chain_drafts(1)


def test_paths_are_sorted_breadth_first_with_parents_before_children():
    tree = TokenTree.from_paths([[0, 0], [1], [0], [0, 0, 0], [1, 0]])
    assert tree.paths == ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))
    assert tree.parents == (-1, -1, 0, 1, 2)
    assert tree.depths == (1, 1, 2, 2, 3)
    assert tree.children(-1) == [0, 1] and tree.children(0) == [2]
    assert all(p < i for i, p in enumerate(tree.parents))
    assert tree.prefix(3).paths == ((0,), (1,), (0, 0))  # a prefix is a tree
    assert not tree.is_chain and TokenTree.from_paths([[0], [0, 0]]).is_chain


def test_topk_tree_takes_the_likeliest_paths():
    tree = TokenTree.from_topk(2, 4, rank_rates=(0.6, 0.3), depth_decay=1.0)
    # scores: (0) .6, (1) .3, (0,0) .36, (0,1) .18, (1,0) .18, (0,0,0) .216
    assert tree.paths == ((0,), (1,), (0, 0), (0, 0, 0))
    assert TokenTree.from_topk(1, 3).paths == ((0,), (0, 0), (0, 0, 0))  # a chain
    deep = TokenTree.from_topk(1, 20)
    assert deep.max_depth == MAX_TREE_DEPTH  # capped: a path must fit one short row


@pytest.mark.parametrize(
    ("paths", "match"),
    [
        ([[0], [1, 0]], "no parent"),
        ([[0], [0]], "twice"),
        ([[0], [-1]], "child ranks"),
        ("[(0,)]", "non-empty list"),
        ([[0] * d for d in range(1, MAX_TREE_DEPTH + 2)], "depth"),
    ],
)
def test_malformed_trees_are_refused(paths, match):
    with pytest.raises(PlanError, match=match):
        TokenTree.from_paths(paths)


def test_unsorted_tree_breaks_invariants():
    with pytest.raises(InvariantError, match="breadth-first"):
        TokenTree(((0, 0), (0,)))


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix", None])
def test_chain_proposers_refuse_trees_by_name(method):
    with pytest.raises(PlanError, match="hidden-state head") as err:
        check_tree_drafts(2, num_spec_tokens=4, method=method)
    assert "topk=2" in str(err.value)


def test_tree_node_count_must_match_k():
    with pytest.raises(PlanError, match="has 3 nodes"):
        check_tree_drafts(1, [[0], [1], [0, 0]], num_spec_tokens=2, method="mtp")
    with pytest.raises(PlanError, match="not both"):
        check_tree_drafts(2, [[0]], method="mtp")
    assert check_tree_drafts(2, num_spec_tokens=5, method="eagle").num_nodes == 5


@pytest.mark.parametrize("topk", [0, -1, 1.5, True])
def test_bad_topk_values(topk):
    with pytest.raises(PlanError, match="positive integer"):
        check_tree_drafts(topk)


def _plan(config: dict) -> tuple[int, dict]:
    result = CliRunner().invoke(
        app, ["plan", "qwen3.5-0.8b", "--speculative-config", json.dumps(config), "--json"]
    )
    return result.exit_code, json.loads(result.stdout)


def test_plan_cli_refuses_a_tree_of_a_chain_proposer():
    code, out = _plan({"method": "ngram", "num_speculative_tokens": 3, "topk": 4})
    assert code == 2
    error = out["error"]
    assert error["type"] == "PlanError" and "topk=4" in error["message"]


def test_plan_cli_plans_a_tree_as_its_node_count():
    tree = "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]"  # vLLM's string form
    code, out = _plan({"method": "qwen3_next_mtp", "speculative_token_tree": tree})
    assert code == 0, out
    code_k, out_k = _plan({"method": "mtp", "num_speculative_tokens": 5})
    assert code_k == 0
    assert json.dumps(out, sort_keys=True) == json.dumps(out_k, sort_keys=True)
