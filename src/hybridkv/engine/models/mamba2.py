"""Mamba2 mixer (Nemotron-H layout; Granite-4.0-H and Falcon-H1 use the same core).

    in_proj(x) -> [z (inner) | xBC (inner + 2*groups*N) | dt (heads)]
    xBC -> causal conv (rolling state) + bias -> silu -> [x | B | C]
    dt = clamp(softplus(dt + dt_bias), min=time_step_min),  A = -exp(A_log)
    y = selective scan(x, dt, A, B, C, D; ssm state)
    out = out_proj(grouped_rmsnorm(y * silu(z)))

transformers clamps ``dt`` at ``time_step_min`` in its multi-token scan but not in its
one-token decode; we clamp always so the result cannot depend on how a prompt is
chunked. The two agree whenever ``softplus(dt + dt_bias) >= time_step_min``.
Granite-4.0-H and Falcon-H1 clamp to ``time_step_limit = (min, max)`` the same way.

Variants (keyword arguments of `Mamba2.load`): the config key names (`Mamba2Shape`
constructors), a separate out_proj bias flag (Falcon-H1's ``projectors_bias``), an
input multiplier and a per-channel multiplier on ``in_proj``'s output (Falcon-H1's
``ssm_in_multiplier`` and muP vector), and the output norm:

    "gated_rms"   RMSNorm per group of silu(z) * y, weight cast last (Nemotron-H, Granite)
    "gate_norm"   the same, weight multiplied in float32 (Falcon-H1, norm_before_gate off)
    "norm_gate"   RMSNorm per group of y, weight, then * silu(z) (Falcon-H1 default norm)
    "gate"        y * silu(z), no norm and no weight (Falcon-H1 without mamba_rms_norm)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridkv.engine.models.common import STATE, LayerDesc
from hybridkv.engine.models.loader import Checkpoint, cfg_get, cfg_require
from hybridkv.engine.ops.context import ForwardBatch, LayerCache, StateCache
from hybridkv.engine.ops.ssm_batched import mamba2_scan_grid
from hybridkv.engine.ops.state_batched import (
    capture_steps,
    causal_conv_grid,
    gather_state,
    state_parts,
    write_conv,
    write_ssm,
)
from hybridkv.engine.ops.state_ops import (
    causal_conv1d_history,
    mamba2_scan_capture,
    read_state,
    request_slots,
    write_states,
)
from hybridkv.errors import EngineError


@dataclass(frozen=True)
class Mamba2Shape:
    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    use_conv_bias: bool
    use_bias: bool
    use_out_bias: bool | None = None  # None: same as use_bias

    @property
    def out_bias(self) -> bool:
        return self.use_bias if self.use_out_bias is None else self.use_out_bias

    @classmethod
    def from_mamba_config(cls, config: dict[str, Any], intermediate: int) -> Mamba2Shape:
        """Granite-4.0-H / Falcon-H1 names (``mamba_n_heads``, ``mamba_d_head`` ("auto":
        ``intermediate // heads``), ``mamba_d_state``, ...)."""
        heads = int(cfg_require(config, "mamba_n_heads"))
        head_dim = cfg_get(config, "mamba_d_head", default="auto")
        head_dim = intermediate // heads if head_dim == "auto" else int(head_dim)
        shape = cls(
            hidden_size=int(cfg_require(config, "hidden_size")),
            num_heads=heads,
            head_dim=head_dim,
            state_size=int(cfg_require(config, "mamba_d_state")),
            n_groups=int(cfg_get(config, "mamba_n_groups", default=1)),
            conv_kernel=int(cfg_get(config, "mamba_d_conv", default=4)),
            use_conv_bias=bool(cfg_get(config, "mamba_conv_bias", default=True)),
            use_bias=bool(cfg_get(config, "mamba_proj_bias", default=False)),
        )
        if shape.inner != intermediate or heads % shape.n_groups:
            raise EngineError(
                f"mamba_n_heads {heads} x mamba_d_head {head_dim} != intermediate "
                f"{intermediate}, or heads not a multiple of mamba_n_groups {shape.n_groups}"
            )
        return shape

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Mamba2Shape:
        shape = cls(
            hidden_size=int(cfg_require(config, "hidden_size")),
            num_heads=int(cfg_require(config, "mamba_num_heads")),
            head_dim=int(cfg_require(config, "mamba_head_dim")),
            state_size=int(cfg_require(config, "ssm_state_size")),
            n_groups=int(cfg_get(config, "n_groups", default=1)),
            conv_kernel=int(cfg_get(config, "conv_kernel", default=4)),
            use_conv_bias=bool(cfg_get(config, "use_conv_bias", default=True)),
            use_bias=bool(cfg_get(config, "use_bias", "mamba_proj_bias", default=False)),
        )
        if shape.num_heads % shape.n_groups:
            raise EngineError(
                f"mamba_num_heads {shape.num_heads} is not a multiple of n_groups {shape.n_groups}"
            )
        return shape

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.n_groups * self.state_size


@dataclass
class Mamba2:
    shape: Mamba2Shape
    in_proj: torch.Tensor
    in_bias: torch.Tensor | None
    conv_weight: torch.Tensor  # [conv_dim, kernel]
    conv_bias: torch.Tensor | None
    dt_bias: torch.Tensor
    A_log: torch.Tensor
    D: torch.Tensor
    norm_weight: torch.Tensor  # [inner]
    out_proj: torch.Tensor
    out_bias: torch.Tensor | None
    eps: float
    dt_min: float
    ssm_dtype: torch.dtype | None
    dt_max: float = math.inf
    norm: str = "gated_rms"
    in_multiplier: float | None = None
    proj_multiplier: torch.Tensor | None = None  # [inner + conv_dim + heads]

    @classmethod
    def load(
        cls,
        ckpt: Checkpoint,
        prefix: str,
        config: dict[str, Any],
        *,
        shape: Mamba2Shape | None = None,
        eps: float | None = None,
        dt_limit: tuple[float, float] | None = None,
        norm: str = "gated_rms",
        in_multiplier: float | None = None,
        proj_multiplier: torch.Tensor | None = None,
    ) -> Mamba2:
        s = Mamba2Shape.from_config(config) if shape is None else shape
        proj_size = s.inner + s.conv_dim + s.num_heads
        ssm_dtype = config.get("mamba_ssm_cache_dtype")
        if norm not in NORMS:
            raise EngineError(f"Mamba2 norm {norm!r} is not one of {NORMS}")
        if eps is None:
            eps = float(cfg_get(config, "layer_norm_epsilon", "rms_norm_eps", default=1e-5))
        if dt_limit is None:
            dt_limit = (float(cfg_get(config, "time_step_min", default=0.0)), math.inf)
        if proj_multiplier is not None and tuple(proj_multiplier.shape) != (proj_size,):
            raise EngineError(f"{prefix}: in_proj multiplier has {proj_multiplier.shape}")
        return cls(
            shape=s,
            in_proj=ckpt.take(f"{prefix}.in_proj.weight", (proj_size, s.hidden_size)),
            in_bias=ckpt.take(f"{prefix}.in_proj.bias", (proj_size,)) if s.use_bias else None,
            conv_weight=ckpt.take(f"{prefix}.conv1d.weight", (s.conv_dim, 1, s.conv_kernel))[:, 0],
            conv_bias=(
                ckpt.take(f"{prefix}.conv1d.bias", (s.conv_dim,)) if s.use_conv_bias else None
            ),
            dt_bias=ckpt.take(f"{prefix}.dt_bias", (s.num_heads,)),
            A_log=ckpt.take(f"{prefix}.A_log", (s.num_heads,)),
            D=ckpt.take(f"{prefix}.D", (s.num_heads,)),
            norm_weight=(
                ckpt.take(f"{prefix}.norm.weight", (s.inner,))
                if norm != "gate"
                else torch.empty(0, dtype=ckpt.dtype, device=ckpt.device)
            ),
            out_proj=ckpt.take(f"{prefix}.out_proj.weight", (s.hidden_size, s.inner)),
            out_bias=ckpt.take(f"{prefix}.out_proj.bias", (s.hidden_size,)) if s.out_bias else None,
            eps=eps,
            dt_min=dt_limit[0],
            ssm_dtype=getattr(torch, ssm_dtype) if isinstance(ssm_dtype, str) else None,
            dt_max=dt_limit[1],
            norm=norm,
            in_multiplier=in_multiplier,
            proj_multiplier=proj_multiplier,
        )

    def desc(self, index: int) -> LayerDesc:
        s = self.shape
        return LayerDesc(
            index=index,
            kind=STATE,
            family="mamba2",
            shapes={
                "conv": (s.conv_dim, s.conv_kernel - 1),
                "ssm": (s.num_heads, s.head_dim, s.state_size),
            },
            ssm_dtype=self.ssm_dtype,
        )

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache) -> torch.Tensor:
        return self.forward(x, batch, cache, batched=True)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache, *, batched: bool
    ) -> torch.Tensor:
        """``batched`` False runs the per-request reference loop (the oracle in tests)."""
        if not isinstance(cache, StateCache):
            raise EngineError(f"Mamba2 layer got a {type(cache).__name__}, not StateCache")
        s = self.shape
        if self.in_multiplier is not None:
            x = x * self.in_multiplier
        projected = F.linear(x, self.in_proj, self.in_bias)
        if self.proj_multiplier is not None:
            projected = projected * self.proj_multiplier
        z, xbc, dt = torch.split(projected, [s.inner, s.conv_dim, s.num_heads], dim=-1)
        dt = F.softplus(dt + self.dt_bias)
        if math.isfinite(self.dt_max):
            dt = dt.clamp(min=self.dt_min, max=self.dt_max)
        else:
            dt = dt.clamp(min=self.dt_min)
        A = -torch.exp(self.A_log.float())
        y = x.new_empty(x.shape[0], s.inner)
        if batched:
            self._scan_batched(y, xbc, dt, A, batch, cache)
        else:
            self._scan_reference(y, xbc, dt, A, batch, cache)
        return F.linear(self._gated_norm(y, z), self.out_proj, self.out_bias)

    def _split_conv(
        self, conv_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """silu'd conv output ``[..., conv_dim]`` -> x ``[..., H, P]``, B and C ``[..., H,
        N]`` (groups repeated over their heads)."""
        s = self.shape
        lead = conv_out.shape[:-1]
        per_group = s.num_heads // s.n_groups
        hs, B, C = torch.split(
            F.silu(conv_out),
            [s.inner, s.n_groups * s.state_size, s.n_groups * s.state_size],
            dim=-1,
        )
        B = B.reshape(*lead, s.n_groups, s.state_size).repeat_interleave(per_group, dim=-2)
        C = C.reshape(*lead, s.n_groups, s.state_size).repeat_interleave(per_group, dim=-2)
        return hs.reshape(*lead, s.num_heads, s.head_dim), B, C

    def _scan_batched(
        self,
        y: torch.Tensor,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        batch: ForwardBatch,
        cache: StateCache,
    ) -> None:
        """All requests of a part at once (`state_batched`; padding cells get dt = 0)."""
        for part in state_parts(batch, cache.group):
            grid = part.layout
            conv_out, history = causal_conv_grid(
                grid.pad(xbc), gather_state(cache.conv, part), self.conv_weight, self.conv_bias
            )
            hs, B, C = self._split_conv(conv_out)
            at, index = capture_steps(part)
            out, states = mamba2_scan_grid(
                hs,
                grid.pad(dt),
                A,
                B,
                C,
                self.D,
                gather_state(cache.ssm, part),
                at,
                index,
                part.point_rows,
            )
            grid.unpad_into(y, out.flatten(-2))
            write_conv(cache.conv, part, history)
            write_ssm(cache.ssm, part, states)

    def _scan_reference(
        self,
        y: torch.Tensor,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        batch: ForwardBatch,
        cache: StateCache,
    ) -> None:
        """One request at a time, token by token (`state_ops`)."""
        for req in request_slots(batch, cache):
            start, end = req.start, req.end
            conv_out, history = causal_conv1d_history(
                xbc[start:end],
                read_state(cache.conv, req.read_slot),
                self.conv_weight,
                self.conv_bias,
            )
            hs, B, C = self._split_conv(conv_out)
            out, states = mamba2_scan_capture(
                hs,
                dt[start:end],
                A,
                B,
                C,
                self.D,
                read_state(cache.ssm, req.read_slot),
                req.capture_at,
            )
            y[start:end] = out.reshape(end - start, -1)
            write_states(cache.conv, cache.ssm, req, history, states)

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gate and RMSNorm within each of ``n_groups`` channel groups (see ``norm``)."""
        if self.norm == "gate":
            return y * F.silu(z)
        if self.norm == "norm_gate":
            normed = self._group_rms(y.float()) * self.norm_weight.float()
            return (normed * F.silu(z.float())).to(y.dtype)
        normed = self._group_rms(y.float() * F.silu(z.float()))
        if self.norm == "gate_norm":
            return (self.norm_weight.float() * normed).to(y.dtype)
        return self.norm_weight * normed.to(y.dtype)

    def _group_rms(self, x: torch.Tensor) -> torch.Tensor:
        s = self.shape
        grouped = x.view(-1, s.n_groups, s.inner // s.n_groups)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return grouped.view(-1, s.inner)


NORMS = ("gated_rms", "gate_norm", "norm_gate", "gate")


def time_step_limit(config: dict[str, Any]) -> tuple[float, float]:
    """``time_step_limit`` of a Granite / Falcon-H1 config (JSON writes infinity as
    ``{"__float__": "Infinity"}``); default ``(0, inf)``."""
    raw = config.get("time_step_limit")
    if raw is None:
        return (0.0, math.inf)

    def num(v: Any) -> float:
        return float(v["__float__"]) if isinstance(v, dict) else float(v)

    low, high = raw
    return (num(low), num(high))
