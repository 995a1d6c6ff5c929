"""Gated DeltaNet mixer (Qwen3.5, Qwen3-Next linear-attention layers).

    x -> [q | k | v] -> causal conv (rolling state) -> silu -> split heads
    beta = sigmoid(b),  g = -exp(A_log) * softplus(a + dt_bias)
    o = gated delta rule(q, k, v, g, beta; recurrent state)
    out = out_proj(rmsnorm(o) * silu(z))

The two checkpoints differ only in how the input projections are packed, so a
`Projector` (`models.gdn_projection`) turns hidden states into ``(mixed_qkv, z, b, a)``
and the rest is shared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridkv.engine.models.common import STATE, LayerDesc
from hybridkv.engine.models.gdn_projection import GDNShape, Projector
from hybridkv.engine.models.loader import Checkpoint
from hybridkv.engine.ops import compiled, compiled_decode, delta_rule
from hybridkv.engine.ops.context import ForwardBatch, LayerCache, StateCache
from hybridkv.engine.ops.packed_linear import linear
from hybridkv.engine.ops.state_batched import (
    SHORT_MAX_TOKENS,
    capture_steps,
    causal_conv_grid,
    gather_state,
    read_views,
    slot_views,
    state_parts,
    write_conv,
    write_conv_views,
    write_ssm,
    write_ssm_rows,
)
from hybridkv.engine.ops.state_ops import (
    causal_conv1d_history,
    gated_delta_rule_capture,
    read_state,
    request_slots,
    write_states,
)
from hybridkv.errors import EngineError


@dataclass
class GatedDeltaNet:
    shape: GDNShape
    project: Projector
    conv_weight: torch.Tensor  # [conv_dim, kernel]
    dt_bias: torch.Tensor
    A_log: torch.Tensor
    norm_weight: torch.Tensor  # [head_v_dim]
    out_proj: torch.Tensor
    eps: float

    @classmethod
    def load(
        cls,
        ckpt: Checkpoint,
        prefix: str,
        shape: GDNShape,
        projector: Callable[[Checkpoint, str, GDNShape], Projector],
        eps: float,
    ) -> GatedDeltaNet:
        s = shape
        conv = ckpt.take(f"{prefix}.conv1d.weight", (s.conv_dim, 1, s.conv_kernel))
        return cls(
            shape=s,
            project=projector(ckpt, prefix, s),
            conv_weight=conv[:, 0, :],
            dt_bias=ckpt.take(f"{prefix}.dt_bias", (s.num_v_heads,)),
            A_log=ckpt.take(f"{prefix}.A_log", (s.num_v_heads,)),
            norm_weight=ckpt.take(f"{prefix}.norm.weight", (s.head_v_dim,)),
            out_proj=ckpt.take(f"{prefix}.out_proj.weight", (s.hidden_size, s.value_dim)),
            eps=eps,
        )

    def desc(self, index: int) -> LayerDesc:
        s = self.shape
        return LayerDesc(
            index=index,
            kind=STATE,
            family="gated_delta_net",
            shapes={
                "conv": (s.conv_dim, s.conv_kernel - 1),
                # Stored [Hv, dv, dk] as the planner's spec lays it out; the scan works
                # on the transpose [Hv, dk, dv].
                "ssm": (s.num_v_heads, s.head_v_dim, s.head_k_dim),
            },
        )

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache) -> torch.Tensor:
        return self.forward(x, batch, cache, batched=True)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache, *, batched: bool
    ) -> torch.Tensor:
        """``batched`` False runs the per-request reference loop (the oracle in tests)."""
        if not isinstance(cache, StateCache):
            raise EngineError(f"Gated DeltaNet layer got a {type(cache).__name__}, not StateCache")
        s = self.shape
        mixed, z, b, a = self.project(x)
        if batched and compiled_decode.applies(x):  # opt-in, bf16 decode steps
            normed = self._decode_compiled(mixed, z, b, a, batch, cache)
            if normed is not None:
                return linear(normed, self.out_proj)
        beta = torch.sigmoid(b)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = x.new_empty(x.shape[0], s.num_v_heads, s.head_v_dim)
        if batched:
            self._core_batched(core, mixed, g, beta, batch, cache)
        else:
            self._core_reference(core, mixed, g, beta, batch, cache)
        gate = z.view(-1, s.num_v_heads, s.head_v_dim)
        normed = self._gated_norm(core, gate).reshape(x.shape[0], s.value_dim)
        return linear(normed, self.out_proj)

    def _decode_compiled(
        self,
        mixed: torch.Tensor,
        z: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        batch: ForwardBatch,
        cache: StateCache,
    ) -> torch.Tensor | None:
        """`compiled_decode.gdn_decode` for a step in which every row decodes one token
        from a slot of its own and stores the new state back there (`StatePart.in_place`:
        distinct slots, never the null slot the padding rows use); None for any other
        step (the eager path runs it)."""
        parts = state_parts(batch, cache.group)
        if len(parts) != 1:
            return None
        part = parts[0]
        grid = part.layout
        if grid.max_len != 1 or not grid.identity or not part.in_place:
            return None
        s = self.shape
        normed, conv_new = compiled_decode.gdn_decode(
            mixed,
            z,
            b,
            a,
            self.A_log,
            self.dt_bias,
            # a fresh tensor, not a view: the graph may not take two views of one pool
            cache.conv.index_select(0, part.read_slots),
            cache.ssm,
            part.read_slots,
            self.conv_weight.to(mixed.dtype),
            self.norm_weight,
            self.eps,
            s.num_k_heads,
            s.head_k_dim,
        )
        conv_views = slot_views(cache.conv, part)
        if conv_views is None:  # slots in more runs than views pay for: one scatter
            cache.conv.index_copy_(0, part.read_slots, conv_new)
        else:
            for run, view in zip(part.slot_runs or (), conv_views, strict=True):
                view.copy_(conv_new[run.rows])
        return normed

    def _split_heads(
        self, conv_out: torch.Tensor, *, repeat: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[..., conv_dim]`` -> q, k ``[..., Hv, dk]`` (key heads repeated; with
        ``repeat`` False left as ``[..., Hk, dk]``), v ``[..., Hv, dv]``."""
        s = self.shape
        lead = conv_out.shape[:-1]
        ratio = s.num_v_heads // s.num_k_heads if repeat else 1
        q, k, v = torch.split(conv_out, [s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = q.reshape(*lead, s.num_k_heads, s.head_k_dim).repeat_interleave(ratio, dim=-2)
        k = k.reshape(*lead, s.num_k_heads, s.head_k_dim).repeat_interleave(ratio, dim=-2)
        return q, k, v.reshape(*lead, s.num_v_heads, s.head_v_dim)

    def _core_batched(
        self,
        core: torch.Tensor,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        batch: ForwardBatch,
        cache: StateCache,
    ) -> None:
        """All requests at once per part (decode rows / prefill chunks; `state_batched`)."""
        ratio = self.shape.num_v_heads // self.shape.num_k_heads
        for part in state_parts(batch, cache.group):
            grid = part.layout
            # Decode where each row reads and writes back its own slot, the slots in a few
            # progressions: conv and ssm states are strided views of the buffers, updated
            # in place (no gather, no scatter).
            conv_views = ssm_views = None
            if grid.max_len == 1:
                conv_views, ssm_views = slot_views(cache.conv, part), slot_views(cache.ssm, part)
            fused = compiled.applies(mixed) and grid.max_len > SHORT_MAX_TOKENS  # opt-in
            conv_out, history = causal_conv_grid(
                grid.pad(mixed),
                gather_state(cache.conv, part) if conv_views is None else read_views(conv_views),
                self.conv_weight,
                None,
                silu=fused,
            )
            if not fused:  # in place: a fresh buffer (same values as silu)
                F.silu(conv_out, inplace=True)
            q, k, v = self._split_heads(conv_out, repeat=False)
            q, k, v, g_grid, beta_grid = delta_rule.prepare_grouped(
                q,
                k,
                v,
                grid.pad(g),
                grid.pad(beta),
                ratio,
                heads_major=grid.max_len > SHORT_MAX_TOKENS,
                fused=fused,
            )
            if conv_views is not None and ssm_views is not None and part.slot_runs is not None:
                outs = [
                    _decode_run(
                        batch,
                        view,
                        q[run.rows],
                        k[run.rows],
                        v[run.rows],
                        g_grid[run.rows],
                        beta_grid[run.rows],
                    )
                    for run, view in zip(part.slot_runs, ssm_views, strict=True)
                ]
                grid.unpad_into(core, outs[0] if len(outs) == 1 else torch.cat(outs))
                write_conv_views(conv_views, part, history)
                continue
            if grid.max_len == 1 and part.uniform_k == 1:  # decode: gathered, stored layout
                stored = gather_state(cache.ssm, part).float().contiguous()
                out = delta_rule.delta_rule_decode_(
                    q, k, v, g_grid, beta_grid, stored, _work(batch, stored)
                )
                grid.unpad_into(core, out)
                write_conv(cache.conv, part, history)
                write_ssm_rows(cache.ssm, part, stored)
                continue
            # The ssm buffer is [Hv, dv, dk]; the rule works on [Hv, dk, dv].
            state = gather_state(cache.ssm, part).transpose(-1, -2)
            if grid.max_len <= SHORT_MAX_TOKENS:
                at, index = capture_steps(part)
                out, states = delta_rule.delta_rule_recurrent(
                    q, k, v, g_grid, beta_grid, state, at, index, part.point_rows
                )
            else:
                out, states = delta_rule.delta_rule_chunked(
                    q,
                    k,
                    v,
                    g_grid,
                    beta_grid,
                    state,
                    part.point_rows,
                    list(part.point_k_host),
                    fused=fused,
                )
            grid.unpad_into(core, out)
            write_conv(cache.conv, part, history)
            write_ssm(cache.ssm, part, states.transpose(-1, -2))

    def _core_reference(
        self,
        core: torch.Tensor,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        batch: ForwardBatch,
        cache: StateCache,
    ) -> None:
        """One request at a time, token by token (`state_ops`)."""
        for req in request_slots(batch, cache):
            start, end = req.start, req.end
            conv_out, history = causal_conv1d_history(
                mixed[start:end], read_state(cache.conv, req.read_slot), self.conv_weight, None
            )
            q, k, v = self._split_heads(F.silu(conv_out))
            state = read_state(cache.ssm, req.read_slot).transpose(-1, -2)
            out, states = gated_delta_rule_capture(
                q, k, v, g[start:end], beta[start:end], state, req.capture_at
            )
            core[start:end] = out
            stored = {at: st.transpose(-1, -2) for at, st in states.items()}
            write_states(cache.conv, cache.ssm, req, history, stored)

    def _gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head (plain weight, no +1), then times silu(gate)."""
        if compiled.applies(x):  # opt-in, bf16 prefill only (`engine.ops.compiled`)
            return compiled.gated_norm(x, gate, self.norm_weight, self.eps)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = normed.to(x.dtype)
        if out.dtype == torch.float32 and self.norm_weight.dtype == torch.float32:
            # float32: `out` is `normed`, a fresh buffer; multiplying in place gives the
            # out-of-place products' values without two more [T, Hv, dv] buffers.
            return out.mul_(self.norm_weight).mul_(F.silu(gate))
        out = self.norm_weight * out
        return (out * F.silu(gate.float())).to(x.dtype)


def _decode_run(
    batch: ForwardBatch,
    view: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """The decode kernel on one slot run's states (``view``: a strided view of the ssm
    buffer). float32 states are updated in place through the view. Other dtypes (bf16
    models keep a bf16 state) are read into a float32 copy and written back through the
    view: the same casts as the gather path (``index_select`` -> float, kernel, ``to``
    + ``index_put``), so the same values, but one strided pass each way instead of a
    gather plus a cast and a cast plus an indexed store (at 32 rows ~4 ms of a ~35 ms
    bf16 decode step went to those four ops, profiled). The pass in is also the
    kernel's decay (`delta_rule.decay_into`), into a scratch buffer (no fresh pages)."""
    if view.dtype == torch.float32:
        return delta_rule.delta_rule_decode_(q, k, v, g, beta, view, _work(batch, view))
    shape = tuple(view.shape)
    stored = (
        torch.empty(shape, dtype=torch.float32, device=view.device)
        if batch.scratch is None
        else batch.scratch.take("delta_rule_state", shape, torch.float32, view.device)
    )
    delta_rule.decay_into(stored, view, g)
    if compiled.decode_applies(view):  # opt-in (`engine.ops.compiled`)
        out, new = compiled.delta_step(stored, q, k, v, beta)
        view.copy_(new)
        return out
    out = delta_rule.delta_rule_decode_(
        q, k, v, g, beta, stored, _work(batch, stored), decayed=True
    )
    view.copy_(stored)
    return out


def _work(batch: ForwardBatch, stored: torch.Tensor) -> torch.Tensor | None:
    """The decode kernel's product buffer from the runner's scratch (None without one):
    ``[R, H, dk, dv]``, laid out as the stored ``[R, H, dv, dk]`` state (a transposed
    view), which is the layout a fresh product takes: the same loops, the same sums."""
    if batch.scratch is None:
        return None
    shape = tuple(stored.shape)
    return batch.scratch.take("delta_rule", shape, torch.float32, stored.device).transpose(-1, -2)
