"""Runtime cache manager: block pools, hashing, group managers, coordinator, facade."""

from hybridkv.cache.block import NULL_BLOCK, BlockInfo
from hybridkv.cache.delta import NO_CHANGE, GroupDelta, StepDelta
from hybridkv.cache.events import BLOCK_REMOVED, BLOCK_STORED, CacheEvent, CacheStats
from hybridkv.cache.hashing import HASH_ALGOS
from hybridkv.cache.manager import CacheManager
from hybridkv.cache.managers import MANAGER_TABLE, StateSlots, StepSlots

__all__ = [
    "BLOCK_REMOVED",
    "BLOCK_STORED",
    "HASH_ALGOS",
    "MANAGER_TABLE",
    "NO_CHANGE",
    "NULL_BLOCK",
    "BlockInfo",
    "CacheEvent",
    "CacheManager",
    "CacheStats",
    "GroupDelta",
    "StateSlots",
    "StepDelta",
    "StepSlots",
]
