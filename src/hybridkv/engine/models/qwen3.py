"""Qwen3 (dense): pre-norm decoder layers of q/k-normed GQA attention and a SwiGLU MLP.

Also the shared `PreNormLayer` (norm -> mixer -> residual, norm -> MLP -> residual) that
the Qwen3.5 / Qwen3-Next hybrids reuse with other mixers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.engine.context import ForwardBatch, LayerCache
from hybridkv.engine.loader import Checkpoint, cfg_get, cfg_require
from hybridkv.engine.models.attention_block import Attention, AttentionShape
from hybridkv.engine.models.common import (
    CausalLM,
    GatedMLP,
    LayerDesc,
    bind_norm,
    inv_sqrt,
    load_lm_head,
    make_rope,
    rms_norm,
    rope_parameters,
)

Mixer = Callable[[torch.Tensor, ForwardBatch, LayerCache], torch.Tensor]


@dataclass
class PreNormLayer:
    """``h += mixer(norm1(h)); h += mlp(norm2(h))``."""

    desc: LayerDesc
    input_norm: Callable[[torch.Tensor], torch.Tensor]
    mixer: Mixer
    post_norm: Callable[[torch.Tensor], torch.Tensor]
    mlp: Callable[[torch.Tensor], torch.Tensor]

    def __call__(
        self, hidden: torch.Tensor, batch: ForwardBatch, cache: LayerCache | None
    ) -> torch.Tensor:
        assert cache is not None
        hidden = hidden + self.mixer(self.input_norm(hidden), batch, cache)
        return hidden + self.mlp(self.post_norm(hidden))


def attention_shape(config: dict[str, Any], gated: bool = False) -> AttentionShape:
    hidden = int(cfg_require(config, "hidden_size"))
    num_heads = int(cfg_require(config, "num_attention_heads"))
    head_dim = int(cfg_get(config, "head_dim", default=hidden // num_heads))
    return AttentionShape(
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(cfg_get(config, "num_key_value_heads", default=num_heads)),
        head_dim=head_dim,
        bias=bool(config.get("attention_bias", False)),
        gated=gated,
        qk_norm=True,
    )


def load_qwen3(config: dict[str, Any], ckpt: Checkpoint) -> CausalLM:
    hidden = int(cfg_require(config, "hidden_size"))
    vocab = int(cfg_require(config, "vocab_size"))
    eps = float(cfg_get(config, "rms_norm_eps", default=1e-6))
    num_layers = int(cfg_require(config, "num_hidden_layers"))
    shape = attention_shape(config)
    layer_types = config.get("layer_types") or ["full_attention"] * num_layers
    rope = make_rope(rope_parameters(config), shape.head_dim, ckpt.device)

    embed = ckpt.take("model.embed_tokens.weight", (vocab, hidden))
    blocks = []
    for i in range(num_layers):
        prefix = f"model.layers.{i}"
        window = config.get("sliding_window") if layer_types[i] == "sliding_attention" else None
        attn = Attention.load(
            ckpt,
            f"{prefix}.self_attn",
            shape,
            norm=rms_norm,
            eps=eps,
            rope=rope,
            scale=inv_sqrt(shape.head_dim),
            sliding_window=window,
        )
        blocks.append(
            PreNormLayer(
                desc=attn.desc(i),
                input_norm=bind_norm(
                    rms_norm, ckpt.take(f"{prefix}.input_layernorm.weight", (hidden,)), eps
                ),
                mixer=attn,
                post_norm=bind_norm(
                    rms_norm, ckpt.take(f"{prefix}.post_attention_layernorm.weight", (hidden,)), eps
                ),
                mlp=GatedMLP.load(
                    ckpt,
                    f"{prefix}.mlp",
                    hidden,
                    int(cfg_require(config, "intermediate_size")),
                    str(cfg_get(config, "hidden_act", default="silu")),
                ),
            )
        )
    final_norm = bind_norm(rms_norm, ckpt.take("model.norm.weight", (hidden,)), eps)
    return CausalLM(
        config, ckpt.dtype, embed, blocks, final_norm, load_lm_head(ckpt, config, embed)
    )
