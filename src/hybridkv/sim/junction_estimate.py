"""What a *junction partial entry* would add to measured prefix hits (an estimate; no
such entry exists in the cache).

The gap left with memory to spare on chat is first turns that diverge inside a shared
block: request ``i`` shares ``d_i`` tokens (its token-exact reuse bound) with an earlier
request, ``d_i`` is not on a block boundary, and the hit stops at the boundary below.
A junction partial entry would store, when ``i`` runs, its state at ``d_i`` plus the
attention KV of ``[floor(d_i), d_i)`` under a key of the prefix up to ``d_i``; a later
request sharing ``d_i`` tokens with ``i`` would then hit ``d_i`` tokens. Unlike a
turn-end entry (whose owner has finished, so the hitting request takes the block over),
``i``'s block keeps being written past ``d_i``: the hitting request needs a *copy* of
the block's first ``d_i - floor(d_i)`` positions (copy-on-write in the engine), now
built (`hybridkv.cache.junction`, on with the default junction + turn_end rules).

`junction_partial_gain` replays the arrival order: the entries recorded so far (one per
request whose ``d_i`` falls mid-block), and for each request the longest entry its
prompt reaches; the gain is how far that entry goes past the request's measured hit,
counted only when the hit reached the block boundary below the entry (the entry adds a
block's tail; it cannot bring back evicted blocks before it). Entries take no memory
here, so this is an upper estimate of what the rule adds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from hybridkv.sim.reuse import reuse_bound_tokens
from hybridkv.sim.trace import TraceRequest


def junction_partial_gain(
    trace: Sequence[TraceRequest], hit_tokens: Mapping[str, int], block_tokens: int
) -> tuple[int, int]:
    """(extra hit tokens, requests that gain) if every mid-block divergence point of
    the trace were stored as a junction partial entry; ``hit_tokens``: each request's
    measured first-admission hit (by id), ``block_tokens``: the hit granularity."""
    bound = reuse_bound_tokens(trace)
    order = sorted(range(len(trace)), key=lambda i: (trace[i].arrival_s, trace[i].id))
    entries: list[tuple[np.ndarray, int, str | None]] = []
    gain = gainers = 0
    for i in order:
        req = trace[i]
        prompt = np.asarray(req.prompt, dtype=np.int64)
        reach = 0
        for tokens, d, salt in entries:
            if d <= reach or d > len(prompt) - 1 or salt != req.cache_salt:
                continue
            if np.array_equal(tokens[:d], prompt[:d]):
                reach = d
        hit = hit_tokens.get(req.id, 0)
        # the entry only adds its mid-block tail, and only to a hit that reached the
        # block boundary below it (a shorter hit lost blocks the entry cannot replace)
        floor = reach // block_tokens * block_tokens if block_tokens > 0 else reach
        extra = reach - hit if hit >= floor else 0
        if extra > 0:
            gain += extra
            gainers += 1
        if block_tokens > 0 and bound[i] % block_tokens:
            entries.append((prompt, bound[i], req.cache_salt))
    return gain, gainers


def record_first_hits(manager: object) -> dict[str, int]:
    """Wrap ``manager`` (a `CacheManager`) so that the returned dict fills with each
    request's hit at its first admission (the last lookup before its first allocate),
    as the simulator's hit rate counts it."""
    hits: dict[str, int] = {}
    pending: dict[str, int] = {}
    lookup = manager.lookup  # type: ignore[attr-defined]
    allocate = manager.allocate  # type: ignore[attr-defined]

    def looked_up(req_id: str) -> int:
        pending[req_id] = hit = lookup(req_id)
        return int(hit)

    def allocated(req_id: str, *args: object, **kwargs: object) -> object:
        if req_id not in hits and req_id in pending:
            hits[req_id] = pending[req_id]
        return allocate(req_id, *args, **kwargs)

    manager.lookup = looked_up  # type: ignore[attr-defined]
    manager.allocate = allocated  # type: ignore[attr-defined]
    return hits
