"""Verification of draft tokens against the main model's logits.

One request, K drafts, K + 1 scored positions::

    position:   0        1        ...  K-1        K
    logits:     p(.|ctx) p(.|d0)       p(.|..dK-2) p(.|..dK-1)
    checks:     d0       d1            dK-1        (bonus)

Greedy: accept drafts while ``d_i == argmax p_i``; the token at the first mismatch (or
the bonus position) is ``argmax`` there. Output = accepted drafts + 1 token.

Sampling (temperature > 0): standard speculative sampling (Leviathan et al. 2023,
Chen et al. 2023): accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``; on
rejection sample from ``normalize(max(0, p_i - q_i))``; if all are accepted sample the
bonus from ``p_K``. The emitted tokens are then distributed exactly as sampling from
the main model. Proposers that copy tokens (n-gram, suffix) have a one-hot ``q``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    num_accepted: int  # drafts accepted, 0..K
    token_ids: list[int]  # accepted drafts + the corrected / bonus token


def verify_greedy(logits: torch.Tensor, draft_ids: list[int]) -> Verdict:
    """``logits``: [K + 1, vocab] for one request."""
    return accept_greedy(logits.argmax(dim=-1).tolist(), draft_ids)


def accept_greedy(best: list[int], draft_ids: list[int]) -> Verdict:
    """`verify_greedy` from the argmax ids ``best`` (K + 1) of the scored positions
    (batched sampling computes them for the whole step at once)."""
    accepted = 0
    while accepted < len(draft_ids) and draft_ids[accepted] == best[accepted]:
        accepted += 1
    return Verdict(accepted, [*draft_ids[:accepted], best[accepted]])


def token_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) in float64 (the distribution verification uses)."""
    return torch.softmax(logits.double() / temperature, dim=-1)


def verify_sampling(
    logits: torch.Tensor,
    draft_ids: list[int],
    temperature: float,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> Verdict:
    """Speculative sampling. ``draft_probs``: [K, vocab] proposal distributions, or
    None for deterministic proposers (one-hot proposals)."""
    p = token_probs(logits, temperature)
    for i, token in enumerate(draft_ids):
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        accept_prob = min(1.0, float(p[i, token]) / q_token) if q_token > 0 else 0.0
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < accept_prob:
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[token] = 0.0
        else:
            residual = (p[i] - draft_probs[i].double()).clamp_min(0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[i]
        fixed = int(torch.multinomial(dist, 1, generator=generator))
        return Verdict(i, [*draft_ids[:i], fixed])
    bonus = int(torch.multinomial(p[len(draft_ids)], 1, generator=generator))
    return Verdict(len(draft_ids), [*draft_ids, bonus])


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """One token from [vocab] logits: argmax at temperature 0, else a sample."""
    if temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(token_probs(logits, temperature), 1, generator=generator))
