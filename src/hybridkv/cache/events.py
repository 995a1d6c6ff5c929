"""Cache events (for routers that track which prefixes live where) and statistics."""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.ids import BlockId

BLOCK_STORED = "stored"
BLOCK_REMOVED = "removed"


@dataclass(frozen=True)
class CacheEvent:
    """A block entered (``stored``) or left (``removed``) a group's hash index.

    ``num_tokens`` is the prefix length the block's hash covers (its end position).
    """

    kind: str
    group_id: int
    block_id: BlockId
    block_hash: bytes
    num_tokens: int


@dataclass(frozen=True)
class CacheStats:
    """Counters since construction; ``usage`` is the referenced share of usable blocks."""

    usage: float
    usage_per_pool: tuple[float, ...]
    num_requests: int
    num_lookups: int
    num_lookup_tokens: int
    num_hit_tokens: int
    num_blocks_stored: int
    num_evictions: int
    num_checkpoints_stored: int
    num_checkpoints_used: int
    num_preemptions: int
    num_allocate_failures: int

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_lookup_tokens if self.num_lookup_tokens else 0.0
