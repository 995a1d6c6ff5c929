"""Peak blocks one request holds: the one formula behind capacity and admission.

Each group's spec says how many blocks a request holds during a step at ``c`` computed
tokens (`LayerSpec.blocks_needed`). A request decoding to ``T`` tokens steps through
every ``c <= T - n``; the blocks it holds at once in a set of groups (one pool) peak at

    peak(T) = max over c in [0, T - n] of  sum over groups g of  blocks_g(c)

which is what the planner budgets per request and what the allocator really takes at
the worst step. Groups peak at different ``c`` (a window at its worst alignment, a
state group right after a checkpoint boundary), so the peak of the sum can be lower
than the sum of the peaks.

Computed without scanning every ``c``: each group's count either only grows with ``c``
(full attention) or repeats with a period from some ``c`` on (window: ``B`` from
``W - 1``; state: ``B``; chunked: ``lcm(C, B)``). Cut ``[0, T - n]`` where a group turns
periodic; inside each piece the sum is (non-decreasing) + (periodic with ``P`` = lcm of
the periods), so its maximum lies in the piece's last ``P`` positions::

    c:  0 ........ W-2 | W-1 ..................... T-n
        window grows   | window periodic (B)
                  [last P]                    [last P]  <- only these are evaluated

When ``P`` exceeds `MAX_SCAN` and the piece is longer than `MAX_SCAN` too, each group's
own peak is summed instead (an upper bound); a shorter piece is scanned whole.

Groups with equal `peak_key` (same spec, block size, spec states and state mode: a
model's layers cut into equal groups) have equal counts at every ``c``, so each distinct
key is evaluated once and weighted by its multiplicity; results are memoised by
``(keys with multiplicities, T, n, L)`` because capacity asks the same question for
every pool and length (pure function of its key, so the memo cannot go stale).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from math import lcm
from typing import Protocol

MAX_SCAN = 1 << 14  # positions evaluated per piece before falling back to an upper bound
_MEMO_LIMIT = 1 << 16  # memo entries kept before the memo is dropped (bounds memory)
_memo: dict[tuple[Hashable, ...], int] = {}


class StepBlocks(Protocol):
    """What the peak needs of a group (`GroupPlan` provides it)."""

    def blocks_at(self, num_computed_tokens: int, num_new_tokens: int, num_lookahead: int) -> int:
        """Blocks held during one step at ``c`` computed tokens."""
        ...

    def blocks_period(self) -> tuple[int, int] | None:
        """``(from_c, period)`` of `blocks_at` in ``c``, or None when it only grows."""
        ...

    def blocks_bound(self, num_tokens: int, num_new_tokens: int, num_lookahead: int) -> int:
        """An upper bound of `blocks_at` over every ``c <= num_tokens - n``."""
        ...

    @property
    def peak_key(self) -> Hashable:
        """Equal keys mean equal `blocks_at` at every step."""
        ...


def peak_blocks(
    groups: Sequence[StepBlocks],
    num_tokens: int,
    num_new_tokens: int = 1,
    num_lookahead_tokens: int = 0,
) -> int:
    """Max over steps ``c + n <= num_tokens`` of the blocks held in ``groups`` at once."""
    n, lookahead = num_new_tokens, num_lookahead_tokens
    last = num_tokens - n
    if not groups or last < 0:
        return 0
    reps: dict[Hashable, StepBlocks] = {}
    counts: dict[Hashable, int] = {}
    for g in groups:
        key = g.peak_key
        reps.setdefault(key, g)
        counts[key] = counts.get(key, 0) + 1
    memo_key = (tuple(sorted(counts.items(), key=repr)), num_tokens, n, lookahead)
    found = _memo.get(memo_key)
    if found is None:
        units = [(reps[k], c) for k, c in counts.items()]
        found = _scan(units, num_tokens, n, lookahead)
        if len(_memo) >= _MEMO_LIMIT:
            _memo.clear()
        _memo[memo_key] = found
    return found


def _scan(units: list[tuple[StepBlocks, int]], num_tokens: int, n: int, lookahead: int) -> int:
    """`peak_blocks` over distinct groups, each counted ``multiplicity`` times."""
    last = num_tokens - n
    groups = [g for g, _ in units]
    periods = [g.blocks_period() for g in groups]
    cuts = sorted({0} | {p[0] for p in periods if p is not None and 0 < p[0] <= last})
    best = 0
    for i, start in enumerate(cuts):
        end = cuts[i + 1] - 1 if i + 1 < len(cuts) else last
        period = 1
        for p in periods:
            if p is not None and p[0] <= start:
                period = lcm(period, p[1])
        if period > MAX_SCAN and end - start >= MAX_SCAN:
            # too long to scan step by step: the sum of each group's own peak (an upper
            # bound); a segment shorter than the joint period is scanned whole (exact)
            return sum(m * _own_peak(g, num_tokens, n, lookahead) for g, m in units)
        for c in range(max(start, end - period + 1), end + 1):
            best = max(best, sum(m * g.blocks_at(c, n, lookahead) for g, m in units))
    return best


def _own_peak(group: StepBlocks, num_tokens: int, n: int, lookahead: int) -> int:
    """One group's peak by the same scan, or its upper bound when the period is long."""
    period = group.blocks_period()
    if period is not None and period[1] > MAX_SCAN:
        return group.blocks_bound(num_tokens, n, lookahead)
    return peak_blocks([group], num_tokens, n, lookahead)
