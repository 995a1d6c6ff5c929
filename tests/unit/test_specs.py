"""Every spec formula against numbers computed by hand (DESIGN section 3)."""

from __future__ import annotations

import pytest

from hybridkv.errors import SpecError
from hybridkv.spec import (
    AttentionSpec,
    ChunkedLocalSpec,
    DType,
    GatedDeltaNetSpec,
    KDASpec,
    LightningSpec,
    Mamba1Spec,
    Mamba2Spec,
    MLASpec,
    ModelSpec,
    ShortConvSpec,
    SlidingWindowSpec,
    parse_dtype,
)

QWEN35_GDN = dict(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4)


def test_dtype_sizes_and_aliases() -> None:
    assert [d.num_bytes for d in DType] == [2, 2, 4, 1, 1]
    assert parse_dtype("fp8") is DType.FP8_E4M3
    assert parse_dtype("torch.bfloat16") is DType.BFLOAT16
    assert parse_dtype("float8_e5m2") is DType.FP8_E5M2
    with pytest.raises(SpecError, match="fp4"):
        parse_dtype("fp4")


def test_full_attention_page() -> None:
    # Qwen3.5-9B attention: 4 kv heads x 256 dim, K and V, bf16 -> 4096 B/token.
    spec = AttentionSpec(num_kv_heads=4, head_dim=256, gated=True)
    assert spec.bytes_per_token() == 4 * 256 * 2 * 2 == 4096
    assert spec.page_bytes(528) == 528 * 4096 == 2_162_688
    assert spec.with_dtypes(kv=DType.FP8_E4M3).page_bytes(16) == 16 * 2048
    # value dim may differ from key dim
    assert AttentionSpec(num_kv_heads=1, head_dim=192, v_head_dim=128).bytes_per_token() == 640


def test_attention_tp_divides_and_replicates() -> None:
    spec = AttentionSpec(num_kv_heads=8, head_dim=128)
    assert spec.shard(4).num_kv_heads == 2
    assert AttentionSpec(num_kv_heads=2, head_dim=128).shard(8).num_kv_heads == 1
    with pytest.raises(SpecError, match=r"num_kv_heads=6 .* 4"):
        AttentionSpec(num_kv_heads=6, head_dim=128).shard(4)


def test_sliding_window_live_blocks() -> None:
    spec = SlidingWindowSpec(num_kv_heads=1, head_dim=8, sliding_window=4)
    # span W - 1 + in_flight = 4 tokens over blocks of 2 -> 2 blocks, +1 for an unaligned start
    assert spec.max_live_blocks(2, 1) == 3
    # 3 + 4 = 7 positions touch at most 4 blocks of 2 (e.g. positions 1..7: blocks 0..3)
    assert spec.max_live_blocks(2, 4) == 4
    for window in range(1, 12):
        for block in range(1, 6):
            for in_flight in range(1, 6):
                swa = SlidingWindowSpec(num_kv_heads=1, head_dim=8, sliding_window=window)
                span = window - 1 + in_flight
                worst = max(
                    (start + span - 1) // block - start // block + 1 for start in range(block)
                )
                assert swa.max_live_blocks(block, in_flight) == worst
    assert spec.kind == "sliding_attention"


def test_chunked_and_mla_pages() -> None:
    chunk = ChunkedLocalSpec(num_kv_heads=8, head_dim=128, attention_chunk_size=8192)
    assert chunk.page_bytes(16) == 16 * 8 * 256 * 2
    # DeepSeek-V3: rank 512 + rope 64 = 576 values per token, bf16 -> 1152 B/token
    mla = MLASpec(kv_lora_rank=512, qk_rope_head_dim=64)
    assert mla.page_bytes(64) == 64 * 1152
    assert mla.shard(8) == mla  # latent replicated


def test_gated_deltanet_state_matches_qwen35_numbers() -> None:
    spec = GatedDeltaNetSpec(**QWEN35_GDN, ssm_dtype=DType.FLOAT32)
    # conv channels 2*16*128 + 32*128 = 8192, rows kernel-1 = 3, bf16
    assert spec.conv_shape() == (8192, 3)
    assert spec.conv_bytes() == 8192 * 3 * 2 == 49_152
    # recurrent 32 x 128 x 128 fp32
    assert spec.ssm_bytes() == 32 * 128 * 128 * 4 == 2_097_152
    assert spec.page_bytes() == 2_146_304  # models.json: state_page_bytes ..._ssm_fp32
    assert spec.page_bytes(block_size=16) == spec.page_bytes(block_size=4096)  # lesson 1
    # each speculative token adds one conv row per layer (lesson 2): 8192 * 2 B
    assert spec.page_bytes(num_spec_tokens=3) - spec.page_bytes() == 3 * 16_384
    assert spec.with_dtypes(ssm=DType.BFLOAT16).page_bytes() == 1_097_728


def test_gdn_tp() -> None:
    spec = GatedDeltaNetSpec(**QWEN35_GDN).shard(4)
    assert (spec.num_k_heads, spec.num_v_heads) == (4, 8)
    assert spec.conv_channels() == 2048


def test_mamba2_state() -> None:
    # Nemotron-H-8B style: 128 heads x 64, d_state 128, 8 groups, kernel 4
    spec = Mamba2Spec(num_heads=128, head_dim=64, d_state=128, n_groups=8, conv_kernel=4)
    channels = 128 * 64 + 2 * 8 * 128
    assert spec.conv_shape() == (channels, 3)
    assert spec.conv_shape(2) == (channels, 5)
    assert spec.page_bytes() == channels * 3 * 2 + 128 * 64 * 128 * 2
    # groups rounded up to TP: 1 group on 4 ranks -> replicated, 1 per rank
    one_group = Mamba2Spec(num_heads=8, head_dim=4, d_state=16, n_groups=1, conv_kernel=4)
    assert one_group.shard(4).n_groups == 1
    assert one_group.shard(4).num_heads == 2
    with pytest.raises(SpecError, match="n_groups=3"):
        Mamba2Spec(num_heads=12, head_dim=4, d_state=16, n_groups=3, conv_kernel=4).shard(2)


def test_mamba1_short_conv_kda_lightning() -> None:
    m1 = Mamba1Spec(intermediate_size=8192, d_state=16, conv_kernel=4)
    assert m1.page_bytes() == 8192 * 3 * 2 + 8192 * 16 * 2
    assert m1.page_bytes(num_spec_tokens=4) == m1.page_bytes()  # no spec rows for mamba1
    conv = ShortConvSpec(hidden_size=1024, conv_l_cache=3)
    assert conv.page_bytes() == 1024 * 2 * 2
    kda = KDASpec(num_heads=32, head_dim=128, conv_kernel=4, ssm_dtype=DType.BFLOAT16)
    # recurrent is fp32 whatever the ssm dtype asks
    assert kda.page_bytes() == 3 * 32 * 128 * 3 * 2 + 32 * 128 * 128 * 4
    light = LightningSpec(num_heads=64, head_dim=96, ssm_dtype=DType.FLOAT32)
    assert light.page_bytes() == 64 * 96 * 96 * 4
    assert light.conv_shape() == (0, 0)


def test_bad_geometry_is_a_typed_error() -> None:
    with pytest.raises(SpecError, match="num_kv_heads"):
        AttentionSpec(num_kv_heads=0, head_dim=128)
    with pytest.raises(SpecError, match="sliding_window"):
        SlidingWindowSpec(num_kv_heads=1, head_dim=8, sliding_window=-1)
    with pytest.raises(SpecError, match="no cache-holding layers"):
        ModelSpec(name="x", model_type="llama", layers=())


def test_model_spec_mix_and_mtp_head() -> None:
    attn = AttentionSpec(num_kv_heads=2, head_dim=256, gated=True)
    gdn = GatedDeltaNetSpec(**QWEN35_GDN)
    model = ModelSpec(
        name="m",
        model_type="qwen3_next",
        layers=tuple(attn if (i + 1) % 4 == 0 else gdn for i in range(8)),
        num_mtp_layers=1,
    )
    assert model.kind_counts() == {"full_attention": 2, "state:gated_delta_net": 6}
    head = model.draft_head()
    assert head.num_layers == 1 and head.layers[0].bytes_per_token() == attn.bytes_per_token()
    assert model.shard(2).layers[3].num_kv_heads == 1
