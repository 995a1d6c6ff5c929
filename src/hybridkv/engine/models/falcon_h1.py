"""Falcon-H1 (``falcon_h1``): attention and Mamba2 side by side in every layer.

    x = norm1(h)
    h = h + ssm_out * mamba(x) + attn_out * attn(attn_in * x)
    h = h + down_mult * down(up(y) * act(gate_mult * gate(y))),   y = norm2(h)

Each decoder layer holds two caches, so it is a `MultiCacheBlock` with two parts in
plan order (attention, then Mamba2: what the planner lays out); their `LayerDesc`
indices ``2 i`` and ``2 i + 1`` are cache keys, not decoder-layer indices.

The muP multipliers: embeddings times ``embedding_multiplier``, logits times
``lm_head_multiplier``, keys times ``key_multiplier`` (before rope), the Mamba2 input
times ``ssm_in_multiplier`` and ``in_proj``'s output times a per-section vector
(``ssm_multipliers`` for z, x, B, C, dt; a buffer transformers rebuilds from the
config, not a checkpoint tensor). Mamba2's output norm is optional
(``mamba_rms_norm``; default off: ``y * silu(z)``), normalising before the gate when
``mamba_norm_before_gate``; its ``out_proj`` bias follows ``projectors_bias``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridkv.engine.models.assembly import ModelDims, Norm, causal_lm, norm_loader
from hybridkv.engine.models.attention_block import Attention, AttentionShape
from hybridkv.engine.models.common import CausalLM, LayerDesc, activation, rms_norm
from hybridkv.engine.models.loader import Checkpoint, cfg_get, cfg_require
from hybridkv.engine.models.mamba2 import Mamba2, Mamba2Shape, time_step_limit
from hybridkv.engine.models.rope import make_rope, rope_parameters
from hybridkv.engine.ops.context import ForwardBatch, LayerCache
from hybridkv.errors import EngineError


@dataclass
class FalconMlp:
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: torch.Tensor | None
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    gate_multiplier: float
    down_multiplier: float
    act: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def load(cls, ckpt: Checkpoint, prefix: str, config: dict[str, Any], hidden: int) -> FalconMlp:
        inter = int(cfg_require(config, "intermediate_size"))
        use_bias = bool(config.get("mlp_bias", False))
        gate_mult, down_mult = (float(m) for m in (config.get("mlp_multipliers") or [1.0, 1.0]))

        def bias(name: str, size: int) -> torch.Tensor | None:
            return ckpt.take(f"{prefix}.{name}.bias", (size,)) if use_bias else None

        return cls(
            gate=ckpt.take(f"{prefix}.gate_proj.weight", (inter, hidden)),
            up=ckpt.take(f"{prefix}.up_proj.weight", (inter, hidden)),
            down=ckpt.take(f"{prefix}.down_proj.weight", (hidden, inter)),
            gate_bias=bias("gate_proj", inter),
            up_bias=bias("up_proj", inter),
            down_bias=bias("down_proj", hidden),
            gate_multiplier=gate_mult,
            down_multiplier=down_mult,
            act=activation(str(cfg_get(config, "hidden_act", default="silu"))),
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.act(F.linear(x, self.gate, self.gate_bias) * self.gate_multiplier)
        y = F.linear(x, self.up, self.up_bias) * gate
        return F.linear(y, self.down, self.down_bias) * self.down_multiplier


@dataclass
class FalconH1Layer:
    descs: tuple[LayerDesc, ...]  # (attention, mamba2)
    input_norm: Norm
    attn: Attention
    mamba: Mamba2
    pre_ff_norm: Norm
    mlp: FalconMlp
    attn_in: float
    attn_out: float
    ssm_out: float

    def __call__(
        self, hidden: torch.Tensor, batch: ForwardBatch, caches: Sequence[LayerCache]
    ) -> torch.Tensor:
        attn_cache, ssm_cache = caches
        normed = self.input_norm(hidden)
        mixed = self.mamba(normed, batch, ssm_cache) * self.ssm_out
        mixed = mixed + self.attn(normed * self.attn_in, batch, attn_cache) * self.attn_out
        hidden = hidden + mixed
        return hidden + self.mlp(self.pre_ff_norm(hidden))


def mup_vector(config: dict[str, Any], shape: Mamba2Shape) -> torch.Tensor:
    """The per-channel multiplier of ``in_proj``'s output: z, x, B, C, dt sections."""
    multipliers = [float(m) for m in (config.get("ssm_multipliers") or [1.0] * 5)]
    if len(multipliers) != 5:
        raise EngineError(f"ssm_multipliers must have 5 entries, got {multipliers}")
    groups_state = shape.n_groups * shape.state_size
    sizes = (shape.inner, shape.inner, groups_state, groups_state, shape.num_heads)
    return torch.cat(
        [torch.full((n,), m, dtype=torch.float32) for n, m in zip(sizes, multipliers, strict=True)]
    )


def mamba_norm(config: dict[str, Any]) -> str:
    if not config.get("mamba_rms_norm", False):
        return "gate"
    return "norm_gate" if config.get("mamba_norm_before_gate", True) else "gate_norm"


def load_falcon_h1(config: dict[str, Any], ckpt: Checkpoint) -> CausalLM:
    dims = ModelDims.from_config(config, eps_default=1e-5)
    attn_shape = AttentionShape.from_config(config)
    rope = make_rope(rope_parameters(config), attn_shape.head_dim, ckpt.device)
    d_ssm = config.get("mamba_d_ssm")
    intermediate = (
        int(cfg_get(config, "mamba_expand", default=2)) * dims.hidden
        if d_ssm is None
        else int(d_ssm)
    )
    mamba_shape = dataclasses.replace(
        Mamba2Shape.from_mamba_config(config, intermediate),
        use_out_bias=bool(config.get("projectors_bias", False)),
    )
    mup = mup_vector(config, mamba_shape).to(device=ckpt.device, dtype=ckpt.dtype)
    norm = norm_loader(ckpt, rms_norm, dims)

    blocks = []
    for i in range(dims.num_layers):
        prefix = f"model.layers.{i}"
        attn = Attention.load(
            ckpt,
            f"{prefix}.self_attn",
            attn_shape,
            norm=rms_norm,
            eps=dims.eps,
            rope=rope,
            key_multiplier=float(cfg_get(config, "key_multiplier", default=1.0)),
        )
        mamba = Mamba2.load(
            ckpt,
            f"{prefix}.mamba",
            config,
            shape=mamba_shape,
            eps=dims.eps,
            dt_limit=time_step_limit(config),
            norm=mamba_norm(config),
            in_multiplier=float(cfg_get(config, "ssm_in_multiplier", default=1.0)),
            proj_multiplier=mup,
        )
        blocks.append(
            FalconH1Layer(
                descs=(attn.desc(2 * i), mamba.desc(2 * i + 1)),
                input_norm=norm(f"{prefix}.input_layernorm.weight"),
                attn=attn,
                mamba=mamba,
                pre_ff_norm=norm(f"{prefix}.pre_ff_layernorm.weight"),
                mlp=FalconMlp.load(ckpt, f"{prefix}.feed_forward", config, dims.hidden),
                attn_in=float(cfg_get(config, "attention_in_multiplier", default=1.0)),
                attn_out=float(cfg_get(config, "attention_out_multiplier", default=1.0)),
                ssm_out=float(cfg_get(config, "ssm_out_multiplier", default=1.0)),
            )
        )
    return causal_lm(
        config,
        ckpt,
        dims,
        blocks,
        norm("model.final_layernorm.weight"),
        embed_multiplier=float(cfg_get(config, "embedding_multiplier", default=1.0)),
        logits_multiplier=float(cfg_get(config, "lm_head_multiplier", default=1.0)),
    )
