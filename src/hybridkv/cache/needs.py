"""What a step would take, asked before taking it: `CacheManager.blocks_needed`.

A scheduler that wants to drop drafts before it preempts anyone must know, before the
first `allocate` of a step, whether the step fits: `allocate` cannot be undone. For a
running request the answer is exact and additive: its blocks are referenced, so taking
a block for one request never evicts a block another running request holds, and a
step over running requests fits iff, per pool, the sum of their needs is at most
`CacheManager.num_free_blocks`::

    pool 0: 3 free; A decodes 1 + 2 drafts (needs 1), B 1 + 3 (needs 1), C 1 + 3
    (needs 2): 4 > 3 -> drop C's drafts (C needs 1 without them): 3 <= 3, it fits

A request being admitted (first allocate after `lookup`) is not covered: its hit blocks
may sit in the free queue, and taking blocks for others may evict them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import SupportsIndex

from hybridkv.cache.managers import GroupManager
from hybridkv.cache.request import RequestRecord
from hybridkv.cache.validate import check_count
from hybridkv.errors import CacheError


def step_needs(
    r: RequestRecord,
    managers: Sequence[GroupManager],
    num_pools: int,
    num_new_tokens: SupportsIndex,
    num_lookahead_tokens: SupportsIndex,
) -> list[int]:
    """Per pool, the blocks ``allocate(n, L)`` of running request ``r`` would take."""
    req_id = r.req_id
    if not r.started or r.pending:
        state = "allocated and not committed" if r.pending else "not admitted"
        raise CacheError(
            f"blocks_needed of request {req_id!r}: only for a running request between "
            f"steps; it is {state}"
        )
    # objects until checked (numpy integers welcome; `check_count` names bools and floats)
    n = check_count(req_id, "num_new_tokens", num_new_tokens)
    lookahead = check_count(req_id, "num_lookahead_tokens", num_lookahead_tokens)
    c = r.num_computed
    top = c + n
    if top > len(r.tokens):
        raise CacheError(
            f"blocks_needed of request {req_id!r}: {c} computed + {n} new tokens exceed "
            f"its {len(r.tokens)} verified tokens; drafts go in num_lookahead_tokens"
        )
    need = [0] * num_pools
    if top + lookahead <= r.fast_end and top <= r.fast_verified and lookahead <= r.fast_lookahead:
        return need  # within every group's fast limits: `allocate` takes nothing
    for g in r.groups_to_allocate(n, lookahead):
        manager = managers[g]
        need[manager.pool.pool_id] += manager.num_new_blocks(r.states[g], c, n, lookahead)
    return need


def total_step_needs(
    records: Sequence[RequestRecord],
    managers: Sequence[GroupManager],
    num_pools: int,
    num_new_tokens: Sequence[SupportsIndex],
    num_lookahead_tokens: Sequence[SupportsIndex],
) -> list[int]:
    """Per pool, the sum of `step_needs` over a step's running requests (one call per
    step; a step whose requests all stay within their fast limits costs a few
    comparisons per request)."""
    total = [0] * num_pools
    for r, n, lookahead in zip(records, num_new_tokens, num_lookahead_tokens, strict=True):
        if (
            type(n) is int
            and type(lookahead) is int
            and n >= 0
            and lookahead >= 0
            and r.started
            and not r.pending
        ):
            top = r.num_computed + n
            if (
                top <= len(r.tokens)
                and top + lookahead <= r.fast_end
                and top <= r.fast_verified
                and lookahead <= r.fast_lookahead
            ):
                continue  # the fast path: no block
        need = step_needs(r, managers, num_pools, n, lookahead)
        total = [a + b for a, b in zip(total, need, strict=True)]
    return total
