"""Rotary position embedding: the default, linear and YaRN frequency tables and the
half-split rotation, from a transformers ``rope_parameters`` dict."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.engine.models.loader import cfg_get
from hybridkv.errors import EngineError


@dataclass(frozen=True)
class Rope:
    """Rotary embedding on the first ``rotary_dim`` channels of each head (half-split)."""

    inv_freq: torch.Tensor  # [rotary_dim // 2], float32
    attention_scaling: float = 1.0

    @property
    def rotary_dim(self) -> int:
        return 2 * int(self.inv_freq.numel())

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def apply(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        table: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Rotate ``x [T, heads, head_dim]``; channels past ``rotary_dim`` pass through.
        ``table``: ``cos_sin(positions, x.dtype)`` when the caller has it already (every
        attention layer of a step shares one)."""
        cos, sin = self.cos_sin(positions, x.dtype) if table is None else table
        cos, sin = cos[:, None, :], sin[:, None, :]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def make_rope(params: Mapping[str, Any], head_dim: int, device: torch.device | str = "cpu") -> Rope:
    """Rope from a transformers ``rope_parameters`` dict (default and linear types); the
    frequencies are computed on the CPU (as transformers does), then moved to ``device``."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = float(params.get("rope_theta", 10000.0))
    dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    scaling = 1.0
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "yarn":
        inv_freq, scaling = _yarn(params, base, dim, exponents)
    elif rope_type != "default":
        raise EngineError(f"rope_type {rope_type!r} is not supported (default, linear, yarn)")
    return Rope(inv_freq=inv_freq.to(device), attention_scaling=scaling)


def _yarn(
    params: Mapping[str, Any], base: float, dim: int, exponents: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): per frequency, blend the original (extrapolated) and the
    ``factor``-interpolated frequency with a linear ramp between the dimensions that
    make ``beta_fast`` and ``beta_slow`` rotations over the original context; cos/sin
    are scaled by ``0.1 ln(factor) + 1`` (or the ``mscale`` ratio / ``attention_factor``)."""
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise EngineError("yarn rope needs original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        raise EngineError("yarn rope needs a factor")
    factor, original = float(factor), float(original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    scaling = params.get("attention_factor")
    if scaling is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        scaling = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the original frequency
    pos_freqs = base**exponents
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    return interpolated * (1 - keep) + extrapolated * keep, float(scaling)


def rope_parameters(config: Mapping[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The rope parameters of ``layer_type`` (per-type dicts win), with legacy fallbacks."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    params = dict(params)
    params.setdefault("rope_theta", cfg_get(dict(config), "rope_theta", default=10000.0))
    if "partial_rotary_factor" in config and "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = config["partial_rotary_factor"]
    return params
