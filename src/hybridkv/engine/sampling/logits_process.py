"""Logits processing of one request's scored rows before verification / sampling:
penalties, ``min_tokens`` and the sampling filters of `SamplingParams`.

Row ``j`` of a step's ``[1 + L, vocab]`` rows scores the token after draft ``j - 1``,
so its history is the output so far plus the first ``j`` drafts::

    output  o0 o1 o2 | drafts d0 d1      row 0: history o0..o2, row 2: o0..o2 d0 d1

In order (vLLM's semantics, see its ``SamplingParams`` docs):
1. ``repetition_penalty`` r on every token seen in prompt or history: a positive logit
   is divided by r, a negative one multiplied (the CTRL / transformers rule).
2. ``frequency_penalty`` f and ``presence_penalty`` p over the history (output only):
   ``logit -= f * count + p * (count > 0)`` (OpenAI's formula).
3. ``min_tokens``: while fewer than that many tokens were emitted, the request's stop
   ids (EOS unless ignored, ``stop_token_ids``) get -inf.
4. Sampling only (temperature T > 0), on softmax(logit / T): ``min_p`` drops tokens
   below ``min_p`` times the top probability, then ``top_k`` keeps the k most likely,
   then ``top_p`` keeps the smallest most-likely set whose mass reaches ``top_p``
   (renormalized after the previous filters). Dropped tokens get -inf.

The rows come back unscaled (the sampler divides by T itself), so softmax of a
processed row / T is the filtered distribution. Greedy rows skip step 4: the top token
always survives the filters.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from hybridkv.engine.sampling.sampler import SamplingParams


def process_rows(
    rows: torch.Tensor,
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    draft_ids: Sequence[int],
    stop_token_ids: Collection[int],
) -> torch.Tensor:
    """``rows [1 + L, vocab]`` processed as the module doc says (a new float32 tensor)."""
    out = rows.float().clone()
    vocab = out.shape[-1]
    device = out.device
    for j in range(out.shape[0]):
        history = [*output, *draft_ids[:j]]
        row = out[j]
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            seen[torch.tensor([*prompt, *history], dtype=torch.long, device=device)] = True
            r = params.repetition_penalty
            row = torch.where(seen, torch.where(row > 0, row / r, row * r), row)
        if history and (params.frequency_penalty or params.presence_penalty):
            ids = torch.tensor(history, dtype=torch.long, device=device)
            counts = torch.bincount(ids, minlength=vocab)[:vocab].float()
            row = row - params.frequency_penalty * counts
            row = row - params.presence_penalty * (counts > 0).float()
        if len(history) < params.min_tokens and stop_token_ids:
            row = row.clone()
            row[torch.tensor(sorted(stop_token_ids), dtype=torch.long, device=device)] = -torch.inf
        if params.filtered:
            row = _filter(row, params)
        out[j] = row
    return out.nan_to_num(nan=-torch.inf, neginf=-torch.inf)  # never a NaN into a softmax


def _filter(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Step 4 of the module doc on one row."""
    probs = torch.softmax(row / params.temperature, dim=-1)
    keep = probs > 0
    if params.min_p > 0.0:
        keep &= probs >= params.min_p * probs.max()
    if 0 < params.top_k < int(keep.sum()):
        kth = torch.topk(torch.where(keep, probs, -1.0), params.top_k).values[-1]
        keep &= probs >= kth
    if params.top_p < 1.0:
        kept = torch.where(keep, probs, 0.0)
        kept = kept / kept.sum()
        sorted_probs, order = torch.sort(kept, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass ahead of each
        in_nucleus = torch.zeros_like(keep)
        in_nucleus[order] = before < params.top_p
        in_nucleus[order[0]] = True  # the top token always (top_p may round to 0 in float32)
        keep &= in_nucleus
    return torch.where(keep, row, torch.tensor(-torch.inf, device=row.device))
