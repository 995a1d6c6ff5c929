"""The token-exact reuse bound of a trace: what a perfect prefix cache could hit.

For each request in arrival order, the bound counts the longest prefix of its prompt
that equals a prefix of some earlier request's whole sequence (prompt + output, as a
multi-turn session's next turn sees it), capped at ``len(prompt) - 1`` (one token is
always computed to sample from). Infinite memory, token granularity, no timing: every
layout, checkpoint policy and eviction policy is measured against it::

    earlier   a b c d e f | g h        (prompt | output)
    prompt    a b c d e f g h x y      -> 8 tokens reusable of 10

Cost: one vectorised comparison per (request, earlier request with the same first
token); a few hundred requests of tens of thousands of tokens take well under a second.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridkv.sim.trace import TraceRequest


def reuse_bound_tokens(requests: Sequence[TraceRequest]) -> list[int]:
    """Per request (in the order given, sorted by arrival), the reusable prompt tokens."""
    ordered = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s, requests[i].id))
    seen: dict[tuple[int, str | None], list[np.ndarray]] = {}
    out = [0] * len(requests)
    for index in ordered:
        req = requests[index]
        prompt = np.asarray(req.prompt, dtype=np.int64)
        key = (int(prompt[0]), req.cache_salt)
        best = 0
        for earlier in seen.get(key, []):
            limit = min(len(earlier), len(prompt) - 1)
            if limit <= best:
                continue
            diff = np.flatnonzero(earlier[:limit] != prompt[:limit])
            best = max(best, int(diff[0]) if len(diff) else limit)
        out[index] = best
        sequence = np.asarray(list(req.prompt) + list(req.output), dtype=np.int64)
        seen.setdefault(key, []).append(sequence)
    return out


def reuse_bound_rate(requests: Sequence[TraceRequest]) -> float:
    """Reusable prompt tokens over all prompt tokens (comparable to `prefix_hit_rate`)."""
    total = sum(len(r.prompt) for r in requests)
    return sum(reuse_bound_tokens(requests)) / total if total else 0.0
