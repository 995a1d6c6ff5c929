"""Mamba2 and Mamba1 selective scans over a padded ``[R, L]`` grid, all rows at once.

The per-request oracles are `state_ops.mamba2_scan_capture` and
`models.mamba1.mamba1_scan_capture`; these run the same recurrence token by token,
vectorised over rows. Padding cells must carry ``dt = 0``: the decay is then 1 and the
update 0, so a row's state passes through them unchanged and the state "after k tokens"
of a shorter row is read at step k. Captures follow `state_batched.capture_steps`:
``capture_at`` lists the distinct k, point p takes ``capture_at[index[p]]`` of row
``rows[p]``.
"""

from __future__ import annotations

import torch


def _pick(
    kept: dict[int, torch.Tensor], capture_at: list[int], index: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    return torch.stack([kept[c] for c in capture_at])[index, rows]


def mamba2_scan_grid(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
    capture_at: list[int],
    index: torch.Tensor,
    rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, L, H, P]``, ``dt [R, L, H]``, ``A, D [H]``, ``B, C [R, L, H, N]``, ``state
    [R, H, P, N]``: ``S = exp(dt A) S + (dt x) B^T;  y = S C + D x``. Returns ``y`` like
    ``x`` and the captured states ``[P', H, P, N]``, in float32."""
    dtype = x.dtype
    xf, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    state = state.float()
    kept = {0: state}
    decay = torch.exp(dt * A.float())  # [R, L, H]
    scaled = dt[..., None] * xf  # [R, L, H, P]
    out = torch.empty_like(xf)
    for t in range(x.shape[1]):
        update = scaled[:, t, :, :, None] * B[:, t, :, None, :]  # [R, H, P, N]
        state = state * decay[:, t, :, None, None] + update
        out[:, t] = (state @ C[:, t, :, :, None])[..., 0]
        if t + 1 in capture_at:
            kept[t + 1] = state
    out = out + D.float()[:, None] * xf
    return out.to(dtype), _pick(kept, capture_at, index, rows)


def mamba1_scan_grid(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
    capture_at: list[int],
    index: torch.Tensor,
    rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x, dt [R, L, I]``, ``B, C [R, L, N]``, ``A [I, N]``, ``D [I]``, ``state [R, I,
    N]``: ``S = exp(A dt) S + (dt B^T) x;  y = S C + D x``, in float32."""
    dtype = x.dtype
    xf, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    state = state.float()
    kept = {0: state}
    out = torch.empty_like(xf)
    for t in range(x.shape[1]):
        decay = torch.exp(A[None] * dt[:, t, :, None])  # [R, I, N]
        state = decay * state + (dt[:, t, :, None] * B[:, t, None, :]) * xf[:, t, :, None]
        out[:, t] = (state @ C[:, t, :, None])[..., 0]
        if t + 1 in capture_at:
            kept[t + 1] = state
    out = out + xf * D.float()
    return out.to(dtype), _pick(kept, capture_at, index, rows)
