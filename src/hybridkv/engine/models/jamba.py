"""Jamba (``jamba``): pre-norm layers whose mixer is Mamba1 or attention (no rope), and
whose feed-forward is a SwiGLU MLP or a top-k mixture of SwiGLU experts.

    h = h + mixer(input_layernorm(h));   h = h + ff(pre_ff_layernorm(h))

Layer ``i`` is attention when ``i % attn_layer_period == attn_layer_offset`` and has
experts when ``i % expert_layer_period == expert_layer_offset`` (and ``num_experts > 1``).
The router softmaxes all expert logits in float32 and keeps the top k unnormalised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridkv.engine.models.assembly import ModelDims, PreNormLayer, causal_lm, norm_loader
from hybridkv.engine.models.attention_block import Attention, AttentionShape
from hybridkv.engine.models.common import CausalLM, GatedMLP, activation, rms_norm
from hybridkv.engine.models.loader import Checkpoint, cfg_get, cfg_require
from hybridkv.engine.models.mamba1 import Mamba1
from hybridkv.engine.models.moe import dispatch_experts, fused_glu, load_stacked_experts
from hybridkv.errors import EngineError

Act = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class JambaExperts:
    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]
    top_k: int
    act: Act

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, top_ids = probs.topk(self.top_k, dim=-1)
        return dispatch_experts(
            x,
            top_ids,
            weights.to(x.dtype),
            lambda e, xs: fused_glu(xs, self.gate_up[e], self.down[e], self.act),
        )


def _periodic(config: dict[str, Any], period_key: str, offset_key: str, i: int) -> bool:
    period = int(cfg_require(config, period_key))
    offset = int(cfg_require(config, offset_key))
    if not 0 <= offset < period:
        raise EngineError(f"{offset_key} {offset} is not in [0, {period_key} {period})")
    return i % period == offset


def load_jamba(config: dict[str, Any], ckpt: Checkpoint) -> CausalLM:
    dims = ModelDims.from_config(config, eps_default=1e-6)
    shape = AttentionShape.from_config(config)
    norm = norm_loader(ckpt, rms_norm, dims)
    act_name = str(cfg_get(config, "hidden_act", default="silu"))
    inter = int(cfg_require(config, "intermediate_size"))
    num_experts = int(cfg_get(config, "num_experts", default=1))
    blocks = []
    for i in range(dims.num_layers):
        prefix = f"model.layers.{i}"
        mixer: Mamba1 | Attention
        if _periodic(config, "attn_layer_period", "attn_layer_offset", i):
            mixer = Attention.load(
                ckpt, f"{prefix}.self_attn", shape, norm=rms_norm, eps=dims.eps, rope=None
            )
        else:
            mixer = Mamba1.load(ckpt, f"{prefix}.mamba", config)
        ff_prefix = f"{prefix}.feed_forward"
        ff: Callable[[torch.Tensor], torch.Tensor]
        if num_experts > 1 and _periodic(config, "expert_layer_period", "expert_layer_offset", i):
            gate_up, down = load_stacked_experts(
                ckpt, f"{ff_prefix}.experts", num_experts, dims.hidden, inter
            )
            ff = JambaExperts(
                router=ckpt.take(f"{ff_prefix}.router.weight", (num_experts, dims.hidden)),
                gate_up=gate_up,
                down=down,
                top_k=int(cfg_get(config, "num_experts_per_tok", default=2)),
                act=activation(act_name),
            )
        else:
            ff = GatedMLP.load(ckpt, ff_prefix, dims.hidden, inter, act_name)
        blocks.append(
            PreNormLayer(
                desc=mixer.desc(i),
                input_norm=norm(f"{prefix}.input_layernorm.weight"),
                mixer=mixer,
                post_norm=norm(f"{prefix}.pre_ff_layernorm.weight"),
                mlp=ff,
            )
        )
    return causal_lm(config, ckpt, dims, blocks, norm("model.final_layernorm.weight"))
