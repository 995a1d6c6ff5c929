"""lru's bulk links: a request's whole table released in one pass (`BlockPool.
release_many`). Split from `cache.free_queue` so that each file stays readable.

Measured and dropped: the same as numpy operations on the link arrays (and caching a
prefill chunk's blocks with numpy and dict updates) was no faster for tables of ~100
blocks, and twice slower per `free` in `bench/manager_step.py` (numpy's per-call cost
is a few microseconds; the loop's is ~40 bytecodes per block)."""

from __future__ import annotations

from collections.abc import Iterable

from hybridkv.cache.free_queue_reads import PROBATION, FreeQueueReads, mypyc_attr


@mypyc_attr(allow_interpreted_subclasses=True)  # see `FreeQueueReads`
class LruLinks(FreeQueueReads):
    """`release_lru` of a `FreeQueue` (attributes set by its __init__)."""

    def push_fresh_many(self, block_ids: list[int]) -> None:
        raise NotImplementedError  # `FreeQueue.push_fresh_many`

    def release_lru(
        self, refs: list[int], hashes: dict[int, bytes], block_ids: Iterable[int]
    ) -> int | None:
        """lru: drop one reference of each block (null blocks skipped) and push those
        that reach 0, in order: cached ones onto the newest end, the others onto the
        fresh stack -- `BlockPool.release_many` in one pass that links cached blocks as
        it meets them (no second loop). Returns a block released while free (the loop
        stops there, links closed; the caller raises), else None."""
        prev, nxt, tier_of = self._prev, self._next, self._tier
        sentinel = self._num_blocks + PROBATION
        last = prev[sentinel]
        fresh: list[int] = []
        bad = None
        num = 0
        for block in block_ids:
            if not block:  # NULL_BLOCK (0): a plain truth test in the hot loop
                continue
            count = refs[block] - 1
            if count:
                if count < 0:
                    bad = block
                    break
                refs[block] = count  # still shared
            else:
                refs[block] = 0
                if block in hashes:
                    tier_of[block] = PROBATION
                    nxt[last] = block
                    prev[block] = last
                    last = block
                    num += 1
                else:
                    fresh.append(block)
        if num:
            nxt[last] = sentinel
            prev[sentinel] = last
            self._tier_len[PROBATION] += num
            self._num_cached += num
        if fresh:
            self.push_fresh_many(fresh)
        return bad
