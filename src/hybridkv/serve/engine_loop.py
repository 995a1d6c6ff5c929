"""The continuous-batching loop: one background thread owns the `LLM`.

torch modules and the `CacheManager` are not thread-safe, so exactly one thread touches
the engine. The HTTP side (asyncio) talks to it through two queues per direction:

    asyncio handlers                         engine thread (`EngineLoop._run`)
    ----------------                         ---------------------------------
    submit(handle)  --+                      idle: block on the inbox (no busy loop)
    abort(handle)   --+--> inbox (thread- -> busy: drain the inbox, then LLM.step()
    call(fn)        --+    safe queue)       after each step, per active request:
                                               decode, cut at stop strings, then
    handle.next_event() <-- asyncio.Queue <--  loop.call_soon_threadsafe(put, Output)
                            per request

Events of one request, in order: `Accepted` (or `Failed`: the engine refused it), then
`Output` after every step that produced tokens for one of its choices (``index``; one
engine request per choice, `prepare.Generation`), the last of each choice with a
``finish_reason`` ("stop": EOS, a stop id or a stop string; "length": max_tokens). A
request aborted by its client (disconnect) is cancelled in the engine at once, all its
choices, which frees their blocks.

``call(fn)`` runs ``fn()`` on the engine thread between steps and returns a
`concurrent.futures.Future`: metrics snapshots, invariant checks and tests read the
engine that way, never from another thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampling.logprobs import TokenLogprob
from hybridkv.engine.sampling.sampler import SamplingParams
from hybridkv.errors import HybridKVError, InvariantError, RequestError
from hybridkv.serve.metrics import Histogram, MetricsSnapshot
from hybridkv.serve.prepare import Generation
from hybridkv.serve.textstream import TextStream, text_decoder

log = logging.getLogger("hybridkv.serve")
T = TypeVar("T")


@dataclass(frozen=True)
class Accepted:
    request_id: str


@dataclass(frozen=True)
class Output:
    """New text, token ids and logprobs of choice ``index`` since its previous `Output`;
    counts are totals. ``prompt_logprobs`` (echo with logprobs) come with the first
    `Output` of a choice; ``num_cached_tokens`` is its prefix-cache hit."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class Failed:
    error: RequestError


Event = Accepted | Output | Failed


class RequestHandle:
    """The asyncio side of one request. Created on the event loop that reads it."""

    def __init__(self, generation: Generation, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = uuid.uuid4().hex
        self.generation = generation
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._num_open = generation.num_choices  # choices without their last Output yet
        self.finished = False  # the last event was read (asyncio side)

    def push(self, event: Event) -> None:
        """Hand ``event`` to the reader (any thread)."""
        # A closed event loop (RuntimeError) means nobody is left to read it.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    def check_invariants(self) -> None:
        """Open choices count down from the number of choices; none open means finished."""
        if not 0 <= self._num_open <= self.generation.num_choices:
            raise InvariantError(
                f"request {self.request_id}: {self._num_open} open of "
                f"{self.generation.num_choices} choices"
            )
        if self._num_open == 0 and not self.finished:
            raise InvariantError(f"request {self.request_id}: every choice ended, not finished")

    async def next_event(self) -> Event:
        event = await self._events.get()
        if isinstance(event, Output) and event.finish_reason is not None:
            self._num_open -= 1
        if isinstance(event, Failed) or self._num_open == 0:
            self.finished = True
        self.check_invariants()  # two comparisons: cheap enough for every event
        return event


@dataclass
class _Active:
    handle: RequestHandle
    request: Any  # what LLM.add_request returned
    text: TextStream
    arrival_s: float  # time.monotonic() at submission
    index: int = 0  # the choice it answers
    num_sent_tokens: int = 0
    admitted: bool = False  # its first step ran (prefix-cache query and hit counted)
    num_cached_tokens: int = 0  # prefix-cache hit of its first admission


@dataclass(frozen=True)
class _Submit:
    handle: RequestHandle


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any]


@dataclass(frozen=True)
class _Stop:
    pass


_Command = _Submit | _Abort | _Call | _Stop


@dataclass
class ServeCounters:
    """Counters the HTTP layer adds to the engine's own (engine thread only)."""

    num_prompt_tokens: int = 0
    # Counted once per request at its first admission: the manager's own lookup counters
    # also count the scheduler's ordering lookups and re-admissions after preemption.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    finished: Counter[str] = field(default_factory=Counter)  # by finish reason / "abort"
    time_to_first_token: Histogram = field(default_factory=Histogram)
    e2e_request_latency: Histogram = field(default_factory=Histogram)


class EngineLoop:
    def __init__(self, llm: LLM, model_name: str, *, name: str = "hybridkv-engine") -> None:
        self.llm = llm
        self.model_name = model_name
        self.counters = ServeCounters()
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._active: dict[str, _Active] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._decode = text_decoder(llm.tokenizer)

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, handle: RequestHandle) -> None:
        if not self.alive:
            handle.push(Failed(RequestError("the engine loop is not running", status=503)))
            return
        self._inbox.put(_Submit(handle))

    def abort(self, handle: RequestHandle) -> None:
        """Cancel ``handle``'s request (a no-op once it finished)."""
        self._inbox.put(_Abort(handle.request_id))

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn()`` on the engine thread between steps (module doc)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(RequestError("the engine loop is not running", status=503))
            return future
        self._inbox.put(_Call(fn, future))
        return future

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Fail the requests in flight (503), stop the thread and wait for it."""
        if self._thread.is_alive():
            self._inbox.put(_Stop())
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ engine thread
    def metrics(self) -> MetricsSnapshot:
        """Counters and gauges now (engine thread: use ``call(loop.metrics)``)."""
        stats = self.llm.stats()
        cache = self.llm.manager.stats()
        running, waiting = self.llm.num_requests()
        return MetricsSnapshot(
            model_name=self.model_name,
            num_requests_running=running,
            num_requests_waiting=waiting,
            kv_cache_usage=cache.usage,
            prefix_cache_queries=self.counters.prefix_cache_queries,
            prefix_cache_hits=self.counters.prefix_cache_hits,
            prompt_tokens=self.counters.num_prompt_tokens,
            generation_tokens=stats.num_output_tokens,
            spec_draft_tokens=stats.num_proposed_tokens,
            spec_accepted_tokens=stats.num_accepted_tokens,
            num_preemptions=stats.num_preemptions,
            num_steps=stats.num_steps,
            finished=dict(self.counters.finished),
            time_to_first_token=self.counters.time_to_first_token.snapshot(),
            e2e_request_latency=self.counters.e2e_request_latency.snapshot(),
        )

    def check_invariants(self) -> None:
        """Every active request is unfinished in the engine and counted there once; the
        cache manager's own invariants hold (engine thread: use ``call``)."""
        running, waiting = self.llm.num_requests()
        if running + waiting != len(self._active):
            raise InvariantError(
                f"engine loop tracks {len(self._active)} requests, the engine has "
                f"{running} running + {waiting} waiting"
            )
        self.llm.stepper.logprobs.check_invariants()
        for rid, active in self._active.items():
            active.text.check_invariants()
            result = self.llm.result(active.request)
            if result.finish_reason is not None or result.cancelled:
                raise InvariantError(f"request {rid}: finished in the engine but still active")
            if active.num_sent_tokens > len(result.token_ids):
                raise InvariantError(
                    f"request {rid}: sent {active.num_sent_tokens} tokens of "
                    f"{len(result.token_ids)}"
                )
        self.counters.time_to_first_token.check_invariants()
        self.counters.e2e_request_latency.check_invariants()
        self.llm.manager.check_invariants()

    def _run(self) -> None:
        while True:
            commands: list[_Command] = [] if self._active else [self._inbox.get()]
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for i, command in enumerate(commands):
                if isinstance(command, _Stop):
                    self._stop(commands[i + 1 :])
                    return
                self._guarded(self._handle, command)
            if self._active:
                self._guarded(self._step)

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn``; a bug of ours fails the requests in flight (500) instead of
        killing the thread, which would leave every client waiting forever."""
        try:
            fn(*args)
        except Exception as err:
            log.exception("engine loop error; failing %d requests", len(self._active))
            self._fail_all(f"internal error: {type(err).__name__}: {err}", 500)
            if isinstance(args[0] if args else None, _Submit):
                args[0].handle.push(
                    Failed(RequestError(f"internal error: {err}", status=500, kind="server_error"))
                )

    def _handle(self, command: _Command) -> None:
        if isinstance(command, _Submit):
            self._submit(command.handle)
        elif isinstance(command, _Abort):
            for key in [
                k for k, a in self._active.items() if a.handle.request_id == command.request_id
            ]:
                self.llm.cancel(self._active.pop(key).request)
                self.counters.finished["abort"] += 1
        elif isinstance(command, _Call) and command.future.set_running_or_notify_cancel():
            try:
                command.future.set_result(command.fn())
            except Exception as err:  # handed to the caller, who re-raises it
                command.future.set_exception(err)

    def _submit(self, handle: RequestHandle) -> None:
        """One engine request per choice; all or none (a refusal cancels the others)."""
        g = handle.generation
        added: list[_Active] = []
        error: RequestError | None = None
        now = time.monotonic()
        try:
            for index in range(g.num_choices):
                request = self.llm.add_request(
                    list(g.choice_prompt(index)),
                    _sampling_params(g),
                    index % g.n,
                    cache_salt=g.cache_salt,
                )
                refused = self.llm.result(request).finish_reason
                if refused is not None:  # finished before it ran: the engine refused it
                    reason = getattr(request, "refusal", None) or f"finish reason {refused!r}"
                    error = RequestError(f"the engine refused the request: {reason}")
                    break
                added.append(_Active(handle, request, TextStream(self._decode, g.stop), now, index))
        except HybridKVError as err:
            error = RequestError(str(err), code=type(err).__name__)
        if error is not None:
            for active in added:
                self.llm.cancel(active.request)
            handle.push(Failed(error))
            return
        for active in added:
            self._active[active.request.req_id] = active
            self.counters.num_prompt_tokens += len(active.request.prompt)
        handle.push(Accepted(handle.request_id))

    def _step(self) -> None:
        try:
            self.llm.step()
        except Exception as err:
            # The step's requests are in an unknown state: fail and cancel all of them,
            # keep serving new ones. A typed error is the engine refusing what it was
            # asked (e.g. a request that cannot fit the cache): 400; anything else is ours.
            log.exception("engine step failed; failing %d requests", len(self._active))
            typed = isinstance(err, HybridKVError)
            self._fail_all(
                f"the engine step failed: {type(err).__name__}: {err}",
                400 if typed else 500,
                "invalid_request_error" if typed else "server_error",
            )
            return
        for rid in list(self._active):
            self._publish(rid, self._active[rid])

    def _publish(self, rid: str, active: _Active) -> None:
        g = active.handle.generation
        # The engine's own finish ends the request there: release its logprob records
        # (a cancel below drops them too; this result keeps what was recorded).
        result = self.llm.result(active.request, release=active.request.done)
        if not active.admitted and result.stats.num_steps > 0:
            active.admitted = True
            active.num_cached_tokens = result.stats.prefix_hit_tokens
            self.counters.prefix_cache_queries += result.stats.num_prompt_tokens
            self.counters.prefix_cache_hits += result.stats.prefix_hit_tokens
        ids = result.token_ids
        reason = result.finish_reason
        if len(ids) == active.num_sent_tokens and reason is None:
            return
        if g.max_tokens == 0:  # echo only: the one token run for the prompt is dropped
            if reason is None:
                self.llm.cancel(active.request)
            ids, reason = [], "length"
        delta = active.text.update(ids, finished=reason is not None)
        if delta.stopped and reason is None:
            self.llm.cancel(active.request)  # a stop string: free its blocks now
        if delta.stopped:
            reason = "stop"
        first = active.num_sent_tokens == 0
        new_ids = tuple(ids[active.num_sent_tokens :])
        logprobs = None
        if result.logprobs is not None:
            logprobs = tuple(result.logprobs[active.num_sent_tokens : len(ids)])
        now = time.monotonic()
        if first and new_ids:
            self.counters.time_to_first_token.observe(now - active.arrival_s)
        active.num_sent_tokens = len(ids)
        if reason is not None:
            del self._active[rid]
            self.counters.finished[reason] += 1
            self.counters.e2e_request_latency.observe(now - active.arrival_s)
        prompt_logprobs = result.prompt_logprobs
        active.handle.push(
            Output(
                delta.text,
                new_ids,
                reason,
                len(result.prompt_token_ids),
                len(ids),
                index=active.index,
                logprobs=logprobs,
                prompt_logprobs=tuple(prompt_logprobs) if first and prompt_logprobs else None,
                num_cached_tokens=active.num_cached_tokens,
            )
        )

    def _fail_all(self, message: str, status: int, kind: str = "server_error") -> None:
        for active in self._active.values():
            try:
                self.llm.cancel(active.request)
            except Exception:
                log.exception("cancelling request %s failed", active.handle.request_id)
            active.handle.push(
                Failed(RequestError(message, status=status, kind=kind, code="engine_error"))
            )
            self.counters.finished["abort"] += 1
        self._active.clear()

    def _stop(self, rest: list[_Command]) -> None:
        self._fail_all("the server is shutting down", 503)
        for command in rest:
            if isinstance(command, _Submit):
                command.handle.push(
                    Failed(RequestError("the server is shutting down", status=503, code="shutdown"))
                )
            elif isinstance(command, _Call):
                command.future.set_exception(
                    RequestError("the server is shutting down", status=503)
                )


def _sampling_params(g: Generation) -> SamplingParams:
    """The engine's `SamplingParams` of every choice of ``g`` (echo with logprobs asks
    for prompt logprobs; max_tokens 0 runs one token, dropped in `EngineLoop._publish`)."""
    return SamplingParams(
        max(1, g.max_tokens),
        g.temperature,
        g.seed,
        g.ignore_eos,
        logprobs=g.logprobs if g.max_tokens > 0 else None,
        prompt_logprobs=g.logprobs if g.echo and g.logprobs is not None else None,
        **g.sampling,
    )
