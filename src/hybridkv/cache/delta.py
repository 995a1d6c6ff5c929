"""Per-step output of `CacheManager.allocate`: what changed in each block table.

An engine keeps one persistent table row per (request, token-indexed group) and applies
the delta of every step instead of copying whole tables::

    group 0 (sliding, B 4), table before:   [b3, b7, b9]
    commit released position 0 (left the window); allocate took b2 at position 3
    delta: GroupDelta(start=3, new_blocks=(b2,), nulled=(0, 1))
    table after:                            [0, b7, b9, b2]       (0 = NULL_BLOCK)

Admission (the first allocate after `lookup`, or after `preempt`) hands out the whole
table from position 0, hit blocks and null positions included. State groups hand out
slots per step instead (`CacheManager.state_slots`), so they never appear here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from hybridkv.ids import BlockId

_EMPTY: Mapping[int, tuple[BlockId, ...]] = {}


class CopyOrder(NamedTuple):
    """Copy slots ``[0, num_tokens)`` of block ``src_block`` into ``dst_block`` (every
    layer of token-indexed group ``group_id``: K and V pages), before the step runs
    (a junction copy, `cache.junction`)."""

    group_id: int
    src_block: BlockId
    dst_block: BlockId
    num_tokens: int


class GroupDelta(NamedTuple):
    """One group's change: ``new_blocks`` go at positions ``start, start + 1, ...``
    (null blocks included on admission); positions in ``nulled_range`` (``[lo, hi)``,
    released since the previous delta) now hold the null block."""

    start: int
    new_blocks: tuple[BlockId, ...]
    nulled_range: tuple[int, int] | None = None

    @property
    def nulled(self) -> range:
        return range(*self.nulled_range) if self.nulled_range else range(0)

    def apply(self, row: list[BlockId], null_block: BlockId) -> None:
        """Apply to a persistent row (a list; grows as needed)."""
        for pos in self.nulled:
            row[pos] = null_block
        end = self.start + len(self.new_blocks)
        if len(row) < end:
            row.extend([null_block] * (end - len(row)))
        row[self.start : end] = self.new_blocks


class StepDelta(NamedTuple):
    """Changes of one allocated step, per token-indexed group (unchanged groups are
    absent). ``admitted``: the deltas hold whole tables (first allocate of a run).
    ``taken``: blocks taken from the pools this step, per group (state groups too),
    for accounting; unlike ``groups`` it never lists hit blocks. ``copies``: junction
    copies (`cache.junction`) the engine runs before the step, on admission only."""

    groups: Mapping[int, GroupDelta] = _EMPTY  # type: ignore[assignment]
    taken: Mapping[int, tuple[BlockId, ...]] = _EMPTY
    admitted: bool = False
    copies: tuple[CopyOrder, ...] = ()

    def __bool__(self) -> bool:  # a named tuple is immutable and cheap to build
        return bool(self.groups) or bool(self.taken) or bool(self.copies)

    def new_block_ids(self) -> dict[int, list[BlockId]]:
        """``{group: blocks taken this step}`` (the pre-delta return of `allocate`)."""
        return {g: list(blocks) for g, blocks in self.taken.items()}


NO_CHANGE = StepDelta()
