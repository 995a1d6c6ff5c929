"""Granite-4.0-H (``granitemoehybrid``): pre-norm layers whose mixer is Mamba2 or attention.

    h = h + residual_multiplier * mixer(norm1(h))
    h = h + residual_multiplier * (moe(norm2(h)) + shared_mlp(norm2(h)))   # moe if experts > 0

Attention uses ``attention_multiplier`` as its scale (not ``head_dim ** -0.5``) and
rope only when ``position_embedding_type == "rope"`` (NoPE otherwise). Embeddings are
multiplied by ``embedding_multiplier`` and the logits divided by ``logits_scaling``.
``layer_types`` lists ``mamba`` / ``attention`` (also ``linear_attention`` /
``full_attention``); absent means all Mamba2.

The MoE: a bias-free top-k router (softmax over the k chosen logits, in float32) and
experts stored as ``input_linear [E, 2 * inter, hidden]`` (gate rows, then up rows) and
``output_linear [E, hidden, inter]``; the shared MLP is one such expert, always on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridkv.engine.context import ForwardBatch, LayerCache
from hybridkv.engine.loader import Checkpoint, cfg_get, cfg_require
from hybridkv.engine.models.attention_block import Attention, AttentionShape
from hybridkv.engine.models.common import (
    CausalLM,
    LayerDesc,
    activation,
    bind_norm,
    load_lm_head,
    make_rope,
    rms_norm,
    rope_parameters,
)
from hybridkv.engine.models.mamba2 import Mamba2, Mamba2Shape, time_step_limit
from hybridkv.errors import EngineError

Act = Callable[[torch.Tensor], torch.Tensor]
LAYER_KINDS = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "attention",
    "full_attention": "attention",
}


@dataclass
class GluExperts:
    """Top-k routed SwiGLU experts, ``gate_up [E, 2I, H]`` (gate rows first), ``down
    [E, H, I]``; experts are visited in id order and summed into zeros (as transformers)."""

    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor
    down: torch.Tensor
    top_k: int
    act: Act

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router).float()
        top_logits, top_ids = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1).to(x.dtype)
        out = torch.zeros_like(x)
        for expert in torch.unique(top_ids).tolist():
            tokens, slot = torch.where(top_ids == expert)
            gate, up = F.linear(x[tokens], self.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down[expert]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


@dataclass
class SharedMlp:
    """``output(act(gate) * up)`` with ``[gate | up] = input_linear(x)``."""

    input_linear: torch.Tensor  # [2 * I, H]
    output_linear: torch.Tensor  # [H, I]
    act: Act

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.input_linear).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.output_linear)


@dataclass
class GraniteLayer:
    desc: LayerDesc
    input_norm: Callable[[torch.Tensor], torch.Tensor]
    mixer: Callable[[torch.Tensor, ForwardBatch, LayerCache], torch.Tensor]
    post_norm: Callable[[torch.Tensor], torch.Tensor]
    moe: GluExperts | None
    shared: SharedMlp
    residual_multiplier: float

    def __call__(
        self, hidden: torch.Tensor, batch: ForwardBatch, cache: LayerCache | None
    ) -> torch.Tensor:
        assert cache is not None
        mixed = self.mixer(self.input_norm(hidden), batch, cache)
        hidden = hidden + mixed * self.residual_multiplier
        normed = self.post_norm(hidden)
        ff = self.shared(normed)
        if self.moe is not None:
            ff = self.moe(normed) + ff
        return hidden + ff * self.residual_multiplier


def granite_layer_kinds(config: dict[str, Any]) -> list[str]:
    num_layers = int(cfg_require(config, "num_hidden_layers"))
    raw = cfg_get(config, "layer_types", "layers_block_type")
    if raw is None:
        return ["mamba"] * num_layers
    if len(raw) != num_layers:
        raise EngineError(f"layer_types has {len(raw)} entries, config says {num_layers}")
    kinds = []
    for i, kind in enumerate(raw):
        if kind not in LAYER_KINDS:
            raise EngineError(f"Granite layer {i}: layer type {kind!r} is not supported")
        kinds.append(LAYER_KINDS[kind])
    return kinds


def load_granite(config: dict[str, Any], ckpt: Checkpoint) -> CausalLM:
    hidden = int(cfg_require(config, "hidden_size"))
    vocab = int(cfg_require(config, "vocab_size"))
    eps = float(cfg_get(config, "rms_norm_eps", default=1e-6))
    num_heads = int(cfg_require(config, "num_attention_heads"))
    attn_shape = AttentionShape(
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(cfg_get(config, "num_key_value_heads", default=num_heads)),
        head_dim=int(cfg_get(config, "head_dim", default=hidden // num_heads)),
        bias=bool(config.get("attention_bias", False)),
    )
    rope = None
    if config.get("position_embedding_type") == "rope":
        rope = make_rope(rope_parameters(config), attn_shape.head_dim, ckpt.device)
    mamba_shape = Mamba2Shape.from_mamba_config(
        config, int(cfg_get(config, "mamba_expand", default=2)) * hidden
    )
    act_name = str(cfg_get(config, "hidden_act", default="silu"))
    act = activation(act_name)
    num_experts = int(cfg_get(config, "num_local_experts", default=0))
    inter = int(cfg_require(config, "intermediate_size"))
    shared_inter = int(cfg_get(config, "shared_intermediate_size", default=1024))
    residual = float(cfg_get(config, "residual_multiplier", default=1.0))

    blocks = []
    for i, kind in enumerate(granite_layer_kinds(config)):
        prefix = f"model.layers.{i}"
        mixer: Mamba2 | Attention
        if kind == "mamba":
            mixer = Mamba2.load(
                ckpt,
                f"{prefix}.mamba",
                config,
                shape=mamba_shape,
                eps=eps,
                dt_limit=time_step_limit(config),
            )
        else:
            mixer = Attention.load(
                ckpt,
                f"{prefix}.self_attn",
                attn_shape,
                norm=rms_norm,
                eps=eps,
                rope=rope,
                scale=float(cfg_get(config, "attention_multiplier", default=1.0)),
            )
        moe = None
        if num_experts > 0:
            moe_prefix = f"{prefix}.block_sparse_moe"
            # On disk (as save_pretrained writes it): input_linear / output_linear /
            # router.layer; transformers' in-memory names are accepted too.
            legacy = ckpt.has(f"{moe_prefix}.input_linear.weight")
            names = (
                ("router.layer.weight", "input_linear.weight", "output_linear.weight")
                if legacy
                else ("router.weight", "experts.gate_up_proj", "experts.down_proj")
            )
            moe = GluExperts(
                router=ckpt.take(f"{moe_prefix}.{names[0]}", (num_experts, hidden)),
                gate_up=ckpt.take(f"{moe_prefix}.{names[1]}", (num_experts, 2 * inter, hidden)),
                down=ckpt.take(f"{moe_prefix}.{names[2]}", (num_experts, hidden, inter)),
                top_k=int(cfg_get(config, "num_experts_per_tok", default=2)),
                act=act,
            )
        blocks.append(
            GraniteLayer(
                desc=mixer.desc(i),
                input_norm=bind_norm(
                    rms_norm, ckpt.take(f"{prefix}.input_layernorm.weight", (hidden,)), eps
                ),
                mixer=mixer,
                post_norm=bind_norm(
                    rms_norm, ckpt.take(f"{prefix}.post_attention_layernorm.weight", (hidden,)), eps
                ),
                moe=moe,
                shared=SharedMlp(
                    input_linear=ckpt.take(
                        f"{prefix}.shared_mlp.input_linear.weight", (2 * shared_inter, hidden)
                    ),
                    output_linear=ckpt.take(
                        f"{prefix}.shared_mlp.output_linear.weight", (hidden, shared_inter)
                    ),
                    act=act,
                ),
                residual_multiplier=residual,
            )
        )
    embed = ckpt.take("model.embed_tokens.weight", (vocab, hidden))
    return CausalLM(
        config,
        ckpt.dtype,
        embed,
        blocks,
        bind_norm(rms_norm, ckpt.take("model.norm.weight", (hidden,)), eps),
        load_lm_head(ckpt, config, embed),
        embed_multiplier=float(cfg_get(config, "embedding_multiplier", default=1.0)),
        logits_divisor=float(cfg_get(config, "logits_scaling", default=1.0)),
    )
