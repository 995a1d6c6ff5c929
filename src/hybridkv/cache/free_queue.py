"""Free blocks of one pool, in reuse order, with O(1) removal.

Two tiers:

* *fresh* blocks hold no cached data (never cached, or their data was never worth
  caching); they are reused first, last freed first (a stack);
* *cached* blocks still carry a hash and can be hit again; they are evicted least
  recently freed first, and a hit removes one from the middle in O(1).

The cached tier is a doubly linked list kept in two int arrays indexed by block id, with
a sentinel at index ``num_blocks``::

    sentinel <-> b7 <-> b3 <-> b9 <-> sentinel
                 ^ evicted next      ^ freed last

Example: free cached 7, 3, 9 (in that order); a hit on 3 unlinks it (prev[3] = 7 and
next[3] = 9 are joined), so eviction order becomes 7, 9.
"""

from __future__ import annotations

from array import array

from hybridkv.ids import BlockId

_NONE = -1


class FreeQueue:
    """Free block ids of one pool; see the module docstring for the order."""

    def __init__(self, num_blocks: int, fresh_ids: list[int]) -> None:
        self._sentinel = num_blocks
        # Arrays, not lists: cheap to traverse for the garbage collector at any size.
        self._prev = array("q", [_NONE]) * (num_blocks + 1)
        self._next = array("q", [_NONE]) * (num_blocks + 1)
        self._prev[num_blocks] = num_blocks
        self._next[num_blocks] = num_blocks
        self._num_cached = 0
        # Stack: the last element is reused first, so push in reverse to hand out
        # the lowest ids first (readable golden scenarios).
        self._fresh = array("q", reversed(fresh_ids))

    def __len__(self) -> int:
        return len(self._fresh) + self._num_cached

    @property
    def num_cached(self) -> int:
        return self._num_cached

    def in_cached_tier(self, block_id: int) -> bool:
        return self._prev[block_id] != _NONE

    def push_fresh(self, block_id: BlockId) -> None:
        self._fresh.append(block_id)

    def push_cached(self, block_id: BlockId) -> None:
        """Append at the most-recently-freed end."""
        assert self._prev[block_id] == _NONE, f"block {block_id} is already in the queue"
        last = self._prev[self._sentinel]
        self._next[last] = block_id
        self._prev[block_id] = last
        self._next[block_id] = self._sentinel
        self._prev[self._sentinel] = block_id
        self._num_cached += 1

    def push_fresh_many(self, block_ids: list[int]) -> None:
        self._fresh.extend(block_ids)

    def push_cached_many(self, block_ids: list[int]) -> None:
        """`push_cached` for each block in order (the last one is freed last), linked
        in one pass: a request's table at `free`."""
        prev, nxt, sentinel = self._prev, self._next, self._sentinel
        last = prev[sentinel]
        for block in block_ids:
            nxt[last] = block
            prev[block] = last
            last = block
        nxt[last] = sentinel
        prev[sentinel] = last
        self._num_cached += len(block_ids)

    def remove_cached(self, block_id: BlockId) -> None:
        """Unlink a cached free block (it was hit), O(1)."""
        prev, nxt = self._prev[block_id], self._next[block_id]
        assert prev != _NONE, f"block {block_id} is not a cached free block"
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._prev[block_id] = self._next[block_id] = _NONE
        self._num_cached -= 1

    def pop(self) -> tuple[BlockId, bool]:
        """The next block to reuse and whether it comes from the cached tier (eviction)."""
        if self._fresh:
            return BlockId(self._fresh.pop()), False
        first = self._next[self._sentinel]
        assert first != self._sentinel, "pop from an empty free queue"
        self.remove_cached(BlockId(first))
        return BlockId(first), True

    def fresh_ids(self) -> list[int]:
        return list(self._fresh)

    def cached_ids(self) -> list[int]:
        """Cached free blocks, next to be evicted first."""
        out = []
        node = self._next[self._sentinel]
        while node != self._sentinel:
            out.append(node)
            node = self._next[node]
        return out
