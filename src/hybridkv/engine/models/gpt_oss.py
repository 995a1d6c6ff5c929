"""gpt-oss (``gpt_oss``): alternating sliding-window / full attention with learned
softmax sinks, and a top-k mixture of clamped-SwiGLU experts in every layer.

* Attention: q/k/v/o with biases, GQA, rope (the config's type; YaRN by default),
  scale ``head_dim ** -0.5``, and one sink logit per query head that joins the
  softmax and is dropped (weights ``self_attn.sinks``, nothing cached). Layer types
  come from ``layer_types`` (default: even layers sliding, odd layers full).
* MoE: ``router`` (with bias) picks the top k logits, softmax over them; expert ``e``
  computes ``gate_up = x @ gate_up_proj[e] + bias`` (``[hidden, 2 * inter]``, gate and
  up interleaved: even columns gate, odd up), then
  ``glu = min(gate, L) * sigmoid(alpha * min(gate, L))``,
  ``out = ((clamp(up, -L, L) + 1) * glu) @ down_proj[e] + bias``, with
  ``alpha = swiglu_alpha`` and ``L = swiglu_limit``.
* RMSNorm multiplies its weight in float32 (like Nemotron-H).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridkv.engine.loader import Checkpoint, cfg_get, cfg_require
from hybridkv.engine.models.attention_block import Attention, AttentionShape
from hybridkv.engine.models.common import (
    CausalLM,
    bind_norm,
    inv_sqrt,
    load_lm_head,
    make_rope,
    rope_parameters,
)
from hybridkv.engine.models.nemotron_h import rms_norm_fp32_weight
from hybridkv.engine.models.qwen3 import PreNormLayer
from hybridkv.errors import EngineError


@dataclass
class ClampedSwigluExperts:
    router: torch.Tensor  # [E, H]
    router_bias: torch.Tensor  # [E]
    gate_up: torch.Tensor  # [E, H, 2I]
    gate_up_bias: torch.Tensor  # [E, 2I]
    down: torch.Tensor  # [E, I, H]
    down_bias: torch.Tensor  # [E, H]
    top_k: int
    alpha: float
    limit: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router, self.router_bias)
        top_logits, top_ids = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=1, dtype=top_logits.dtype)
        out = torch.zeros_like(x)
        for expert in torch.unique(top_ids).tolist():
            tokens, slot = torch.where(top_ids == expert)
            gate_up = x[tokens] @ self.gate_up[expert] + self.gate_up_bias[expert]
            gate = gate_up[..., ::2].clamp(max=self.limit)
            up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
            glu = gate * torch.sigmoid(gate * self.alpha)
            y = ((up + 1) * glu) @ self.down[expert] + self.down_bias[expert]
            out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(out.dtype))
        return out


def gpt_oss_layer_types(config: dict[str, Any], num_layers: int) -> list[str]:
    types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
    ]
    if len(types) != num_layers:
        raise EngineError(f"layer_types has {len(types)} entries, config says {num_layers}")
    return list(types)


def load_gpt_oss(config: dict[str, Any], ckpt: Checkpoint) -> CausalLM:
    hidden = int(cfg_require(config, "hidden_size"))
    vocab = int(cfg_require(config, "vocab_size"))
    eps = float(cfg_get(config, "rms_norm_eps", default=1e-5))
    num_layers = int(cfg_require(config, "num_hidden_layers"))
    num_heads = int(cfg_require(config, "num_attention_heads"))
    shape = AttentionShape(
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(cfg_get(config, "num_key_value_heads", default=num_heads)),
        head_dim=int(cfg_get(config, "head_dim", default=hidden // num_heads)),
        bias=bool(config.get("attention_bias", True)),
        sinks=True,
    )
    rope = make_rope(rope_parameters(config), shape.head_dim, ckpt.device)
    num_experts = int(cfg_require(config, "num_local_experts"))
    inter = int(cfg_require(config, "intermediate_size"))
    raw_window = config.get("sliding_window")
    window = None if raw_window is None else int(raw_window)

    def norm(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        return bind_norm(rms_norm_fp32_weight, ckpt.take(name, (hidden,)), eps)

    blocks = []
    for i, kind in enumerate(gpt_oss_layer_types(config, num_layers)):
        if kind not in ("sliding_attention", "full_attention"):
            raise EngineError(f"gpt-oss layer {i}: layer type {kind!r} is not supported")
        if kind == "sliding_attention" and window is None:
            raise EngineError(f"gpt-oss layer {i} is sliding but sliding_window is null")
        prefix = f"model.layers.{i}"
        attn = Attention.load(
            ckpt,
            f"{prefix}.self_attn",
            shape,
            norm=rms_norm_fp32_weight,
            eps=eps,
            rope=rope,
            scale=inv_sqrt(shape.head_dim),
            sliding_window=window if kind == "sliding_attention" else None,
        )
        mlp = f"{prefix}.mlp"
        experts = ClampedSwigluExperts(
            router=ckpt.take(f"{mlp}.router.weight", (num_experts, hidden)),
            router_bias=ckpt.take(f"{mlp}.router.bias", (num_experts,)),
            gate_up=ckpt.take(f"{mlp}.experts.gate_up_proj", (num_experts, hidden, 2 * inter)),
            gate_up_bias=ckpt.take(f"{mlp}.experts.gate_up_proj_bias", (num_experts, 2 * inter)),
            down=ckpt.take(f"{mlp}.experts.down_proj", (num_experts, inter, hidden)),
            down_bias=ckpt.take(f"{mlp}.experts.down_proj_bias", (num_experts, hidden)),
            top_k=int(cfg_get(config, "num_experts_per_tok", "experts_per_token", default=4)),
            alpha=float(cfg_get(config, "swiglu_alpha", default=1.702)),
            limit=float(cfg_get(config, "swiglu_limit", default=7.0)),
        )
        blocks.append(
            PreNormLayer(
                desc=attn.desc(i),
                input_norm=norm(f"{prefix}.input_layernorm.weight"),
                mixer=attn,
                post_norm=norm(f"{prefix}.post_attention_layernorm.weight"),
                mlp=experts,
            )
        )
    embed = ckpt.take("model.embed_tokens.weight", (vocab, hidden))
    return CausalLM(
        config,
        ckpt.dtype,
        embed,
        blocks,
        norm("model.norm.weight"),
        load_lm_head(ckpt, config, embed),
    )
