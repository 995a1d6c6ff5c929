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

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridkv.engine.models.assembly import ModelDims, PreNormLayer, causal_lm, norm_loader
from hybridkv.engine.models.attention_block import Attention, AttentionShape
from hybridkv.engine.models.common import CausalLM
from hybridkv.engine.models.loader import Checkpoint, cfg_get, cfg_require
from hybridkv.engine.models.moe import dispatch_experts
from hybridkv.engine.models.nemotron_h import rms_norm_fp32_weight
from hybridkv.engine.models.rope import make_rope, rope_parameters
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

    @classmethod
    def load(
        cls, ckpt: Checkpoint, prefix: str, config: dict[str, Any], hidden: int
    ) -> ClampedSwigluExperts:
        num_experts = int(cfg_require(config, "num_local_experts"))
        inter = int(cfg_require(config, "intermediate_size"))
        experts = f"{prefix}.experts"
        return cls(
            router=ckpt.take(f"{prefix}.router.weight", (num_experts, hidden)),
            router_bias=ckpt.take(f"{prefix}.router.bias", (num_experts,)),
            gate_up=ckpt.take(f"{experts}.gate_up_proj", (num_experts, hidden, 2 * inter)),
            gate_up_bias=ckpt.take(f"{experts}.gate_up_proj_bias", (num_experts, 2 * inter)),
            down=ckpt.take(f"{experts}.down_proj", (num_experts, inter, hidden)),
            down_bias=ckpt.take(f"{experts}.down_proj_bias", (num_experts, hidden)),
            top_k=int(cfg_get(config, "num_experts_per_tok", "experts_per_token", default=4)),
            alpha=float(cfg_get(config, "swiglu_alpha", default=1.702)),
            limit=float(cfg_get(config, "swiglu_limit", default=7.0)),
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router, self.router_bias)
        top_logits, top_ids = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=1, dtype=top_logits.dtype)
        return dispatch_experts(x, top_ids, weights, self._expert)

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = x @ self.gate_up[expert] + self.gate_up_bias[expert]
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return ((up + 1) * glu) @ self.down[expert] + self.down_bias[expert]


def gpt_oss_layer_types(config: dict[str, Any], num_layers: int) -> list[str]:
    types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
    ]
    if len(types) != num_layers:
        raise EngineError(f"layer_types has {len(types)} entries, config says {num_layers}")
    return list(types)


def load_gpt_oss(config: dict[str, Any], ckpt: Checkpoint) -> CausalLM:
    dims = ModelDims.from_config(config, eps_default=1e-5)
    shape = AttentionShape.from_config(config, bias_default=True, sinks=True)
    rope = make_rope(rope_parameters(config), shape.head_dim, ckpt.device)
    raw_window = config.get("sliding_window")
    window = None if raw_window is None else int(raw_window)
    norm = norm_loader(ckpt, rms_norm_fp32_weight, dims)

    blocks = []
    for i, kind in enumerate(gpt_oss_layer_types(config, dims.num_layers)):
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
            eps=dims.eps,
            rope=rope,
            sliding_window=window if kind == "sliding_attention" else None,
        )
        experts = ClampedSwigluExperts.load(ckpt, f"{prefix}.mlp", config, dims.hidden)
        blocks.append(PreNormLayer.load(norm, prefix, i, attn, experts))
    return causal_lm(config, ckpt, dims, blocks, norm("model.norm.weight"))
