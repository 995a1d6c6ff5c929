"""The multi-token-prediction (MTP) head of Qwen3.5 / Qwen3-Next checkpoints.

transformers drops these tensors on load; they sit next to the main model's weights:

    mtp.pre_fc_norm_embedding.weight  [hidden]           zero-centred RMSNorm (1 + w)
    mtp.pre_fc_norm_hidden.weight     [hidden]           zero-centred RMSNorm
    mtp.fc.weight                     [hidden, 2*hidden] over cat(embedding, hidden)
    mtp.layers.{i}.*                  a full-attention decoder layer of the main model's
                                      shape (gated attention, q/k norms; MoE when the
                                      main model has experts)
    mtp.norm.weight                   [hidden]           zero-centred RMSNorm

Config: ``mtp_num_hidden_layers`` (Qwen3.5) or ``num_nextn_predict_layers``
(Qwen3-Next). The embedding and LM head are the main model's. Sources (facts, not
code): the tensor names of the released Qwen3-Next / Qwen3.5 checkpoints as vLLM's
``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py`` and LightLLM's ``qwen3next_mtp`` load them;
the fc input order (embedding first, then hidden) as DeepSeek-V3's ``eh_proj``.

One head step at position p (the conventions of vLLM's MTP proposer)::

    x   = fc(cat(norm_e(embed(token[p + 1])), norm_h(h[p])))
    x   = layers(x) at position p            (its own KV pages: draft layers of the plan)
    out = norm(x);  logits = lm_head(out)    predicts token[p + 2]

``h[p]`` is the main model's final-normed hidden state at p; chained steps (draft 2..K)
feed the head's own ``out`` instead. With several MTP layers, all run in sequence at
every step (Qwen's checkpoints ship one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridkv.engine.models.assembly import ModelDims, PreNormLayer, norm_loader
from hybridkv.engine.models.attention_block import Attention, AttentionShape
from hybridkv.engine.models.common import (
    CausalLM,
    GatedMLP,
    HiddenStates,
    LayerDesc,
    rms_norm_offset,
)
from hybridkv.engine.models.loader import Checkpoint, cfg_get, cfg_require
from hybridkv.engine.models.rope import make_rope, rope_parameters
from hybridkv.engine.ops.context import ForwardBatch, LayerCache
from hybridkv.errors import EngineError

MTP_PREFIX = "mtp."
MTP_LAYER_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")
MTP_MODEL_TYPES = ("qwen3_5_text", "qwen3_next")


def num_mtp_layers(config: Mapping[str, Any]) -> int:
    return int(cfg_get(dict(config), *MTP_LAYER_KEYS, default=0) or 0)


@dataclass
class MTPHead:
    """A hidden-state-fed drafter head (see the module doc). ``layers`` are its cache-
    holding layers, planned as draft layers ``draft.0 ..``."""

    main: CausalLM
    pre_fc_norm_embedding: Any
    pre_fc_norm_hidden: Any
    fc: torch.Tensor  # [hidden, 2 * hidden]
    blocks: list[PreNormLayer]
    norm: Any
    name: str = "mtp"
    capture: tuple[int, ...] = ()  # main decoder layers it reads: none, the final state

    @property
    def layers(self) -> list[LayerDesc]:
        return [block.desc for block in self.blocks]

    @property
    def device(self) -> torch.device:
        return self.main.device

    @property
    def vocab_size(self) -> int:
        return self.main.vocab_size

    def features(self, hidden: HiddenStates) -> torch.Tensor:
        """What the head reads from a main-model pass: the final-normed hidden states."""
        return hidden.final

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        caches: Mapping[int, LayerCache],
        features: torch.Tensor,
        *,
        chained: bool = False,
    ) -> torch.Tensor:
        """Head output ``[T, hidden]`` (after ``mtp.norm``) for the batch's tokens (each
        the token after the position whose ``features`` row it gets). ``chained``: the
        rows are the head's own outputs; an MTP head treats them like main states."""
        del chained  # the same norm_h + fc path either way
        embedded = self.pre_fc_norm_embedding(self.main.embed_tokens(batch.input_ids))
        x = F.linear(torch.cat((embedded, self.pre_fc_norm_hidden(features)), dim=-1), self.fc)
        for block in self.blocks:
            x = block(x, batch, caches[block.desc.index])
        return self.norm(x)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return F.linear(out, self.main.lm_head).float()


def load_mtp_head(config: dict[str, Any], ckpt: Checkpoint, main: CausalLM) -> MTPHead:
    """The MTP head of a Qwen3.5 / Qwen3-Next checkpoint, sharing ``main``'s embedding
    and LM head; `EngineError` if the config or the checkpoint has none."""
    model_type = str(config.get("model_type"))
    if model_type not in MTP_MODEL_TYPES:
        raise EngineError(
            f"model_type {model_type!r} has no MTP head in the engine; MTP heads run for "
            f"{', '.join(MTP_MODEL_TYPES)} (use a draft model, ngram or suffix instead)"
        )
    count = num_mtp_layers(config)
    if count < 1:
        raise EngineError(
            f"{ckpt.folder}/config.json states no MTP layers ({' / '.join(MTP_LAYER_KEYS)}); "
            "spec_method 'mtp' needs a checkpoint that ships them"
        )
    if not ckpt.has(f"{MTP_PREFIX}fc.weight"):
        raise EngineError(
            f"checkpoint {ckpt.folder} states {count} MTP layer(s) but has no "
            f"'{MTP_PREFIX}fc.weight' (was it saved by transformers, which drops mtp.*?)"
        )
    dims = ModelDims.from_config(config, eps_default=1e-6)
    main_hidden = int(main.embed.shape[1])
    if dims.hidden != main_hidden or dims.vocab != main.vocab_size:
        raise EngineError(
            f"{ckpt.folder}/config.json: hidden_size {dims.hidden} / vocab_size {dims.vocab} "
            f"but the main model has {main_hidden} / {main.vocab_size}; the MTP head shares "
            "its embedding and LM head"
        )
    norm = norm_loader(ckpt, rms_norm_offset, dims)
    shape = AttentionShape.from_config(config, gated=True, qk_norm=True)
    rope = make_rope(rope_parameters(config), shape.head_dim, ckpt.device)
    blocks = []
    for i in range(count):
        prefix = f"{MTP_PREFIX}layers.{i}"
        attn = Attention.load(
            ckpt, f"{prefix}.self_attn", shape, norm=rms_norm_offset, eps=dims.eps, rope=rope
        )
        blocks.append(PreNormLayer.load(norm, prefix, i, attn, _mlp(config, ckpt, prefix, dims)))
    head = MTPHead(
        main=main,
        pre_fc_norm_embedding=norm(f"{MTP_PREFIX}pre_fc_norm_embedding.weight"),
        pre_fc_norm_hidden=norm(f"{MTP_PREFIX}pre_fc_norm_hidden.weight"),
        fc=ckpt.take(f"{MTP_PREFIX}fc.weight", (dims.hidden, 2 * dims.hidden)),
        blocks=blocks,
        norm=norm(f"{MTP_PREFIX}norm.weight"),
    )
    left = mtp_tensor_names(ckpt.unused())
    if left:
        raise EngineError(
            f"{ckpt.folder}: MTP tensors the {count}-layer head does not use: {left[:5]}; "
            f"is {' / '.join(MTP_LAYER_KEYS)} right?"
        )
    return head


def _mlp(config: dict[str, Any], ckpt: Checkpoint, prefix: str, dims: ModelDims) -> Any:
    """The MTP layer's MLP: sparse MoE when the main model has experts (Qwen3-Next and
    the Qwen3.5 MoE models), else a gated MLP."""
    from hybridkv.engine.models.qwen3_5 import _load_moe

    if int(config.get("num_experts") or 0) > 0:
        return _load_moe(ckpt, f"{prefix}.mlp", config)
    act = str(cfg_get(config, "hidden_act", default="silu"))
    inter = int(cfg_require(config, "intermediate_size"))
    return GatedMLP.load(ckpt, f"{prefix}.mlp", dims.hidden, inter, act)


def mtp_tensor_names(names: Sequence[str]) -> list[str]:
    return [n for n in names if n.startswith(MTP_PREFIX)]
