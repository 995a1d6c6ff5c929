"""Mamba1 mixer (Jamba layout).

    in_proj(x) -> [x (inner) | z (inner)]
    x -> causal conv (rolling state) + bias -> silu
    [dt_r | B | C] = x_proj(x);  dt_r, B, C each RMS-normed (Jamba's dt/b/c layernorms)
    dt = softplus(dt_proj.weight @ dt_r + dt_proj.bias),  A = -exp(A_log)   [inner, N]
    S = exp(dt * A) * S + (dt * x) B^T;   y = S C + D * x;   y = y * silu(z)
    out = out_proj(y)

The scan runs in float32, one token at a time; the state is ``[inner, d_state]``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridkv.engine.models.common import STATE, LayerDesc, rms_norm
from hybridkv.engine.models.loader import Checkpoint, cfg_get, cfg_require
from hybridkv.engine.ops.context import ForwardBatch, LayerCache, StateCache
from hybridkv.engine.ops.ssm_batched import mamba1_scan_grid
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
    read_state,
    request_slots,
    write_states,
)
from hybridkv.errors import EngineError


def mamba1_scan_capture(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
    capture_at: Iterable[int],
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Selective scan of ``x, dt [L, I]``, ``B, C [L, N]``, ``A [I, N]``, ``D [I]`` from
    ``state [I, N]``, in float32; also the state after each ``k`` in ``capture_at``."""
    wanted = set(capture_at)
    dtype = x.dtype
    xf, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    state = state.float()
    captured = {0: state} if 0 in wanted else {}
    out = torch.empty_like(xf)
    for t in range(x.shape[0]):
        decay = torch.exp(A * dt[t][:, None])
        state = decay * state + (dt[t][:, None] * B[t][None, :]) * xf[t][:, None]
        out[t] = state @ C[t]
        if t + 1 in wanted:
            captured[t + 1] = state
    out = out + xf * D.float()
    return out.to(dtype), captured


@dataclass
class Mamba1:
    hidden_size: int
    inner: int
    state_size: int
    dt_rank: int
    conv_kernel: int
    in_proj: torch.Tensor  # [2 * inner, hidden]
    in_bias: torch.Tensor | None
    conv_weight: torch.Tensor  # [inner, kernel]
    conv_bias: torch.Tensor | None
    x_proj: torch.Tensor  # [dt_rank + 2N, inner]
    dt_proj: torch.Tensor  # [inner, dt_rank]
    dt_bias: torch.Tensor  # [inner]
    A_log: torch.Tensor  # [inner, N]
    D: torch.Tensor  # [inner]
    dt_norm: torch.Tensor
    b_norm: torch.Tensor
    c_norm: torch.Tensor
    out_proj: torch.Tensor
    out_bias: torch.Tensor | None
    eps: float

    @classmethod
    def load(cls, ckpt: Checkpoint, prefix: str, config: dict[str, Any]) -> Mamba1:
        hidden = int(cfg_require(config, "hidden_size"))
        inner = int(cfg_get(config, "mamba_expand", default=2)) * hidden
        n = int(cfg_get(config, "mamba_d_state", default=16))
        kernel = int(cfg_get(config, "mamba_d_conv", default=4))
        rank_raw = cfg_get(config, "mamba_dt_rank", default="auto")
        rank = -(-hidden // 16) if rank_raw == "auto" else int(rank_raw)
        conv_bias = bool(cfg_get(config, "mamba_conv_bias", default=True))
        bias = bool(cfg_get(config, "mamba_proj_bias", default=False))
        if str(cfg_get(config, "hidden_act", default="silu")) not in ("silu", "swish"):
            raise EngineError("Mamba1 supports only the silu conv activation")
        return cls(
            hidden_size=hidden,
            inner=inner,
            state_size=n,
            dt_rank=rank,
            conv_kernel=kernel,
            in_proj=ckpt.take(f"{prefix}.in_proj.weight", (2 * inner, hidden)),
            in_bias=ckpt.take(f"{prefix}.in_proj.bias", (2 * inner,)) if bias else None,
            conv_weight=ckpt.take(f"{prefix}.conv1d.weight", (inner, 1, kernel))[:, 0],
            conv_bias=ckpt.take(f"{prefix}.conv1d.bias", (inner,)) if conv_bias else None,
            x_proj=ckpt.take(f"{prefix}.x_proj.weight", (rank + 2 * n, inner)),
            dt_proj=ckpt.take(f"{prefix}.dt_proj.weight", (inner, rank)),
            dt_bias=ckpt.take(f"{prefix}.dt_proj.bias", (inner,)),
            A_log=ckpt.take(f"{prefix}.A_log", (inner, n)),
            D=ckpt.take(f"{prefix}.D", (inner,)),
            dt_norm=ckpt.take(f"{prefix}.dt_layernorm.weight", (rank,)),
            b_norm=ckpt.take(f"{prefix}.b_layernorm.weight", (n,)),
            c_norm=ckpt.take(f"{prefix}.c_layernorm.weight", (n,)),
            out_proj=ckpt.take(f"{prefix}.out_proj.weight", (hidden, inner)),
            out_bias=ckpt.take(f"{prefix}.out_proj.bias", (hidden,)) if bias else None,
            eps=float(cfg_get(config, "rms_norm_eps", default=1e-6)),
        )

    def desc(self, index: int) -> LayerDesc:
        return LayerDesc(
            index=index,
            kind=STATE,
            family="mamba1",
            shapes={
                "conv": (self.inner, self.conv_kernel - 1),
                "ssm": (self.inner, self.state_size),
            },
        )

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache) -> torch.Tensor:
        return self.forward(x, batch, cache, batched=True)

    def _dt_b_c(self, hs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dt_r, B, C = torch.split(
            F.linear(hs, self.x_proj), [self.dt_rank, self.state_size, self.state_size], dim=-1
        )
        dt_r = rms_norm(dt_r, self.dt_norm, self.eps)
        B = rms_norm(B, self.b_norm, self.eps)
        C = rms_norm(C, self.c_norm, self.eps)
        dt = F.softplus(F.linear(dt_r, self.dt_proj).float() + self.dt_bias.float())
        return dt, B, C

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache, *, batched: bool
    ) -> torch.Tensor:
        """``batched`` False runs the per-request reference loop (the oracle in tests)."""
        if not isinstance(cache, StateCache):
            raise EngineError(f"Mamba1 layer got a {type(cache).__name__}, not StateCache")
        xs, z = F.linear(x, self.in_proj, self.in_bias).chunk(2, dim=-1)
        A = -torch.exp(self.A_log.float())
        y = x.new_empty(x.shape[0], self.inner)
        if batched:
            for part in state_parts(batch, cache.group):
                grid = part.layout
                conv_out, history = causal_conv_grid(
                    grid.pad(xs), gather_state(cache.conv, part), self.conv_weight, self.conv_bias
                )
                hs = F.silu(conv_out)
                dt, B, C = self._dt_b_c(hs)
                dt = torch.where(grid.valid[..., None], dt, 0.0)  # padding: state unchanged
                at, index = capture_steps(part)
                out, states = mamba1_scan_grid(
                    hs,
                    dt,
                    A,
                    B,
                    C,
                    self.D,
                    gather_state(cache.ssm, part),
                    at,
                    index,
                    part.point_rows,
                )
                grid.unpad_into(y, out)
                write_conv(cache.conv, part, history)
                write_ssm(cache.ssm, part, states)
            return F.linear(y * F.silu(z), self.out_proj, self.out_bias)
        for req in request_slots(batch, cache):
            start, end = req.start, req.end
            conv_out, history = causal_conv1d_history(
                xs[start:end],
                read_state(cache.conv, req.read_slot),
                self.conv_weight,
                self.conv_bias,
            )
            hs = F.silu(conv_out)
            dt, B, C = self._dt_b_c(hs)
            out, captured = mamba1_scan_capture(
                hs,
                dt,
                A,
                B,
                C,
                self.D,
                read_state(cache.ssm, req.read_slot),
                req.capture_at,
            )
            y[start:end] = out * F.silu(z[start:end])
            write_states(cache.conv, cache.ssm, req, history, captured)
        return F.linear(y, self.out_proj, self.out_bias)
