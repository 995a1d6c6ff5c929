"""The seed configurations end to end, through `LLM` and `hybridkv generate`:

1. a Qwen3-Next-style main (Gated DeltaNet + gated full attention, MoE) with a dense
   Qwen3 draft, fp8 KV, K = 3;
2. the same main with a suffix proposer whose draft count jumps between 0 and 16, on a
   warm prefix cache.

Both give exactly the tokens of the non-speculative engine under the same fp8 numerics,
and the second round of requests hits the prefix cache (attention and state)."""

from __future__ import annotations

import itertools
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from exactness_harness import save_tiny  # noqa: E402
from llm_support import COMMON  # noqa: E402
from mtp_support import _config  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import hybridkv.cli.engine  # noqa: E402,F401  (registers generate)
from hybridkv.cli import app  # noqa: E402
from hybridkv.engine import LLM  # noqa: E402

NUM_NEW = 24
KV = "fp8_e4m3"
RUN = dict(kv_dtype=KV, chunk_size=16, max_num_seqs=1)  # one by one: later ones hit


@pytest.fixture(scope="module")
def seed_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("seed")
    main_cls, main_config = _config("qwen3_next")
    save_tiny(main_cls, main_config, root / "main")
    save_tiny(
        transformers.Qwen3ForCausalLM,
        transformers.Qwen3Config(**COMMON, num_hidden_layers=2),
        root / "draft",
        seed=1,
    )
    return root / "main", root / "draft"


def base_prompts() -> list[list[int]]:
    """Three prompts sharing a 120-token prefix."""
    gen = torch.Generator().manual_seed(2)
    system = torch.randint(0, 128, (120,), generator=gen).tolist()
    return [system + torch.randint(0, 128, (n,), generator=gen).tolist() for n in (7, 1, 20)]


@pytest.fixture(scope="module")
def seed_prompts(seed_pair):
    """The base prompts, then two that repeat a base prompt with its own greedy output
    ``o``: ``p + o + p + o[:12]`` starts decoding on a long suffix match (16 drafts)
    while the others start on none (0 drafts)."""
    main, _draft = seed_pair
    base = base_prompts()
    outs = [r.token_ids for r in LLM(main, **RUN).generate(base[:2], 40)]
    return base + [p + o + p + o[:12] for p, o in zip(base[:2], outs, strict=True)]


def plain_tokens(main, prompts) -> list[list[int]]:
    return [r.token_ids for r in LLM(main, **RUN).generate(prompts, NUM_NEW)]


def test_draft_model_fp8_k3_on_a_hybrid_moe_main(seed_pair, seed_prompts):
    main, draft = seed_pair
    prompts = seed_prompts
    llm = LLM(main, draft=draft, num_spec_tokens=3, **RUN)
    kinds = {(g.model, g.kind) for g in llm.plan.groups}
    assert ("main", "state") in kinds and ("main", "full_attention") in kinds
    assert any(m.startswith("draft") or "draft" in m for m, _ in kinds)
    assert {c.key.dtype for c in llm.tensors.draft_caches.values()} == {torch.float8_e4m3fn}
    want = plain_tokens(main, prompts)
    for _round in range(2):
        assert [r.token_ids for r in llm.generate(prompts, NUM_NEW)] == want
    s = llm.stats()
    assert s.prefix_hit_tokens["attention"] > 0 and s.prefix_hit_tokens["state"] > 0
    assert s.num_proposed_tokens > 0
    llm.manager.check_invariants()


def test_suffix_draft_counts_jump_between_0_and_16_on_a_warm_cache(seed_pair, seed_prompts):
    main, _draft = seed_pair
    prompts = seed_prompts
    llm = LLM(main, spec_method="suffix", num_spec_tokens=16, **RUN)
    counts: list[int] = []
    propose = llm.proposer.propose

    def counted(req_id, token_ids, max_num):
        out = propose(req_id, token_ids, max_num)
        counts.append(len(out))
        return out

    llm.proposer.propose = counted
    want = plain_tokens(main, prompts)
    for _round in range(2):
        assert [r.token_ids for r in llm.generate(prompts, NUM_NEW)] == want
    assert 0 in counts and 16 in counts, counts
    assert any(abs(a - b) >= 8 for a, b in itertools.pairwise(counts)), counts
    assert s_accepted(llm) > 0
    s = llm.stats()
    assert s.prefix_hit_tokens["attention"] > 0 and s.prefix_hit_tokens["state"] > 0
    llm.manager.check_invariants()


def s_accepted(llm: LLM) -> int:
    return llm.stats().num_accepted_tokens


@pytest.mark.parametrize(
    "spec",
    [["--draft", "DRAFT", "--num-spec", "3"], ["--spec-method", "suffix", "--num-spec", "16"]],
)
def test_seed_configs_through_hybridkv_generate(seed_pair, seed_prompts, spec):
    main, draft = seed_pair
    spec = [str(draft) if a == "DRAFT" else a for a in spec]
    args = ["generate", str(main), "--kv-dtype", KV, "--chunk-size", "16", "--max-num-seqs", "1"]
    for p in seed_prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    result = CliRunner().invoke(app, [*args, *spec, "--max-new-tokens", str(NUM_NEW), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["kv_dtype"] == KV
    assert [o["token_ids"] for o in payload["outputs"]] == plain_tokens(main, seed_prompts)
    stats = payload["stats"]
    assert stats["prefix_hit_tokens"]["attention"] > 0 and stats["prefix_hit_tokens"]["state"] > 0
    assert stats["num_proposed_tokens"] > 0
