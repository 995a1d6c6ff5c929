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

# Beyond these a float32 logit divided or multiplied by the penalty overflows or
# underflows (vLLM only asks for > 0; useful values are about 1 to 2).
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """``max_new_tokens`` at most; generation also stops after emitting an EOS id of the
    checkpoint (as transformers' ``generate``; ``ignore_eos=True`` turns that off) or any
    of ``stop_token_ids`` (always). The stop token is part of the output.

    Logits processing (`hybridkv.engine.sampling.logits_process`, vLLM's semantics): penalties
    (``repetition_penalty`` over prompt and output, ``presence_penalty`` /
    ``frequency_penalty`` over the output) and ``min_tokens`` (stop ids masked until
    that many tokens were emitted) apply at any temperature; ``top_k`` (0: off),
    ``top_p`` and ``min_p`` filter the temperature-scaled distribution when sampling.
    Defaults are "off": the plain greedy / temperature path is unchanged.

    ``logprobs=k``: each output token's log-probability and the ``k`` most likely
    tokens' (0: only the chosen one's); ``prompt_logprobs=k`` the same for every prompt
    token after the first. Both are of the model's raw distribution (log-softmax of the
    logits before any processing), as vLLM's default. A request with
    ``prompt_logprobs`` is admitted without a prefix-cache hit (every prompt position
    must be computed), as vLLM does; its blocks are still cached for others.
    """

    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise EngineError(f"max_new_tokens={self.max_new_tokens}: needs >= 1")
        if not self.temperature >= 0:
            raise EngineError(f"temperature={self.temperature}: needs >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise EngineError(f"top_p={self.top_p}: needs 0 < top_p <= 1 (1 = off)")
        if self.top_k < 0:
            raise EngineError(f"top_k={self.top_k}: needs >= 0 (0 = off)")
        if not 0.0 <= self.min_p <= 1.0:
            raise EngineError(f"min_p={self.min_p}: needs 0 <= min_p <= 1 (0 = off)")
        if self.min_tokens < 0 or self.min_tokens > self.max_new_tokens:
            raise EngineError(
                f"min_tokens={self.min_tokens}: needs 0 <= min_tokens <= max_new_tokens "
                f"({self.max_new_tokens})"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise EngineError(f"{name}={value}: needs -2 <= {name} <= 2 (0 = off)")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise EngineError(
                f"repetition_penalty={self.repetition_penalty}: needs "
                f"{MIN_REPETITION_PENALTY} <= value <= {MAX_REPETITION_PENALTY} (1 = off)"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise EngineError(f"{name}={value}: needs >= 0 (or None: off)")

    @property
    def penalized(self) -> bool:
        """Processing that can change the greedy choice too (penalties, min_tokens)."""
        return (
            self.min_tokens > 0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def filtered(self) -> bool:
        """Filters of the sampled distribution (no effect on greedy: the top token stays)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


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
