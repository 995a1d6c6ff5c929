"""The attention mixer shared by the dense and hybrid architectures.

Variants are flags, not subclasses: optional per-head q/k norms (Qwen3, Gemma 3,
Qwen3.5), an output gate packed with the query projection (Qwen3.5 / Qwen3-Next:
``q_proj`` yields ``[q | gate]`` per head), rope or none (NoPE layers), a sliding
window, the attention scale and logit softcap each config defines, learned softmax
sinks (gpt-oss) and a key multiplier (Falcon-H1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridkv.engine.models.common import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    LayerDesc,
    NormFn,
    bind_norm,
    inv_sqrt,
)
from hybridkv.engine.models.loader import Checkpoint, cfg_get, cfg_require
from hybridkv.engine.models.rope import Rope
from hybridkv.engine.ops.attention import paged_attention
from hybridkv.engine.ops.compiled import REDUCED_DTYPES
from hybridkv.engine.ops.context import ForwardBatch, KVCache, LayerCache
from hybridkv.engine.ops.packed_linear import linear
from hybridkv.engine.ops.tree_batch import rope_positions
from hybridkv.errors import EngineError


@dataclass(frozen=True)
class AttentionShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool = False
    gated: bool = False  # q_proj also yields a sigmoid gate on the attention output
    qk_norm: bool = False
    sinks: bool = False  # learned per-head softmax sink logits (gpt-oss), ``{prefix}.sinks``

    @classmethod
    def from_config(
        cls,
        config: dict[str, Any],
        *,
        bias_default: bool = False,
        gated: bool = False,
        qk_norm: bool = False,
        sinks: bool = False,
    ) -> AttentionShape:
        """From the Llama-style keys every architecture here uses; only the default of
        ``attention_bias`` (gpt-oss: on) and the variant flags differ."""
        hidden = int(cfg_require(config, "hidden_size"))
        num_heads = int(cfg_require(config, "num_attention_heads"))
        return cls(
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=int(cfg_get(config, "num_key_value_heads", default=num_heads)),
            head_dim=int(cfg_get(config, "head_dim", default=hidden // num_heads)),
            bias=bool(config.get("attention_bias", bias_default)),
            gated=gated,
            qk_norm=qk_norm,
            sinks=sinks,
        )


@dataclass
class Attention:
    """q/k/v projections, rope, paged attention, optional gate, o projection."""

    shape: AttentionShape
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    q_norm: Callable[[torch.Tensor], torch.Tensor] | None
    k_norm: Callable[[torch.Tensor], torch.Tensor] | None
    rope: Rope | None
    scale: float
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [num_heads]
    key_multiplier: float | None = None  # Falcon-H1: k_proj output scaled before rope
    kv_scales: tuple[float, float] | None = None  # fp8 checkpoints' k_scale / v_scale
    # bf16 / fp16 without biases: [q_proj; k_proj; v_proj] as one weight, one product
    # per step instead of three (q_proj, k_proj, v_proj become row views of it: no
    # second copy). float32 keeps three products (transformers' sums, which the
    # exactness tests hold); the outputs are the same values (tested).
    qkv_proj: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        weights = (self.q_proj, self.k_proj, self.v_proj)
        if (
            self.q_bias is None
            and self.k_bias is None
            and self.v_bias is None
            and all(w.dtype in REDUCED_DTYPES and w.dtype == self.q_proj.dtype for w in weights)
            and all(w.device == self.q_proj.device for w in weights)
        ):
            fused = torch.cat(weights)
            nq, nk = self.q_proj.shape[0], self.k_proj.shape[0]
            self.q_proj, self.k_proj = fused[:nq], fused[nq : nq + nk]
            self.v_proj, self.qkv_proj = fused[nq + nk :], fused

    @classmethod
    def load(
        cls,
        ckpt: Checkpoint,
        prefix: str,
        shape: AttentionShape,
        *,
        norm: NormFn,
        eps: float,
        rope: Rope | None,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        key_multiplier: float | None = None,
    ) -> Attention:
        """``scale`` None: ``head_dim ** -0.5``."""
        s = shape
        q_out = s.num_heads * s.head_dim * (2 if s.gated else 1)
        kv_out = s.num_kv_heads * s.head_dim
        o_in = s.num_heads * s.head_dim
        if s.num_heads % s.num_kv_heads:
            raise EngineError(
                f"{prefix}: num_attention_heads {s.num_heads} is not a multiple of "
                f"num_key_value_heads {s.num_kv_heads}"
            )

        def bias(name: str, size: int) -> torch.Tensor | None:
            return ckpt.take(f"{prefix}.{name}.bias", (size,)) if s.bias else None

        def head_norm(name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
            if not s.qk_norm:
                return None
            weight = ckpt.take(f"{prefix}.{name}.weight", (s.head_dim,))
            return bind_norm(norm, weight, eps)

        return cls(
            shape=s,
            q_proj=ckpt.take(f"{prefix}.q_proj.weight", (q_out, s.hidden_size)),
            k_proj=ckpt.take(f"{prefix}.k_proj.weight", (kv_out, s.hidden_size)),
            v_proj=ckpt.take(f"{prefix}.v_proj.weight", (kv_out, s.hidden_size)),
            o_proj=ckpt.take(f"{prefix}.o_proj.weight", (s.hidden_size, o_in)),
            q_bias=bias("q_proj", q_out),
            k_bias=bias("k_proj", kv_out),
            v_bias=bias("v_proj", kv_out),
            o_bias=bias("o_proj", s.hidden_size),
            q_norm=head_norm("q_norm"),
            k_norm=head_norm("k_norm"),
            rope=rope,
            scale=inv_sqrt(s.head_dim) if scale is None else scale,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks=ckpt.take(f"{prefix}.sinks", (s.num_heads,)) if s.sinks else None,
            key_multiplier=key_multiplier,
            kv_scales=load_kv_scales(ckpt, prefix),
        )

    def desc(self, index: int) -> LayerDesc:
        s = self.shape
        return LayerDesc(
            index=index,
            kind=SLIDING_ATTENTION if self.sliding_window is not None else FULL_ATTENTION,
            family="attention",
            shapes={"key": (s.num_kv_heads, s.head_dim), "value": (s.num_kv_heads, s.head_dim)},
            sliding_window=self.sliding_window,
            kv_scales=self.kv_scales,
        )

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache) -> torch.Tensor:
        if not isinstance(cache, KVCache):
            raise EngineError(f"attention layer got a {type(cache).__name__}, expected KVCache")
        s = self.shape
        num_tokens = x.shape[0]
        if self.qkv_proj is None:
            q = linear(x, self.q_proj, self.q_bias)
            k = linear(x, self.k_proj, self.k_bias)
            v = linear(x, self.v_proj, self.v_bias)
        else:  # column slices of one product
            qkv = linear(x, self.qkv_proj)
            nq, nk = self.q_proj.shape[0], self.k_proj.shape[0]
            q, k, v = qkv[:, :nq], qkv[:, nq : nq + nk], qkv[:, nq + nk :]
        q = q.view(num_tokens, s.num_heads, -1)
        gate = None
        if s.gated:
            q, gate = q[..., : s.head_dim], q[..., s.head_dim :]
            gate = gate.reshape(num_tokens, -1)
        k = k.view(num_tokens, s.num_kv_heads, s.head_dim)
        v = v.view(num_tokens, s.num_kv_heads, s.head_dim)
        if self.key_multiplier is not None:
            k = k * self.key_multiplier
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            rope = self.rope
            positions = rope_positions(batch)  # a tree's nodes: num_computed + depth
            # cos/sin of the step's positions: built by the first layer, shared by the rest
            table = batch.memoized(
                ("rope", id(rope), q.dtype), lambda: rope.cos_sin(positions, q.dtype)
            )
            q = rope.apply(q, positions, table)
            k = rope.apply(k, positions, table)
        out = paged_attention(
            q,
            k,
            v,
            cache,
            batch,
            scale=self.scale,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
            sinks=self.sinks,
        ).reshape(num_tokens, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return linear(out, self.o_proj, self.o_bias)


def load_kv_scales(ckpt: Checkpoint, prefix: str) -> tuple[float, float] | None:
    """``{prefix}.k_scale`` / ``{prefix}.v_scale``: the per-tensor fp8 KV scales that fp8
    checkpoints (ModelOpt, compressed-tensors, as vLLM reads them) store next to the
    projections, as a scalar or a one-element tensor. Both or neither."""
    names = (f"{prefix}.k_scale", f"{prefix}.v_scale")
    present = [ckpt.has(n) for n in names]
    if not any(present):
        return None
    if not all(present):
        missing = names[present.index(False)]
        raise EngineError(f"checkpoint {ckpt.folder} has one fp8 KV scale but not {missing!r}")
    scales = []
    for name in names:
        shape = ckpt.shape(name)
        if len(shape) > 1 or (shape and shape[0] != 1):
            raise EngineError(
                f"{name!r} has shape {shape}; the engine supports per-tensor KV scales "
                "(a scalar or one element), not per-head or per-channel ones"
            )
        scales.append(float(ckpt.take(name, shape, torch.float32).reshape(())))
    return scales[0], scales[1]
