"""Continuous batching over a `CacheManager`: which requests run this step, how many
tokens each, who is preempted. Pure Python (no torch).

One step under a token budget of 8 with chunk size 4 (oldest running first, then
waiting requests while ``max_num_seqs`` and the budget allow)::

    running   A decode (1)   B prefill 10 left -> chunk 4      budget 8 -> 3
    waiting   C (prompt 9, prefix hit 4) -> min(5, chunk 4, budget 3) = 3 tokens

A running request whose `allocate` fails preempts the newest running request (maybe
itself) and retries; a preempted request goes back to the front of the waiting queue,
keeps its verified tokens, and later recomputes them from its prefix hit (a clean or a
restored state, never its old slot). A waiting request that does not fit stops
admission for this step. With speculative decoding, a running request at a decode step
(one verified token left to compute) also reserves ``lookahead(req, budget)`` draft
positions (allocate(req, 1, L)); the drafts count against the token budget. Prefix hits
come from `CacheManager.lookup` in tokens; computing resumes at the hit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from hybridkv.cache import CacheManager
from hybridkv.engine.sampler import SamplingParams
from hybridkv.errors import EngineError


class Status(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"


@dataclass
class Request:
    req_id: str
    index: int  # position in its generate call (seeds its sampler)
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    prefix_hit_tokens: int = 0  # summed over admissions (a resumed request looks up again)
    num_preemptions: int = 0
    num_steps: int = 0
    stop_token_ids: frozenset[int] = frozenset()  # emitting one of these finishes it
    finish_reason: str | None = None  # "stop" (a stop id emitted) | "length"
    cache_salt: str | None = None  # hashed into its prefix: only equal salts share blocks

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def num_to_emit(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids`` (the next tokens) the request emits: up to
        ``max_new_tokens`` in all, and through the first stop id (tokens after it are
        dropped, as generation ends there)."""
        n = min(len(token_ids), self.params.max_new_tokens - len(self.output))
        for i, token in enumerate(token_ids[:n]):
            if token in self.stop_token_ids:
                return i + 1
        return n

    def emit(self, token_ids: Sequence[int]) -> None:
        """Append the next output tokens (already cut by `num_to_emit`) and note why
        the request finished, if it did."""
        if self.done or len(token_ids) != self.num_to_emit(token_ids):
            raise EngineError(
                f"request {self.req_id!r}: cannot emit {len(token_ids)} tokens after "
                f"{len(self.output)} of {self.params.max_new_tokens} (finish reason "
                f"{self.finish_reason})"
            )
        self.output.extend(token_ids)
        if token_ids and token_ids[-1] in self.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.output) >= self.params.max_new_tokens:
            self.finish_reason = "length"


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_new_tokens`` tokens of ``request`` from position ``num_computed``, and
    ``num_lookahead`` draft positions reserved after them (decode steps only)."""

    request: Request
    num_computed: int
    num_new_tokens: int
    prefix_hit: int | None  # set when the request was (re)admitted this step
    num_lookahead: int = 0

    @property
    def samples(self) -> bool:
        """Whether the chunk reaches the end of the known tokens (its logits are used)."""
        return self.num_computed + self.num_new_tokens == self.request.num_tokens


class Scheduler:
    def __init__(
        self,
        manager: CacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunk_size: int | None = None,
        lookahead: Callable[[Request, int], int] | None = None,
    ) -> None:
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("chunk_size", 1 if chunk_size is None else chunk_size),
        ):
            if value < 1:
                raise EngineError(f"{name}={value}: needs >= 1")
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size
        self.lookahead = lookahead  # (request, token budget left) -> drafts to reserve
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the newest
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests
    def add(self, request: Request) -> None:
        self.manager.add_request(request.req_id, request.prompt, cache_salt=request.cache_salt)
        self.waiting.append(request)

    def cancel(self, request: Request) -> None:
        """Drop a waiting or running request and release its blocks."""
        if request.status in (Status.FINISHED, Status.CANCELLED):
            return
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.manager.free(request.req_id)
        request.status = Status.CANCELLED

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self.manager.free(request.req_id)
        request.status = Status.FINISHED

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new(req, req.num_computed, budget)
            la = 0
            if self.lookahead is not None and req.num_computed + n == req.num_tokens and n == 1:
                la = max(0, self.lookahead(req, budget - n))
            while self.manager.allocate(req.req_id, n, la) is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                out.append(ScheduledChunk(req, req.num_computed, n, None, la))
                budget -= n + la
                i += 1
        # vLLM's rule too: no admissions in a step that had to preempt.
        while (
            self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs
        ):
            req = self.waiting[0]
            hit = self.manager.lookup(req.req_id)
            n = self._num_new(req, hit, budget)
            blocks = self.manager.allocate(req.req_id, n)
            while blocks is None and not self.running and not out and n > 1:
                # Alone in the cache: a smaller first chunk needs fewer live blocks
                # (a sliding window's blocks are freed as the chunks move on).
                n //= 2
                blocks = self.manager.allocate(req.req_id, n)
            if blocks is None:
                if not self.running and not out:
                    raise EngineError(
                        f"request {req.req_id!r} ({req.num_tokens} tokens, {n} this step) does "
                        "not fit in an empty cache; raise the memory budget or lower "
                        "max_num_batched_tokens / chunk_size"
                    )
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.num_computed = hit
            req.prefix_hit_tokens += hit
            self.running.append(req)
            out.append(ScheduledChunk(req, hit, n, hit))
            budget -= n
        if not out and self.has_work:
            raise EngineError(
                f"no request could be scheduled ({len(self.running)} running, "
                f"{len(self.waiting)} waiting); the cache is too small for one request"
            )
        return out

    def _num_new(self, req: Request, num_computed: int, budget: int) -> int:
        n = min(req.num_tokens - num_computed, budget)
        if self.chunk_size is not None:
            n = min(n, self.chunk_size)
        return n

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.manager.preempt(req.req_id)
        req.status = Status.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
