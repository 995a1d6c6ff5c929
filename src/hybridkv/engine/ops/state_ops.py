"""Recurrent-state kernels in plain PyTorch: causal conv, Gated DeltaNet, Mamba2 SSM.

Every op works on one request's new tokens and one state slot. The slot is read only
when the request has an initial state; otherwise the op starts from zeros and never
touches the slot's old contents (a recomputed preempted request must not see them).

Conv state layout: ``[channels, rows]`` holding the most recent conv inputs, oldest
first, ``rows >= kernel - 1``. Only the last ``kernel - 1`` columns feed the conv; the
extra rows (speculative tokens) just keep a longer history. Example, kernel 4, rows 3,
after inputs x0..x4 the state is ``[x2 x3 x4]``; the next token x5 sees ``x2 x3 x4 x5``.

Write points: a step may store the state after any prefix of a request's new tokens
(`StateSlots.write_points`): after ``k`` tokens the conv state is ``history[:, k:k+rows]``
of ``history = [initial | x0 .. x_{n-1}]`` and the ssm state is captured in the scan
loop. Example, rows 3, initial ``[a b c]``, new x0..x3, points k = 0, 2, 4::

    history   a  b  c  x0 x1 x2 x3
    k = 0    [a  b  c]
    k = 2          [c  x0 x1]
    k = 4                [x1 x2 x3]

The scans are sequential over tokens (exact and simple; prefill of a few hundred tokens
on a tiny model takes well under a second).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridkv.engine.ops.context import ForwardBatch, StateCache, StateSlots, WritePoint
from hybridkv.errors import EngineError


def initial_state(buffer: torch.Tensor, slot: int, has_initial: bool) -> torch.Tensor:
    """A working copy of ``buffer[slot]``, or zeros when the request starts fresh."""
    if has_initial:
        return buffer[slot].clone()
    return torch.zeros_like(buffer[slot])


@dataclass(frozen=True)
class RequestState:
    """One request's stream range, read slot (None: zeros) and write points."""

    start: int
    end: int
    read_slot: int | None
    points: tuple[WritePoint, ...]

    @property
    def capture_at(self) -> list[int]:
        return sorted({k for k, _ in self.points})


def request_slots(batch: ForwardBatch, cache: StateCache) -> list[RequestState]:
    """Read slot and write points per request with new tokens."""
    if batch.tree is not None:
        raise EngineError(
            f"state group {cache.group!r}: token trees run on the batched state path only "
            "(`state_batched`), not the per-request reference loop"
        )
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
        read = int(slot_ids[r]) if has_initial[r] else None
        out.append(RequestState(start, end, read, slots.points(r, end - start)))
    return out


def read_state(buffer: torch.Tensor, slot: int | None) -> torch.Tensor:
    """A working copy of ``buffer[slot]``, or zeros for None (never the old contents)."""
    if slot is None:
        return torch.zeros_like(buffer[0])
    return buffer[slot].clone()


def write_states(
    conv: torch.Tensor,
    ssm: torch.Tensor,
    req: RequestState,
    conv_history: torch.Tensor,
    ssm_states: dict[int, torch.Tensor],
) -> None:
    """Store conv window and ssm state at every write point of ``req``.

    Called after the request's whole scan, so an in-place point (write slot == read
    slot) cannot disturb what the scan read.
    """
    rows = conv.shape[-1]
    for k, slot in req.points:
        conv[slot] = conv_history[:, k : k + rows].to(conv.dtype)
        ssm[slot] = ssm_states[k].to(ssm.dtype)


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
    out, history = causal_conv1d_history(x, conv_state, weight, bias)
    return out, history[:, -conv_state.shape[-1] :]


def causal_conv1d_history(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv1d`, returning the whole history ``[C, rows + L]`` instead of the
    new state; the state after ``k`` tokens is ``history[:, k : k + rows]``."""
    kernel = weight.shape[-1]
    rows = conv_state.shape[-1]
    if rows < kernel - 1:
        raise EngineError(f"conv state has {rows} columns but the kernel needs {kernel - 1}")
    history = torch.cat([conv_state.to(x.dtype), x.T], dim=-1)  # [C, rows + L]
    window = history[:, rows - (kernel - 1) :]
    out = F.conv1d(window[None].to(weight.dtype), weight[:, None, :], bias, groups=weight.shape[0])
    return out[0].T.to(x.dtype), history


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
    out, states = gated_delta_rule_capture(q, k, v, g, beta, state, [q.shape[0]])
    return out, states[q.shape[0]]


def gated_delta_rule_capture(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    capture_at: Iterable[int],
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """`gated_delta_rule` that also returns the state after each ``k`` in ``capture_at``
    (0: the initial state; the number of tokens: the final one)."""
    wanted = set(capture_at)
    dtype = q.dtype
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    k = l2norm(k.float())
    v, g, beta = v.float(), g.float(), beta.float()
    state = state.float()
    captured = {0: state} if 0 in wanted else {}
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        predicted = (state * k[t][:, :, None]).sum(dim=1)  # [H, dv]
        delta = (v[t] - predicted) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = (state * q[t][:, :, None]).sum(dim=1)
        if t + 1 in wanted:
            captured[t + 1] = state
    return out.to(dtype), captured


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
    out, states = mamba2_scan_capture(x, dt, A, B, C, D, state, [x.shape[0]])
    return out, states[x.shape[0]]


def mamba2_scan_capture(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
    capture_at: Iterable[int],
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """`mamba2_scan` that also returns the state after each ``k`` in ``capture_at``."""
    wanted = set(capture_at)
    dtype = x.dtype
    xf, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    state = state.float()
    captured = {0: state} if 0 in wanted else {}
    decay = torch.exp(dt * A.float())  # [L, H]
    out = torch.empty_like(xf)
    for t in range(x.shape[0]):
        update = (dt[t][:, None] * xf[t])[:, :, None] * B[t][:, None, :]  # [H, P, N]
        state = state * decay[t][:, None, None] + update
        out[t] = (state * C[t][:, None, :]).sum(dim=-1)
        if t + 1 in wanted:
            captured[t + 1] = state
    out = out + D.float()[:, None] * xf
    return out.to(dtype), captured
