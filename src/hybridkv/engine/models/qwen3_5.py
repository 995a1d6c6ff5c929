"""Qwen3.5 text (``qwen3_5_text``) and Qwen3-Next (``qwen3_next``) hybrids.

``layer_types`` mixes ``linear_attention`` (Gated DeltaNet, a state layer) and
``full_attention`` (gated attention with q/k norms and partial rotary). All norms are
zero-centred (scale ``1 + w``) except the GDN output norm. Qwen3-Next packs the GDN
input projections differently and may use a sparse MoE MLP with a gated shared expert.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hybridkv.engine.models.assembly import ModelDims, PreNormLayer, causal_lm, norm_loader
from hybridkv.engine.models.attention_block import Attention, AttentionShape
from hybridkv.engine.models.common import CausalLM, GatedMLP, activation, rms_norm_offset
from hybridkv.engine.models.gated_deltanet import GatedDeltaNet
from hybridkv.engine.models.gdn_projection import (
    GDNShape,
    qwen3_5_projector,
    qwen3_next_projector,
)
from hybridkv.engine.models.loader import Checkpoint, cfg_get, cfg_require
from hybridkv.engine.models.moe import (
    REDUCED_DTYPES,
    DenseMoE,
    dense_pays,
    dispatch_experts,
    fused_glu,
    load_stacked_experts,
)
from hybridkv.engine.models.rope import make_rope, rope_parameters
from hybridkv.engine.ops.packed_linear import linear
from hybridkv.errors import EngineError


@dataclass
class SparseMoE:
    """Top-k routed experts (softmax router, optional renormalisation) + gated shared expert."""

    router: torch.Tensor  # [E, hidden]
    gate_up: torch.Tensor  # [E, 2 * inter, hidden]
    down: torch.Tensor  # [E, hidden, inter]
    top_k: int
    norm_topk_prob: bool
    act_name: str
    shared: GatedMLP | None
    shared_gate: torch.Tensor | None  # [1, hidden]
    expert_gate_up: list[torch.Tensor] = field(init=False, repr=False)
    expert_down: list[torch.Tensor] = field(init=False, repr=False)
    _dense: DenseMoE | None = field(init=False, repr=False, default=None)
    _no_dense: bool = field(init=False, repr=False, default=False)

    def __post_init__(self) -> None:
        # One view object per expert, kept: `packed_linear.linear` packs a weight the
        # second time it sees the same tensor, which a view taken per call never is.
        self.expert_gate_up = list(self.gate_up.unbind(0))
        self.expert_down = list(self.down.unbind(0))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in REDUCED_DTYPES and dense_pays(x.shape[0], self.num_experts):
            dense = self._dense_form()
            if dense is not None:
                return dense(x)
        act = activation(self.act_name)
        probs = torch.softmax(linear(x, self.router), dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = dispatch_experts(
            x,
            experts,
            weights,
            lambda e, xs: fused_glu(xs, self.expert_gate_up[e], self.expert_down[e], act),
        )
        if self.shared is not None and self.shared_gate is not None:
            out = out + torch.sigmoid(linear(x, self.shared_gate)) * self.shared(x)
        return out

    @property
    def num_experts(self) -> int:
        return int(self.gate_up.shape[0])

    def _dense_form(self) -> DenseMoE | None:
        """`DenseMoE` for reduced-precision decode steps (built once; None when the
        shared expert's width differs from the experts': then the loop runs)."""
        if self._dense is None and not self._no_dense:
            shared = None
            if self.shared is not None:
                shared = (self.shared.gate, self.shared.up, self.shared.down)
            self._dense = DenseMoE.build(
                self.router,
                self.gate_up,
                self.down,
                top_k=self.top_k,
                norm_topk_prob=self.norm_topk_prob,
                act=activation(self.act_name),
                shared=shared,
                shared_gate=self.shared_gate,
            )
            self._no_dense = self._dense is None
        return self._dense


def _load_moe(ckpt: Checkpoint, prefix: str, config: dict[str, Any]) -> SparseMoE:
    hidden = int(cfg_require(config, "hidden_size"))
    num_experts = int(cfg_require(config, "num_experts"))
    inter = int(cfg_require(config, "moe_intermediate_size"))
    act = str(cfg_get(config, "hidden_act", default="silu"))
    shared_inter = int(cfg_get(config, "shared_expert_intermediate_size", default=0))
    shared = None
    shared_gate = None
    if shared_inter:
        shared = GatedMLP.load(ckpt, f"{prefix}.shared_expert", hidden, shared_inter, act)
        shared_gate = ckpt.take(f"{prefix}.shared_expert_gate.weight", (1, hidden))
    gate_up, down = load_stacked_experts(ckpt, f"{prefix}.experts", num_experts, hidden, inter)
    return SparseMoE(
        router=ckpt.take(f"{prefix}.gate.weight", (num_experts, hidden)),
        gate_up=gate_up,
        down=down,
        top_k=int(cfg_require(config, "num_experts_per_tok")),
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        act_name=act,
        shared=shared,
        shared_gate=shared_gate,
    )


def _is_moe_layer(config: dict[str, Any], index: int) -> bool:
    num_experts = int(config.get("num_experts") or 0)
    step = int(config.get("decoder_sparse_step") or 1)
    return (
        num_experts > 0
        and index not in (config.get("mlp_only_layers") or [])
        and (index + 1) % step == 0
    )


def load_qwen3_5(config: dict[str, Any], ckpt: Checkpoint) -> CausalLM:
    next_layout = config.get("model_type") == "qwen3_next"
    dims = ModelDims.from_config(config, eps_default=1e-6)
    layer_types = cfg_require(config, "layer_types")
    if len(layer_types) < dims.num_layers:
        raise EngineError(
            f"layer_types has {len(layer_types)} entries for {dims.num_layers} layers"
        )
    attn_shape = AttentionShape.from_config(config, gated=True, qk_norm=True)
    rope = make_rope(rope_parameters(config), attn_shape.head_dim, ckpt.device)
    gdn_shape = GDNShape.from_config(config) if "linear_attention" in layer_types else None
    projector = qwen3_next_projector if next_layout else qwen3_5_projector
    act = str(cfg_get(config, "hidden_act", default="silu"))
    norm = norm_loader(ckpt, rms_norm_offset, dims)

    blocks = []
    for i in range(dims.num_layers):
        prefix = f"model.layers.{i}"
        mixer: GatedDeltaNet | Attention
        if layer_types[i] == "linear_attention":
            assert gdn_shape is not None
            mixer = GatedDeltaNet.load(
                ckpt, f"{prefix}.linear_attn", gdn_shape, projector, dims.eps
            )
        elif layer_types[i] == "full_attention":
            mixer = Attention.load(
                ckpt,
                f"{prefix}.self_attn",
                attn_shape,
                norm=rms_norm_offset,
                eps=dims.eps,
                rope=rope,
            )
        else:
            raise EngineError(f"layer {i}: layer type {layer_types[i]!r} is not supported")
        if _is_moe_layer(config, i):
            mlp: SparseMoE | GatedMLP = _load_moe(ckpt, f"{prefix}.mlp", config)
        else:
            inter = int(cfg_require(config, "intermediate_size"))
            mlp = GatedMLP.load(ckpt, f"{prefix}.mlp", dims.hidden, inter, act)
        blocks.append(PreNormLayer.load(norm, prefix, i, mixer, mlp))
    ckpt.ignore(
        "mtp.",
        "the MTP head: loaded by `load_mtp` only for speculative decoding with spec_method 'mtp'",
    )
    return causal_lm(config, ckpt, dims, blocks, norm("model.norm.weight"))
