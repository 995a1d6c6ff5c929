"""Block identity: the null block and a read-only view of one block's metadata.

Every pool reserves page 0 as the *null block*: a placeholder for table positions a
request no longer needs (tokens that left a sliding window, blocks before the current
local-attention chunk, skipped state checkpoints). It is never free, never cached and
never reference counted; kernels may read it but its contents are meaningless.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from hybridkv.ids import BlockId

NULL_BLOCK: Final = BlockId(0)


@dataclass(frozen=True)
class BlockInfo:
    """A snapshot of one block (for tests, events and debugging)."""

    block_id: BlockId
    pool_id: int
    ref_count: int
    block_hash: bytes | None  # set while the block is in its group's hash index
    group_id: int | None  # group whose index holds the block (None when uncached)
    is_free: bool
