"""LFM2 (``lfm2``): pre-norm layers whose operator is a gated short conv or GQA attention.

    h = h + operator(operator_norm(h));   h = h + feed_forward(ffn_norm(h))

``layer_types`` lists ``conv`` / ``full_attention`` (else ``full_attn_idxs``; neither:
all attention). Attention has per-head RMS q/k norms (``q_layernorm`` / ``k_layernorm``)
and rope; its output projection is ``out_proj``. The SwiGLU feed-forward is ``w1`` (gate),
``w3`` (up), ``w2`` (down), its width shrunk as the config's ``block_*`` keys say. The
final norm is ``model.embedding_norm``; the head is tied by default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hybridkv.engine.models.assembly import ModelDims, Norm, PreNormLayer, causal_lm
from hybridkv.engine.models.attention_block import Attention, AttentionShape
from hybridkv.engine.models.common import CausalLM, GatedMLP, activation, bind_norm, rms_norm
from hybridkv.engine.models.loader import Checkpoint, cfg_get, cfg_require
from hybridkv.engine.models.rope import Rope, make_rope, rope_parameters
from hybridkv.engine.models.short_conv import ShortConv
from hybridkv.errors import EngineError


def lfm2_layer_types(config: dict[str, Any], num_layers: int) -> list[str]:
    types = config.get("layer_types")
    if types is None:
        idxs = config.get("full_attn_idxs")
        full = set(range(num_layers)) if idxs is None else {int(i) for i in idxs}
        types = ["full_attention" if i in full else "conv" for i in range(num_layers)]
    if len(types) != num_layers:
        raise EngineError(f"layer_types has {len(types)} entries, config says {num_layers}")
    for i, kind in enumerate(types):
        if kind not in ("conv", "full_attention"):
            raise EngineError(f"LFM2 layer {i}: layer type {kind!r} is not supported")
    return list(types)


def lfm2_ff_size(config: dict[str, Any]) -> int:
    inter = int(cfg_require(config, "intermediate_size"))
    if cfg_get(config, "block_auto_adjust_ff_dim", default=True):
        inter = int(2 * inter / 3)
        multiplier = config.get("block_ffn_dim_multiplier")
        if multiplier is not None:
            inter = int(float(multiplier) * inter)
            multiple = int(cfg_get(config, "block_multiple_of", default=256))
            inter = multiple * ((inter + multiple - 1) // multiple)
    return inter


def _attention(
    ckpt: Checkpoint, prefix: str, shape: AttentionShape, eps: float, rope: Rope
) -> Attention:
    s = shape
    if s.num_heads % s.num_kv_heads:
        raise EngineError(
            f"{prefix}: num_attention_heads {s.num_heads} is not a multiple of "
            f"num_key_value_heads {s.num_kv_heads}"
        )
    kv_out = s.num_kv_heads * s.head_dim

    def head_norm(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        return bind_norm(rms_norm, ckpt.take(f"{prefix}.{name}.weight", (s.head_dim,)), eps)

    return Attention(
        shape=s,
        q_proj=ckpt.take(f"{prefix}.q_proj.weight", (s.num_heads * s.head_dim, s.hidden_size)),
        k_proj=ckpt.take(f"{prefix}.k_proj.weight", (kv_out, s.hidden_size)),
        v_proj=ckpt.take(f"{prefix}.v_proj.weight", (kv_out, s.hidden_size)),
        o_proj=ckpt.take(f"{prefix}.out_proj.weight", (s.hidden_size, s.num_heads * s.head_dim)),
        q_bias=None,
        k_bias=None,
        v_bias=None,
        o_bias=None,
        q_norm=head_norm("q_layernorm"),
        k_norm=head_norm("k_layernorm"),
        rope=rope,
        scale=s.head_dim**-0.5,
    )


def load_lfm2(config: dict[str, Any], ckpt: Checkpoint) -> CausalLM:
    config = {"tie_word_embeddings": True, **config}
    dims = ModelDims.from_config(config, eps_default=1e-5, eps_key="norm_eps")
    shape = AttentionShape.from_config(config, qk_norm=True)
    rope = make_rope(rope_parameters(config), shape.head_dim, ckpt.device)
    kernel = int(cfg_get(config, "conv_L_cache", default=3))
    conv_bias = bool(cfg_get(config, "conv_bias", default=False))
    inter = lfm2_ff_size(config)

    def norm(name: str) -> Norm:
        return bind_norm(rms_norm, ckpt.take(name, (dims.hidden,)), dims.eps)

    blocks = []
    for i, kind in enumerate(lfm2_layer_types(config, dims.num_layers)):
        prefix = f"model.layers.{i}"
        mixer: ShortConv | Attention
        if kind == "conv":
            mixer = ShortConv.load(ckpt, f"{prefix}.conv", dims.hidden, kernel, conv_bias)
        else:
            mixer = _attention(ckpt, f"{prefix}.self_attn", shape, dims.eps, rope)
        ff = f"{prefix}.feed_forward"
        mlp = GatedMLP(
            gate=ckpt.take(f"{ff}.w1.weight", (inter, dims.hidden)),
            up=ckpt.take(f"{ff}.w3.weight", (inter, dims.hidden)),
            down=ckpt.take(f"{ff}.w2.weight", (dims.hidden, inter)),
            act=activation("silu"),  # LFM2 hard-codes SiLU
        )
        blocks.append(
            PreNormLayer(
                desc=mixer.desc(i),
                input_norm=norm(f"{prefix}.operator_norm.weight"),
                mixer=mixer,
                post_norm=norm(f"{prefix}.ffn_norm.weight"),
                mlp=mlp,
            )
        )
    return causal_lm(config, ckpt, dims, blocks, norm("model.embedding_norm.weight"))
