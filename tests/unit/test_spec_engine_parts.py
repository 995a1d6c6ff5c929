"""Pieces of speculative decoding in the engine: draft-pass state slots, counters,
the scheduler's lookahead, `LLM` argument checks and `hybridkv generate --draft`."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
from typer.testing import CliRunner  # noqa: E402

import hybridkv.cli.engine  # noqa: E402,F401  (registers the commands)
from hybridkv.cli import app  # noqa: E402
from hybridkv.demo import DEMO_DRAFT, DEMO_MAIN  # noqa: E402
from hybridkv.engine.forward.runner import draft_pass_points, state_write_points  # noqa: E402
from hybridkv.engine.speculative.drafting import SpecCounters, make_proposer  # noqa: E402
from hybridkv.errors import EngineError  # noqa: E402


def test_draft_passes_chain_write_then_spec_slots():
    """Pass 1 reads the running state and writes `write`; pass j reads what pass j - 1
    wrote and writes spec slot j - 2 (the picture in `draft_pass_points`)."""
    assert draft_pass_points(7, 7, (11, 12, 13), 1) == (7, [(1, 7)])
    assert draft_pass_points(None, 5, (11, 12, 13), 1) == (None, [(1, 5)])
    assert draft_pass_points(7, 5, (11, 12, 13), 2) == (5, [(1, 11)])
    assert draft_pass_points(7, 5, (11, 12, 13), 4) == (12, [(1, 13)])
    with pytest.raises(EngineError):
        draft_pass_points(7, 5, (11,), 3)


def test_state_write_points_limit_spec_points_to_carried_drafts():
    full = state_write_points(3, 3, 11, (8, 9), None, 10)
    assert full == (3, [(1, 3), (2, 8), (3, 9)])
    assert state_write_points(3, 3, 11, (8, 9), None, 10, 0) == (3, [(1, 3)])


def test_spec_counters():
    c = SpecCounters()
    c.add(4, 4)
    c.add(0, 0)
    c.add(4, 1)
    assert (c.num_proposed, c.num_accepted, c.num_verify_steps, c.num_draft_steps) == (8, 5, 3, 2)
    assert c.mean_accepted_length == pytest.approx(8 / 3)
    assert c.acceptance_rate == pytest.approx(5 / 8)
    assert SpecCounters().mean_accepted_length == 0.0
    with pytest.raises(EngineError):
        make_proposer("eagle")


def test_llm_spec_argument_checks():
    from hybridkv.engine import LLM

    with pytest.raises(EngineError, match="needs a draft model"):
        LLM(DEMO_MAIN, spec_method="draft", num_spec_tokens=2)
    with pytest.raises(EngineError, match="num_spec_tokens"):
        LLM(DEMO_MAIN, spec_method="ngram")
    with pytest.raises(EngineError, match="spec method"):
        LLM(DEMO_MAIN, num_spec_tokens=3)


def test_draft_model_on_demo_pair_matches_plain_greedy_and_accepts():
    from hybridkv.engine import LLM

    prompts = ["import os\nimport sys\n\ndef main(", "def parse_args("]
    plain = LLM(DEMO_MAIN, max_model_len=256).generate(prompts, 40)
    llm = LLM(DEMO_MAIN, draft=DEMO_DRAFT, num_spec_tokens=4, max_model_len=256)
    spec = llm.generate(prompts, 40)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert llm.stats().mean_accepted_length > 1.5
    assert all(r.stats.num_verify_steps > 0 for r in spec)


@pytest.mark.parametrize(
    "args",
    [
        ["--draft", "demo-draft", "--num-spec", "3"],
        ["--spec-method", "suffix", "--num-spec", "2"],
    ],
)
def test_generate_prints_spec_stats_in_json(args):
    result = CliRunner().invoke(
        app,
        [
            "generate",
            "demo",
            "--prompt",
            "import os\nimport sys\n",
            "--max-new-tokens",
            "12",
            *args,
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    stats = payload["stats"]
    assert stats["spec_method"] in ("draft", "suffix")
    assert stats["num_verify_steps"] >= 1 and "mean_accepted_length" in stats
    assert "num_proposed_tokens" in payload["outputs"][0]["stats"]
    assert len(payload["outputs"][0]["token_ids"]) == 12
