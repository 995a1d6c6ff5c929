"""What the mixture-of-experts MLPs share once a router has chosen: the dispatch loop,
the fused gate/up expert and the stacked expert weights.

Routing itself (softmax before or after top-k, in which dtype, renormalised or not)
differs per architecture and stays in its module: it decides the bits of the result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridkv.engine.models.loader import Checkpoint
from hybridkv.engine.ops.packed_linear import linear

Act = Callable[[torch.Tensor], torch.Tensor]

# `DenseMoE` runs instead of the dispatch loop for steps of at most this many tokens, on
# models with at most `DENSE_MAX_EXPERTS` routed experts. Measured on the benchmark
# model (4 experts, top 2, width 256, hidden 512, bf16, 8 layers, 1 thread, median of
# 15): 1 token 1.65 ms against 2.5 ms for the loop, 8 tokens 2.4 / 4.4, 32 tokens 4.3 /
# 6.8, 128 tokens 11.9 / 12.3, 256 tokens 22 / 22, 1024 tokens 90 / 64: short steps are
# bound by per-op overhead and by reading the weights (which the loop reads too once
# every expert is hit); long ones by arithmetic, where computing every expert for
# every token costs (E + 1) / (k + 1) times the loop's products.
DENSE_MAX_TOKENS = 128
DENSE_MAX_EXPERTS = 8
# Model dtypes `DenseMoE` may run in (float32 and float64 keep the loop; `DenseMoE` doc).
REDUCED_DTYPES = (torch.bfloat16, torch.float16)
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


def dense_pays(num_tokens: int, num_experts: int) -> bool:
    """Whether `DenseMoE` should replace the dispatch loop for a step (constants above)."""
    return num_experts <= DENSE_MAX_EXPERTS and num_tokens <= DENSE_MAX_TOKENS


@dataclass(frozen=True)
class DenseMoE:
    """Routed experts plus a gated shared expert as two products for all tokens: every
    expert's gate and up in one ``[(E + 1) * 2I, hidden]`` weight, the activations
    scaled by each token's routing weight (0 for experts it did not choose, the sigmoid
    gate for the shared expert), then one ``[hidden, (E + 1) * I]`` down product that
    sums the experts inside the matmul. About 12 ops per layer against ~10 per expert
    plus routing for the dispatch loop (`dispatch_experts`), for (E + 1) / (k + 1) times
    its arithmetic.

    Only for reduced-precision models (bf16 / fp16): the sum over experts happens in the
    product's float32 accumulator and rounds once, where the loop rounds each expert's
    output, its weighting and each addition to the model dtype; float32 keeps the loop,
    whose order matches transformers (the exactness contract). Its weights are a second
    copy of the experts', built on first use."""

    route: torch.Tensor  # [E (+ 1), hidden]: the router's rows, then the shared gate's
    gate_up: torch.Tensor  # [(E (+ 1)) * 2 * inter, hidden]: per expert its gate, its up
    down: torch.Tensor  # [hidden, (E (+ 1)) * inter]
    num_experts: int
    inter: int
    top_k: int
    norm_topk_prob: bool
    act: Act
    has_shared: bool

    @classmethod
    def build(
        cls,
        router: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        *,
        top_k: int,
        norm_topk_prob: bool,
        act: Act,
        shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        shared_gate: torch.Tensor | None,
    ) -> DenseMoE | None:
        """``gate_up [E, 2I, hidden]`` (gate rows first), ``down [E, hidden, I]``;
        ``shared``: the shared expert's (gate, up, down) with its ``shared_gate [1,
        hidden]``. None when the shared expert has no gate or another width than the
        experts' ``I`` (the caller keeps the loop)."""
        num_experts, two_inter, _ = gate_up.shape
        inter = two_inter // 2
        blocks, downs, route = list(gate_up.unbind(0)), list(down.unbind(0)), [router]
        if shared is not None:
            gate, up, shared_down = shared
            if shared_gate is None or gate.shape[0] != inter:
                return None
            blocks.append(torch.cat([gate, up]))
            downs.append(shared_down)
            route.append(shared_gate)
        return cls(
            route=torch.cat(route).contiguous(),
            gate_up=torch.cat(blocks).contiguous(),
            down=torch.cat(downs, dim=1).contiguous(),
            num_experts=num_experts,
            inter=inter,
            top_k=top_k,
            norm_topk_prob=norm_topk_prob,
            act=act,
            has_shared=shared is not None,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens, experts = x.shape[0], self.num_experts
        logits = linear(x, self.route)
        probs = torch.softmax(logits[:, :experts], dim=-1, dtype=torch.float)
        top, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        weights = x.new_zeros(num_tokens, experts + self.has_shared)
        weights.scatter_(1, chosen, top.to(x.dtype))
        if self.has_shared:
            weights[:, experts:] = torch.sigmoid(logits[:, experts:])
        hidden = linear(x, self.gate_up).view(num_tokens, -1, 2, self.inter)
        gate, up = hidden[:, :, 0], hidden[:, :, 1]
        mixed = self.act(gate).mul_(up)  # a fresh buffer: the gate is a strided view
        mixed.mul_(weights[:, :, None])
        return linear(mixed.reshape(num_tokens, -1), self.down)
