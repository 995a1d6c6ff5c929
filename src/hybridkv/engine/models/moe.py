"""What the mixture-of-experts MLPs share once a router has chosen: the dispatch loop,
the fused gate/up expert and the stacked expert weights.

Routing itself (softmax before or after top-k, in which dtype, renormalised or not)
differs per architecture and stays in its module: it decides the bits of the result.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridkv.engine.loader import Checkpoint
from hybridkv.engine.packed_linear import linear

Act = Callable[[torch.Tensor], torch.Tensor]
Expert = Callable[[int, torch.Tensor], torch.Tensor]  # (expert id, its tokens) -> output


def dispatch_experts(
    x: torch.Tensor, top_ids: torch.Tensor, weights: torch.Tensor, expert: Expert
) -> torch.Tensor:
    """``sum_k weights[t, k] * expert(top_ids[t, k], x[t])`` for every token ``t``.

    Experts run in id order and add into zeros, as transformers does, so the sums
    round the same way; ``weights`` are in the dtype the architecture multiplies in.
    """
    out = torch.zeros_like(x)
    for expert_id in torch.unique(top_ids).tolist():
        tokens, slot = torch.where(top_ids == expert_id)
        y = expert(expert_id, x[tokens]) * weights[tokens, slot, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def fused_glu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Act) -> torch.Tensor:
    """``down(act(gate) * up)`` with ``[gate | up] = gate_up(x)`` (gate rows first).

    One matmul for gate and up, as the fused checkpoints run it: splitting the weight
    into two matmuls may round differently."""
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(act(gate) * up, down)


def load_stacked_experts(
    ckpt: Checkpoint, prefix: str, num_experts: int, hidden: int, inter: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weights stacked ``[E, 2*inter, hidden]`` / ``[E, hidden, inter]``.

    Checkpoints store them either fused (``experts.gate_up_proj``) or one module per
    expert (``experts.{e}.gate_proj.weight`` ...); both load to the fused layout.
    """
    if ckpt.has(f"{prefix}.gate_up_proj"):
        return (
            ckpt.take(f"{prefix}.gate_up_proj", (num_experts, 2 * inter, hidden)),
            ckpt.take(f"{prefix}.down_proj", (num_experts, hidden, inter)),
        )
    gate_up, down = [], []
    for e in range(num_experts):
        gate = ckpt.take(f"{prefix}.{e}.gate_proj.weight", (inter, hidden))
        up = ckpt.take(f"{prefix}.{e}.up_proj.weight", (inter, hidden))
        gate_up.append(torch.cat([gate, up], dim=0))
        down.append(ckpt.take(f"{prefix}.{e}.down_proj.weight", (hidden, inter)))
    return torch.stack(gate_up), torch.stack(down)
