"""Property: over random main + draft layer mixes the planner returns a plan whose
invariants hold, or raises `PlanError`; never anything else."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hybridkv.errors import PlanError
from hybridkv.plan import PlanOptions, plan
from hybridkv.plan.planner import TIE_TOLERANCE
from hybridkv.spec import (
    AttentionSpec,
    ChunkedLocalSpec,
    DType,
    GatedDeltaNetSpec,
    KDASpec,
    LayerSpec,
    LightningSpec,
    Mamba1Spec,
    Mamba2Spec,
    MLASpec,
    ModelSpec,
    ShortConvSpec,
    SlidingWindowSpec,
)

dtypes = st.sampled_from(list(DType))
heads = st.sampled_from([1, 2, 3, 4, 8, 16, 32])
dims = st.sampled_from([16, 64, 96, 128, 192, 256])


@st.composite
def layer_specs(draw: st.DrawFn) -> LayerSpec:
    kind = draw(
        st.sampled_from(
            ["full", "swa", "chunk", "mla", "gdn", "mamba2", "mamba1", "conv", "kda", "lightning"]
        )
    )
    kv = draw(dtypes)
    conv, ssm = draw(dtypes), draw(dtypes)
    if kind == "full":
        return AttentionSpec(num_kv_heads=draw(heads), head_dim=draw(dims), dtype=kv)
    if kind == "swa":
        return SlidingWindowSpec(
            num_kv_heads=draw(heads),
            head_dim=draw(dims),
            dtype=kv,
            sliding_window=draw(st.integers(1, 8192)),
        )
    if kind == "chunk":
        return ChunkedLocalSpec(
            num_kv_heads=draw(heads),
            head_dim=draw(dims),
            dtype=kv,
            attention_chunk_size=draw(st.integers(16, 8192)),
        )
    if kind == "mla":
        return MLASpec(
            kv_lora_rank=draw(st.sampled_from([64, 256, 512])),
            qk_rope_head_dim=draw(st.sampled_from([16, 64])),
            dtype=kv,
        )
    if kind == "gdn":
        return GatedDeltaNetSpec(
            num_k_heads=draw(heads),
            num_v_heads=draw(heads),
            head_k_dim=draw(dims),
            head_v_dim=draw(dims),
            conv_kernel=draw(st.integers(2, 4)),
            conv_dtype=conv,
            ssm_dtype=ssm,
        )
    if kind == "mamba2":
        return Mamba2Spec(
            num_heads=draw(heads),
            head_dim=draw(dims),
            d_state=draw(st.sampled_from([16, 64, 128])),
            n_groups=draw(st.sampled_from([1, 2, 8])),
            conv_kernel=4,
            conv_dtype=conv,
            ssm_dtype=ssm,
        )
    if kind == "mamba1":
        return Mamba1Spec(
            intermediate_size=draw(st.sampled_from([256, 1024, 8192])),
            d_state=16,
            conv_kernel=4,
            conv_dtype=conv,
            ssm_dtype=ssm,
        )
    if kind == "conv":
        return ShortConvSpec(
            hidden_size=draw(st.sampled_from([256, 1024])), conv_l_cache=3, conv_dtype=conv
        )
    if kind == "kda":
        return KDASpec(num_heads=draw(heads), head_dim=draw(dims), conv_kernel=4, conv_dtype=conv)
    return LightningSpec(num_heads=draw(heads), head_dim=draw(dims), ssm_dtype=ssm)


@st.composite
def models(draw: st.DrawFn, name: str) -> ModelSpec:
    palette = draw(st.lists(layer_specs(), min_size=1, max_size=3))
    layers = draw(st.lists(st.sampled_from(palette), min_size=1, max_size=24))
    return ModelSpec(
        name=name,
        model_type="random",
        layers=tuple(layers),
        max_position_embeddings=draw(st.sampled_from([2048, 32768, 131072])),
    )


@st.composite
def options(draw: st.DrawFn) -> PlanOptions:
    method = draw(st.sampled_from([None, "draft", "ngram", "suffix", "mtp"]))
    prefix = draw(st.booleans())
    return PlanOptions(
        spec_method=method,
        num_spec_tokens=draw(st.integers(1, 16)) if method else 0,
        kv_dtype=draw(st.none() | dtypes),
        ssm_dtype=draw(st.none() | dtypes),
        tp=draw(st.sampled_from([1, 2, 4, 8])),
        max_model_len=draw(st.none() | st.integers(1, 300_000)),
        max_num_seqs=draw(st.integers(1, 2048)),
        prefix_caching=prefix,
        state_mode=draw(st.sampled_from([None, "none"] + (["align"] if prefix else []))),
        memory_bytes=draw(st.integers(1 << 20, 200 << 30)),
        block_size=draw(st.none() | st.integers(1, 256).map(lambda n: 16 * n)),  # the grid
        layout=draw(st.sampled_from(["auto", "shared", "split", "vllm"])),
    )


@given(main=models("main"), draft=st.none() | models("draft"), opts=options())
def test_planner_returns_valid_plan_or_plan_error(
    main: ModelSpec, draft: ModelSpec | None, opts: PlanOptions
) -> None:
    try:
        result = plan(main, draft, opts)
    except PlanError as err:
        assert str(err)  # every refusal says why
        return
    result.check_invariants()
    for alt in result.alternatives:
        alt.check_invariants()
        # never below vLLM's rule, never coarser prefix hits; otherwise `auto` treats
        # concurrency within TIE_TOLERANCE of the best as a tie, and only finer prefix
        # hits than vLLM's rule allows justify less, said aloud in the warnings
        best = alt.capacity.max_concurrency
        if alt.layout == "vllm":
            assert result.capacity.max_concurrency >= best
            if opts.prefix_caching:
                assert result.hit_granularity_tokens <= alt.hit_granularity_tokens
        elif result.capacity.max_concurrency < best * (1 - TIE_TOLERANCE):
            assert opts.prefix_caching
            assert alt.hit_granularity_tokens > result.hit_granularity_tokens
            assert any("coarser hit granularity" in w for w in result.warnings)
    assert result.capacity.max_concurrency >= 1
    if opts.block_size is not None and result.layout in ("shared", "split"):
        main_attn = [g for g in result.groups if g.model == "main" and g.kind != "state"]
        # honoured exactly for the main attention class, never silently changed
        assert not main_attn or opts.block_size in {g.block_size for g in main_attn}
