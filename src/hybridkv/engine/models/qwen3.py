"""Qwen3 (dense): pre-norm decoder layers of q/k-normed GQA attention and a SwiGLU MLP."""

from __future__ import annotations

from typing import Any

from hybridkv.engine.models.assembly import ModelDims, PreNormLayer, causal_lm, norm_loader
from hybridkv.engine.models.attention_block import Attention, AttentionShape
from hybridkv.engine.models.common import CausalLM, GatedMLP, rms_norm
from hybridkv.engine.models.loader import Checkpoint, cfg_get, cfg_require
from hybridkv.engine.models.rope import make_rope, rope_parameters


def load_qwen3(config: dict[str, Any], ckpt: Checkpoint) -> CausalLM:
    dims = ModelDims.from_config(config, eps_default=1e-6)
    shape = AttentionShape.from_config(config, qk_norm=True)
    layer_types = config.get("layer_types") or ["full_attention"] * dims.num_layers
    rope = make_rope(rope_parameters(config), shape.head_dim, ckpt.device)
    norm = norm_loader(ckpt, rms_norm, dims)

    blocks = []
    for i in range(dims.num_layers):
        prefix = f"model.layers.{i}"
        window = config.get("sliding_window") if layer_types[i] == "sliding_attention" else None
        attn = Attention.load(
            ckpt,
            f"{prefix}.self_attn",
            shape,
            norm=rms_norm,
            eps=dims.eps,
            rope=rope,
            sliding_window=window,
        )
        mlp = GatedMLP.load(
            ckpt,
            f"{prefix}.mlp",
            dims.hidden,
            int(cfg_require(config, "intermediate_size")),
            str(cfg_get(config, "hidden_act", default="silu")),
        )
        blocks.append(PreNormLayer.load(norm, prefix, i, attn, mlp))
    return causal_lm(config, ckpt, dims, blocks, norm("model.norm.weight"))
