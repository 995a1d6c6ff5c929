"""Gated DeltaNet layer geometry and its checkpoints' input projections.

Qwen3.5 stores ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``;
Qwen3-Next packs them per key head into ``in_proj_qkvz`` and ``in_proj_ba``. A
`Projector` turns hidden states into ``(mixed_qkv, z, b, a)`` in Qwen3.5's order, so the
mixer (`models.gated_deltanet`) is shared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.engine.models.loader import Checkpoint, cfg_get, cfg_require
from hybridkv.engine.ops import compiled
from hybridkv.engine.ops.packed_linear import linear
from hybridkv.errors import EngineError


@dataclass(frozen=True)
class GDNShape:
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GDNShape:
        shape = cls(
            hidden_size=int(cfg_require(config, "hidden_size")),
            num_k_heads=int(cfg_require(config, "linear_num_key_heads")),
            num_v_heads=int(cfg_require(config, "linear_num_value_heads")),
            head_k_dim=int(cfg_require(config, "linear_key_head_dim")),
            head_v_dim=int(cfg_require(config, "linear_value_head_dim")),
            conv_kernel=int(cfg_get(config, "linear_conv_kernel_dim", default=4)),
        )
        if shape.num_v_heads % shape.num_k_heads:
            raise EngineError(
                f"linear_num_value_heads {shape.num_v_heads} is not a multiple of "
                f"linear_num_key_heads {shape.num_k_heads}"
            )
        return shape

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


# hidden [T, hidden] -> (mixed_qkv [T, conv_dim], z [T, value_dim], b [T, Hv], a [T, Hv])
Projector = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def qwen3_5_projector(ckpt: Checkpoint, prefix: str, s: GDNShape) -> Projector:
    """Qwen3.5: separate ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``."""
    w_qkv = ckpt.take(f"{prefix}.in_proj_qkv.weight", (s.conv_dim, s.hidden_size))
    w_z = ckpt.take(f"{prefix}.in_proj_z.weight", (s.value_dim, s.hidden_size))
    w_b = ckpt.take(f"{prefix}.in_proj_b.weight", (s.num_v_heads, s.hidden_size))
    w_a = ckpt.take(f"{prefix}.in_proj_a.weight", (s.num_v_heads, s.hidden_size))
    return lambda x: (linear(x, w_qkv), linear(x, w_z), linear(x, w_b), linear(x, w_a))


def qwen3_next_projector(ckpt: Checkpoint, prefix: str, s: GDNShape) -> Projector:
    """Qwen3-Next: ``in_proj_qkvz`` and ``in_proj_ba`` packed per key head.

    Per key head the rows are ``[q (dk) | k (dk) | v (r*dv) | z (r*dv)]`` and
    ``[b (r) | a (r)]`` with ``r = Hv / Hk``; we regroup them into Qwen3.5's order.
    """
    ratio = s.num_v_heads // s.num_k_heads
    per_head = 2 * s.head_k_dim + 2 * ratio * s.head_v_dim
    w_qkvz = ckpt.take(f"{prefix}.in_proj_qkvz.weight", (s.num_k_heads * per_head, s.hidden_size))
    w_ba = ckpt.take(f"{prefix}.in_proj_ba.weight", (2 * s.num_v_heads, s.hidden_size))
    if w_qkvz.dtype in compiled.REDUCED_DTYPES and w_ba.dtype == w_qkvz.dtype:
        return _fused_projector(_regrouped(w_qkvz, w_ba, s), s)

    def project(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = x.shape[0]
        qkvz = linear(x, w_qkvz).view(n, s.num_k_heads, per_head)
        q, k, v, z = torch.split(
            qkvz, [s.head_k_dim, s.head_k_dim, ratio * s.head_v_dim, ratio * s.head_v_dim], dim=-1
        )
        b, a = torch.split(linear(x, w_ba).view(n, s.num_k_heads, 2 * ratio), ratio, dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return mixed, z.reshape(n, -1), b.reshape(n, -1), a.reshape(n, -1)

    return project  # type: ignore[return-value]


def _regrouped(w_qkvz: torch.Tensor, w_ba: torch.Tensor, s: GDNShape) -> torch.Tensor:
    """Qwen3-Next's two packed-per-key-head weights as one, rows in Qwen3.5's order
    ``[q | k | v | z | b | a]`` (each head-major): one product per step instead of two,
    and q, k, v, z, b, a are column slices of it (no split, reshape copies or cat)."""
    ratio = s.num_v_heads // s.num_k_heads
    dk, rv = s.head_k_dim, ratio * s.head_v_dim
    heads = w_qkvz.view(s.num_k_heads, 2 * dk + 2 * rv, s.hidden_size)
    ba = w_ba.view(s.num_k_heads, 2 * ratio, s.hidden_size)
    parts = [
        heads[:, :dk],
        heads[:, dk : 2 * dk],
        heads[:, 2 * dk : 2 * dk + rv],
        heads[:, 2 * dk + rv :],
        ba[:, :ratio],
        ba[:, ratio:],
    ]
    return torch.cat([p.reshape(-1, s.hidden_size) for p in parts]).contiguous()


def _fused_projector(weight: torch.Tensor, s: GDNShape) -> Projector:
    """bf16 / fp16 only (float32 keeps transformers' two products, whose sums the
    exactness tests hold): a row permutation changes no output value, one product of
    ``N = conv_dim + value_dim + 2 Hv`` replaces two (measured: docs/performance.md)."""
    ends = (s.conv_dim, s.conv_dim + s.value_dim, s.conv_dim + s.value_dim + s.num_v_heads)

    def project(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = linear(x, weight)
        return (
            out[:, : ends[0]],
            out[:, ends[0] : ends[1]],
            out[:, ends[1] : ends[2]],
            out[:, ends[2] :],
        )

    return project  # type: ignore[return-value]
