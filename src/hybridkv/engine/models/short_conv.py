"""LFM2's gated short convolution (a state layer with a conv window and no ssm matrix).

    in_proj(x) -> [B | C | x]              (each ``hidden`` wide)
    y = C * causal_conv(B * x)              (depthwise, kernel ``L_cache``, no activation)
    out = out_proj(y)

The state is the last ``L_cache - 1`` conv inputs (``B * x``) per channel; the layer's
``ssm`` part is empty (shape ``()``) and never read or written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridkv.engine.models.common import STATE, LayerDesc
from hybridkv.engine.models.loader import Checkpoint
from hybridkv.engine.ops.context import ForwardBatch, LayerCache, StateCache
from hybridkv.engine.ops.state_batched import (
    causal_conv_grid,
    gather_state,
    state_parts,
    write_conv,
)
from hybridkv.engine.ops.state_ops import causal_conv1d_history, read_state, request_slots
from hybridkv.errors import EngineError


@dataclass
class ShortConv:
    hidden_size: int
    kernel: int
    in_proj: torch.Tensor  # [3 * hidden, hidden]
    in_bias: torch.Tensor | None
    conv_weight: torch.Tensor  # [hidden, kernel]
    conv_bias: torch.Tensor | None
    out_proj: torch.Tensor  # [hidden, hidden]
    out_bias: torch.Tensor | None

    @classmethod
    def load(cls, ckpt: Checkpoint, prefix: str, hidden: int, kernel: int, bias: bool) -> ShortConv:
        def maybe(name: str, size: int) -> torch.Tensor | None:
            return ckpt.take(f"{prefix}.{name}.bias", (size,)) if bias else None

        return cls(
            hidden_size=hidden,
            kernel=kernel,
            in_proj=ckpt.take(f"{prefix}.in_proj.weight", (3 * hidden, hidden)),
            in_bias=maybe("in_proj", 3 * hidden),
            conv_weight=ckpt.take(f"{prefix}.conv.weight", (hidden, 1, kernel))[:, 0],
            conv_bias=maybe("conv", hidden),
            out_proj=ckpt.take(f"{prefix}.out_proj.weight", (hidden, hidden)),
            out_bias=maybe("out_proj", hidden),
        )

    def desc(self, index: int) -> LayerDesc:
        return LayerDesc(
            index=index,
            kind=STATE,
            family="short_conv",
            shapes={"conv": (self.hidden_size, self.kernel - 1), "ssm": ()},
        )

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache) -> torch.Tensor:
        return self.forward(x, batch, cache, batched=True)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache, *, batched: bool
    ) -> torch.Tensor:
        """``batched`` False runs the per-request reference loop (the oracle in tests)."""
        if not isinstance(cache, StateCache):
            raise EngineError(f"short conv layer got a {type(cache).__name__}, not StateCache")
        b, c, h = F.linear(x, self.in_proj, self.in_bias).chunk(3, dim=-1)
        bx = b * h
        y = torch.empty_like(bx)
        if batched:
            for part in state_parts(batch, cache.group):
                conv_out, history = causal_conv_grid(
                    part.layout.pad(bx),
                    gather_state(cache.conv, part),
                    self.conv_weight,
                    self.conv_bias,
                )
                part.layout.unpad_into(y, conv_out)
                write_conv(cache.conv, part, history)
            return F.linear(c * y, self.out_proj, self.out_bias)
        rows = cache.conv.shape[-1]
        for req in request_slots(batch, cache):
            conv_out, history = causal_conv1d_history(
                bx[req.start : req.end],
                read_state(cache.conv, req.read_slot),
                self.conv_weight,
                self.conv_bias,
            )
            y[req.start : req.end] = c[req.start : req.end] * conv_out
            # Conv-only state: after the whole request, so an in-place point is safe.
            for k, slot in req.points:
                cache.conv[slot] = history[:, k : k + rows].to(cache.conv.dtype)
        return F.linear(y, self.out_proj, self.out_bias)
