"""An EAGLE-style drafter head: one decoder layer fed the token embedding and a
projection of several main-model layers' hidden states (EAGLE-3's feature fusion).

Folder format (ours; not the released EAGLE-3 checkpoints' layout, which fuses the
embedding into a 2x-wide attention input instead of an ``fc``)::

    eagle_config.json
        {"format": "hybridkv-eagle", "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
         "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "aux_layers": [0, 1, 2]}
    model.safetensors
        fc_aux.weight                   [hidden, len(aux_layers) * hidden]
        pre_fc_norm_embedding.weight    [hidden]   RMSNorm (w * x)
        pre_fc_norm_hidden.weight       [hidden]
        fc.weight                       [hidden, 2 * hidden] over cat(embedding, feature)
        layers.0.*                      a Qwen3 decoder layer (q/k-normed GQA, SwiGLU)
        norm.weight                     [hidden]

``hidden_size`` must equal the main model's (the head shares its embedding and LM
head, hence its vocabulary). ``aux_layers`` are main decoder-layer indices; their
outputs (the residual stream after the layer, before any final norm) are read.

One head step at position p, as the MTP head (`hybridkv.engine.models.mtp`)::

    f   = fc_aux(cat(h_i[p] for i in aux_layers))      first step after a main pass
    f   = out[p - 1]                                    chained steps (draft 2..K)
    x   = fc(cat(norm_e(embed(token[p + 1])), norm_h(f)))
    out = layer(x) at position p;  logits = lm_head(norm(out))

As in EAGLE, the chained feature is the layer output before the final norm.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hybridkv.engine.models.assembly import ModelDims, PreNormLayer, norm_loader
from hybridkv.engine.models.attention_block import Attention, AttentionShape
from hybridkv.engine.models.common import CausalLM, GatedMLP, HiddenStates, LayerDesc, rms_norm
from hybridkv.engine.models.loader import Checkpoint, cfg_require
from hybridkv.engine.models.rope import make_rope, rope_parameters
from hybridkv.engine.ops.context import ForwardBatch, LayerCache
from hybridkv.errors import EngineError
from hybridkv.spec.layers import AttentionSpec
from hybridkv.spec.model import ModelSpec

EAGLE_CONFIG = "eagle_config.json"
EAGLE_FORMAT = "hybridkv-eagle"


@dataclass
class EagleHead:
    """The head of the module doc; `DraftHead` for `HeadDrafter`."""

    main: CausalLM
    config: dict[str, Any]
    fc_aux: torch.Tensor  # [hidden, n * hidden]
    pre_fc_norm_embedding: Any
    pre_fc_norm_hidden: Any
    fc: torch.Tensor  # [hidden, 2 * hidden]
    blocks: list[PreNormLayer]
    norm: Any
    capture: tuple[int, ...]
    name: str = "eagle"

    @property
    def layers(self) -> list[LayerDesc]:
        return [block.desc for block in self.blocks]

    @property
    def device(self) -> torch.device:
        return self.main.device

    def features(self, hidden: HiddenStates) -> torch.Tensor:
        """The captured main layers' outputs side by side, ``[T, n * hidden]``."""
        return torch.cat([hidden.layers[i] for i in self.capture], dim=-1)

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        caches: Mapping[int, LayerCache],
        features: torch.Tensor,
        *,
        chained: bool = False,
    ) -> torch.Tensor:
        """The layer output ``[T, hidden]`` before the final norm (chained as is)."""
        feature = features if chained else F.linear(features, self.fc_aux)
        embedded = self.pre_fc_norm_embedding(self.main.embed_tokens(batch.input_ids))
        x = F.linear(torch.cat((embedded, self.pre_fc_norm_hidden(feature)), dim=-1), self.fc)
        for block in self.blocks:
            x = block(x, batch, caches[block.desc.index])
        return x

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(out), self.main.lm_head).float()

    def model_spec(self, main: ModelSpec) -> ModelSpec:
        """The head's layers as a draft `ModelSpec` for the planner."""
        shape = self.blocks[0].mixer
        assert isinstance(shape, Attention)
        layer = AttentionSpec(
            num_kv_heads=shape.shape.num_kv_heads, head_dim=shape.shape.head_dim, dtype=main.dtype
        )
        return ModelSpec(
            name=f"{main.name}:eagle",
            model_type="hybridkv_eagle",
            layers=(layer,) * len(self.blocks),
            dtype=main.dtype,
            max_position_embeddings=main.max_position_embeddings,
            source=f"EAGLE head for {main.name}",
        )


def read_eagle_config(folder: Path) -> dict[str, Any]:
    path = folder / EAGLE_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise EngineError(
            f"no {EAGLE_CONFIG} in {folder}: an EAGLE head folder holds {EAGLE_CONFIG} "
            "and model.safetensors (format in hybridkv.engine.models.eagle)"
        ) from None
    except json.JSONDecodeError as err:
        raise EngineError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(config, dict) or config.get("format") != EAGLE_FORMAT:
        raise EngineError(f"{path}: 'format' must be {EAGLE_FORMAT!r}")
    return config


def load_eagle_head(folder: Path, main: CausalLM) -> EagleHead:
    """The EAGLE head in ``folder`` for ``main`` (its dtype and device)."""
    config = read_eagle_config(folder)
    dims = ModelDims(
        hidden=int(cfg_require(config, "hidden_size")),
        vocab=main.vocab_size,
        eps=float(config.get("rms_norm_eps", 1e-6)),
        num_layers=int(config.get("num_hidden_layers", 1)),
    )
    main_hidden = int(main.embed.shape[1])
    if dims.hidden != main_hidden:
        raise EngineError(
            f"{folder}/{EAGLE_CONFIG}: hidden_size {dims.hidden} != the main model's "
            f"{main_hidden}; the head shares the main model's embedding and LM head"
        )
    aux = tuple(int(i) for i in cfg_require(config, "aux_layers"))
    num_main = len(main.blocks)
    if not aux or any(not 0 <= i < num_main for i in aux) or len(set(aux)) != len(aux):
        raise EngineError(
            f"{folder}/{EAGLE_CONFIG}: aux_layers {list(aux)} must be distinct decoder-layer "
            f"indices of the main model, 0..{num_main - 1}"
        )
    ckpt = Checkpoint(folder, main.dtype, main.device)
    norm = norm_loader(ckpt, rms_norm, dims)
    shape = AttentionShape.from_config(config, qk_norm=True)
    rope = make_rope(rope_parameters(config), shape.head_dim, ckpt.device)
    act = str(config.get("hidden_act", "silu"))
    inter = int(cfg_require(config, "intermediate_size"))
    blocks = []
    for i in range(dims.num_layers):
        prefix = f"layers.{i}"
        attn = Attention.load(
            ckpt, f"{prefix}.self_attn", shape, norm=rms_norm, eps=dims.eps, rope=rope
        )
        mlp = GatedMLP.load(ckpt, f"{prefix}.mlp", dims.hidden, inter, act)
        blocks.append(PreNormLayer.load(norm, prefix, i, attn, mlp))
    head = EagleHead(
        main=main,
        config=config,
        fc_aux=ckpt.take("fc_aux.weight", (dims.hidden, len(aux) * dims.hidden)),
        pre_fc_norm_embedding=norm("pre_fc_norm_embedding.weight"),
        pre_fc_norm_hidden=norm("pre_fc_norm_hidden.weight"),
        fc=ckpt.take("fc.weight", (dims.hidden, 2 * dims.hidden)),
        blocks=blocks,
        norm=norm("norm.weight"),
        capture=aux,
    )
    if ckpt.unused():
        raise EngineError(f"{folder}: tensors the EAGLE head does not use: {ckpt.unused()[:5]}")
    return head
