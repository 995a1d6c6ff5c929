"""Chunked local attention: a token reads only its own chunk of ``C`` tokens.

C = 8, block size 4, 13 tokens computed (next token at 13, chunk [8, 16))::

    position   0..3  4..7  8..11  12..15
    table      [0]   [0]   [b3]   [b6]

    first_live_block(c) = (c // C) * C // B      (ChunkedLocalSpec.first_live_block)

A hit that ends on a chunk boundary needs no block of this group at all.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.cache.managers.full import FullAttentionManager
from hybridkv.ids import BlockId, cdiv
from hybridkv.spec.layers import ChunkedLocalSpec


class ChunkedLocalManager(FullAttentionManager):
    releases = True

    def init_kind(self) -> None:
        assert isinstance(self.group.spec, ChunkedLocalSpec)
        self.chunk_tokens = self.group.spec.attention_chunk_size

    def first_live_block(self, num_computed: int) -> int:
        # `ChunkedLocalSpec.first_live_block` in the manager's own ints (as sliding's)
        chunk = self.chunk_tokens
        return num_computed // chunk * chunk // self.block_size

    def next_release(self, first_live: int) -> int | None:
        boundary = (first_live + 1) * self.block_size
        return cdiv(boundary, self.chunk_tokens) * self.chunk_tokens

    def max_hit(
        self,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
        limit: int,
        found: dict[int, BlockId],
    ) -> int:
        return self.window_hit(hashes, root, tokens, limit, found)
