"""Hand-built model specs shared by planner and cache tests (no config parsing)."""

from __future__ import annotations

from hybridkv.spec import (
    AttentionSpec,
    DType,
    GatedDeltaNetSpec,
    Mamba2Spec,
    ModelSpec,
    SlidingWindowSpec,
)

GDN = GatedDeltaNetSpec(
    num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4
)


def qwen35_9b(ssm: DType = DType.FLOAT32) -> ModelSpec:
    attn = AttentionSpec(num_kv_heads=4, head_dim=256, gated=True)
    gdn = GDN.with_dtypes(ssm=ssm)
    return ModelSpec(
        name="qwen3.5-9b",
        model_type="qwen3_5_text",
        layers=tuple(attn if (i + 1) % 4 == 0 else gdn for i in range(32)),
        max_position_embeddings=262144,
    )


def qwen3_coder_next() -> ModelSpec:
    attn = AttentionSpec(num_kv_heads=2, head_dim=256, gated=True)
    return ModelSpec(
        name="qwen3-coder-next",
        model_type="qwen3_next",
        layers=tuple(attn if (i + 1) % 4 == 0 else GDN for i in range(48)),
        max_position_embeddings=262144,
        num_mtp_layers=1,
    )


def qwen3_4b() -> ModelSpec:
    return ModelSpec(
        name="qwen3-4b",
        model_type="qwen3",
        layers=(AttentionSpec(num_kv_heads=8, head_dim=128),) * 36,
        max_position_embeddings=40960,
    )


def gemma_like() -> ModelSpec:
    local = SlidingWindowSpec(num_kv_heads=4, head_dim=128, sliding_window=1024)
    full = AttentionSpec(num_kv_heads=4, head_dim=128)
    return ModelSpec(
        name="gemma-like",
        model_type="gemma3_text",
        layers=tuple(full if (i + 1) % 6 == 0 else local for i in range(24)),
        max_position_embeddings=131072,
    )


def nemotron_like() -> ModelSpec:
    mamba = Mamba2Spec(num_heads=64, head_dim=64, d_state=128, n_groups=8, conv_kernel=4)
    attn = AttentionSpec(num_kv_heads=8, head_dim=128)
    return ModelSpec(
        name="nemotron-like",
        model_type="nemotron_h",
        layers=tuple(attn if i % 7 == 3 else mamba for i in range(28)),
        max_position_embeddings=131072,
    )
