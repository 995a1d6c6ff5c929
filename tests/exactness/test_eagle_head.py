"""EAGLE-style heads (`hybridkv.engine.models.eagle`): proposals equal a transformers-
module reference recomputed from scratch, output equals transformers' greedy tokens,
on a Gated DeltaNet hybrid main (head fed three main layers' hidden states), with
accepted and rejected drafts and a warm prefix cache; bad folders are typed errors."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from eagle_support import ReferenceEagle, build_eagle_head  # noqa: E402
from exactness_harness import hf_greedy  # noqa: E402
from llm_support import shared_prefix_prompts  # noqa: E402
from mtp_support import build_mtp_checkpoint  # noqa: E402
from test_mtp_head import check_against_reference, record_drafts  # noqa: E402

from hybridkv.engine import LLM  # noqa: E402
from hybridkv.errors import EngineError  # noqa: E402

K = 3
NUM_NEW = 20


@pytest.fixture(scope="module")
def eagle_case(tmp_path_factory):
    cache = {}

    def get(echo: bool):
        if echo not in cache:
            root = tmp_path_factory.mktemp(f"eagle_{echo}")
            hf = build_mtp_checkpoint("qwen3_5", root / "main", echo=echo)
            build_eagle_head(root / "eagle", hf.config.hidden_size, echo=echo)
            cache[echo] = (root / "main", root / "eagle", hf, ReferenceEagle(hf, root / "eagle"))
        return cache[echo]

    return get


@pytest.mark.parametrize("echo", [False, True], ids=["rejecting", "accepting"])
def test_eagle_drafts_match_reference_and_output_is_exact(eagle_case, echo):
    main, head, hf, ref = eagle_case(echo)
    prompts = shared_prefix_prompts()
    want = hf_greedy(hf, prompts, NUM_NEW)
    llm = LLM(main, spec_method="eagle", draft=head, num_spec_tokens=K, chunk_size=16)
    seen = record_drafts(llm)
    assert [r.token_ids for r in llm.generate(prompts, NUM_NEW)] == want
    check_against_reference(ref, seen)
    s = llm.stats()
    assert s.num_proposed_tokens > 0
    if echo:
        assert 0 < s.num_accepted_tokens < s.num_proposed_tokens
    llm.manager.check_invariants()


def test_eagle_warm_prefix_cache(eagle_case):
    main, head, hf, ref = eagle_case(True)
    gen = torch.Generator().manual_seed(9)
    system = torch.randint(0, 128, (200,), generator=gen).tolist()  # > 2 blocks of 64
    prompts = [system + torch.randint(0, 128, (n,), generator=gen).tolist() for n in (4, 9)]
    want = hf_greedy(hf, prompts, NUM_NEW)
    llm = LLM(
        main, spec_method="eagle", draft=head, num_spec_tokens=K, chunk_size=8, state_mode="align"
    )
    assert [r.token_ids for r in llm.generate(prompts, NUM_NEW)] == want
    seen = record_drafts(llm)
    assert [r.token_ids for r in llm.generate(prompts, NUM_NEW)] == want
    assert llm.stats().prefix_hit_tokens["attention"] > 0
    check_against_reference(ref, seen)


def test_eagle_folder_errors(eagle_case, tmp_path):
    main, head, _hf, _ref = eagle_case(False)
    with pytest.raises(EngineError, match="needs an EAGLE head folder"):
        LLM(main, spec_method="eagle", num_spec_tokens=2)
    with pytest.raises(EngineError, match=r"no eagle_config\.json"):
        LLM(main, spec_method="eagle", draft=tmp_path, num_spec_tokens=2)
    bad = tmp_path / "bad"
    shutil.copytree(head, bad)
    cfg = json.loads((bad / "eagle_config.json").read_text())
    cfg["aux_layers"] = [0, 9]
    (bad / "eagle_config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineError, match=r"aux_layers \[0, 9\]"):
        LLM(main, spec_method="eagle", draft=bad, num_spec_tokens=2)
    cfg["aux_layers"], cfg["hidden_size"] = [0], 32
    (bad / "eagle_config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineError, match="hidden_size 32"):
        LLM(main, spec_method="eagle", draft=bad, num_spec_tokens=2)


def test_eagle_with_fp8_kv_equals_non_speculative_fp8(eagle_case):
    main, head, _hf, _ref = eagle_case(True)
    prompts = shared_prefix_prompts()
    llm = LLM(main, spec_method="eagle", draft=head, num_spec_tokens=K, kv_dtype="fp8_e5m2")
    assert {c.key.dtype for c in llm.tensors.draft_caches.values()} == {torch.float8_e5m2}
    got = [r.token_ids for r in llm.generate(prompts, NUM_NEW)]
    assert got == [r.token_ids for r in LLM(main, kv_dtype="fp8_e5m2").generate(prompts, NUM_NEW)]
    assert llm.stats().num_accepted_tokens > 0
