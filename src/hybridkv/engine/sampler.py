"""Token sampling: greedy (temperature 0) or temperature sampling with a per-request seed.

Each request owns its random generator, seeded from ``(seed, request index)``, so its
tokens do not depend on which other requests share its steps, on chunking or on
preemption (a recomputed request does not draw: only the final position samples).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridkv.errors import EngineError


@dataclass(frozen=True)
class SamplingParams:
    """``max_new_tokens`` at most; generation also stops after emitting an EOS id of the
    checkpoint (as transformers' ``generate``; ``ignore_eos=True`` turns that off) or any
    of ``stop_token_ids`` (always). The stop token is part of the output."""

    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise EngineError(f"max_new_tokens={self.max_new_tokens}: needs >= 1")
        if self.temperature < 0:
            raise EngineError(f"temperature={self.temperature}: needs >= 0")


def make_generator(seed: int, index: int) -> torch.Generator:
    """The random stream of request ``index`` of a ``generate`` call with ``seed``."""
    gen = torch.Generator()
    gen.manual_seed((seed * 1_000_003 + index) % (1 << 63))
    return gen


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """One token from ``logits [vocab]``: argmax at temperature 0, else softmax(l / T)
    drawn on the host (the generator is a CPU one, so a seed gives the same stream on
    every device)."""
    if temperature == 0.0:
        return int(torch.argmax(logits))
    if generator is None:
        raise EngineError(f"temperature {temperature} needs a random generator")
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def greedy_ids(logits: Sequence[torch.Tensor]) -> list[list[int]]:
    """Argmax ids of every row of every request's ``[rows, vocab]`` logits: one argmax
    over the step and one transfer to the host, instead of one per request."""
    if not logits:
        return []
    best = torch.cat(list(logits)).argmax(dim=-1).tolist()
    out, start = [], 0
    for rows in logits:
        out.append(best[start : start + rows.shape[0]])
        start += rows.shape[0]
    return out
