"""Tree drafts (topk > 1, a token tree) are refused everywhere, naming what is missing
(tree attention mask, tree-aware commit, per-branch states for state layers) instead of
being planned as a chain."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app
from hybridkv.errors import PlanError
from hybridkv.models.registry import load_model_spec
from hybridkv.plan.tree import check_chain_drafts


def test_chains_pass():
    check_chain_drafts(1)
    check_chain_drafts(1, [], main=load_model_spec("qwen3.5-0.8b"))


def test_topk_on_a_hybrid_names_every_missing_piece():
    main = load_model_spec("qwen3.5-0.8b")
    with pytest.raises(PlanError) as err:
        check_chain_drafts(2, main=main)
    message = str(err.value)
    assert "topk=2" in message and "tree attention mask" in message
    assert "tree-aware commit" in message and "recurrent state per branch point" in message
    assert f"{main.name} layers [0, 1, 2" in message  # the state layers, by index


def test_token_tree_on_a_dense_model_needs_no_state_piece():
    with pytest.raises(PlanError) as err:
        check_chain_drafts(1, [[0], [1], [0, 0]], main=load_model_spec("qwen3-8b"))
    assert "a token tree of 3 nodes" in str(err.value)
    assert "recurrent state" not in str(err.value)


@pytest.mark.parametrize("topk", [0, -1, 1.5, True])
def test_bad_topk_values(topk):
    with pytest.raises(PlanError, match="positive integer"):
        check_chain_drafts(topk)


def test_plan_cli_refuses_a_tree_speculative_config():
    config = {"method": "ngram", "num_speculative_tokens": 3, "topk": 4}
    result = CliRunner().invoke(
        app, ["plan", "qwen3.5-0.8b", "--speculative-config", json.dumps(config), "--json"]
    )
    assert result.exit_code == 2
    error = json.loads(result.stdout)["error"]
    assert error["type"] == "PlanError" and "topk=4" in error["message"]
