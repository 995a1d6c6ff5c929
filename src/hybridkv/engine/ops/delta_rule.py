"""The gated delta rule batched across requests: a recurrence for short steps, a chunked
form for prefill. `state_ops.gated_delta_rule_capture` is the per-request oracle.

Per head, with ``S`` the ``[dk, dv]`` state and q, k l2-normalised (q also scaled)::

    S_t = a_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t

with ``a_t = exp(g_t)``. Over a chunk of C tokens starting from ``S0``, let
``G_t = g_1 + .. + g_t`` and ``D[t, i] = exp(G_t - G_i)`` (decay from i to t). Unrolling
(Yang et al., "Gated Delta Networks", 2024, and "Parallelizing Linear Transformers with
the Delta Rule over Sequence Length", 2024: the WY / UT form)::

    (I + diag(beta) (D o K K^T)_strict) U = diag(beta) (V - diag(exp G) K S0)
    O   = diag(exp G) Q S0 + (D o Q K^T)_incl U
    S_m = exp(G_m) S0 + K[:m]^T (D[m, :m] o U[:m])          (state after m tokens)

so a chunk is a few matmuls and one unit-lower-triangular solve, and the state after any
token of the chunk (a write point) is one more product. Padding cells have
``beta = g = 0`` and ``k = 0``: ``u = 0`` there and the state passes through unchanged.

Shapes: ``q, k [R, L, H, dk]`` (l2-normalised already expanded to the value heads), ``v
[R, L, H, dv]``, ``g, beta [R, L, H]``, ``state [R, H, dk, dv]``; captures are
``(rows [P], ks [P])``; returns ``o [R, L, H, dv]`` and the captured states
``[P, H, dk, dv]``. Everything in float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hybridkv.engine.ops import compiled
from hybridkv.engine.ops.state_ops import l2norm

CHUNK_TOKENS = 64


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the enclosed ops on one intra-op thread. The batched triangular solve is one
    small BLAS call per matrix, each a parallel region of its own: with two threads it
    took 30-1100 ms for ``[256, 64, 64]`` (64-column right side) when another process
    held a core, every call waiting for the descheduled thread, against a steady
    40-70 ms on one thread on the same loaded machine (measured side by side, 7 runs
    each); on an idle machine two threads gain little (4.3 ms)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """float32, l2-normalised q (scaled by ``dk ** -0.5``) and k, as the reference does."""
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    return q, l2norm(k.float()), v.float(), g.float(), beta.float()


def prepare_grouped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ratio: int,
    *,
    heads_major: bool = False,
    fused: bool = False,
) -> tuple[torch.Tensor, ...]:
    """`prepare` for q, k still in key heads ``[..., Hk, dk]``: each head vector is
    normalised once, then repeated ``ratio`` times to the value heads. The norm is per
    vector, so the values are exactly `prepare`'s on repeated heads, for 1 / ratio of
    the normalising work.

    ``heads_major`` (grids ``[R, L, H, d]``, for `delta_rule_chunked`): q, k and v come
    back with the same shapes and values, but laid out ``[R, H, L, d]`` in memory, the
    layout the chunked rule makes contiguous. The repeat to value heads and that
    transpose are then one copy (v: the float32 cast and the transpose), not two: three
    8 MB passes fewer per layer at 16 rows x 256 tokens. ``fused`` (with ``heads_major``;
    `engine.ops.compiled`, opt-in, reduced precision only): q and k in one compiled pass each
    (cast, norm, scale, repeat, transpose)."""
    if heads_major and fused:
        qf = compiled.l2norm_heads_major(q, ratio, q.shape[-1] ** -0.5).transpose(1, 2)
        kf = compiled.l2norm_heads_major(k, ratio, 1.0).transpose(1, 2)
        return qf, kf, _heads_major(v, 1), g.float(), beta.float()
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    k = l2norm(k.float())
    if not heads_major:
        q, k = q.repeat_interleave(ratio, dim=-2), k.repeat_interleave(ratio, dim=-2)
        return q, k, v.float(), g.float(), beta.float()
    return (
        _heads_major(q, ratio),
        _heads_major(k, ratio),
        _heads_major(v, 1),
        g.float(),
        beta.float(),
    )


def _heads_major(x: torch.Tensor, ratio: int) -> torch.Tensor:
    """float32 ``x [R, L, H, d]`` with each head repeated ``ratio`` times (as
    ``repeat_interleave(ratio, dim=2)``), stored ``[R, H * ratio, L, d]`` and returned
    as its ``[R, L, H * ratio, d]`` transposed view: one copy."""
    rows, length, heads, dim = x.shape
    out = torch.empty(rows, heads, ratio, length, dim, dtype=torch.float32, device=x.device)
    out.copy_(x.permute(0, 2, 1, 3)[:, :, None].expand(rows, heads, ratio, length, dim))
    return out.view(rows, heads * ratio, length, dim).transpose(1, 2)


def delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    capture_at: list[int],
    capture_index: torch.Tensor,
    rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token over the grid (all rows at once). ``capture_at``: the distinct
    ``k`` of the write points; point p takes the state after ``capture_at[capture_index
    [p]]`` tokens of row ``rows[p]``. Inputs already `prepare`d."""
    state = state.float()
    kept: dict[int, torch.Tensor] = {0: state}
    out = torch.empty_like(v)
    num_rows, _, heads, dk = q.shape
    dv = v.shape[-1]
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        k_t = k[:, t, :, None, :]  # [R, H, 1, dk]
        predicted = (k_t @ state)[:, :, 0]  # [R, H, dv]
        delta = (v[:, t] - predicted) * beta[:, t, :, None]
        state = torch.baddbmm(
            state.view(-1, dk, dv), k_t.reshape(-1, dk, 1), delta.reshape(-1, 1, dv)
        ).view(num_rows, heads, dk, dv)
        out[:, t] = (q[:, t, :, None, :] @ state)[:, :, 0]
        if t + 1 in capture_at:
            kept[t + 1] = state
    stacked = torch.stack([kept[c] for c in capture_at])  # [num_k, R, H, dk, dv]
    return out, stacked[capture_index, rows]


def delta_rule_decode_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    work: torch.Tensor | None = None,
    *,
    decayed: bool = False,
) -> torch.Tensor:
    """One token per row, the state updated in place in the *stored* layout ``[R, H, dv,
    dk]`` (float32: a gathered copy, or the rows' slots of the buffer as a view). The
    per-request oracle's steps (decay, predict, write, read out) on a transposed view,
    so no transposed copies, no new state tensors and no per-point pick. Broadcast
    multiply-and-sum, not ``bmm``: a batched matrix-vector product runs several times
    slower on CPU than the elementwise form (measured: 0.4 vs 1.4 ms per layer at 32
    rows x 8 heads x 64 x 64). ``q, k [R, 1, H, dk]``, ``v [R, 1, H, dv]``, ``g, beta
    [R, 1, H]``, already `prepare`d. ``work``: a float32 ``[R, H, dk, dv]`` buffer for
    the two products, strided as the state (`engine.ops.scratch`: 4 MB at 32 rows,
    page-faulted afresh on every call when allocated). ``decayed``: the caller has
    already multiplied the state by ``exp(g)`` (`decay_into`). Returns ``o [R, 1, H,
    dv]``."""
    s = state.transpose(-1, -2)  # [R, H, dk, dv] view of the stored [R, H, dv, dk]
    k_col, q_col = k[:, 0, :, :, None], q[:, 0, :, :, None]  # [R, H, dk, 1]
    if not decayed:
        s.mul_(g[:, 0].exp()[..., None, None])
    predicted = (s * k_col if work is None else torch.mul(s, k_col, out=work)).sum(dim=-2)
    delta = (v[:, 0] - predicted) * beta[:, 0, :, None]  # predicted: S^T k, [R, H, dv]
    s.addcmul_(k_col, delta[:, :, None, :])  # S += k delta^T
    return (s * q_col if work is None else torch.mul(s, q_col, out=work)).sum(dim=-2)[:, None]


def decay_into(out: torch.Tensor, state: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``out = float32(state) * exp(g)`` per (row, head), for `delta_rule_decode_` with
    ``decayed=True``: the cast of a reduced-precision stored state and the kernel's
    first step in one pass (float32 of a bf16 value is exact, so the values are those
    of a cast copy decayed in place). ``state [R, H, dv, dk]``, ``g [R, 1, H]``."""
    return torch.mul(state, g[:, 0].exp()[..., None, None], out=out)


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    ks: list[int],
    chunk_tokens: int = CHUNK_TOKENS,
    *,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form (module docstring); point p is the state after ``ks[p]`` tokens
    of row ``rows[p]``. Inputs already `prepare`d. ``fused``: the per-chunk elementwise
    chains run through ``torch.compile`` (`engine.ops.compiled`: opt-in, for reduced-
    precision models only; float32 values then differ in the last bits)."""
    _, length, heads, _ = q.shape
    # [R, H, L, d] so that matmuls run per (row, head); contiguous once here, so every
    # chunk's slice is a strided view the batched matmuls take without a copy
    q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    g, beta = g.transpose(1, 2).contiguous(), beta.transpose(1, 2).contiguous()
    state = state.float()
    # The output in its returned layout [R, L, H, dv], each chunk copied in transposed:
    # the caller's reshape to [T, H, dv] is then a view, not one more copy of the grid.
    out = v.new_empty(v.shape[0], length, heads, v.shape[-1])
    captured = state.new_empty(len(ks), heads, state.shape[-2], state.shape[-1])
    ks_t = torch.tensor(ks, dtype=torch.long)
    for p in (ks_t == 0).nonzero().flatten().tolist():
        captured[p] = state[rows[p]]
    system_fn, out_fn, state_fn = _chunk_system, _chunk_out, _next_state
    if fused:
        system_fn = compiled.get("chunk_system", _chunk_system)
        out_fn = compiled.get("chunk_out", _chunk_out)
        state_fn = compiled.get("next_state", _next_state)
    for start in range(0, length, chunk_tokens):
        end = min(start + chunk_tokens, length)
        size = end - start
        qc, kc, vc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        system, rhs, cum, decay = system_fn(
            kc, vc, beta[:, :, start:end], g[:, :, start:end], state
        )
        # Flattened to [R * H, C, C]: the batched solve is several times faster in 3-d.
        with one_thread():
            solve = _solve_unit_lower_blocked if fused else _solve_unit_lower
            u = solve(system.reshape(-1, size, size), rhs.reshape(-1, size, rhs.shape[-1]))
            u = u.view(rhs.shape)
        out[:, start:end] = out_fn(qc, kc, state, cum, decay, u).transpose(1, 2)
        in_chunk = ((ks_t > start) & (ks_t <= end)).nonzero().flatten()
        if in_chunk.numel():
            _capture(captured, in_chunk, rows, ks_t - start, state, cum, decay, kc, u)
        if end == length:  # the state after the grid is read only through captures
            break
        state = state_fn(state, cum, decay, kc, u)
    return out, captured


def _solve_unit_lower(system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """``system^-1 rhs`` for unit-lower-triangular ``system [B, C, C]``, ``rhs [B, C, d]``."""
    return torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)


# Rows per block of `_solve_unit_lower_blocked`.
SOLVE_BLOCK = 8


def _solve_unit_lower_blocked(system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """`_solve_unit_lower` by blocks of `SOLVE_BLOCK` rows (the fused path's): each block
    subtracts what the solved rows contribute (one batched product), then solves its
    small diagonal system. The same sums in another order, so the values differ from
    `_solve_unit_lower` at float32 rounding (tested). Measured on the batch-32 prefill's
    own systems (``[128, 64, 64]``, 64-column right sides, 1 thread): 2.0-2.5 ms against
    3.6-4.0 ms; strong gates leave many tiny coefficients, and the one-call solve's
    substitution slows on the subnormal products they make (docs/performance.md)."""
    size = system.shape[-1]
    out = torch.empty_like(rhs)
    for start in range(0, size, SOLVE_BLOCK):
        end = min(start + SOLVE_BLOCK, size)
        right = rhs[:, start:end]
        if start:
            right = right - system[:, start:end, :start] @ out[:, :start]
        out[:, start:end] = _solve_unit_lower(system[:, start:end, start:end], right)
    return out


def _chunk_system(
    kc: torch.Tensor, vc: torch.Tensor, bc: torch.Tensor, gc: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's unit-lower system and right side (module doc), the cumulative gate
    ``G`` ``[R, H, C]`` and the decay ``D`` (zero above the diagonal)."""
    size = kc.shape[-2]
    cum = gc.cumsum(-1)  # [R, H, C]
    ones = torch.ones(size, size, dtype=torch.bool, device=kc.device)
    incl = torch.tril(ones)
    gap = cum[..., :, None] - cum[..., None, :]
    decay = gap.masked_fill(~incl, float("-inf")).exp()  # D, zero above the diagonal
    strict = decay.masked_fill(incl & ~torch.tril(ones, -1), 0.0)
    system = bc[..., None] * (strict * (kc @ kc.transpose(-1, -2)))
    system = system + torch.eye(size, dtype=kc.dtype, device=kc.device)
    rhs = bc[..., None] * (vc - cum.exp()[..., None] * (kc @ state))
    return system, rhs, cum, decay


def _chunk_out(
    qc: torch.Tensor,
    kc: torch.Tensor,
    state: torch.Tensor,
    cum: torch.Tensor,
    decay: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """``O = diag(exp G) Q S0 + (D o Q K^T)_incl U`` for one chunk."""
    return cum.exp()[..., None] * (qc @ state) + (decay * (qc @ kc.transpose(-1, -2))) @ u


def _next_state(
    state: torch.Tensor, cum: torch.Tensor, decay: torch.Tensor, kc: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """The state after the whole chunk (`_capture`'s formula at its last token)."""
    last = kc.shape[-2] - 1
    weights = decay[..., last, :, None] * u  # [R, H, C, dv]
    return cum[..., last].exp()[..., None, None] * state + kc.transpose(-1, -2) @ weights


def _capture(
    captured: torch.Tensor,
    points: torch.Tensor,
    rows: torch.Tensor,
    local_ks: torch.Tensor,
    state: torch.Tensor,
    cum: torch.Tensor,
    decay: torch.Tensor,
    kc: torch.Tensor,
    u: torch.Tensor,
) -> None:
    """``S_m = exp(G_m) S0 + K[:m]^T (D[m, :m] o U[:m])`` for the points in this chunk."""
    prow = rows[points.to(rows.device)]
    m = local_ks[points].to(rows.device) - 1  # index of the point's last token in the chunk
    row_decay = decay[prow, :, m]  # [P', H, C]: zero past token m, so U[m+1:] drops out
    start_decay = cum[prow, :, m].exp()  # [P', H]
    if _each_row_once(prow, state.shape[0]):  # the usual prefill: a point at each row's end
        s0, k0, u0 = state, kc, u  # no copies of [R, H, d, d] states (4 MB at 32 rows)
    else:
        s0, k0, u0 = state[prow], kc[prow], u[prow]
    s = start_decay[..., None, None] * s0 + k0.transpose(-1, -2) @ (row_decay[..., None] * u0)
    captured[points.to(captured.device)] = s


def _each_row_once(prow: torch.Tensor, num_rows: int) -> bool:
    """Whether the points' rows are ``0, 1, .., num_rows - 1``: indexing by them is a copy."""
    return prow.numel() == num_rows and bool(
        torch.equal(prow, torch.arange(num_rows, device=prow.device))
    )
