"""`Request`: the one record of a request's progress. The scheduler writes it; the
engine, the simulator and the server read it and never keep a copy of its counts.

Positions of one request (P prompt tokens, k output tokens emitted)::

    tokens     |p0 ........ p_{P-1}|o0 .. o_{k-1}|     num_tokens = P + k (verified)
    computed   |<----- num_computed ----->|            KV / state exist for these
    decoding   num_computed = num_tokens - 1           (the last sampled token runs next)

Limits: at most ``max_new_tokens`` outputs and at most ``max_total_tokens`` tokens in all
(the engine's ``max_model_len``); reaching either finishes the request with
``finish_reason = "length"``, emitting a stop id finishes it with ``"stop"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from hybridkv.errors import SchedulerError


class Status(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    REFUSED = "refused"  # never admitted: see `Request.refusal` (HTTP 400 for a server)


FINISH_REASONS = ("stop", "length", "refused")


@dataclass(eq=False)
class Request:
    """A request's identity, limits and progress (see the module doc)."""

    req_id: str
    prompt: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower is served first; ties by arrival
    arrival_s: float = 0.0
    cache_salt: str | None = None
    max_total_tokens: int | None = None  # set by the scheduler from max_model_len
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "refused"
    refusal: str | None = None  # why the scheduler refused it (status REFUSED)
    prefix_hit_tokens: int = 0  # summed over admissions (a resumed request looks up again)
    num_preemptions: int = 0
    num_steps: int = 0
    seq: int = -1  # arrival order, set by the scheduler (ties in the waiting queue)
    admitted: bool = False  # admitted at least once (later admissions are recomputes)
    # False: admitted without a prefix-cache lookup (prompt logprobs need every prompt
    # position computed); its blocks are still cached for other requests.
    use_prefix_cache: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise SchedulerError(
                f"request {self.req_id!r}: max_new_tokens={self.max_new_tokens}; needs >= 1"
            )
        if not self.prompt:
            raise SchedulerError(f"request {self.req_id!r}: empty prompt; needs >= 1 token")

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens_left(self) -> int:
        """Output tokens it may still emit (max_new_tokens and max_total_tokens)."""
        left = self.max_new_tokens - len(self.output)
        if self.max_total_tokens is not None:
            left = min(left, self.max_total_tokens - self.num_tokens)
        return max(0, left)

    @property
    def decode_ready(self) -> bool:
        """Running with one verified token left to compute after emitting output: the
        next step is a decode step (which may carry drafts)."""
        return (
            self.status is Status.RUNNING
            and bool(self.output)
            and self.num_tokens - self.num_computed == 1
        )

    def num_to_emit(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids`` (the next tokens) the request emits: up to its
        limits, and through the first stop id (tokens after it are dropped)."""
        n = min(len(token_ids), self.num_tokens_left)
        for i, token in enumerate(token_ids[:n]):
            if token in self.stop_token_ids:
                return i + 1
        return n

    def emit(self, token_ids: Sequence[int]) -> None:
        """Append the next output tokens (already cut by `num_to_emit`) and note why
        the request finished, if it did."""
        if self.done or len(token_ids) != self.num_to_emit(token_ids):
            raise SchedulerError(
                f"request {self.req_id!r}: cannot emit {len(token_ids)} tokens after "
                f"{len(self.output)} of {self.max_new_tokens} (finish reason "
                f"{self.finish_reason}, {self.num_tokens_left} left)"
            )
        self.output.extend(token_ids)
        if token_ids and token_ids[-1] in self.stop_token_ids:
            self.finish_reason = "stop"
        elif self.num_tokens_left == 0:
            self.finish_reason = "length"
