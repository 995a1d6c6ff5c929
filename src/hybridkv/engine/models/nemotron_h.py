"""Nemotron-H (``nemotron_h``): a stack of single-mixer blocks, each ``h += mixer(norm(h))``.

A block's mixer is Mamba2 (state layer), attention without rope (NoPE, full
attention), or a relu^2 MLP (no cache). The layout comes from ``layers_block_type``
(transformers 5) or the older ``hybrid_override_pattern`` string (``M`` Mamba2,
``*`` attention, ``-`` MLP, ``E`` MoE). MoE blocks are not supported yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridkv.engine.models.assembly import ModelDims, Norm, causal_lm, norm_loader
from hybridkv.engine.models.attention_block import Attention, AttentionShape
from hybridkv.engine.models.common import CausalLM, LayerDesc, activation
from hybridkv.engine.models.loader import Checkpoint, cfg_get, cfg_require
from hybridkv.engine.models.mamba2 import Mamba2
from hybridkv.engine.ops.context import ForwardBatch, LayerCache
from hybridkv.errors import EngineError

PATTERN_CODES = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
BLOCK_TYPES = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "full_attention": "attention",
    "attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}


def rms_norm_fp32_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm whose weight multiply stays in float32 (Nemotron-H), cast back at the end."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype)


@dataclass
class Mlp:
    """``down(act(up(x)))``: no gate."""

    up: torch.Tensor
    down: torch.Tensor
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    act: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def load(cls, ckpt: Checkpoint, prefix: str, config: dict[str, Any], hidden: int) -> Mlp:
        inter = int(cfg_require(config, "intermediate_size"))
        bias = bool(config.get("mlp_bias", False))
        return cls(
            up=ckpt.take(f"{prefix}.up_proj.weight", (inter, hidden)),
            down=ckpt.take(f"{prefix}.down_proj.weight", (hidden, inter)),
            up_bias=ckpt.take(f"{prefix}.up_proj.bias", (inter,)) if bias else None,
            down_bias=ckpt.take(f"{prefix}.down_proj.bias", (hidden,)) if bias else None,
            act=activation(str(cfg_get(config, "mlp_hidden_act", default="relu2"))),
        )

    def __call__(
        self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache | None
    ) -> torch.Tensor:
        return F.linear(self.act(F.linear(x, self.up, self.up_bias)), self.down, self.down_bias)


@dataclass
class NemotronBlock:
    desc: LayerDesc | None
    norm: Norm
    mixer: Callable[[torch.Tensor, ForwardBatch, Any], torch.Tensor]

    def __call__(
        self, hidden: torch.Tensor, batch: ForwardBatch, cache: LayerCache | None
    ) -> torch.Tensor:
        return hidden + self.mixer(self.norm(hidden), batch, cache)


def block_types(config: dict[str, Any]) -> list[str]:
    raw = config.get("layers_block_type")
    if raw:
        types = [BLOCK_TYPES.get(t, t) for t in raw]
    else:
        pattern = str(cfg_require(config, "hybrid_override_pattern"))
        types = [PATTERN_CODES.get(c, c) for c in pattern]
    num_layers = config.get("num_hidden_layers")
    if num_layers is not None and len(types) != int(num_layers):
        raise EngineError(f"the block pattern has {len(types)} layers, config says {num_layers}")
    return types


def load_nemotron_h(config: dict[str, Any], ckpt: Checkpoint) -> CausalLM:
    kinds = block_types(config)
    dims = ModelDims.from_config(
        config, eps_default=1e-5, eps_key="layer_norm_epsilon", num_layers=len(kinds)
    )
    attn_shape = AttentionShape.from_config(config)
    # Checkpoints on disk name the trunk "backbone"; transformers renames it "model" in memory.
    root = "backbone" if ckpt.has("backbone.embeddings.weight") else "model"
    norm = norm_loader(ckpt, rms_norm_fp32_weight, dims)
    blocks = []
    for i, kind in enumerate(kinds):
        prefix = f"{root}.layers.{i}.mixer"
        mixer: Any
        desc: LayerDesc | None = None
        if kind == "mamba":
            mixer = Mamba2.load(ckpt, prefix, config)
            desc = mixer.desc(i)
        elif kind == "attention":
            mixer = Attention.load(
                ckpt, prefix, attn_shape, norm=rms_norm_fp32_weight, eps=dims.eps, rope=None
            )
            desc = mixer.desc(i)
        elif kind == "mlp":
            mixer = Mlp.load(ckpt, prefix, config, dims.hidden)
        else:
            raise EngineError(f"Nemotron-H layer {i}: block type {kind!r} is not supported")
        blocks.append(NemotronBlock(desc, norm(f"{root}.layers.{i}.norm.weight"), mixer))
    return causal_lm(
        config,
        ckpt,
        dims,
        blocks,
        norm(f"{root}.norm_f.weight"),
        embed_name=f"{root}.embeddings.weight",
    )
