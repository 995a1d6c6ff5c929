"""MTP heads (Qwen3.5 / Qwen3-Next ``mtp.*``) as drafters under the same cache request:
every proposal equals a plain transformers-module reference head recomputed from
scratch (no pages, no cache), and the output equals transformers' greedy tokens and the
engine without speculation -- with drafts rejected, drafts accepted, chunked prefill,
warm prefix-cache hits (the head's KV read from cached blocks), fp8 KV and sampling."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exactness_harness import hf_greedy  # noqa: E402
from llm_support import shared_prefix_prompts  # noqa: E402
from mtp_support import ReferenceMTP, build_mtp_checkpoint  # noqa: E402

from hybridkv.engine import LLM  # noqa: E402
from hybridkv.engine.models.loader import Checkpoint  # noqa: E402
from hybridkv.errors import EngineError  # noqa: E402

K = 3
NUM_NEW = 20


@pytest.fixture(scope="module")
def mtp_case(tmp_path_factory):
    cache = {}

    def get(kind: str, echo: bool):
        if (kind, echo) not in cache:
            folder = tmp_path_factory.mktemp(f"mtp_{kind}_{echo}")
            hf = build_mtp_checkpoint(kind, folder, echo=echo)
            cache[kind, echo] = (folder, hf, ReferenceMTP(hf, folder))
        return cache[kind, echo]

    return get


def record_drafts(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(verified tokens, drafts) of every decode step that drafted."""
    seen: list[tuple[list[int], list[int]]] = []
    drafter = llm.stepper.drafter
    run = drafter.run

    def wrapped(chunks, temps, gens):
        out = run(chunks, temps, gens)
        for c in chunks:
            if c.num_lookahead:
                verified = list(c.request.tokens[: c.num_computed + 1])
                seen.append((verified, out[c.request.req_id].token_ids))
        return out

    drafter.run = wrapped
    return seen


def check_against_reference(ref: ReferenceMTP, seen) -> None:
    assert seen
    for verified, drafts in seen:
        assert drafts == ref.drafts(verified, len(drafts)), f"after {len(verified)} tokens"


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("echo", [False, True], ids=["rejecting", "accepting"])
def test_mtp_drafts_match_reference_and_output_is_exact(mtp_case, kind, echo):
    folder, hf, ref = mtp_case(kind, echo)
    prompts = shared_prefix_prompts()
    want = hf_greedy(hf, prompts, NUM_NEW)
    llm = LLM(folder, spec_method="mtp", num_spec_tokens=K, chunk_size=16)
    assert [g.model for g in llm.plan.groups if "draft" in g.model]  # head layers planned
    seen = record_drafts(llm)
    got = [r.token_ids for r in llm.generate(prompts, NUM_NEW)]
    assert got == want
    assert got == [r.token_ids for r in LLM(folder).generate(prompts, NUM_NEW)]
    check_against_reference(ref, seen)
    s = llm.stats()
    assert s.num_proposed_tokens > 0
    if echo:
        assert 0 < s.num_accepted_tokens < s.num_proposed_tokens
    llm.manager.check_invariants()


def _long_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    system = torch.randint(0, 128, (70,), generator=gen).tolist()
    return [system + torch.randint(0, 128, (n,), generator=gen).tolist() for n in (5, 11, 2)]


def test_mtp_warm_prefix_cache_reads_the_heads_cached_kv(mtp_case):
    """Second round: the attention, state and head groups hit; the head's KV at the
    hit positions comes from cached blocks and its drafts still equal the reference."""
    folder, hf, ref = mtp_case("qwen3_next", True)
    prompts = _long_prompts()
    want = hf_greedy(hf, prompts, NUM_NEW)
    llm = LLM(folder, spec_method="mtp", num_spec_tokens=K, chunk_size=8, state_mode="align")
    assert [r.token_ids for r in llm.generate(prompts, NUM_NEW)] == want
    before = llm.stats().prefix_hit_tokens
    seen = record_drafts(llm)
    assert [r.token_ids for r in llm.generate(prompts, NUM_NEW)] == want
    after = llm.stats().prefix_hit_tokens
    assert after["attention"] > before["attention"] and after["state"] > before["state"]
    check_against_reference(ref, seen)
    llm.manager.check_invariants()


def test_mtp_with_fp8_kv_equals_non_speculative_fp8(mtp_case):
    folder, _hf, _ref = mtp_case("qwen3_next", True)
    prompts = shared_prefix_prompts()
    llm = LLM(folder, spec_method="mtp", num_spec_tokens=K, kv_dtype="fp8_e4m3")
    assert all(c.key.dtype == torch.float8_e4m3fn for c in llm.tensors.draft_caches.values())
    got = [r.token_ids for r in llm.generate(prompts, NUM_NEW)]
    plain = LLM(folder, kv_dtype="fp8_e4m3")
    assert got == [r.token_ids for r in plain.generate(prompts, NUM_NEW)]
    assert llm.stats().num_accepted_tokens > 0


def test_mtp_sampling_is_seeded(mtp_case):
    folder, _hf, _ref = mtp_case("qwen3_5", True)
    prompts = shared_prefix_prompts()[:3]

    def run():
        llm = LLM(folder, spec_method="mtp", num_spec_tokens=K)
        return [r.token_ids for r in llm.generate(prompts, NUM_NEW, temperature=0.8, seed=3)]

    first = run()
    assert first == run()
    assert all(len(t) == NUM_NEW for t in first)


def test_mtp_tensors_are_ignored_with_a_reason_unless_asked_for(mtp_case):
    from hybridkv.engine.models.loader import read_config
    from hybridkv.engine.models.qwen3_5 import load_qwen3_5

    folder, _hf, _ref = mtp_case("qwen3_5", False)
    ckpt = Checkpoint(folder, torch.float32)
    load_qwen3_5(read_config(folder), ckpt)
    assert ckpt.unused() == []
    ignored = ckpt.ignored()
    assert "mtp.fc.weight" in ignored and "spec_method 'mtp'" in ignored["mtp.fc.weight"]


def test_mtp_without_a_head_is_a_typed_error(llm_case, tmp_path):
    with pytest.raises(EngineError, match="no MTP head in the engine"):
        LLM(llm_case("qwen3").folder, spec_method="mtp", num_spec_tokens=2)
    # A Qwen3.5 checkpoint saved by transformers alone: no mtp.* tensors, no count.
    with pytest.raises(EngineError, match="states no MTP layers"):
        LLM(llm_case("qwen3_5").folder, spec_method="mtp", num_spec_tokens=2)


def test_mtp_count_without_tensors_is_a_typed_error(llm_case, tmp_path):
    import json
    import shutil

    folder = Path(tmp_path) / "no_tensors"
    shutil.copytree(llm_case("qwen3_5").folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineError, match=r"no 'mtp\.fc\.weight'"):
        LLM(folder, spec_method="mtp", num_spec_tokens=2)


def test_tree_drafts_plan_one_state_slot_per_node(mtp_case):
    """A tree of N nodes (here topk=2, N=3) is planned as N speculative tokens: every
    state group keeps one speculative state per node (tests/exactness/test_tree_drafts.py
    runs trees end to end)."""
    folder, _hf, _ref = mtp_case("qwen3_5", False)
    llm = LLM(folder, spec_method="mtp", num_spec_tokens=3, spec_topk=2)
    assert llm.tree is not None and llm.tree.num_nodes == llm.num_spec_tokens == 3
    states = [g for g in llm.plan.groups if g.is_state]
    assert states and all(g.num_spec_states == 3 for g in states)


def test_mtp_preemption_mid_speculation_gives_the_same_tokens(mtp_case):
    """A budget that preempts dozens of times (measured: 39 at 180 KiB): recompute
    refills the head's KV and its pending output before the next drafts."""
    folder, hf, _ref = mtp_case("qwen3_next", True)
    prompts = shared_prefix_prompts()
    want = hf_greedy(hf, prompts, 32)
    tight = LLM(
        folder,
        spec_method="mtp",
        num_spec_tokens=K,
        memory_bytes=180 << 10,
        chunk_size=3,
        max_model_len=128,
    )
    assert [r.token_ids for r in tight.generate(prompts, 32)] == want
    assert tight.stats().num_preemptions >= 5
    assert tight.stats().num_accepted_tokens > 0
    tight.manager.check_invariants()


def test_mtp_through_hybridkv_generate(mtp_case):
    import json

    from typer.testing import CliRunner

    import hybridkv.cli.engine  # noqa: F401  (registers generate)
    from hybridkv.cli import app

    folder, hf, _ref = mtp_case("qwen3_next", True)
    prompts = shared_prefix_prompts()[:3]
    args = ["generate", str(folder), "--spec-method", "mtp", "--num-spec", str(K)]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    result = CliRunner().invoke(app, [*args, "--max-new-tokens", str(NUM_NEW), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [o["token_ids"] for o in payload["outputs"]] == hf_greedy(hf, prompts, NUM_NEW)
    assert payload["stats"]["spec_method"] == "mtp"
    assert payload["stats"]["num_accepted_tokens"] > 0
