"""Pieces every architecture shares: layer descriptions, norms, MLPs, the LM shell.

A model is a plain object holding tensors (no ``nn.Module``): it only runs inference,
and keeping weights in explicit fields makes the loader's shape checks the single
place where checkpoint and config meet.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F

from hybridkv.engine.models.loader import Checkpoint
from hybridkv.engine.ops import compiled
from hybridkv.engine.ops.context import ForwardBatch, LayerCache
from hybridkv.engine.ops.packed_linear import linear
from hybridkv.errors import EngineError

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
STATE = "state"


@dataclass(frozen=True)
class LayerDesc:
    """What the runner needs to allocate one layer's cache.

    ``shapes`` are per page (attention: per token in a block, i.e. the page is
    ``[block_size, *shape]``) or per state slot (state layers: ``conv`` and ``ssm``;
    the conv shape has the minimal ``kernel - 1`` columns, more are allowed).
    Attention layers have ``key``/``value``; state layers ``conv``/``ssm``.
    """

    index: int
    kind: str  # FULL_ATTENTION | SLIDING_ATTENTION | STATE
    family: str  # "attention", "gated_delta_net", "mamba2"
    shapes: Mapping[str, tuple[int, ...]]
    sliding_window: int | None = None
    ssm_dtype: torch.dtype | None = None  # None: the model dtype
    # Attention layers of fp8 checkpoints: per-tensor (k_scale, v_scale); None: 1.0 each.
    kv_scales: tuple[float, float] | None = None


class Block(Protocol):
    """One decoder layer: ``hidden [T, hidden] -> hidden``, reading/writing its cache.

    ``desc`` is None for layers without a cache (Nemotron-H's MLP-only layers).
    """

    @property
    def desc(self) -> LayerDesc | None: ...

    def __call__(
        self, hidden: torch.Tensor, batch: ForwardBatch, cache: LayerCache | None
    ) -> torch.Tensor: ...


class MultiCacheBlock(Protocol):
    """A decoder layer with several cached mixers (Falcon-H1: attention and Mamba2 side
    by side). ``descs`` are its cache-holding parts in plan order; it gets their caches
    in the same order. `CausalLM` tells the two kinds apart by the ``descs`` attribute."""

    @property
    def descs(self) -> tuple[LayerDesc, ...]: ...

    def __call__(
        self, hidden: torch.Tensor, batch: ForwardBatch, caches: Sequence[LayerCache]
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class HiddenStates:
    """Hidden states of one step's tokens, in batch order, for a drafter head."""

    final: torch.Tensor  # [T, hidden], after the final norm
    layers: Mapping[int, torch.Tensor]  # decoder layer index -> its output [T, hidden]


class CausalLM:
    """Embedding, a stack of blocks, final norm and LM head; logits at chosen tokens."""

    def __init__(
        self,
        config: dict[str, Any],
        dtype: torch.dtype,
        embed: torch.Tensor,
        blocks: Sequence[Block | MultiCacheBlock],
        final_norm: Callable[[torch.Tensor], torch.Tensor],
        lm_head: torch.Tensor,
        embed_scale: float | None = None,
        final_softcap: float | None = None,
        *,
        embed_multiplier: float | None = None,
        logits_multiplier: float | None = None,
        logits_divisor: float | None = None,
    ):
        self.config = config
        self.dtype = dtype
        self.embed = embed
        self.blocks = list(blocks)
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.embed_scale = embed_scale
        self.final_softcap = final_softcap
        # Granite / Falcon-H1 multipliers, applied as a Python float (not rounded first).
        self.embed_multiplier = embed_multiplier
        self.logits_multiplier = logits_multiplier
        self.logits_divisor = logits_divisor

    @property
    def layers(self) -> list[LayerDesc]:
        """The layers that hold a cache, in plan order: by transformers layer index, and
        for a multi-cache block each of its parts (their ``index`` is then the cache key,
        not the decoder-layer index)."""
        out: list[LayerDesc] = []
        for block in self.blocks:
            descs = getattr(block, "descs", None)
            if descs is not None:
                out.extend(descs)
            elif cast(Block, block).desc is not None:
                out.append(cast(LayerDesc, cast(Block, block).desc))
        return out

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: Mapping[int, LayerCache]) -> torch.Tensor:
        """Run one step; returns float32 logits ``[N, vocab]`` at ``batch.selected_indices()``.

        ``caches`` maps every layer index to its `KVCache` or `StateCache`; the caches
        are updated in place (K/V of the new tokens written, state slots advanced).
        """
        hidden, _ = self._trunk(batch, caches, ())
        return self._logits(self.final_norm(hidden[batch.selected_indices()]))

    @torch.inference_mode()
    def forward_with_hidden(
        self, batch: ForwardBatch, caches: Mapping[int, LayerCache], capture: Sequence[int] = ()
    ) -> tuple[torch.Tensor, HiddenStates]:
        """`forward`, plus what a hidden-state-fed drafter (MTP, EAGLE) reads: the final-
        normed hidden states of every token and the outputs of decoder layers
        ``capture`` (block indices), ``[T, hidden]`` each. The logits are computed
        exactly as `forward` computes them."""
        hidden, captured = self._trunk(batch, caches, capture)
        logits = self._logits(self.final_norm(hidden[batch.selected_indices()]))
        return logits, HiddenStates(final=self.final_norm(hidden), layers=captured)

    def _trunk(
        self, batch: ForwardBatch, caches: Mapping[int, LayerCache], capture: Sequence[int]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Embedding and every block: the last hidden states (before the final norm)
        of all tokens, and the outputs of the blocks in ``capture``."""
        hidden = self.embed_tokens(batch.input_ids)
        captured: dict[int, torch.Tensor] = {}
        for i, block in enumerate(self.blocks):
            descs = getattr(block, "descs", None)
            if descs is not None:
                multi = cast(MultiCacheBlock, block)
                hidden = multi(hidden, batch, [self._cache(caches, d) for d in descs])
            else:
                block = cast(Block, block)
                cache = None
                if block.desc is not None:
                    cache = caches.get(block.desc.index)
                    if cache is None:
                        raise EngineError(f"no cache given for layer {block.desc.index}")
                hidden = block(hidden, batch, cache)
            if i in capture:
                captured[i] = hidden
        return hidden, captured

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings of ``token_ids`` with the architecture's scale / multiplier."""
        hidden = F.embedding(token_ids, self.embed)
        if self.embed_scale is not None:
            # The scale is rounded to the model dtype before multiplying, as trained.
            hidden = hidden * torch.tensor(
                self.embed_scale, dtype=hidden.dtype, device=hidden.device
            )
        if self.embed_multiplier is not None:
            hidden = hidden * self.embed_multiplier
        return hidden

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        logits = linear(normed, self.lm_head)
        if self.logits_multiplier is not None:
            logits = logits * self.logits_multiplier
        if self.logits_divisor is not None:
            logits = logits / self.logits_divisor
        logits = logits.float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    @staticmethod
    def _cache(caches: Mapping[int, LayerCache], desc: LayerDesc) -> LayerCache:
        cache = caches.get(desc.index)
        if cache is None:
            raise EngineError(f"no cache given for layer {desc.index}")
        return cache


# ----------------------------------------------------------------------------- norms


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-style RMSNorm: normalise in float32, cast back, then scale."""
    if compiled.applies(x):  # opt-in, bf16 prefill only (`engine.ops.compiled`)
        return compiled.rms_norm(x, weight, eps)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm (Gemma, Qwen3.5): scale by ``1 + weight`` in float32."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def bind_norm(
    norm: NormFn, weight: torch.Tensor, eps: float
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``norm`` with its weight and eps bound. The zero-centred norm gets its ``1 +
    weight`` (float32) computed once here instead of on every call: the same values,
    two ops fewer per norm and step."""
    if norm is rms_norm_offset:
        scale = 1.0 + weight.float()
        return lambda x: _rms_norm_scaled(x, scale, eps)
    return lambda x: norm(x, weight, eps)


def _rms_norm_scaled(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_offset` with ``scale = 1 + weight`` (float32) given."""
    if compiled.applies(x):  # opt-in, bf16 prefill only (`engine.ops.compiled`)
        return compiled.rms_norm_scaled(x, scale, eps)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * scale).to(x.dtype)


# ----------------------------------------------------------------------------- MLP


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu2": relu2,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise EngineError(f"activation {name!r} is not supported ({sorted(ACTIVATIONS)})") from None


@dataclass
class GatedMLP:
    """``down(act(gate(x)) * up(x))``."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    act: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def load(cls, ckpt: Checkpoint, prefix: str, hidden: int, inter: int, act: str) -> GatedMLP:
        return cls(
            gate=ckpt.take(f"{prefix}.gate_proj.weight", (inter, hidden)),
            up=ckpt.take(f"{prefix}.up_proj.weight", (inter, hidden)),
            down=ckpt.take(f"{prefix}.down_proj.weight", (hidden, inter)),
            act=activation(act),
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # In place where the activation allows: one [T, inter] buffer instead of three
        # (the same values: silu then one product, as the out-of-place form computes).
        hidden = linear(x, self.gate)
        if self.act is F.silu:
            F.silu(hidden, inplace=True)
        else:
            hidden = self.act(hidden)
        hidden.mul_(linear(x, self.up))
        return linear(hidden, self.down)


def load_lm_head(ckpt: Checkpoint, config: Mapping[str, Any], embed: torch.Tensor) -> torch.Tensor:
    """``lm_head.weight``, or the embedding when the config ties them."""
    if config.get("tie_word_embeddings", False) and not ckpt.has("lm_head.weight"):
        return embed
    return ckpt.take("lm_head.weight", tuple(embed.shape))


def inv_sqrt(x: float) -> float:
    return 1.0 / math.sqrt(x)
