"""The scheduler loop both sides of `manager_step.py` replay (plain Python, no imports of
hybridkv or vLLM, so that vLLM's venv can run it too).

One deterministic loop, the same on both sides; only the adapter (four batch calls into
a cache manager) differs, and only adapter calls are timed (process CPU time)::

    every step:  arrivals join the waiting queue (FIFO)
                 running requests: a prefill chunk or a decode step with d drafts
                 admissions while budget and seats last: add + lookup + first chunk
                 [timed] admit(...)      one call per admitted request
                 [timed] allocate(...)   two batches (prefill chunks, decodes)
                 [timed] commit(...)     two batches: chunk done / d drafts, a accepted
                 [timed] free(...)       one batch for the finished requests

Prefill chunks follow vLLM's align split on both sides (a chunk that does not finish
the prompt ends on a block boundary) and stop once at the family junction (the shared
prefix, rounded down to a block), so that the state at the junction is a chunk end on
both sides and later members of the family hit it. A request is not admitted while
another member of its family has not passed the junction (vLLM caches blocks when it
allocates, hybridkv when the step commits: without this rule, hits would differ).
Any allocation failure aborts the run: the pool must be sized so that none happens
(cached free blocks are still evicted), otherwise the two sides would do other work.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol


class Adapter(Protocol):
    def admit(self, index: int, prompt: list[int], chunk: Callable[[int], int]) -> int | None:
        """add + lookup + allocate the first chunk, ``chunk(hit)`` tokens after the hit.
        Returns the hit in tokens, or None if it did not fit."""
        ...

    def allocate(self, items: list[tuple[int, int, int]]) -> bool:
        """(index, num_new, num_drafts) per running request; False if any failed."""
        ...

    def commit(self, items: list[tuple[int, int, int, list[int]]]) -> None:
        """(index, num_new, num_accepted, new token ids) per scheduled request."""
        ...

    def free(self, indexes: list[int]) -> None: ...

    # Optional: ``begin_step()``, called first in every step inside the allocate timer
    # (vLLM's scheduler tells its manager that a step starts); ``sub_timers``, a dict of
    # seconds the adapter splits admission into (add, lookup, first_allocate).


def chunk_end(start: int, budget: int, prompt_len: int, block: int, junction: int) -> int:
    """End of the next prefill chunk (see the module docstring), or ``start`` if none."""
    end = min(start + budget, prompt_len)
    if start < junction < end:
        end = junction
    if end < prompt_len:
        end = end // block * block
    return max(end, start)


def run(trace: dict[str, Any], adapter: Any) -> dict[str, Any]:
    """Replay ``trace`` through ``adapter``; returns timings (seconds) and counters."""
    prompts: list[list[int]] = trace["prompts"]
    outputs: list[list[int]] = trace["outputs"]
    drafts: list[list[list[int]]] = trace["drafts"]  # per request, per decode: [d, a]
    family: list[int] = trace["family"]
    junction: list[int] = trace["junction"]
    arrival: list[int] = trace["arrival_step"]
    block, budget_tokens, max_running = trace["block"], trace["budget"], trace["max_running"]
    timers = {"admit": 0.0, "allocate": 0.0, "commit": 0.0, "free": 0.0, "decode": 0.0}
    counts = {
        "steps": 0,
        "request_steps": 0,
        "decode_request_steps": 0,
        "tokens": 0,
        "prefill_tokens": 0,
        "decode_tokens": 0,
        "draft_tokens": 0,
        "hit_tokens": 0,
        "admissions": 0,
        "allocate_items": 0,  # running requests' allocate calls (admissions apart)
        "commit_items": 0,  # commit calls (every scheduled request-step)
    }
    computed = [0] * len(prompts)
    produced = [0] * len(prompts)  # output tokens emitted
    decode_step = [0] * len(prompts)
    waiting: deque[int] = deque()
    running: list[int] = []
    before_junction: dict[int, int] = {}  # family -> members not yet past the junction
    next_arrival = 0
    # CPU time of this process, not wall time: the machine is shared, and a manager
    # call that waits for a core is not slower work. Both sides use the same clock.
    clock = time.process_time
    begin_step = getattr(adapter, "begin_step", None)
    while next_arrival < len(prompts) or waiting or running:
        step = counts["steps"]
        while next_arrival < len(prompts) and arrival[next_arrival] <= step:
            waiting.append(next_arrival)
            next_arrival += 1
        budget = budget_tokens
        alloc_p: list[tuple[int, int, int]] = []
        alloc_d: list[tuple[int, int, int]] = []
        work_p: list[tuple[int, int, int, list[int]]] = []
        work_d: list[tuple[int, int, int, list[int]]] = []
        for i in running:
            if budget <= 0:
                break
            plen = len(prompts[i])
            if computed[i] < plen:  # prefill chunk
                end = chunk_end(computed[i], budget, plen, block, junction[i])
                if end == computed[i]:
                    continue
                n = end - computed[i]
                alloc_p.append((i, n, 0))
                work_p.append((i, n, 0, [outputs[i][0]] if end == plen else []))
                budget -= n
            else:  # decode: the last sampled token plus d drafts
                d, a = drafts[i][decode_step[i]]
                alloc_d.append((i, 1, d))
                p = produced[i]
                work_d.append((i, 1, a, outputs[i][p : p + a + 1]))
                budget -= 1 + d
        t0 = clock()
        if begin_step is not None:
            begin_step()
        ok = adapter.allocate(alloc_p)
        t1 = clock()
        ok = adapter.allocate(alloc_d) and ok
        t2 = clock()
        if not ok:
            raise SystemExit(f"step {step}: a running request did not fit; enlarge the pool")
        timers["allocate"] += t2 - t0
        timers["decode"] += t2 - t1
        counts["allocate_items"] += len(alloc_p) + len(alloc_d)
        admitted: list[int] = []
        blocked: set[int] = {f for f, num in before_junction.items() if num}
        while waiting and len(running) + len(admitted) < max_running and budget >= block:
            i = waiting[0]
            if family[i] in blocked:
                break  # FIFO: wait for the family's junction (see the module docstring)
            plen, junc, left = len(prompts[i]), junction[i], budget

            def chunk(hit: int, plen: int = plen, junc: int = junc, left: int = left) -> int:
                return chunk_end(hit, left, plen, block, junc) - hit

            t0 = clock()
            hit = adapter.admit(i, prompts[i], chunk)
            timers["admit"] += clock() - t0
            if hit is None:
                raise SystemExit(f"step {step}: admission of {i} did not fit; enlarge the pool")
            waiting.popleft()
            n = chunk(hit)
            computed[i] = hit
            work_p.append((i, n, 0, [outputs[i][0]] if hit + n == plen else []))
            budget -= n
            counts["hit_tokens"] += hit
            counts["admissions"] += 1
            admitted.append(i)
            if hit < junc:
                before_junction[family[i]] = before_junction.get(family[i], 0) + 1
                blocked.add(family[i])
        t0 = clock()
        adapter.commit(work_p)
        t1 = clock()
        adapter.commit(work_d)
        t2 = clock()
        timers["commit"] += t2 - t0
        timers["decode"] += t2 - t1
        work = work_p + work_d
        decodes = len(work_d)
        running.extend(admitted)
        finished: list[int] = []
        for i, n, a, _new in work:
            was_before = computed[i] < junction[i]
            if computed[i] < len(prompts[i]):
                computed[i] += n
                counts["prefill_tokens"] += n
                counts["tokens"] += n
                if computed[i] == len(prompts[i]):
                    produced[i] = 1
            else:
                computed[i] += 1 + a
                counts["decode_tokens"] += 1 + a
                counts["tokens"] += 1 + a
                produced[i] += a + 1
                decode_step[i] += 1
                counts["draft_tokens"] += drafts[i][decode_step[i] - 1][0]
            if was_before and computed[i] >= junction[i]:
                before_junction[family[i]] -= 1
            if decode_step[i] >= len(drafts[i]):
                finished.append(i)
        counts["request_steps"] += len(work)
        counts["commit_items"] += len(work)
        counts["decode_request_steps"] += decodes
        if finished:
            done = set(finished)
            running = [i for i in running if i not in done]
            t0 = clock()
            adapter.free(finished)
            timers["free"] += clock() - t0
        counts["steps"] += 1
    timers["total"] = timers["admit"] + timers["allocate"] + timers["commit"] + timers["free"]
    # Optional: the adapter's split of admission (``add``, ``lookup``, ``first_allocate``)
    sub_timers = dict(getattr(adapter, "sub_timers", {}))
    return {"timers": timers, "counts": counts, "sub_timers": sub_timers}
