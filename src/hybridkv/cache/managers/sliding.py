"""Sliding-window attention: only the last ``W - 1`` tokens before a position are read.

Window W = 6, block size 4, 13 tokens computed (the next token, 13, reads 8..12)::

    position   0..3  4..7  8..11  12..15
    table      [0]   [0]   [b7]   [b2]      blocks 0 and 1 were released: null block

    first_live_block(c) = max(0, c - (W - 1)) // B      (SlidingWindowSpec.first_live_block)

A hit of ``k`` blocks needs the ``cdiv(W - 1, B)`` blocks before it cached (EAGLE drops
none: head groups key blocks one token ahead, see `GroupManager.key`); earlier table
entries are the null block.
Blocks that fall out of the window are released at ``commit`` only, when the step that
could read them has finished and its drafts are settled.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.cache.managers.full import FullAttentionManager
from hybridkv.ids import BlockId
from hybridkv.spec.layers import SlidingWindowSpec


class SlidingWindowManager(FullAttentionManager):
    releases = True

    def init_kind(self) -> None:
        assert isinstance(self.group.spec, SlidingWindowSpec)
        self.window_tokens = self.group.spec.sliding_window

    def first_live_block(self, num_computed: int) -> int:
        # `SlidingWindowSpec.first_live_block` in the manager's own ints (called at every
        # slow commit)
        return max(0, num_computed - (self.window_tokens - 1)) // self.block_size

    def next_release(self, first_live: int) -> int | None:
        return (first_live + 1) * self.block_size + self.window_tokens - 1

    def max_hit(
        self,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
        limit: int,
        found: dict[int, BlockId],
    ) -> int:
        return self.window_hit(hashes, root, tokens, limit, found)
