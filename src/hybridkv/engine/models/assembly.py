"""How loaders put a model together: the sizes every config names the same way, norm
weights bound by name, the pre-norm decoder layer and the LM shell around the blocks.

An architecture module keeps only what is its own (mixers, MLPs, layer layout,
multipliers); everything read or assembled the same way in several of them lives here
so that a fix to, say, the ``eps`` default applies to one place per architecture.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hybridkv.engine.models.common import (
    Block,
    CausalLM,
    LayerDesc,
    MultiCacheBlock,
    NormFn,
    bind_norm,
    load_lm_head,
)
from hybridkv.engine.models.loader import Checkpoint, cfg_get, cfg_require
from hybridkv.engine.ops.context import ForwardBatch, LayerCache

Norm = Callable[[torch.Tensor], torch.Tensor]
NormLoader = Callable[[str], Norm]  # checkpoint name of a [hidden] weight -> bound norm


class Mixer(Protocol):
    """A cache-holding token mixer (attention, Mamba2, Gated DeltaNet)."""

    def desc(self, index: int) -> LayerDesc: ...

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache) -> torch.Tensor: ...


@dataclass(frozen=True)
class ModelDims:
    """The sizes and norm epsilon of the trunk, from the usual transformers keys."""

    hidden: int
    vocab: int
    eps: float
    num_layers: int

    @classmethod
    def from_config(
        cls,
        config: dict[str, Any],
        *,
        eps_default: float,
        eps_key: str = "rms_norm_eps",
        num_layers: int | None = None,
    ) -> ModelDims:
        """``num_layers`` overrides ``num_hidden_layers`` where the layout itself is the
        count (Nemotron-H's block pattern; the config key is then optional)."""
        hidden = int(cfg_require(config, "hidden_size"))
        vocab = int(cfg_require(config, "vocab_size"))
        eps = float(cfg_get(config, eps_key, default=eps_default))
        if num_layers is None:
            num_layers = int(cfg_require(config, "num_hidden_layers"))
        return cls(hidden=hidden, vocab=vocab, eps=eps, num_layers=num_layers)


def norm_loader(ckpt: Checkpoint, norm: NormFn, dims: ModelDims) -> NormLoader:
    """``load(name)``: the ``[hidden]`` weight ``name`` bound to ``norm`` and the model eps."""

    def load(name: str) -> Norm:
        return bind_norm(norm, ckpt.take(name, (dims.hidden,)), dims.eps)

    return load


@dataclass
class PreNormLayer:
    """``h += r * mixer(norm1(h)); h += r * mlp(norm2(h))``; ``r`` is Granite's
    ``residual_multiplier``, None (no multiply at all) for the other architectures."""

    desc: LayerDesc
    input_norm: Norm
    mixer: Callable[[torch.Tensor, ForwardBatch, LayerCache], torch.Tensor]
    post_norm: Norm
    mlp: Callable[[torch.Tensor], torch.Tensor]
    residual_multiplier: float | None = None

    @classmethod
    def load(
        cls,
        norm: NormLoader,
        prefix: str,
        index: int,
        mixer: Mixer,
        mlp: Callable[[torch.Tensor], torch.Tensor],
        residual_multiplier: float | None = None,
    ) -> PreNormLayer:
        """The layer at ``prefix`` with transformers' Llama-style norm names."""
        return cls(
            desc=mixer.desc(index),
            input_norm=norm(f"{prefix}.input_layernorm.weight"),
            mixer=mixer,
            post_norm=norm(f"{prefix}.post_attention_layernorm.weight"),
            mlp=mlp,
            residual_multiplier=residual_multiplier,
        )

    def __call__(
        self, hidden: torch.Tensor, batch: ForwardBatch, cache: LayerCache | None
    ) -> torch.Tensor:
        assert cache is not None
        mixed = self.mixer(self.input_norm(hidden), batch, cache)
        hidden = hidden + self._scaled(mixed)
        return hidden + self._scaled(self.mlp(self.post_norm(hidden)))

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier is None else x * self.residual_multiplier


def causal_lm(
    config: dict[str, Any],
    ckpt: Checkpoint,
    dims: ModelDims,
    blocks: Sequence[Block | MultiCacheBlock],
    final_norm: Norm,
    *,
    embed_name: str = "model.embed_tokens.weight",
    **options: float | None,
) -> CausalLM:
    """The LM around ``blocks``: the embedding, the (possibly tied) head and the
    `CausalLM` ``options`` (scales, multipliers, softcap) the architecture sets."""
    embed = ckpt.take(embed_name, (dims.vocab, dims.hidden))
    lm_head = load_lm_head(ckpt, config, embed)
    return CausalLM(config, ckpt.dtype, embed, blocks, final_norm, lm_head, **options)
