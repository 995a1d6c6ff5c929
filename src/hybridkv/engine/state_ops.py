"""Recurrent-state kernels in plain PyTorch: causal conv, Gated DeltaNet, Mamba2 SSM.

Every op works on one request's new tokens and one state slot. The slot is read only
when the request has an initial state; otherwise the op starts from zeros and never
touches the slot's old contents (a recomputed preempted request must not see them).

Conv state layout: ``[channels, rows]`` holding the most recent conv inputs, oldest
first, ``rows >= kernel - 1``. Only the last ``kernel - 1`` columns feed the conv; the
extra rows (speculative tokens) just keep a longer history. Example, kernel 4, rows 3,
after inputs x0..x4 the state is ``[x2 x3 x4]``; the next token x5 sees ``x2 x3 x4 x5``.

The scans are sequential over tokens (exact and simple; prefill of a few hundred tokens
on a tiny model takes well under a second).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridkv.engine.context import ForwardBatch, StateCache, StateSlots
from hybridkv.errors import EngineError


def initial_state(buffer: torch.Tensor, slot: int, has_initial: bool) -> torch.Tensor:
    """A working copy of ``buffer[slot]``, or zeros when the request starts fresh."""
    if has_initial:
        return buffer[slot].clone()
    return torch.zeros_like(buffer[slot])


def request_slots(batch: ForwardBatch, cache: StateCache) -> list[tuple[int, int, int, bool]]:
    """``(start, end, slot, has_initial_state)`` per request with new tokens."""
    slots: StateSlots = batch.slots(cache.group)
    slot_ids = slots.slot_ids.tolist()
    has_initial = slots.has_initial_state.tolist()
    out = []
    for r, (start, end, computed) in enumerate(batch.query_ranges()):
        if start == end:
            continue
        if has_initial[r] and computed == 0:
            raise EngineError(
                f"request {r} claims an initial state in group {cache.group!r} but has 0 "
                "computed tokens"
            )
        out.append((start, end, int(slot_ids[r]), bool(has_initial[r])))
    return out


def causal_conv1d(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of ``x [L, C]`` continuing from ``conv_state [C, rows]``.

    ``weight`` is ``[C, kernel]``. Returns the output ``[L, C]`` (before activation) and
    the new state: the last ``rows`` inputs.
    """
    kernel = weight.shape[-1]
    rows = conv_state.shape[-1]
    if rows < kernel - 1:
        raise EngineError(f"conv state has {rows} columns but the kernel needs {kernel - 1}")
    history = torch.cat([conv_state.to(x.dtype), x.T], dim=-1)  # [C, rows + L]
    window = history[:, rows - (kernel - 1) :]
    out = F.conv1d(window[None].to(weight.dtype), weight[:, None, :], bias, groups=weight.shape[0])
    return out[0].T.to(x.dtype), history[:, -rows:]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over one request's tokens, in float32.

    ``q, k [L, H, dk]`` (already expanded to the value heads), ``v [L, H, dv]``,
    ``g, beta [L, H]`` (log decay and write strength), ``state [H, dk, dv]``. Per token:

        S = exp(g) * S;   S += k (beta * (v - k^T S))^T;   o = q^T S

    with q, k l2-normalised and q scaled by ``dk ** -0.5``. Returns ``o [L, H, dv]`` and
    the final state.
    """
    dtype = q.dtype
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    k = l2norm(k.float())
    v, g, beta = v.float(), g.float(), beta.float()
    state = state.float()
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        predicted = (state * k[t][:, :, None]).sum(dim=1)  # [H, dv]
        delta = (v[t] - predicted) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = (state * q[t][:, :, None]).sum(dim=1)
    return out.to(dtype), state


def mamba2_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2 selective scan over one request's tokens, in float32.

    ``x [L, H, P]``, ``dt [L, H]`` (already softplus'd and clamped), ``A [H]`` (negative),
    ``B, C [L, H, N]`` (groups already expanded to heads), ``D [H]``,
    ``state [H, P, N]``. Per token:

        S = exp(dt * A) * S + (dt * x) B^T;   y = S C + D * x
    """
    dtype = x.dtype
    xf, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    state = state.float()
    decay = torch.exp(dt * A.float())  # [L, H]
    out = torch.empty_like(xf)
    for t in range(x.shape[0]):
        update = (dt[t][:, None] * xf[t])[:, :, None] * B[t][:, None, :]  # [H, P, N]
        state = state * decay[t][:, None, None] + update
        out[t] = (state * C[t][:, None, :]).sum(dim=-1)
    out = out + D.float()[:, None] * xf
    return out.to(dtype), state
