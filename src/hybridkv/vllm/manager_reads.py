"""What vLLM's scheduler and engine core read of their KV-cache manager between steps
(usage, rows, prefix-cache stats, events, block copies), answered for
`hybridkv.vllm.kv_manager.VllmKVCacheManager` from hybridkv's cache and the worker rows
it keeps; and the no-ops of calls whose work hybridkv does at commit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridkv.cache import CacheManager
from hybridkv.vllm.events import VllmEventLog
from hybridkv.vllm.rows import WorkerRows


class Block:
    """The part of vLLM's ``KVCacheBlock`` its scheduler reads from an allocation."""

    __slots__ = ("block_id",)
    block_hash = None
    block_hash_num_tokens = None

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    def __repr__(self) -> str:
        return f"Block({self.block_id})"


class ManagerReads:
    """The read side of `VllmKVCacheManager` (attributes set by its __init__)."""

    cache: CacheManager
    rows: WorkerRows
    events: VllmEventLog | None
    enable_caching: bool
    num_kv_cache_groups: int
    prefix_cache_stats: Any
    _stats_cls: Any
    _blocks_cls: Any
    _copy_cls: Callable[[int, int], Any]
    _copies: list[tuple[int, int]]
    _new_block_ids: list[int]

    @property
    def usage(self) -> float:
        return self.cache.usage()

    def get_blocks(self, request_id: str) -> Any:
        return self._blocks_cls(
            tuple([Block(b) for b in row] for row in self.rows.rows(request_id))
        )

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(list(row) for row in self.rows.rows(request_id))

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        return self.get_block_ids(request_id)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_kv_cache_groups

    def estimate_cached_tokens(self, request: Any) -> int:
        if not self.cache.has_request(request.request_id):
            return 0
        return self.cache.num_computed_tokens(request.request_id)

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return self.enable_caching and not getattr(request, "skip_reading_prefix_cache", False)

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        if self.prefix_cache_stats is None or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    def make_prefix_cache_stats(self) -> Any:
        if self.prefix_cache_stats is None:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, self._stats_cls()
        return stats

    def take_events(self) -> list[Any]:
        if self.events is None:
            return []
        self.events.record(self.cache.take_events(), None)  # evictions since
        return self.events.take()

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        copies, self._copies = self._copies, []
        # hybridkv pins a copy's source itself until the step commits: nothing to retain
        make = self._copy_cls
        return [make(src, dst) for src, dst in copies], []

    def take_new_block_ids(self) -> list[int]:
        ids, self._new_block_ids = self._new_block_ids, []
        return ids

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}

    def remove_skipped_blocks(self, *_: Any, **__: Any) -> None:
        """hybridkv releases blocks that leave a window at commit."""

    def cache_blocks(self, *_: Any, **__: Any) -> None:
        """hybridkv caches full verified blocks at commit."""
