"""Log-probabilities of output and prompt tokens, recorded as the engine steps.

    prompt   p0   p1   p2   p3        rows computed at positions 0..P-1; the row at
    row      r0   r1   r2  (r3)       position i scores token i + 1, so p0 has none and
    logprob  --   r0   r1   r2        r3 (the last prompt position) scores output o0

Values are log-softmax of the raw logits (before penalties, temperature and filters:
vLLM's default "raw_logprobs"), in float32. ``top`` holds the ``k`` most likely tokens,
best first; the scored token's own entry is separate (it may or may not be among them).

A recomputed request (preempted) computes its prompt positions again: records are kept
by position, so the second pass overwrites with the same values. Output tokens are
recorded once, when emitted (`LogprobRecorder.commit`: tokens a step accepted after a
stop id are dropped with them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hybridkv.errors import InvariantError


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int  # 1 + the number of tokens strictly more likely (vLLM's rank)
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the k most likely


def token_logprobs(rows: torch.Tensor, token_ids: Sequence[int], k: int) -> list[TokenLogprob]:
    """One `TokenLogprob` per row of ``rows [R, vocab]`` scoring ``token_ids[r]``."""
    if rows.shape[0] != len(token_ids):
        raise InvariantError(f"{rows.shape[0]} logit rows for {len(token_ids)} tokens")
    if not token_ids:
        return []
    lp = torch.log_softmax(rows.float(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids[:, None])
    ranks = (lp > chosen).sum(dim=-1) + 1
    k = min(k, lp.shape[-1])
    top_values, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], ids[:, None][:, :0])
    chosen_l, ranks_l = chosen[:, 0].tolist(), ranks.tolist()
    top_v, top_i = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprob(
            int(t), float(chosen_l[r]), int(ranks_l[r]), tuple(zip(top_i[r], top_v[r], strict=True))
        )
        for r, t in enumerate(token_ids)
    ]


@dataclass
class _Record:
    num_logprobs: int | None  # output: top-k per token (None: not wanted)
    num_prompt_logprobs: int | None  # prompt: top-k per token (None: not wanted)
    prompt: dict[int, TokenLogprob] = field(default_factory=dict)  # by prompt position
    output: list[TokenLogprob] = field(default_factory=list)
    staged: list[TokenLogprob] = field(default_factory=list)  # this step's verdict tokens


class LogprobRecorder:
    """Per-request records of the requests that asked for logprobs (executor data of
    `Stepper`, kept past the request's end until `pop`)."""

    def __init__(self) -> None:
        self._records: dict[str, _Record] = {}

    def add(self, req_id: str, num_logprobs: int | None, num_prompt_logprobs: int | None) -> None:
        if num_logprobs is not None or num_prompt_logprobs is not None:
            self._records[req_id] = _Record(num_logprobs, num_prompt_logprobs)

    def wants_output(self, req_id: str) -> bool:
        record = self._records.get(req_id)
        return record is not None and record.num_logprobs is not None

    def wants_prompt_rows(self, req_id: str, num_computed: int, num_prompt_tokens: int) -> bool:
        """Whether a chunk starting at ``num_computed`` scores a prompt token."""
        record = self._records.get(req_id)
        return (
            record is not None
            and record.num_prompt_logprobs is not None
            and num_computed < num_prompt_tokens - 1
        )

    def record_prompt(
        self, req_id: str, prompt: Sequence[int], start: int, rows: torch.Tensor
    ) -> None:
        """``rows`` at positions ``start..``: keep those that score a prompt token."""
        record = self._records[req_id]
        k = record.num_prompt_logprobs or 0
        n = min(rows.shape[0], len(prompt) - 1 - start)
        if n <= 0:
            return
        scored = token_logprobs(rows[:n], prompt[start + 1 : start + 1 + n], k)
        for i, item in enumerate(scored):
            record.prompt[start + 1 + i] = item

    def stage(self, req_id: str, rows: torch.Tensor, token_ids: Sequence[int]) -> None:
        """This step's verdict tokens and their rows (emitted ones kept by `commit`)."""
        record = self._records[req_id]
        record.staged = token_logprobs(rows, token_ids, record.num_logprobs or 0)

    def commit(self, req_id: str, num_emitted: int) -> None:
        record = self._records.get(req_id)
        if record is None or not record.staged:
            return
        if num_emitted > len(record.staged):
            raise InvariantError(
                f"request {req_id!r}: {num_emitted} tokens emitted, {len(record.staged)} scored"
            )
        record.output.extend(record.staged[:num_emitted])
        record.staged = []

    def get(
        self, req_id: str, num_prompt_tokens: int
    ) -> tuple[list[TokenLogprob] | None, list[TokenLogprob | None] | None]:
        """(output logprobs, prompt logprobs: None for position 0) of ``req_id``."""
        record = self._records.get(req_id)
        if record is None:
            return None, None
        output = None if record.num_logprobs is None else list(record.output)
        prompt = None
        if record.num_prompt_logprobs is not None:
            prompt = [record.prompt.get(i) for i in range(num_prompt_tokens)]
        return output, prompt

    def pop(self, req_id: str) -> None:
        self._records.pop(req_id, None)

    def check_invariants(self) -> None:
        for req_id, record in self._records.items():
            if 0 in record.prompt:
                raise InvariantError(f"request {req_id!r}: a logprob for prompt position 0")
