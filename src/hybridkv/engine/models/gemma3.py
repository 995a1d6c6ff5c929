"""Gemma 3 text (``gemma3_text``): interleaved sliding-window and global attention.

Differences from Qwen3 that matter for exactness: embeddings scaled by
``sqrt(hidden)`` (rounded to the model dtype), zero-centred norms (``1 + w``), a norm
before *and* after both the attention and the MLP, ``query_pre_attn_scalar ** -0.5``
as attention scale, a gelu-tanh MLP, optional attention / final logit softcapping, and
separate rope parameters for sliding and global layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.engine.models.assembly import ModelDims, Norm, causal_lm, norm_loader
from hybridkv.engine.models.attention_block import Attention, AttentionShape
from hybridkv.engine.models.common import CausalLM, GatedMLP, LayerDesc, inv_sqrt, rms_norm_offset
from hybridkv.engine.models.loader import Checkpoint, cfg_get, cfg_require
from hybridkv.engine.models.rope import make_rope
from hybridkv.engine.ops.context import ForwardBatch, LayerCache
from hybridkv.errors import EngineError


@dataclass
class Gemma3Layer:
    """``h += post_attn(attn(in(h))); h += post_ff(mlp(pre_ff(h)))``."""

    desc: LayerDesc
    input_norm: Norm
    attn: Attention
    post_attn_norm: Norm
    pre_ff_norm: Norm
    mlp: GatedMLP
    post_ff_norm: Norm

    def __call__(
        self, hidden: torch.Tensor, batch: ForwardBatch, cache: LayerCache | None
    ) -> torch.Tensor:
        assert cache is not None
        hidden = hidden + self.post_attn_norm(self.attn(self.input_norm(hidden), batch, cache))
        return hidden + self.post_ff_norm(self.mlp(self.pre_ff_norm(hidden)))


def gemma3_rope_parameters(config: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """Per-layer-type rope dicts (transformers 5), else the older flat fields."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        return dict(params[layer_type])
    if layer_type == "sliding_attention":
        return {"rope_type": "default", "rope_theta": cfg_get(config, "rope_local_base_freq")}
    flat = dict(config.get("rope_scaling") or {})
    flat.setdefault("rope_type", "default")
    flat["rope_theta"] = cfg_get(config, "rope_theta", default=1_000_000.0)
    return flat


def load_gemma3(config: dict[str, Any], ckpt: Checkpoint) -> CausalLM:
    dims = ModelDims.from_config(config, eps_default=1e-6)
    shape = AttentionShape.from_config(config, qk_norm=True)
    layer_types = config.get("layer_types")
    if not layer_types:
        pattern = int(
            cfg_get(config, "sliding_window_pattern", "_sliding_window_pattern", default=6)
        )
        layer_types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(dims.num_layers)
        ]
    window = int(cfg_require(config, "sliding_window"))
    ropes = {
        t: make_rope(gemma3_rope_parameters(config, t), shape.head_dim, ckpt.device)
        for t in set(layer_types)
    }
    scale = inv_sqrt(float(cfg_get(config, "query_pre_attn_scalar", default=shape.head_dim)))
    act = str(cfg_get(config, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh"))
    norm = norm_loader(ckpt, rms_norm_offset, dims)

    blocks = []
    for i in range(dims.num_layers):
        prefix = f"model.layers.{i}"
        if layer_types[i] not in ("sliding_attention", "full_attention"):
            raise EngineError(f"layer {i}: layer type {layer_types[i]!r} is not supported")
        attn = Attention.load(
            ckpt,
            f"{prefix}.self_attn",
            shape,
            norm=rms_norm_offset,
            eps=dims.eps,
            rope=ropes[layer_types[i]],
            scale=scale,
            sliding_window=window if layer_types[i] == "sliding_attention" else None,
            softcap=config.get("attn_logit_softcapping"),
        )
        inter = int(cfg_require(config, "intermediate_size"))
        blocks.append(
            Gemma3Layer(
                desc=attn.desc(i),
                input_norm=norm(f"{prefix}.input_layernorm.weight"),
                attn=attn,
                post_attn_norm=norm(f"{prefix}.post_attention_layernorm.weight"),
                pre_ff_norm=norm(f"{prefix}.pre_feedforward_layernorm.weight"),
                mlp=GatedMLP.load(ckpt, f"{prefix}.mlp", dims.hidden, inter, act),
                post_ff_norm=norm(f"{prefix}.post_feedforward_layernorm.weight"),
            )
        )
    return causal_lm(
        config,
        ckpt,
        dims,
        blocks,
        norm("model.norm.weight"),
        embed_scale=dims.hidden**0.5,
        final_softcap=config.get("final_logit_softcapping"),
    )
