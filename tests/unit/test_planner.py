"""Planner scenarios: vLLM's rule reproduced, our layouts, user block sizes, errors."""

from __future__ import annotations

import pytest
from tests.specs_fixtures import gemma_like, nemotron_like, qwen3_4b, qwen3_coder_next, qwen35_9b

from hybridkv.errors import PlanError
from hybridkv.models import load_model_spec
from hybridkv.plan import PlanOptions, plan
from hybridkv.spec import DType, ModelSpec, ShortConvSpec

GiB = 1 << 30


def test_vllm_rule_qwen35_9b_block_528_and_076_percent_padding() -> None:
    """vLLM reports a 528-token attention block and 0.76% state padding for this model."""
    p = plan(qwen35_9b(), layout="vllm", memory_bytes=60 * GiB)
    p.check_invariants()
    attn = [g for g in p.groups if g.kind == "full_attention"]
    states = [g for g in p.groups if g.kind == "state"]
    assert {g.block_size for g in attn} == {528}
    assert len(attn) == 1 and len(states) == 3  # 8 attention + 24 GDN, groups of 8
    pad = (states[0].padded_page_bytes - states[0].page_bytes) / states[0].padded_page_bytes
    assert round(pad * 100, 2) == 0.76
    assert p.pools[0].num_pages == 60 * GiB // (2_162_688 * 8)


def test_vllm_rule_dense_draft_pads_deltanet_pages_by_half() -> None:
    """Coder-Next + Qwen3-4B draft, fp8 KV, K=3: vLLM's rule doubles the main attention
    block (1120 -> 2240) and pads every DeltaNet page to the draft's page (50%)."""
    p = plan(
        qwen3_coder_next(),
        qwen3_4b(),
        spec_method="draft",
        num_spec_tokens=3,
        kv_dtype=DType.FP8_E4M3,
        memory_bytes=60 * GiB,
        layout="vllm",
    )
    main_attn = [g for g in p.groups if g.model == "main" and g.kind == "full_attention"]
    draft_attn = [g for g in p.groups if g.model == "draft"]
    state = next(g for g in p.groups if g.kind == "state")
    assert main_attn[0].block_size == 2240 and draft_attn[0].block_size == 1120
    assert state.page_bytes * 2 == state.padded_page_bytes


def test_auto_acceptance_pair_no_padding_smaller_blocks() -> None:
    """Issue 2 acceptance: auto wastes <= 2% on padding, blocks no larger than vLLM's."""
    p = plan(
        qwen3_coder_next(),
        qwen3_4b(),
        spec_method="draft",
        num_spec_tokens=3,
        kv_dtype=DType.FP8_E4M3,
        memory_bytes=60 * GiB,
    )
    p.check_invariants()
    vllm = next(a for a in p.alternatives if a.layout == "vllm")
    assert p.waste_fraction <= 0.02
    for model in ("main", "draft"):
        ours = max(g.block_size for g in p.groups if g.model == model and g.kind != "state")
        theirs = max(g.block_size for g in vllm.groups if g.model == model and g.kind != "state")
        assert ours <= theirs
    assert p.capacity.max_concurrency >= vllm.capacity.max_concurrency
    assert p.capacity.concurrency_at_typical >= vllm.capacity.concurrency_at_typical


@pytest.mark.parametrize("layout", ["shared", "split", "vllm", "auto"])
@pytest.mark.parametrize("make", [qwen35_9b, gemma_like, nemotron_like, qwen3_4b])
def test_every_layout_plans_consistently(layout: str, make) -> None:  # type: ignore[no-untyped-def]
    p = plan(make(), layout=layout, memory_bytes=40 * GiB, max_model_len=32768)
    p.check_invariants()
    assert p.capacity.max_concurrency >= 1
    assert p.used_bytes <= 40 * GiB


def test_auto_never_below_vllm() -> None:
    for main, draft in [
        (qwen35_9b(), None),
        (qwen35_9b(), qwen3_4b()),
        (nemotron_like(), None),
        (gemma_like(), None),
    ]:
        p = plan(
            main,
            draft,
            spec_method="draft" if draft else None,
            num_spec_tokens=4 if draft else 0,
            memory_bytes=30 * GiB,
            max_model_len=32768,
        )
        vllm = [a for a in (p, *p.alternatives) if a.layout == "vllm"]
        if vllm:
            assert p.capacity.max_concurrency >= vllm[0].capacity.max_concurrency


def test_user_block_size_honoured_exactly_or_refused() -> None:
    p = plan(qwen35_9b(), layout="shared", block_size=1024, memory_bytes=40 * GiB)
    assert {g.block_size for g in p.groups if g.kind == "full_attention"} == {1024}
    with pytest.raises(PlanError, match=r"block size 16 .* >= 528"):
        plan(qwen35_9b(), layout="shared", block_size=16, memory_bytes=40 * GiB)
    with pytest.raises(PlanError, match="vLLM would silently raise it to 528"):
        plan(qwen35_9b(), layout="vllm", block_size=16, memory_bytes=40 * GiB)
    split = plan(qwen35_9b(), layout="split", block_size=32, memory_bytes=40 * GiB)
    assert {g.block_size for g in split.groups if g.kind == "full_attention"} == {32}


def test_max_num_seqs_too_large_reports_largest_that_fits() -> None:
    p = plan(
        qwen35_9b(), layout="shared", memory_bytes=4 * GiB, max_model_len=4096, max_num_seqs=1024
    )
    cap = p.capacity
    assert not cap.max_num_seqs_fits and 0 < cap.max_num_seqs_that_fit < 1024
    assert any(f"largest value that fits is {cap.max_num_seqs_that_fit}" in w for w in p.warnings)


def test_memory_too_small_is_a_plan_error_with_numbers() -> None:
    with pytest.raises(PlanError, match=r"cannot hold one request of 262144 tokens"):
        plan(qwen35_9b(), memory_bytes=1 * GiB)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(layout="fast"), "layout='fast'"),
        (dict(num_spec_tokens=3), "needs a speculative method"),
        (dict(spec_method="draft", num_spec_tokens=2), "needs a draft model"),
        (dict(spec_method="ngram", num_spec_tokens=0), "needs K >= 1"),
        (dict(memory_bytes=0), "memory_bytes=0"),
        (dict(state_mode="align", prefix_caching=False), "prefix caching"),
    ],
)
def test_bad_options_are_plan_errors(options: dict, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        plan(qwen35_9b(), **options)


def test_tp_shards_heads_and_refuses_indivisible() -> None:
    one = plan(qwen35_9b(), layout="split", tp=1, memory_bytes=40 * GiB)
    four = plan(qwen35_9b(), layout="split", tp=4, memory_bytes=40 * GiB)
    assert four.groups[0].page_bytes * 4 == one.groups[0].page_bytes
    with pytest.raises(PlanError, match="tp=3"):
        plan(qwen35_9b(), tp=3)


def test_prefix_caching_off_uses_none_mode_and_no_granularity() -> None:
    p = plan(qwen35_9b(), prefix_caching=False, layout="shared", memory_bytes=40 * GiB)
    assert p.hit_granularity_tokens == 0
    assert all(g.state_mode == "none" for g in p.groups)
    assert PlanOptions(prefix_caching=True).resolved_state_mode == "align"


def test_slab_packing_keeps_blocks_small_without_padding() -> None:
    """A slab of whole state pages lets the attention group take more layers per block,
    so its block shrinks (Coder-Next + dense draft: 560 or 1680 tokens, vLLM's rule: 2240;
    1680-token main-model blocks win at the typical length because the state groups'
    extra checkpoint block and the attention groups' last block peak at different
    steps)."""
    p = plan(
        qwen3_coder_next(),
        qwen3_4b(),
        spec_method="draft",
        num_spec_tokens=3,
        kv_dtype=DType.FP8_E4M3,
        memory_bytes=60 * GiB,
        max_model_len=32768,
        layout="shared",
    )
    p.check_invariants()
    assert p.pools[0].packing == "slab"
    assert max(g.block_size for g in p.groups if g.kind != "state") < 2240
    assert min(g.block_size for g in p.groups if g.kind != "state") <= 560
    assert p.waste_fraction <= 0.02
    # layers of one group lie side by side inside the slab, never past it
    slab = p.pools[0].page_bytes
    for t in p.tensors:
        assert t.page_stride_bytes == slab and t.offset_bytes + t.used_bytes <= slab


def test_max_block_size_is_honoured_or_refused() -> None:
    p = plan(
        qwen3_coder_next(),
        qwen3_4b(),
        spec_method="draft",
        num_spec_tokens=3,
        kv_dtype=DType.FP8_E4M3,
        memory_bytes=60 * GiB,
        max_model_len=32768,
        layout="shared",
        max_block_size=512,
    )
    p.check_invariants()
    assert max(g.block_size for g in p.groups if g.kind != "state") <= 512
    # a 2 MiB state page in one slab leaves the 8 attention layers >= 64-token blocks
    with pytest.raises(PlanError, match="--max-block-size 32"):
        plan(qwen35_9b(), layout="shared", max_block_size=32, memory_bytes=40 * GiB)


def test_vllm_rule_merges_an_mtp_head_into_the_main_attention_type() -> None:
    main = qwen35_9b()
    p = plan(
        main,
        main.draft_head(),
        spec_method="mtp",
        num_spec_tokens=2,
        layout="vllm",
        memory_bytes=40 * GiB,
        max_model_len=32768,
    )
    merged = [g for g in p.groups if g.model == "main+draft"]
    assert len(merged) == 1 and len(merged[0].layers) == 9  # 8 attention + 1 MTP layer
    # K=2 adds 2 conv rows per GDN page: 2146304 + 2 * 8192 * 2 B -> 532 -> 544 tokens
    assert {g.block_size for g in p.groups if g.kind != "state"} == {544}


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_auto_on_attention_free_model_is_never_below_vllm_nor_coarser(tp: int) -> None:
    """Regression (property test): two short-conv layers + a one-layer draft, 1 MiB.
    `shared` holds one request more than vLLM's rule but checkpoints every 256 tokens
    instead of 16: auto keeps vLLM's granularity and says so with both numbers."""
    conv = ShortConvSpec(hidden_size=1024, conv_l_cache=3, conv_dtype=DType.FLOAT16)
    main = ModelSpec(name="m", model_type="r", layers=(conv, conv), max_position_embeddings=2048)
    draft = ModelSpec(name="d", model_type="r", layers=(conv,), max_position_embeddings=2048)
    p = plan(main, draft, PlanOptions(memory_bytes=1 << 20, tp=tp))
    vllm = next(a for a in p.alternatives if a.layout == "vllm") if p.layout != "vllm" else p
    assert p.capacity.max_concurrency >= vllm.capacity.max_concurrency
    assert p.hit_granularity_tokens <= vllm.hit_granularity_tokens
    richer = [a for a in p.alternatives if a.capacity.max_concurrency > p.capacity.max_concurrency]
    for alt in richer:
        assert alt.hit_granularity_tokens > p.hit_granularity_tokens
        note = next(w for w in p.warnings if "coarser hit granularity" in w)
        assert str(alt.capacity.max_concurrency) in note and str(alt.hit_granularity_tokens) in note


def test_auto_hit_granularity_never_coarser_than_vllm_under_mtp() -> None:
    """qwen3.5-35b-a3b, MTP K=3, fp8 KV: auto once took 4288-token hits where vLLM's
    rule gives 2144."""
    main = load_model_spec("qwen3.5-35b-a3b")
    p = plan(
        main,
        main.draft_head(method="mtp"),
        spec_method="mtp",
        num_spec_tokens=3,
        kv_dtype=DType.FP8_E4M3,
    )
    vllm = plan(
        main,
        main.draft_head(method="mtp"),
        spec_method="mtp",
        num_spec_tokens=3,
        kv_dtype=DType.FP8_E4M3,
        layout="vllm",
    )
    assert p.hit_granularity_tokens <= vllm.hit_granularity_tokens == 2144
    assert p.capacity.max_concurrency >= vllm.capacity.max_concurrency
