"""Opt-in ``torch.compile`` of whole decode-step layer cores (reduced precision, CPU).

A decode step at batch 1 is mostly op overhead: ~4,500 aten calls of a few microseconds
each around ~50 products (docs/performance.md). The functions here take a
layer's work between its products as one compiled region, so inductor fuses the casts,
norms, gates and state updates into a few loops and the products stay oneDNN's packed
calls (`packed_linear`), outside:

- `gdn_decode`: a Gated DeltaNet layer between ``in_proj`` and ``out_proj`` for a step in
  which every row decodes one token from a state of its own (gates, conv update + silu,
  q / k l2 norms and repeat, state decay, delta rule step, gated output norm). It reads
  the rows' ssm states from the cache buffer and writes the new ones back in place, inside
  the graph (one pass over each state instead of a read, a new tensor and a copy).

Same switch as `engine.ops.compiled` (``LLM(torch_compile=True)``), same rules: bf16 / fp16
on the CPU only, never float32 (held bit-exact against transformers) or CUDA.

Static shapes, bucketed rows (as vLLM captures its decode graphs per batch size): a
step's rows are padded up to the next of `ROW_BUCKETS` and each bucket compiles its own
graph on first use (seconds each; inductor caches them on disk), called without
dynamo's per-call frame hook and guards (`_static_graph`). Inductor's code for
symbolic shapes was several times slower here: the Gated DeltaNet core at 32 rows took
2.54 ms with ``dynamic=True`` against 0.64 ms static (eager 2.6 ms), at 1 row 122 against
72 us (one thread, bf16). Padding rows compute on zeros, read and write the null
slot, and their outputs are dropped. Steps with more rows than the last bucket run eager.

Values differ from the eager bf16 path in the last bits (inductor computes a chain in
float32 and rounds once): tests/engine/test_compiled_decode.py bounds them against a
float64 composition of the eager path's own pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from hybridkv.engine.ops import compiled
from hybridkv.errors import EngineError

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
# Padding rows' state slot: block 0, the pool's null block (`cache.block.NULL_BLOCK`),
# which no request holds and nothing reads.
NULL_SLOT = 0
# Compiled graphs by input layout (`_graph_key`): one per row bucket and buffer layout.
_graphs: dict[tuple[Any, ...], Callable[..., Any]] = {}


def bucket(rows: int) -> int | None:
    """The padded row count for a step of ``rows`` decode rows (None: too many, eager)."""
    return next((b for b in ROW_BUCKETS if b >= rows), None)


def _graph_key(tensors: Sequence[torch.Tensor], consts: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a static graph is specialised on: every input's shape, strides and dtype and
    the constants (`_static_graph`: these replace dynamo's guards)."""
    return (*((t.shape, t.stride(), t.dtype, t.device) for t in tensors), *consts)


def _static_graph(
    fn: Callable[..., Any], tensors: Sequence[torch.Tensor], consts: tuple[Any, ...]
) -> Callable[..., Any]:
    """``fn(*tensors, *consts)`` as an inductor graph for exactly these input layouts,
    built on first use and kept. Traced with ``make_fx`` and compiled with
    ``torch._inductor.compile`` (inductor's entry for graphs captured without dynamo,
    cached on disk like any inductor graph): a call then skips dynamo's frame hook and
    guard checks, which cost 25-60 us per call here (`gdn_decode`, bf16: 62 against 36 us
    at 1 row and 467 against 406 us at 32 rows with 2 threads, 57 against 34 us at 1 row
    with 1) -- per layer and step. The key
    (`_graph_key`) stands in for the guards: any other shape, stride, dtype or constant
    builds another graph."""
    key = (fn.__name__, *_graph_key(tensors, consts))
    graph = _graphs.get(key)
    if graph is None:
        from torch.fx.experimental.proxy_tensor import make_fx

        def traced(*inputs: torch.Tensor) -> Any:
            return fn(*inputs, *consts)

        # traced on fake tensors (the same shapes, strides and offsets; nothing runs, so
        # the buffers the function updates are not touched), compiled for these inputs
        graph_module = make_fx(traced, tracing_mode="fake")(*tensors)
        graph = torch._inductor.compile(graph_module, list(tensors))
        _graphs[key] = graph
    return graph


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x [R, ...]`` with zero rows appended up to ``rows``."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def applies(x: torch.Tensor) -> bool:
    """Whether a decode step over ``x [R, hidden]`` takes the compiled layer cores: the
    switch is on, reduced precision, on the CPU, at most the last bucket's rows."""
    return (
        compiled.enabled()
        and x.dtype in compiled.REDUCED_DTYPES
        and x.device.type == "cpu"
        and x.shape[0] <= ROW_BUCKETS[-1]
    )


def _gdn_decode(
    mixed: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_buffer: torch.Tensor,
    slots: torch.Tensor,
    taps: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    num_k_heads: int,
    head_k_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = mixed.shape[0]
    ssm = ssm_buffer.index_select(0, slots)
    dtype = mixed.dtype
    num_v_heads, head_v_dim = ssm.shape[1], ssm.shape[2]
    ratio = num_v_heads // num_k_heads
    key_dim = num_k_heads * head_k_dim
    # gates, as `GatedDeltaNet.forward`
    beta = torch.sigmoid(b).float()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    # causal conv over the stored window plus the new token, then silu
    # (`state_batched.causal_conv_grid`): history [R, C, rows + 1]; a plan may keep more
    # rows than K - 1 (for speculative tokens), the conv reads the last K - 1
    history = torch.cat([conv_state.to(dtype), mixed[:, :, None]], dim=2)
    window = history[:, :, history.shape[2] - taps.shape[1] :]  # the last K inputs
    conv = F.silu((window * taps).sum(dim=2).to(dtype))
    q, k, v = torch.split(conv, [key_dim, key_dim, num_v_heads * head_v_dim], dim=-1)
    # `delta_rule.prepare_grouped`: float32, l2-normalised, q scaled, repeated to v heads
    qf = q.reshape(rows, num_k_heads, head_k_dim).float()
    kf = k.reshape(rows, num_k_heads, head_k_dim).float()
    qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + 1e-6) * head_k_dim**-0.5
    kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    qf = qf.repeat_interleave(ratio, dim=1)  # [R, Hv, dk]
    kf = kf.repeat_interleave(ratio, dim=1)
    vf = v.reshape(rows, num_v_heads, head_v_dim).float()
    # `delta_rule.delta_rule_decode_` on the stored [R, Hv, dv, dk] layout
    state = ssm.float() * g.exp()[..., None, None]
    predicted = (state * kf[:, :, None, :]).sum(-1)  # S^T k: [R, Hv, dv]
    delta = (vf - predicted) * beta[..., None]
    state = state + delta[..., None] * kf[:, :, None, :]
    out = (state * qf[:, :, None, :]).sum(-1).to(dtype)  # [R, Hv, dv]
    # `GatedDeltaNet._gated_norm`
    of = out.float()
    normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    gate = z.reshape(rows, num_v_heads, head_v_dim)
    gated = (norm_weight * normed * F.silu(gate.float())).to(dtype)
    # stored in place (inductor writes the rows into the buffer, no copy of them)
    ssm_buffer.index_put_((slots,), state.to(ssm_buffer.dtype))
    return gated.reshape(rows, num_v_heads * head_v_dim), history[:, :, 1:].to(conv_state.dtype)


def gdn_decode(
    mixed: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_buffer: torch.Tensor,
    slots: torch.Tensor,
    taps: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    num_k_heads: int,
    head_k_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Gated DeltaNet decode token per row. ``mixed [R, conv_dim]`` (q | k | v, before
    the conv), ``z [R, Hv * dv]``, ``b, a [R, Hv]``; ``conv_state [R, conv_dim, rows]``
    the rows' conv windows (``rows >= K - 1``: a plan may keep more for speculative
    tokens; the conv reads the last K - 1); row r's ssm state is slot ``slots[r]`` of
    ``ssm_buffer [S, Hv, dv, dk]``, read and updated in place inside the graph (the
    buffer, not a per-step view, is the graph's input, so one graph serves every step
    and layer, and the new state is written once, where it lives: 2 MB per layer at 32
    rows); ``taps [conv_dim, K]``. The slots must be distinct and not 0: padding
    rows read and write slot 0, the pool's null block, whose contents nothing reads.
    (The conv states come in and go out as tensors: they are small, and aot_autograd
    refuses to mutate two inputs that are views of one pool; measured, one row of conv
    then ssm per slot as the one mutated input was 7-10% slower at 32 rows.) Returns
    the gated, normed core ``[R, Hv * dv]`` (input of ``out_proj``) and the rows' new
    conv windows (shifted by the new token)."""
    rows = mixed.shape[0]
    padded = bucket(rows)
    if padded is None:
        raise EngineError(
            f"gdn_decode: {rows} decode rows, more than the last bucket {ROW_BUCKETS[-1]}: "
            "check `applies` first"
        )
    if padded != rows:
        slots = torch.cat([slots, slots.new_full((padded - rows,), NULL_SLOT)])
        mixed, z, b, a, conv_state = (_pad_rows(t, padded) for t in (mixed, z, b, a, conv_state))
    else:  # column slices of one projection (bf16 Qwen3-Next): one graph per bucket, not
        # one per input layout (strides are part of a static graph's key)
        mixed, z, b, a = (t.contiguous() for t in (mixed, z, b, a))
    tensors = (mixed, z, b, a, a_log, dt_bias, conv_state, ssm_buffer, slots, taps, norm_weight)
    consts = (eps, num_k_heads, head_k_dim)
    normed, conv_new = _static_graph(_gdn_decode, tensors, consts)(*tensors)
    return normed[:rows], conv_new[:rows]
