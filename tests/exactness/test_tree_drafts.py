"""Token trees verified in one main pass: the output equals transformers' greedy tokens
(fp32) for pure attention, sliding window, Gated DeltaNet, Mamba2 and short-conv
models; every node's logits equal transformers run on the node's own path (tree mask
and per-node recurrent state); the accepted path's K/V, states and checkpoints are
committed (a warm second round hits the cache and is still exact); the manager's
accounting holds."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exactness_harness import hf_greedy  # noqa: E402
from llm_support import VOCAB, shared_prefix_prompts  # noqa: E402
from mtp_support import ReferenceMTP, build_mtp_checkpoint  # noqa: E402
from tree_support import TREE, ScriptedTreeDrafter, node_logits_oracle  # noqa: E402

from hybridkv.engine import LLM  # noqa: E402
from hybridkv.engine.speculative import tree as tree_mod  # noqa: E402
from hybridkv.engine.speculative.proposers.tree import TreeHeadDrafter  # noqa: E402
from hybridkv.errors import PlanError  # noqa: E402

NUM_NEW = 32


def scripted_llm(case, **options) -> tuple[LLM, ScriptedTreeDrafter]:
    """An engine planned for TREE.num_nodes drafts per step, drafting with the script."""
    llm = LLM(case.folder, spec_method="ngram", num_spec_tokens=TREE.num_nodes, **options)
    drafter = ScriptedTreeDrafter(case.prompts, case.expected, VOCAB)
    llm.stepper.drafter = drafter
    return llm, drafter


@pytest.mark.parametrize(
    "name", ["qwen3", "gemma3", "qwen3_5", "nemotron_h", "lfm2", "gpt_oss", "falcon_h1"]
)
def test_tree_output_is_exact_and_warm_round_hits(llm_case, name, monkeypatch):
    case = llm_case(name)
    llm, _drafter = scripted_llm(case, chunk_size=16, state_mode="all")
    moved: list[bool] = []
    real = tree_mod.compact_path

    def recording(runner, manager, req_id, first, path):
        moved.append(any(i != d for d, i in enumerate(path)))
        return real(runner, manager, req_id, first, path)

    monkeypatch.setattr(tree_mod, "compact_path", recording)
    got = [r.token_ids for r in llm.generate(case.prompts, NUM_NEW)]
    assert got == case.expected
    stats = llm.stats()
    assert stats.num_accepted_tokens > 0 and sum(moved) > 0, "no off-chain path accepted"
    assert stats.mean_accepted_length > 1.5
    llm.manager.check_invariants()
    before = llm.stats().prefix_hit_tokens
    again = [r.token_ids for r in llm.generate(case.prompts, NUM_NEW)]
    assert again == case.expected
    after = llm.stats().prefix_hit_tokens
    # the prompts share 40-token prefixes: a hit needs a block that fits in one
    if max(g.block_size for g in llm.plan.groups) <= 40:
        assert after["attention"] > before["attention"]
        if case.hybrid:
            assert after["state"] > before["state"]
    llm.manager.check_invariants()


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "qwen3_5", "nemotron_h", "lfm2"])
def test_every_node_sees_its_own_path_only(llm_case, name):
    """The main pass's logits at each node == transformers on verified + that node's
    path: the tree mask (attention) and one state per node from its parent's (GDN,
    Mamba2, short conv) are exact."""
    case = llm_case(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(case.folder, dtype=torch.float32)
    hf.eval()
    llm, drafter = scripted_llm(case, chunk_size=16)
    captured = []
    execute = llm.runner.execute

    def spy(steps):
        logits = execute(steps)
        for step, rows in zip(steps, logits, strict=True):
            if step.parents is not None:
                captured.append((step, rows))
        return logits

    llm.runner.execute = spy
    prompts = case.prompts[:3]
    llm.generate(prompts, 8)
    assert len(captured) >= 3
    for step, rows in captured[:6]:
        verified, drafts = next(
            (v, d)
            for v, d in drafter.seen
            if len(v) == step.num_computed + 1 and d.token_ids == list(step.token_ids[1:])
        )
        assert verified[-1] == step.token_ids[0]
        want = node_logits_oracle(hf, verified, drafts)
        torch.testing.assert_close(rows[1:].float(), want, atol=2e-4, rtol=2e-4)


def test_tree_with_a_preempting_budget_is_exact(llm_case):
    case = llm_case("qwen3_5")
    llm, _ = scripted_llm(case, memory_bytes=250 << 10, chunk_size=4, max_model_len=128)
    got = [r.token_ids for r in llm.generate(case.prompts, NUM_NEW)]
    assert got == case.expected
    assert llm.stats().num_preemptions > 0
    llm.manager.check_invariants()


@pytest.fixture(scope="module")
def mtp_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tree_mtp")
    hf = build_mtp_checkpoint("qwen3_5", folder, echo=True)
    return folder, hf


@pytest.mark.parametrize(
    "options",
    [{"spec_topk": 2, "num_spec_tokens": 4}, {"spec_tree": [[0], [1], [0, 0], [1, 0], [0, 1]]}],
    ids=["topk", "explicit"],
)
def test_mtp_head_tree_is_exact(mtp_folder, options):
    folder, hf = mtp_folder
    prompts = shared_prefix_prompts()
    want = hf_greedy(hf, prompts, 20)
    llm = LLM(folder, spec_method="mtp", chunk_size=16, **options)
    assert isinstance(llm.stepper.drafter, TreeHeadDrafter)
    assert llm.num_spec_tokens == llm.tree.num_nodes  # planned: N speculative tokens
    assert [r.token_ids for r in llm.generate(prompts, 20)] == want
    assert llm.stats().num_accepted_tokens > 0
    llm.manager.check_invariants()
    llm.runner.check_invariants()
    llm.stepper.drafter.check_invariants()


def test_tree_refusals(mtp_folder, llm_case):
    folder, _hf = mtp_folder
    with pytest.raises(PlanError, match="hidden-state head"):
        LLM(llm_case("qwen3").folder, spec_method="ngram", num_spec_tokens=3, spec_topk=2)
    with pytest.raises(PlanError, match="no parent"):
        LLM(folder, spec_method="mtp", spec_tree=[[0], [1, 0]])
    with pytest.raises(PlanError, match="the token tree has 3 nodes"):
        LLM(folder, spec_method="mtp", num_spec_tokens=2, spec_tree=[[0], [1], [0, 0]])
    with pytest.raises(PlanError, match="depth"):
        LLM(folder, spec_method="mtp", spec_tree=[[0] * d for d in range(1, 10)])


def test_sampled_requests_draft_a_chain_under_a_tree(mtp_folder):
    """Trees verify greedily; a sampled request drafts a chain of N and is verified by
    speculative sampling: the same stream as the chain engine with K = N, same seed."""
    folder, _hf = mtp_folder
    prompts = shared_prefix_prompts()[:4]
    tree = LLM(folder, spec_method="mtp", spec_topk=2, num_spec_tokens=3)
    chain = LLM(folder, spec_method="mtp", num_spec_tokens=3)
    got = [r.token_ids for r in tree.generate(prompts, 16, temperature=0.8, seed=5)]
    assert got == [r.token_ids for r in chain.generate(prompts, 16, temperature=0.8, seed=5)]
    assert tree.stats().num_proposed_tokens > 0
    tree.manager.check_invariants()


def reference_tree(ref: ReferenceMTP, verified: list[int], drafts) -> list[int]:
    """The tree's node tokens from the plain reference head: each node's children are
    the ranks of the head's logits after the node's own path (chained, no cache)."""
    parents = drafts.parents
    hidden = ref.hf.model(torch.tensor([verified])).last_hidden_state[0]
    tokens: list[int] = []
    for i in range(len(parents)):
        path = []
        node = parents[i]
        while node >= 0:
            path.append(node)
            node = parents[node]
        inputs = list(verified[1:])
        features = hidden[:-1]
        last = ref._head(torch.tensor(inputs), features)[-1]
        for node in reversed(path):
            inputs.append(drafts.token_ids[node])
            features = torch.cat((features, last[None]))
            last = ref._head(torch.tensor(inputs), features)[-1]
        logits = last @ ref.hf.lm_head.weight.T
        rank = sum(1 for j in range(i) if parents[j] == parents[i])
        tokens.append(int(torch.topk(logits, rank + 1).indices[rank]))
    return tokens


def test_mtp_tree_drafts_match_the_reference_head(mtp_folder):
    folder, hf = mtp_folder
    ref = ReferenceMTP(hf, folder)
    llm = LLM(folder, spec_method="mtp", spec_tree=[[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]])
    drafter = llm.stepper.drafter
    seen = []
    run = drafter.run

    def recording(chunks, temps, gens):
        out = run(chunks, temps, gens)
        for c in chunks:
            if c.num_lookahead:
                seen.append((list(c.request.tokens[: c.num_computed + 1]), out[c.request.req_id]))
        return out

    drafter.run = recording
    llm.generate(shared_prefix_prompts()[:3], 10)
    assert len(seen) >= 5
    for verified, drafts in seen[:8]:
        assert drafts.token_ids == reference_tree(ref, verified, drafts), len(verified)


def test_tree_with_fp8_kv_equals_non_speculative_fp8(mtp_folder):
    """The compaction moves fp8 pages as they are: the same tokens as the engine
    without speculation under the same fp8 numerics."""
    folder, _hf = mtp_folder
    prompts = shared_prefix_prompts()
    want = [r.token_ids for r in LLM(folder, kv_dtype="fp8_e4m3").generate(prompts, 20)]
    llm = LLM(folder, spec_method="mtp", spec_topk=2, num_spec_tokens=4, kv_dtype="fp8_e4m3")
    assert [r.token_ids for r in llm.generate(prompts, 20)] == want
    assert llm.stats().num_accepted_tokens > 0


@pytest.mark.parametrize(
    "config",
    [
        {"method": "qwen3_5_mtp", "num_speculative_tokens": 4, "topk": 2},
        {"method": "mtp", "speculative_token_tree": "[(0,), (1,), (0, 0), (1, 0)]"},
    ],
)
def test_tree_through_hybridkv_generate(mtp_folder, config):
    import json

    from typer.testing import CliRunner

    import hybridkv.cli.engine  # noqa: F401  (registers generate)
    from hybridkv.cli import app

    folder, hf = mtp_folder
    prompts = shared_prefix_prompts()[:3]
    args = ["generate", str(folder), "--speculative-config", json.dumps(config)]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    result = CliRunner().invoke(app, [*args, "--max-new-tokens", "16", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [o["token_ids"] for o in payload["outputs"]] == hf_greedy(hf, prompts, 16)
    assert payload["stats"]["spec_method"] == "mtp"
    assert payload["stats"]["num_spec_tokens"] == 4


def test_generate_refuses_a_tree_of_ngram(mtp_folder):
    import json

    from typer.testing import CliRunner

    import hybridkv.cli.engine  # noqa: F401
    from hybridkv.cli import app

    folder, _hf = mtp_folder
    config = {"method": "ngram", "num_speculative_tokens": 3, "topk": 2}
    result = CliRunner().invoke(
        app,
        [
            "generate",
            str(folder),
            "--prompt-ids",
            "1,2",
            "--speculative-config",
            json.dumps(config),
        ],
    )
    assert result.exit_code != 0
    assert "hidden-state head" in result.output


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "nemotron_h"])
def test_checkpoints_written_by_tree_steps_serve_exact_hits(llm_case, name):
    """Round 1 decodes 16 tokens with trees (state checkpoints at every boundary, some
    from compacted speculative slots); round 2 continues prompt + those 16 tokens and
    hits the cache past the original prompts, i.e. reads K/V and states that tree
    steps committed. Its tokens are transformers' tokens 16..31."""
    case = llm_case(name)
    half = NUM_NEW // 2
    llm, _ = scripted_llm(case, chunk_size=16, state_mode="all", block_size=16)
    assert [r.token_ids for r in llm.generate(case.prompts, half)] == [
        e[:half] for e in case.expected
    ]
    longer = [list(p) + e[:half] for p, e in zip(case.prompts, case.expected, strict=True)]
    rest = [e[half:] for e in case.expected]
    llm.stepper.drafter = ScriptedTreeDrafter(longer, rest, VOCAB)
    before = llm.stats().prefix_hit_tokens
    assert [r.token_ids for r in llm.generate(longer, half)] == rest
    after = llm.stats().prefix_hit_tokens
    # what hits could reach if nothing past the original prompts had been committed
    prompt_only = sum(len(p) // 16 * 16 for p in case.prompts)
    assert after["attention"] - before["attention"] > prompt_only
    if case.hybrid:
        assert after["state"] - before["state"] > prompt_only
    llm.manager.check_invariants()


def test_eagle_head_tree_is_exact(tmp_path):
    from eagle_support import build_eagle_head

    hf = build_mtp_checkpoint("qwen3_5", tmp_path / "main", echo=True)
    build_eagle_head(tmp_path / "eagle", hf.config.hidden_size, echo=True)
    prompts = shared_prefix_prompts()[:4]
    want = hf_greedy(hf, prompts, 16)
    llm = LLM(
        tmp_path / "main",
        spec_method="eagle",
        draft=tmp_path / "eagle",
        spec_tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]],
    )
    assert [r.token_ids for r in llm.generate(prompts, 16)] == want
    assert llm.stats().num_proposed_tokens > 0
    llm.manager.check_invariants()
