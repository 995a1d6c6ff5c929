"""Runtime cache manager: block pools, hashing, group managers, coordinator, facade."""

from hybridkv.cache.block import NULL_BLOCK, BlockInfo
from hybridkv.cache.delta import NO_CHANGE, GroupDelta, StepDelta
from hybridkv.cache.events import BLOCK_REMOVED, BLOCK_STORED, CacheEvent, CacheStats
from hybridkv.cache.hashing import HASH_ALGOS
from hybridkv.cache.manager import CacheManager
from hybridkv.cache.managers import MANAGER_TABLE, StateSlots, StepSlots
from hybridkv.cache.step_paths import __file__ as _step_paths_file

# Which build is loaded: True when the mypyc-compiled core (``HYBRIDKV_COMPILE=1``, see
# setup.py) is imported, False for the pure-Python sources (the default and reference).
COMPILED: bool = not _step_paths_file.endswith((".py", ".pyc"))

__all__ = [
    "BLOCK_REMOVED",
    "BLOCK_STORED",
    "COMPILED",
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
