"""Opt-in ``torch.compile`` of the elementwise chains of reduced-precision prefill steps:
the rms norms, the Gated DeltaNet output norm with its gate, its causal conv with the silu
after it, the l2 norm of q and k with their repeat to value heads, and the chunked delta
rule's per-chunk algebra (`delta_rule.delta_rule_chunked` with ``fused=True``: the system, the
outputs and the state update around the triangular solve, which stays eager on one
thread).

A bf16 norm in eager torch is seven passes over ``[T, hidden]`` (the float32 copy, the
square, the mean, the reciprocal root, two products, the cast back), each writing a
float32 temporary; the Gated DeltaNet output norm with its gate is about twelve. At
prefill sizes (4096 tokens x 512) those passes cost more than the layer's products.
Inductor fuses each chain into one loop. Measured (one thread, bf16, ``[4096, 512]``
rms norm): 0.58 ms compiled against 2.7-4.7 ms eager; at 1-32 rows the compiled call
is slower (about 40 us of guard and wrapper per call against 15-30 us eager), so only
steps of at least `MIN_TOKENS` tokens take it.

Off by default, process-wide: ``LLM(..., torch_compile=True)`` (or `enable`) turns it on.
Then the first reduced-precision step of at least `MIN_TOKENS` tokens compiles each
function once (dynamic token count; seconds to a minute on 2 cores, cached on disk by
inductor for later processes): run one such request before timing. float32 never takes
these paths (its sums are held bit-exact against transformers), nor do CUDA tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

MIN_TOKENS = 64
# The Gated DeltaNet decode update (`delta_step`) is compiled from this many rows on: at
# 8-32 rows its ~7 passes over ``[R, H, dv, dk]`` float32 states cost more than the call.
MIN_DECODE_ROWS = 8
REDUCED_DTYPES = (torch.bfloat16, torch.float16)

_enabled = False
_compiled: dict[str, Callable[..., Any]] = {}


def enable(on: bool = True) -> None:
    """Turn the compiled paths on (or off) for this process."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def applies(x: torch.Tensor) -> bool:
    """Whether ``x [T, ...]`` takes a compiled path: switched on, reduced precision, on
    the CPU, at least `MIN_TOKENS` rows."""
    return (
        _enabled
        and x.dtype in REDUCED_DTYPES
        and x.device.type == "cpu"
        and x.dim() >= 2
        and x.shape[0] >= MIN_TOKENS
    )


def get(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn)`` (dynamic shapes, one graph), compiled once per process."""
    compiled = _compiled.get(name)
    if compiled is None:
        compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        _compiled[name] = compiled
    return compiled


def _rms_norm_scaled(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * scale).to(x.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _gated_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(gate.float())).to(x.dtype)


def rms_norm_scaled(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """`common._rms_norm_scaled` (zero-centred norm, ``scale = 1 + weight``), compiled."""
    return get("rms_norm_scaled", _rms_norm_scaled)(x, scale, eps)  # type: ignore[no-any-return]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`common.rms_norm` (Llama-style), compiled."""
    return get("rms_norm", _rms_norm)(x, weight, eps)  # type: ignore[no-any-return]


def gated_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """The Gated DeltaNet output norm (per head, plain weight) times ``silu(gate)``."""
    return get("gated_norm", _gated_norm)(x, gate, weight, eps)  # type: ignore[no-any-return]


def _l2norm_heads_major(x: torch.Tensor, ratio: int, scale: float) -> torch.Tensor:
    rows, length, heads, dim = x.shape
    xf = x.float()
    normed = xf * torch.rsqrt((xf * xf).sum(dim=-1, keepdim=True) + 1e-6) * scale
    repeated = normed.permute(0, 2, 1, 3)[:, :, None].expand(rows, heads, ratio, length, dim)
    return repeated.reshape(rows, heads * ratio, length, dim)


def l2norm_heads_major(x: torch.Tensor, ratio: int, scale: float) -> torch.Tensor:
    """`delta_rule.prepare_grouped`'s q / k for the chunked rule in one pass: float32,
    l2-normalised per head vector (``eps`` 1e-6, as `state_ops.l2norm`), times
    ``scale``, each head repeated ``ratio`` times, stored ``[R, H * ratio, L, d]``."""
    return get("l2norm_heads_major", _l2norm_heads_major)(x, ratio, scale)  # type: ignore[no-any-return]


def _conv_silu(history: torch.Tensor, taps: torch.Tensor, first: int, length: int) -> torch.Tensor:
    # taps [K, C]: each tap a contiguous row of channels (see `conv_silu`)
    out = history[:, first : first + length] * taps[0]
    for j in range(1, taps.shape[0]):
        out = out + history[:, first + j : first + j + length] * taps[j]
    return F.silu(out)


def conv_silu(history: torch.Tensor, taps: torch.Tensor, first: int, length: int) -> torch.Tensor:
    """`state_batched.causal_conv_grid`'s taps ``[C, K]`` over the channels-last ``history
    [R, rows + L, C]`` and the silu after them, in one pass.

    The graph takes the taps transposed, ``[K, C]`` contiguous (a copy of ``C x K``
    values per call, microseconds) so that each tap's loads are contiguous along the
    channels, not strided by K. The values are the same (the same products and sums in
    the same order); measured (one thread, bf16, ``[16, 259,
    1024]``, kernel 4): 11.7 -> 3.9 ms."""
    fn = get("conv_silu", _conv_silu)
    return fn(history, taps.t().contiguous(), first, length)  # type: ignore[no-any-return]


def decode_applies(state: torch.Tensor) -> bool:
    """Whether a decode run over ``state [R, H, dv, dk]`` (the stored bf16 / fp16 slots)
    takes `delta_step`: switched on, reduced precision, CPU, `MIN_DECODE_ROWS` rows."""
    return (
        _enabled
        and state.dtype in REDUCED_DTYPES
        and state.device.type == "cpu"
        and state.shape[0] >= MIN_DECODE_ROWS
    )


def _delta_step(
    decayed: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    s = decayed.transpose(-1, -2)  # [R, H, dk, dv]
    k_col, q_col = k[:, 0, :, :, None], q[:, 0, :, :, None]
    predicted = (s * k_col).sum(dim=-2)
    delta = (v[:, 0] - predicted) * beta[:, 0, :, None]
    new = s + k_col * delta[:, :, None, :]
    return (new * q_col).sum(dim=-2)[:, None], new.transpose(-1, -2)


def delta_step(
    decayed: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`delta_rule.delta_rule_decode_` after its decay (``decayed [R, H, dv, dk]``
    float32, `delta_rule.decay_into`), compiled: returns ``o [R, 1, H, dv]`` and the
    new state ``[R, H, dv, dk]`` (not in place: the caller casts it into the slots)."""
    return get("delta_step", _delta_step)(decayed, q, k, v, beta)  # type: ignore[no-any-return]
