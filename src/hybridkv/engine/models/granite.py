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

from hybridkv.engine.models.assembly import ModelDims, PreNormLayer, causal_lm, norm_loader
from hybridkv.engine.models.attention_block import Attention, AttentionShape
from hybridkv.engine.models.common import CausalLM, activation, rms_norm
from hybridkv.engine.models.loader import Checkpoint, cfg_get, cfg_require
from hybridkv.engine.models.mamba2 import Mamba2, Mamba2Shape, time_step_limit
from hybridkv.engine.models.moe import dispatch_experts, fused_glu, load_stacked_experts
from hybridkv.engine.models.rope import make_rope, rope_parameters
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
    [E, H, I]``; the router is bias-free and softmaxes the k chosen logits in float32."""

    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor
    down: torch.Tensor
    top_k: int
    act: Act

    @classmethod
    def load(
        cls, ckpt: Checkpoint, prefix: str, config: dict[str, Any], hidden: int, act: Act
    ) -> GluExperts:
        num_experts = int(cfg_require(config, "num_local_experts"))
        inter = int(cfg_require(config, "intermediate_size"))
        # On disk (as save_pretrained writes it): input_linear / output_linear /
        # router.layer; transformers' in-memory names are accepted too.
        if ckpt.has(f"{prefix}.input_linear.weight"):
            router = ckpt.take(f"{prefix}.router.layer.weight", (num_experts, hidden))
            gate_up = ckpt.take(f"{prefix}.input_linear.weight", (num_experts, 2 * inter, hidden))
            down = ckpt.take(f"{prefix}.output_linear.weight", (num_experts, hidden, inter))
        else:
            router = ckpt.take(f"{prefix}.router.weight", (num_experts, hidden))
            gate_up, down = load_stacked_experts(
                ckpt, f"{prefix}.experts", num_experts, hidden, inter
            )
        top_k = int(cfg_get(config, "num_experts_per_tok", default=2))
        return cls(router=router, gate_up=gate_up, down=down, top_k=top_k, act=act)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router).float()
        top_logits, top_ids = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1).to(x.dtype)
        return dispatch_experts(
            x,
            top_ids,
            weights,
            lambda e, xs: fused_glu(xs, self.gate_up[e], self.down[e], self.act),
        )


@dataclass
class GraniteFeedForward:
    """``moe(x) + shared(x)``; the shared MLP is one always-on expert (``input_linear``
    yields ``[gate | up]``), the MoE is absent when the config has no experts."""

    moe: GluExperts | None
    input_linear: torch.Tensor  # [2 * I, H]
    output_linear: torch.Tensor  # [H, I]
    act: Act

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ff = fused_glu(x, self.input_linear, self.output_linear, self.act)
        return ff if self.moe is None else self.moe(x) + ff


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
    dims = ModelDims.from_config(config, eps_default=1e-6)
    attn_shape = AttentionShape.from_config(config)
    rope = None
    if config.get("position_embedding_type") == "rope":
        rope = make_rope(rope_parameters(config), attn_shape.head_dim, ckpt.device)
    mamba_shape = Mamba2Shape.from_mamba_config(
        config, int(cfg_get(config, "mamba_expand", default=2)) * dims.hidden
    )
    act = activation(str(cfg_get(config, "hidden_act", default="silu")))
    num_experts = int(cfg_get(config, "num_local_experts", default=0))
    shared_inter = int(cfg_get(config, "shared_intermediate_size", default=1024))
    residual = float(cfg_get(config, "residual_multiplier", default=1.0))
    norm = norm_loader(ckpt, rms_norm, dims)

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
                eps=dims.eps,
                dt_limit=time_step_limit(config),
            )
        else:
            mixer = Attention.load(
                ckpt,
                f"{prefix}.self_attn",
                attn_shape,
                norm=rms_norm,
                eps=dims.eps,
                rope=rope,
                scale=float(cfg_get(config, "attention_multiplier", default=1.0)),
            )
        moe_prefix = f"{prefix}.block_sparse_moe"
        shared = f"{prefix}.shared_mlp"
        ff = GraniteFeedForward(
            moe=GluExperts.load(ckpt, moe_prefix, config, dims.hidden, act)
            if num_experts > 0
            else None,
            input_linear=ckpt.take(
                f"{shared}.input_linear.weight", (2 * shared_inter, dims.hidden)
            ),
            output_linear=ckpt.take(f"{shared}.output_linear.weight", (dims.hidden, shared_inter)),
            act=act,
        )
        blocks.append(PreNormLayer.load(norm, prefix, i, mixer, ff, residual_multiplier=residual))
    return causal_lm(
        config,
        ckpt,
        dims,
        blocks,
        norm("model.norm.weight"),
        embed_multiplier=float(cfg_get(config, "embedding_multiplier", default=1.0)),
        logits_divisor=float(cfg_get(config, "logits_scaling", default=1.0)),
    )
